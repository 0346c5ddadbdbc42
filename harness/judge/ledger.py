"""A device's ledger of reservations: one JSON file per device, shared by every nanfuzz process on it.

Each read-and-write holds the file locked (``fcntl.flock``) and drops the entries of
processes that have ended, so a reservation survives its process by no more than
the next look at the ledger: an entry names its process by pid and start time, so a
pid used again by another process does not inherit it.  A look is short, since every
process of a campaign takes one or two per case: the processes already seen are asked in
one poll of their pidfds, and an unchanged ledger is not written again.
"""
from __future__ import annotations

import contextlib
import json
import os
import select
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: each process sees only the device's own report of its free memory
    fcntl = None


def _started(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), None if there is no such process or
    it has ended (a zombie its parent has not reaped yet holds no memory); -1 where the process
    table cannot tell (not Linux: liveness alone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return None if fields[0] in ("Z", "X", "x") else int(fields[19])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return -1


def _start_time(entry: dict):
    """An entry's start time as a key: a value no process has (a ledger written by something else)
    stands for itself, and such an entry is dropped at its first look, as before."""
    started = entry.get("started")
    return started if started is None or isinstance(started, int) else repr(started)


class _Liveness:
    """Whether the processes named in a ledger still run, asked at every look: a process already
    seen is watched through a pidfd (Linux 5.3 and later), which turns readable when it ends (a
    zombie included) and never stands for another process given its pid, so one poll answers for
    every entry; a process seen for the first time, or where pidfds are missing, is read from the
    process table (``_started``)."""

    def __init__(self):
        self._watched: dict[tuple[int, object], int] = {}  # (pid, start time) -> its pidfd

    def alive(self, entries: dict) -> dict:
        """The ``entries`` (pid -> entry) whose processes still run."""
        keys = {pid: (int(pid), _start_time(entry)) for pid, entry in entries.items()}
        for key in set(self._watched) - set(keys.values()):
            os.close(self._watched.pop(key))  # gone from the ledger: no longer watched
        ended = self._ended([key for key in keys.values() if key in self._watched])
        live = {}
        for pid, entry in entries.items():
            key = keys[pid]
            if key in self._watched:
                if key not in ended:
                    live[pid] = entry
            elif _alive(*key):
                live[pid] = entry
                self._watch(key)
        return live

    def forget(self) -> None:
        for fd in self._watched.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._watched.clear()

    def _ended(self, keys: list) -> set:
        if not keys:
            return set()
        poller = select.poll()
        by_fd = {}
        for key in keys:
            fd = self._watched[key]
            by_fd[fd] = key
            poller.register(fd, select.POLLIN)
        ended = {by_fd[fd] for fd, _ in poller.poll(0)}
        for key in ended:
            os.close(self._watched.pop(key))
        return ended

    def _watch(self, key: tuple) -> None:
        pid, started = key
        if not hasattr(os, "pidfd_open") or started in (None, -1):
            return  # without a start time a pidfd could name the process that took the pid since
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return
        if _started(pid) == started:  # still the process the entry names, opened after the look
            self._watched[key] = fd
        else:
            os.close(fd)


class Ledger:
    """One device's reservations, in a JSON file that each read-and-write holds locked."""

    def __init__(self, path: Path):
        self.path = path
        self._stamp = None  # the file as this process left it at its last look
        self._pid, self._started = None, None
        self._liveness, self._liveness_pid = _Liveness(), os.getpid()

    @property
    def me(self) -> str:
        return str(os.getpid())

    @property
    def started(self) -> int | None:
        if self._pid != os.getpid():  # a forked child is another process
            self._pid, self._started = os.getpid(), _started(os.getpid())
        return self._started

    def _live(self, entries: dict) -> dict:
        if self._liveness_pid != os.getpid():  # a forked child closes its copies of its parent's pidfds
            self._liveness.forget()
            self._liveness, self._liveness_pid = _Liveness(), os.getpid()
        return self._liveness.alive(entries)

    @classmethod
    def open(cls, folder: Path, key: str) -> "Ledger | None":
        """The ledger of device ``key`` in ``folder`` (made, for every user, if missing); None
        where it cannot be kept there."""
        try:
            if not folder.is_dir():
                folder.mkdir(parents=True, exist_ok=True)
                with contextlib.suppress(OSError):
                    folder.chmod(0o1777)  # every user's campaigns share the device: sticky, as /tmp is
            path = folder / f"{key}.json"
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
            with contextlib.suppress(OSError):
                os.fchmod(fd, 0o666)
            os.close(fd)
        except OSError:
            return None
        return cls(path)

    @contextlib.contextmanager
    def entries(self):
        """The live entries (dead processes' dropped), locked; what the caller leaves in the dict is
        written back."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)  # a cleaner may have removed it
        except OSError:
            yield {}  # the folder went away: only the device's own report counts
            return
        try:
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_EX)
            raw = b""
            while chunk := os.read(fd, 1 << 16):
                raw += chunk
            try:
                found = json.loads(raw) if raw.strip() else {}
            except ValueError:
                found = {}  # a writer died mid-write: its entries come back at their next look
            live = self._live({pid: entry for pid, entry in (found.items() if isinstance(found, dict) else ())
                               if isinstance(entry, dict) and pid.isdigit()})
            yield live
            written = json.dumps(live).encode()
            if written == raw:
                return  # unchanged: nothing to write
            with contextlib.suppress(OSError):  # a full disk: the entries come back at the next look
                os.lseek(fd, 0, os.SEEK_SET)
                os.ftruncate(fd, 0)
                os.write(fd, written)
        finally:
            self._stamp = _stamp(os.fstat(fd))
            os.close(fd)  # the lock goes with it

    def unchanged(self) -> bool:
        """Is the file as this process left it at its last look (nobody has written it since)?  A
        write within the file system's clock tick that keeps its size is missed: the callers look
        again within a fraction of a second anyway."""
        try:
            return self._stamp is not None and _stamp(os.stat(self.path)) == self._stamp
        except OSError:
            return False


def _stamp(status: os.stat_result) -> tuple:
    return status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns


def _alive(pid: int, started) -> bool:
    now = _started(pid)
    return now is not None and (now == -1 or started in (None, -1) or now == started)
