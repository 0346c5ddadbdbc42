#!/usr/bin/env python3
"""The same as ``nanfuzz gate merge`` (kept for scripts that run ``python ci/gate_merge.py``; nanfuzz must be installed)."""
import sys

from nanfuzz.harness.gate.merge import main

if __name__ == "__main__":
    sys.exit(main())
