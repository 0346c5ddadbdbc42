"""An adapter module whose native extension faults as it is imported."""
import os
import signal

os.kill(os.getpid(), signal.SIGSEGV)
