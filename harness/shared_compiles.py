"""One compile per binary among nanfuzz's processes on a host.

The jobs of a ``--jobs`` run, their workers and the compile farm's processes
share Triton's on-disk cache, but Triton itself does not know that another
process is compiling the binary it just missed: on a cold cache fourteen
workers meeting a new specialisation compile it fourteen times, and a worker
waits for a farm entry as a whole although its case needs one binary of it.

Installed in those processes, ``ClaimingCache`` (Triton's file cache manager,
plus a claim) changes what a miss does.  The first process to miss a binary
claims it with a file in the binary's cache folder and compiles it; a process
that misses a claimed binary waits for it to land in the cache and loads it.
A claim ends with the binary, with its process, or with ``release_claims()``
after a compile that failed; a claim older than ``CLAIM_TIMEOUT`` is ignored.

A compile farm process, which only builds binaries ahead, installs it with
``skip_claimed``: a binary another process has claimed raises
``ClaimedElsewhere`` instead of a wait, and the farm process goes on to the
case's next launch.  Two farm processes given the same case then build its
launches side by side (a mixed batch's decode and prefill kernels) instead
of one after the other.
"""
from __future__ import annotations

import functools
import os
import time

CLAIM_FILE = "nanfuzz-compiling"
CLAIM_TIMEOUT = 300.0   # seconds; big kernels compile for tens of seconds on ROCm
_POLL = 0.01

_claims: set[str] = set()  # claim files this process holds
_waited = [0.0]            # seconds this process waited for other processes' compiles
_skip_claimed = [False]    # raise ClaimedElsewhere rather than wait (a farm process's choice)


class ClaimedElsewhere(Exception):
    """Another live process is compiling this binary (raised only under ``install(skip_claimed=True)``)."""


def available() -> bool:
    """Can ``install()`` work here: a Triton with ``knobs``, whose cache manager is its own
    file cache (a user's own manager, a remote cache say, is left alone)?"""
    try:
        from triton import knobs
        from triton.runtime.cache import FileCacheManager
    except ImportError:
        return False
    cache = getattr(knobs, "cache", None)
    if cache is None or not hasattr(cache, "manager_class"):
        return False
    return cache.manager_class in (None, FileCacheManager, _claiming_class())


def install(skip_claimed: bool = False) -> bool:
    """Make Triton's cache claim misses in this process (False where it cannot: ``available``);
    with ``skip_claimed``, a miss another process has claimed raises ``ClaimedElsewhere``."""
    if not available():
        return False
    from triton import knobs

    knobs.cache.manager_class = _claiming_class()
    _skip_claimed[0] = skip_claimed
    return True


def release_claims() -> None:
    """Drop this process's claims left by compiles that raised (a finished compile drops its own)."""
    for path in list(_claims):
        _drop(path)


def waited_seconds() -> float:
    """Seconds this process has waited so far for binaries other processes were compiling."""
    return _waited[0]


def _drop(path: str) -> None:
    _claims.discard(path)
    try:
        os.unlink(path)
    except OSError:
        pass


def _holder_alive(path: str) -> bool:
    """Is the claim at ``path`` held by a live process and younger than ``CLAIM_TIMEOUT``?"""
    try:
        with open(path) as f:
            pid = int(f.read().strip() or 0)
        age = time.time() - os.stat(path).st_mtime
    except (OSError, ValueError):
        return False
    if pid <= 0 or age > CLAIM_TIMEOUT:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    """Has ``pid`` ended, its parent not having reaped it yet?  (Linux; elsewhere: no.)"""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def _try_claim(path: str) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    except OSError:
        return True  # a cache folder we cannot write: compile without a claim, as Triton would
    with os.fdopen(fd, "w") as f:
        f.write(str(os.getpid()))
    _claims.add(path)
    return True


@functools.cache
def _claiming_class():
    from triton.runtime.cache import FileCacheManager

    class ClaimingCache(FileCacheManager):
        """Triton's file cache manager; a miss of a binary's metadata group claims the binary
        or waits for the process that claimed it (see the module's docstring)."""

        def __init__(self, key, override=False, dump=False):
            super().__init__(key, override=override, dump=dump)
            self._claims_misses = not override and not dump and bool(self.cache_dir)

        def get_group(self, filename):
            group = super().get_group(filename)
            if group is not None or not self._claims_misses or not filename.endswith(".json"):
                return group
            claim = self._make_path(CLAIM_FILE)
            started = time.monotonic()
            try:
                while True:
                    if _try_claim(claim):
                        return None  # ours to compile
                    if _skip_claimed[0] and _holder_alive(claim):
                        raise ClaimedElsewhere(claim)
                    while _holder_alive(claim):
                        time.sleep(_POLL)
                        group = super().get_group(filename)
                        if group is not None:
                            return group
                    group = super().get_group(filename)
                    if group is not None:
                        return group
                    if os.path.exists(claim):  # a dead or stale holder's: take it over
                        _drop(claim)
            finally:
                _waited[0] += time.monotonic() - started

        def put_group(self, filename, group):
            path = super().put_group(filename, group)
            if filename.endswith(".json"):
                claim = self._make_path(CLAIM_FILE)
                if claim in _claims:
                    _drop(claim)
            return path

    return ClaimingCache
