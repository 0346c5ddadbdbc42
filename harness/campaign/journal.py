"""The pending-case journal: the case in flight, per campaign process.

Before each case is handed to the subject, the campaign writes it to its own
journal file, ``<state>/journal/<kernel>.<pid>.<token>.json``, and holds an
exclusive ``flock`` on that file for as long as the campaign lives.  A
campaign that finishes removes its file.  A file nobody holds a lock on was
left by a campaign process that died unobserved (``kill -9``, an in-process
kernel that took the process down): its case is a lead, replayed in a fresh
worker before anything is reported.  Concurrent campaigns and xdist workers
never read each other's files, because a live owner's lock is held.  A
leftover's replay is journaled too, marked as one: a campaign whose kernel
runs in its own process and dies again replaying it leaves it marked.
"""
from __future__ import annotations

import json
import os
import re
import secrets
from dataclasses import dataclass
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

    def record(self, case: Case, replaying: bool = False) -> None:
        """The case about to run (``replaying``: a leftover's replay); overwritten in place (the lock
        stays on this file)."""
        if self._fd is None:
            return
        data = json.dumps({"kernel": self.kernel_name, "case": case.to_dict(), "replaying": replaying}).encode()
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


@dataclass(frozen=True)
class Leftover:
    """A case a dead campaign process left in flight; ``died_replaying``: it died replaying a leftover."""

    case: Case
    died_replaying: bool = False


def leftovers(state_dir: Path, kernel_name: str) -> list[Leftover]:
    """Cases that dead campaign processes left in flight against ``kernel_name``; their files are removed."""
    directory = Path(state_dir) / "journal"
    found: list[Leftover] = []
    if not directory.is_dir():
        return found
    for path in sorted(directory.glob(f"{safe_name(kernel_name)}.*.json")):
        case = _claim(path, kernel_name)
        if case is not None:
            found.append(case)
    return found


def drop(state_dir: Path, kernel_name: str, pid: int) -> None:
    """The journal of campaign process ``pid``, which its run ended itself because the run was
    stopped (a job still in a check when its grace ran out): its case was never judged, and no
    kernel ended that process, so it is no case for the next run to replay."""
    for path in (Path(state_dir) / "journal").glob(f"{safe_name(kernel_name)}.{pid}.*.json"):
        try:
            os.unlink(path)
        except OSError:
            pass


def put_back(state_dir: Path, kernel_name: str, leftover: Leftover) -> None:
    """A claimed leftover that could not be replayed now, left again for a later campaign."""
    directory = Path(state_dir) / "journal"
    path = directory / f"{safe_name(kernel_name)}.{os.getpid()}.{secrets.token_hex(4)}.json"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"kernel": kernel_name, "case": leftover.case.to_dict(),
                                    "replaying": leftover.died_replaying}))
    except OSError:
        pass  # the campaign's note says it was not replayed


def _claim(path: Path, kernel_name: str) -> Leftover | None:
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
            return Leftover(Case.from_dict(data["case"]), data.get("replaying") is True)
        except (ValueError, KeyError, TypeError, AttributeError, NanfuzzError):
            return None
    finally:
        os.close(fd)
