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
of one after the other.  A worker does the same for one check at a time
(``skipping_misses``), and while a farm runs it also skips a binary nobody
compiles yet: the campaign checks another case meanwhile and comes back to
this one once the binary has landed (``harness.campaign.deferrals``).
"""
from __future__ import annotations

import contextlib
import functools
import os
import time
from dataclasses import dataclass, field

CLAIM_FILE = "nanfuzz-compiling"
CLAIM_TIMEOUT = 300.0   # seconds; big kernels compile for tens of seconds on ROCm
_POLL = 0.01



@dataclass
class _ProcessClaims:
    """What this process's claiming cache does on a miss, and what it has done so far."""

    held: set[str] = field(default_factory=set)  # claim files this process holds
    waited: float = 0.0            # seconds this process waited for other processes' compiles
    skip_claimed: bool = False     # raise ClaimedElsewhere rather than wait (a farm process's choice)
    skip_unclaimed: bool = False   # ... and so for a binary nobody compiles (``skipping_misses``)
    met: list | None = None        # under skipping_misses: the misses skipped so far


_state = _ProcessClaims()


class ClaimedElsewhere(BaseException):
    """Another live process is compiling this binary, or (``skipping_misses(unclaimed=True)``) is
    going to: raised only where such binaries are skipped.  Its argument is the claim's path.
    Not an ``Exception``: a kernel's host code that catches every error must not swallow it."""


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
    _state.skip_claimed = skip_claimed
    return True


@dataclass(frozen=True)
class Skipped:
    """A binary a launch did without: ``claim``, where a compile of it is claimed; ``landed``,
    where its metadata group appears once it is in the cache (Triton's file cache's naming);
    ``claimed``, whether another process was compiling it (else nobody was, yet); ``stuck``, where
    a marker appears once what was to build it will not soon (a compile farm's task waiting for
    device memory, or given up), "" where nothing is watched so."""

    claim: str
    landed: str
    claimed: bool = True
    stuck: str = ""


@contextlib.contextmanager
def skipping_misses(unclaimed: bool = False):
    """Within: a miss of a binary another live process is compiling raises ``ClaimedElsewhere``
    instead of waiting; with ``unclaimed``, so does a miss nobody is compiling (left unclaimed, for
    a compile farm to build).  Yields a list that gets a ``Skipped`` for each, so a caller whose
    code under test caught the exception still knows that a launch was skipped."""
    met: list[Skipped] = []
    before = _state.skip_claimed, _state.skip_unclaimed, _state.met
    _state.skip_claimed, _state.skip_unclaimed, _state.met = True, unclaimed, met
    try:
        yield met
    finally:
        _state.skip_claimed, _state.skip_unclaimed, _state.met = before


def claim_pending(path: str) -> bool:
    """Is the binary whose claim is at ``path`` still being compiled (by a live process)?"""
    return os.path.exists(path) and _holder_alive(path)


def release_claims() -> None:
    """Drop this process's claims left by compiles that raised (a finished compile drops its own)."""
    for path in list(_state.held):
        _drop(path)


def waited_seconds() -> float:
    """Seconds this process has waited so far for binaries other processes were compiling."""
    return _state.waited


def _drop(path: str) -> None:
    _state.held.discard(path)
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
    _state.held.add(path)
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
            if _state.skip_unclaimed:
                self._skip(claim, filename, claimed=_holder_alive(claim))
            started = time.monotonic()
            try:
                while True:
                    if _try_claim(claim):
                        return None  # ours to compile
                    if _state.skip_claimed and _holder_alive(claim):
                        self._skip(claim, filename, claimed=True)
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
                _state.waited += time.monotonic() - started

        def _skip(self, claim: str, filename: str, claimed: bool):
            if _state.met is not None:
                _state.met.append(Skipped(claim, self._make_path(f"__grp__{filename}"), claimed))
            raise ClaimedElsewhere(claim)

        def put_group(self, filename, group):
            path = super().put_group(filename, group)
            if filename.endswith(".json"):
                claim = self._make_path(CLAIM_FILE)
                if claim in _state.held:
                    _drop(claim)
            return path

    return ClaimingCache
