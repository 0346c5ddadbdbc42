#!/usr/bin/env python3
"""The same as ``nanfuzz gate`` (kept for scripts that run ``python ci/gate.py``; nanfuzz must be installed)."""
import sys

from nanfuzz.harness.gate.run import main

if __name__ == "__main__":
    sys.exit(main())
