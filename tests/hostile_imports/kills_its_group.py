"""An adapter module that sends SIGKILL to its whole process group as it is imported."""
import os
import signal

os.killpg(0, signal.SIGKILL)
