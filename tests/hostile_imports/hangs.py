"""An adapter module that never finishes importing (a lock, a download, a device that never answers)."""
import time

time.sleep(3600)
