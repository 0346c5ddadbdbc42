"""What the process table says: the processes a test's subject left, and whether one still runs."""
from __future__ import annotations

import os
import sys
import uuid

import pytest

MARK = "NANFUZZ_TEST_RUN"


def marked_environment(env: dict | None = None) -> tuple[dict, str]:
    """An environment for a command whose every descendant carries a fresh mark; and the mark."""
    if not sys.platform.startswith("linux"):
        pytest.skip("reads the process table in /proc")
    mark = uuid.uuid4().hex
    return {**(os.environ if env is None else env), MARK: mark}, mark


def marked(mark: str) -> list[str]:
    """``pid: command`` of every running process whose environment carries ``mark``."""
    needle = f"{MARK}={mark}".encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{pid}: {command[:120]}")
        except OSError:
            continue  # ended meanwhile, or not ours to read
    return found


def ended(pid: int, within: float = 30.0) -> bool:
    """Does ``pid`` end within ``within`` seconds?  A group is ended by a guard process that
    notices its worker's death a moment later, not at once."""
    import time

    until = time.monotonic() + within
    while running(pid):
        if time.monotonic() > until:
            return False
        time.sleep(0.05)
    return True


def running(pid: int) -> bool:
    """Is ``pid`` a live process (a zombie left to reap counts as ended)?"""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False
