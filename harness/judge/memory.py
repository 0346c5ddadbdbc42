"""The device memory governor: what every nanfuzz process on a device may allocate for its cases.

Every process that builds cases on a device (a campaign's worker, each job's
worker, a compile-farm process, a campaign running launches in its own
process), of every campaign on the machine, reserves what a case needs before
it builds anything, in one ledger per device: a file in the ledger folder,
named after the device's UUID (so processes that see the device under
different indices agree), locked with ``fcntl`` for each read-and-write.  An
entry is keyed by its process's pid and start time, so the reservation of a
dead process is void: whoever reads the ledger next drops it.

An entry weighs what its process may hold: while a case runs, the case's whole
footprint (the batches, the judge's copies, the oracle's working set, the pool's
caches); between cases, what the process still holds (the pool's caches, the
allocator's cache), until it gives them back; after a small case, the case's reservation (its
claim, ``CLAIM_LIMIT``), which the next cases that fit in it use without a look.  A reservation is granted when
it fits twice: beside every other entry in what the device has, and in what
the device reports free now, less what other entries reserved and have not
allocated yet and a margin (this also covers what nanfuzz does not see: other
programs, contexts).  One that does not fit first makes its own process give
back what it holds, then waits, its want written in the ledger: every other
process gives back what it holds at its next case or, idle, within a second,
and later reservations leave room for earlier wants.  A wait is bounded; past
it the case is declined (``TooLargeForDevice``).  A case that needs more than
the device has is declined at once.

On a CPU the device is the host's memory, counted the same way.  A
``SimulatedDevice`` stands in for a GPU of a given size whose cases each need
a given amount: how the CPU tests hold the governor to account
(``harness.judge.device_memory``; the ledger file is ``harness.judge.ledger``).
"""
from __future__ import annotations

import contextlib
from collections import Counter
import os
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from nanfuzz.harness.judge.device_memory import (GiB, DeviceMemory, Footprint, GpuMemory, HostMemory, SimulatedDevice,
                                                 SimulatedMemory, amount, device_key, out_of_memory)
from nanfuzz.harness.judge.ledger import Ledger
from nanfuzz.reference.errors import NanfuzzError

__all__ = ["GiB", "Footprint", "amount", "SimulatedDevice", "MemoryPolicy", "TooLargeForDevice", "JudgingOutOfMemory",
           "HarnessOutOfMemory", "Governor", "governor", "out_of_memory", "device_key"]

# How long a drawn case waits for memory before the search declines it: a production-size check
# takes seconds on an H200 (``nanfuzz bench --scaling``), so two minutes lets every other
# campaign on the device finish a case or two.
SEARCH_WAIT = 120.0
# Between looks at the ledger while waiting (with up to as much again at random, so that waiters
# do not look in step): _FIRST_POLL after the first look, twice as long after each look since, up to
# _POLL.  14 jobs of small cases on an H100 waited 159 times in 37 s, 0.45 s each on average, where
# every look again came 0.25 to 0.5 s later: about one look, which a short first pause cuts.
_FIRST_POLL = 0.02
_POLL = 0.25
# A process keeps its reservation of a case needing at most this much beyond what it holds (its
# claim), and judges the next cases that fit in the claim without a look at the ledger, while the
# ledger is unchanged since its last look and that look is recent: fourteen workers looking twice
# per small case held the ledger's lock most of the time, and waited for it longer than they
# judged.  A process that waits for memory changes the ledger, so holders give their claims back
# at their next case as they give back their caches; a change the file's stamp misses is seen
# within _LOOK_EVERY.
CLAIM_LIMIT = 1 * GiB
_LOOK_EVERY = 0.25


# What a reservation waits on (``Governor.wait_causes``): the ledger's entries of other nanfuzz
# processes, by their reservations and claims alone or only with the wants standing ahead of it, or
# the device's own report of its free memory (what other processes' allocators keep, nanfuzz's
# included, and processes outside it).
HELD_BY_OTHERS = "held by other nanfuzz processes"
WANTED_FIRST_BY_OTHERS = "wanted first by other nanfuzz processes"
NOT_FREE_ON_THE_DEVICE = "not free on the device"
WAIT_CAUSES = (HELD_BY_OTHERS, WANTED_FIRST_BY_OTHERS, NOT_FREE_ON_THE_DEVICE)


class TooLargeForDevice(NanfuzzError):
    """A case declined for memory: more than the device has, or more than came free within the
    wait.  A campaign counts such a case and goes on (with a note); a finding's case is never lost
    to it (see ``harness.campaign.runner``)."""


class MemoryTaken(TooLargeForDevice):
    """A case declined because its memory did not come free within the wait: other processes held
    it, and may give it back later."""


class JudgingOutOfMemory(TooLargeForDevice):
    """A case declined because nanfuzz's own allocations failed while judging it, twice."""


class HarnessOutOfMemory(Exception):
    """nanfuzz's own allocation failed while it judged a case (materialising, the oracle, the
    verdict): retried once with memory granted again, else declined; never the kernel's verdict."""


@dataclass(frozen=True)
class MemoryPolicy:
    """How a campaign's processes share their device's memory (it travels in ``Settings`` and in
    each worker's ``WorkerSpec``)."""

    ledger_dir: str | None = None       # NANFUZZ_MEMORY_DIR; None: nanfuzz-memory in the temporary folder
    search_wait: float = SEARCH_WAIT    # seconds a drawn case waits for memory before it is declined
    simulated: SimulatedDevice | None = None

    def folder(self) -> Path:
        return Path(self.ledger_dir) if self.ledger_dir else Path(tempfile.gettempdir()) / "nanfuzz-memory"


# -- the governor --------------------------------------------------------------------

class Governor:
    """This process's side of one device's ledger."""

    def __init__(self, device: DeviceMemory, ledger: Ledger | None):
        self.device, self.ledger = device, ledger
        self.waits = 0           # reservations that had to wait
        self.waited = 0.0        # seconds they waited
        self.wait_causes: Counter[str] = Counter()  # those waits by what stood in the way when each began
        self._short_of = ""      # what the last shortfall found lacking (``WAIT_CAUSES``)
        self.granted = 0         # what the case in flight reserved
        self.claim = 0           # what this process's entry keeps weighing between small cases (see CLAIM_LIMIT); 0: none
        self.looked = None       # when this process last looked at the ledger (time.monotonic)

    # -- the ledger entries --------------------------------------------------------
    def _write(self, entries: dict, weight: int, allocated: int, wants: int = 0, since: float = 0.0) -> None:
        if self.ledger is not None:
            entries[self.ledger.me] = {"started": self.ledger.started, "weight": int(weight),
                                       "allocated": int(allocated), "wants": int(wants), "since": since,
                                       "kept": int(self.device.kept(allocated))}

    @contextlib.contextmanager
    def _entries(self):
        if self.ledger is None:
            yield {}
        else:
            with self.ledger.entries() as entries:
                yield entries
            self.looked = time.monotonic()

    def _unchanged(self) -> bool:
        """Has nobody written the ledger since this process's recent last look (so nobody began to
        wait for memory)?"""
        return (self.ledger is not None and self.looked is not None
                and time.monotonic() - self.looked < _LOOK_EVERY and self.ledger.unchanged())

    def _others_want(self, entries: dict) -> bool:
        me = self.ledger.me if self.ledger is not None else None
        return any(e.get("wants") for pid, e in entries.items() if pid != me)

    # -- a case's memory -----------------------------------------------------------
    def reserve(self, estimate: int | Callable[[], int], patience: float,
                waiting: Callable[[bool], None] = lambda on: None, keep: bool = True, headroom: int = 0) -> int:
        """Reserve what a case whose check holds about ``estimate`` bytes at its peak needs (what
        this process holds between cases included: a function of it is asked again once this
        process has given back what it holds); wait up to ``patience`` seconds for it.  Returns
        the bytes reserved; ``TooLargeForDevice`` when it never fits or does not come free in
        time.  ``waiting(True)`` is told when a wait begins, ``waiting(False)`` when it ends.
        ``keep``: a small case's reservation stays this process's claim after it (``CLAIM_LIMIT``).
        ``headroom``: bytes that must stay free beside it, never reserved (what a helper leaves for
        the campaign's checks)."""
        asked = estimate  # the estimate last asked for

        def needed() -> int:
            nonlocal asked
            asked = estimate() if callable(estimate) else estimate
            return self.device.footprint(asked)

        def made_of() -> str:  # what the estimate holds, where it says
            return f" ({asked.described()})" if isinstance(asked, Footprint) else ""

        need = needed()
        if self.claim and need <= self.claim and self._unchanged():
            self.granted = need  # within what this process's entry already weighs
            return need
        total = self.device.total()
        gave_back = told = False
        if self._larger_than_device(need) and self.device.held():
            # what this process keeps between cases counts in the estimate (a large case's pool):
            # given back, the case may fit
            gave_back = True
            self.device.give_back()
            need = needed()
        if self._larger_than_device(need + headroom):
            raise TooLargeForDevice(f"this case needs about {amount(need)} of {self.device.where} memory"
                                    f"{made_of()}, more than the {amount(total - headroom)} the device has"
                                    f"{' beside the room left for checks' if headroom else ''}; declined")
        started, pause = time.monotonic(), _FIRST_POLL
        try:
            while True:
                with self._entries() as entries:
                    shortfall = self._shortfall(entries, need, total, started, headroom)
                    held = self.device.held()
                    if shortfall:
                        # the entry weighs what this process holds, and wants the rest; a process that
                        # never waits wants nothing: its want, gone a moment later, would only stand
                        # ahead of others' (sixteen compile processes asking at once refused a 0 MiB case)
                        self.claim = 0
                        stands_in_line = patience > 0 and not self._beyond_others_giving_back(entries, need, total)
                        self._write(entries, held, held, wants=need if stands_in_line else 0, since=started)
                    else:
                        # the entry stays as it was while the claim covers the case: others' looks
                        # find the ledger unchanged
                        self.claim = max(self.claim, need, held) if keep and need - held <= CLAIM_LIMIT else 0
                        self._write(entries, max(need, self.claim), held)
                if not shortfall:
                    self.granted = need
                    return need
                if not gave_back:  # this process's own caches go first
                    gave_back = True
                    if held:
                        self.device.give_back()
                        need = needed()
                        continue
                if not told:
                    told = True
                    self.waits += 1
                    self.wait_causes[self._short_of] += 1
                    waiting(True)
                if time.monotonic() - started >= patience:
                    raise MemoryTaken(f"this case needs about {amount(need)} of {self.device.where} "
                                      f"memory{made_of()} and {shortfall} after "
                                      f"{time.monotonic() - started:.0f} s of waiting; declined")
                time.sleep(pause * (1 + random.random()))
                pause = min(_POLL, 2 * pause)
        except BaseException:
            self._forget_want()
            raise
        finally:
            if told:
                self.waited += time.monotonic() - started
                waiting(False)

    def larger_than_device(self, estimate: int) -> bool:
        """Would a case estimated at ``estimate`` bytes never fit this device, however empty?"""
        return self._larger_than_device(self.device.footprint(estimate))

    def _larger_than_device(self, need: int) -> bool:
        return need > self.device.total() - self.device.margin()

    def built(self) -> None:
        """The case in flight has built its batches: its entry records what this process holds now, so
        that other processes stop setting aside, beside what the device reports free, the part of
        the reservation already allocated (counted twice, a 1 MiB case was refused with 64 GiB
        free).  Small cases within the claim write nothing."""
        if self.ledger is None or not self.granted or self.granted <= CLAIM_LIMIT:
            return
        with self._entries() as entries:
            mine = entries.get(self.ledger.me)
            if mine is not None:
                mine["allocated"] = int(self.device.held())

    def open_context(self, room: int) -> bool:
        """May this process open its context on the device, leaving ``room`` bytes for cases?  Asked
        by a process that helps (a compile farm's) rather than judges: never waited for.  Where it
        may, its entry weighs the context from now on.  The context opens outside the ledger's lock,
        once the other processes' entries leave room for it: opening one takes tenths of a second,
        and held under the lock, sixteen compile processes opening theirs in turn made every check of
        the campaign wait about 0.2 s at each look at the ledger for the first seconds of its life."""
        from nanfuzz.harness.judge.device_memory import CONTEXT_BYTES

        need = self.device.footprint(CONTEXT_BYTES + room)
        if self._larger_than_device(need):
            return False
        with self._entries() as entries:
            if self._shortfall(entries, need, self.device.total(), time.monotonic(), look_at_device=False):
                return False
        self.device.free()  # opens the context: what it reports comes next, under the lock
        try:
            self.reserve(CONTEXT_BYTES + room, patience=0.0, keep=False)
        except TooLargeForDevice:
            return False
        self.settle()
        return True

    def _shortfall(self, entries: dict, need: int, total: int, started: float, headroom: int = 0,
                   look_at_device: bool = True) -> str:
        """Why ``need`` (with ``headroom`` left free beside it) does not fit now ("" when it does);
        ``look_at_device=False``: by the other processes' entries alone."""
        need += headroom
        me = self.ledger.me if self.ledger is not None else None
        others = {pid: e for pid, e in entries.items() if pid != me}
        committed = sum(e.get("weight", 0) for e in others.values())
        # wants older than this one come first: their shortfall is set aside
        ahead = sum(max(0, e.get("wants", 0) - e.get("weight", 0)) for e in others.values()
                    if e.get("wants") and e.get("since", 0.0) < started)
        if committed + ahead + need > total:
            self._short_of = HELD_BY_OTHERS if committed + need > total else WANTED_FIRST_BY_OTHERS
            return (f"{amount(total - committed - ahead)} are not held or wanted by the "
                    f"{len(others)} other nanfuzz process(es) on it")
        free = self.device.free() if look_at_device else None
        if free is None:
            return ""
        pending = sum(max(0, e.get("weight", 0) - e.get("allocated", 0)) for e in others.values())
        usable = free - pending - self.device.margin()
        if need - self.device.held() > usable:
            self._short_of = NOT_FREE_ON_THE_DEVICE
            return (f"{amount(usable)} are free to it ({amount(free)} free on the device, "
                    f"{amount(pending)} of it reserved by other nanfuzz processes)")
        return ""

    def _beyond_others_giving_back(self, entries: dict, need: int, total: int) -> bool:
        """Can ``need`` come free only once other processes end?  Then its want stands ahead of no one:
        what others give back would not make it fit, and a want ahead of every later reservation stopped
        every campaign on an 80 GB H100 for its whole two-minute wait behind a 77 GiB case beside
        six other processes' contexts.  It waits all the same, and stands in line once it can fit."""
        me = self.ledger.me if self.ledger is not None else None
        return need + sum(e.get("kept", 0) for pid, e in entries.items() if pid != me) > total

    def _forget_want(self) -> None:
        self.claim = 0
        with self._entries() as entries:
            held = self.device.held()
            self._write(entries, held, held)

    def settle(self) -> None:
        """The case is over: this process's entry weighs what it holds now, given back at once where
        another process waits."""
        self.granted = 0
        self.device.case_done()
        if self.claim and self._unchanged() and self.device.held() <= self.claim:
            return  # the entry weighs the claim, which covers what this process holds
        with self._entries() as entries:
            if self._others_want(entries):
                self.claim = 0
                if self.device.held():
                    self.device.give_back()
            held = self.device.held()
            self._write(entries, max(held, self.claim), held)

    def idle(self) -> None:
        """Between cases (a worker waiting for its next one): give back what this process holds
        where another process waits for memory."""
        if self.ledger is None or not (self.claim or self.device.held()):
            return
        with self._entries() as entries:
            if self._others_want(entries):
                self.claim = 0
                self.device.give_back()
                held = self.device.held()
                self._write(entries, held, held)

    def give_back(self) -> None:
        """Everything this process holds between cases, and its claim, freed now (before a retry)."""
        self.claim = 0
        self.device.give_back()
        with self._entries() as entries:
            held = self.device.held()
            self._write(entries, held, held)


_governors: dict[tuple, Governor] = {}


def governor(policy: MemoryPolicy, device) -> Governor:
    """This process's governor of ``device`` (a ``torch.device``) under ``policy``."""
    index = (device.index if device.index is not None else _current_index()) if device.type == "cuda" else None
    key = (os.getpid(), policy, device.type, index)  # a forked child starts its own
    if key not in _governors:
        if policy.simulated is not None:
            view: DeviceMemory = SimulatedMemory(policy.simulated)
        elif device.type == "cuda":
            view = GpuMemory(index)
        else:
            view = HostMemory()
        _governors[key] = Governor(view, Ledger.open(policy.folder(), view.key))
    return _governors[key]


def _current_index() -> int:
    import torch

    return torch.cuda.current_device()
