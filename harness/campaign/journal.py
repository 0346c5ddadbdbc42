"""The pending-case journal: the case in flight, per campaign process.

Before each case is handed to the subject, the campaign writes it to its own
journal file, ``<state>/journal/<kernel>.<pid>.<token>.json``, and holds an
exclusive ``flock`` on that file for as long as the campaign lives.  A
campaign that finishes removes its file.  A file nobody holds a lock on was
left by a campaign process that died unobserved (``kill -9``, an in-process
kernel that took the process down): its case is a lead, replayed in a fresh
worker before anything is reported.  Concurrent campaigns and xdist workers
never read each other's files, because a live owner's lock is held.
"""
from __future__ import annotations

import json
import os
import re
import secrets
from pathlib import Path

from nanfuzz.reference.case import Case
from nanfuzz.reference.errors import NanfuzzError

try:
    import fcntl
except ImportError:  # not POSIX: no locks, so no leftover is ever claimed from a live campaign
    fcntl = None


def safe_name(kernel_name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", kernel_name)


class Journal:
    """One campaign process's journal file (a context manager)."""

    def __init__(self, state_dir: Path, kernel_name: str):
        self.directory = Path(state_dir) / "journal"
        self.kernel_name = kernel_name
        self.path = self.directory / f"{safe_name(kernel_name)}.{os.getpid()}.{secrets.token_hex(4)}.json"
        self._fd = None
        self.note = ""  # set when the journal cannot be kept (the campaign runs on without it)

    def __enter__(self) -> "Journal":
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            self.note = (f"cannot keep the pending-case journal in {str(self.directory)!r} ({exc.strerror}); "
                         "running without it (set NANFUZZ_STATE_DIR to a writable folder)")
            return self
        if fcntl is not None:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        return self

    def record(self, case: Case) -> None:
        """The case about to run; overwritten in place (the lock stays on this file)."""
        if self._fd is None:
            return
        data = json.dumps({"kernel": self.kernel_name, "case": case.to_dict()}).encode()
        try:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, data, 0)
        except OSError:
            pass  # a full disk must not end the campaign; the supervisor still sees crashes

    def clear(self) -> None:
        if self._fd is not None:
            try:
                os.ftruncate(self._fd, 0)
            except OSError:
                pass

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            try:
                os.unlink(self.path)
            except OSError:
                pass
            os.close(self._fd)
            self._fd = None


def leftovers(state_dir: Path, kernel_name: str) -> list[Case]:
    """Cases that dead campaign processes left in flight against ``kernel_name``; their files are removed."""
    directory = Path(state_dir) / "journal"
    found: list[Case] = []
    if not directory.is_dir():
        return found
    for path in sorted(directory.glob(f"{safe_name(kernel_name)}.*.json")):
        case = _claim(path, kernel_name)
        if case is not None:
            found.append(case)
    return found


def _claim(path: Path, kernel_name: str) -> Case | None:
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        if fcntl is None:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None  # its campaign is alive
        text = os.read(fd, 1 << 24).decode("utf-8", "replace")
        try:
            os.unlink(path)
        except OSError:
            pass
        if not text.strip():
            return None  # it died between cases
        try:
            data = json.loads(text)
            if data.get("kernel") != kernel_name:
                return None
            return Case.from_dict(data["case"])
        except (ValueError, KeyError, TypeError, AttributeError, NanfuzzError):
            return None
    finally:
        os.close(fd)
