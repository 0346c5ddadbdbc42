"""``python -m nanfuzz`` is the ``nanfuzz`` command."""
import sys

from nanfuzz.harness.cli import main

sys.exit(main())
