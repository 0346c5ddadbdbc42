"""Cases whose check waits for a compile go to the back of the queue.

On a cold GPU cache a case's launch may need a binary that another process
(the compile farm, another job's worker) is still compiling, or that the
compile farm has yet to reach.  Rather than wait for it, or compile it
itself while the farm's processes already use every core, the worker skips
the case (``worker.Deferred``) and the search goes on to its next case,
whose binaries may be ready.  The skipped case is checked once its binary
has landed (``Deferrals.landed``), and every case still put off when the
Hypothesis run ends is checked then, each as soon as it can be.

To Hypothesis a skipped case is a pass, and it draws exactly what it would
have drawn had the case passed (``harness.campaign.upcoming`` relies on the same).
So when a case checked late fails, the runner replays the same seeded run:
a ``Replay`` answers each case already judged with its outcome, passes the
cases still unchecked, and raises the late failure when Hypothesis draws its
case again, which Hypothesis then shrinks as if it had failed in order.
"""
from __future__ import annotations

import os

from nanfuzz.harness.launch import shared_compiles
from nanfuzz.harness.judge.check import Outcome
from nanfuzz.harness.launch.shared_compiles import Skipped
from nanfuzz.reference.case import Case


class FoundLate(KeyboardInterrupt):
    """A deferred case failed: ends the Hypothesis run (untouched by Hypothesis, as a Ctrl-C is)
    so that the runner can replay it up to that case."""

    def __init__(self, case: Case, outcome: Outcome):
        super().__init__()
        self.case, self.outcome = case, outcome


class Deferrals:
    """The cases of one Hypothesis run put off until a binary lands, in the order they were drawn."""

    def __init__(self):
        self._waiting: list[tuple[Case, Skipped]] = []  # (case, the binary it did without)
        self._compiled_elsewhere: set[str] = set()      # claims seen held since a case was put off
        self.count = 0                                  # deferrals so far (a case may be put off twice)

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def add(self, case: Case, skipped: Skipped) -> None:
        self._waiting.append((case, skipped))
        self.count += 1

    def landed(self, farm_running: bool) -> list[tuple[Case, bool]]:
        """Take out the cases that can be checked now, each with whether its binary is built.  It is
        when it has landed.  It is not when a compile of it was under way elsewhere and ended without
        landing it (that compile failed, or its process died), when the farm's task that was to build it
        is stuck (``Skipped.stuck``), or when nobody compiles it and no farm runs that would: the check
        then compiles it itself, and meets whatever stopped the other."""
        states: dict[Skipped, bool | None] = {}  # many cases wait for one binary: look once per binary
        ready, waiting = [], []
        for case, skipped in self._waiting:
            if skipped not in states:
                states[skipped] = self._state(skipped, farm_running)
            if states[skipped] is None:
                waiting.append((case, skipped))
            else:
                ready.append((case, states[skipped]))
        self._waiting = waiting
        return ready

    def _state(self, skipped: Skipped, farm_running: bool) -> bool | None:
        """True: landed; False: ready to compile in the check; None: still to wait for."""
        if skipped.stuck and os.path.exists(skipped.stuck):
            return False
        if os.path.exists(skipped.landed):
            return True
        if shared_compiles.claim_pending(skipped.claim):
            self._compiled_elsewhere.add(skipped.claim)
            return None
        if skipped.claimed or skipped.claim in self._compiled_elsewhere or not farm_running:
            return False
        return None

    def remaining(self) -> list[Case]:
        """Take out every case still waiting."""
        cases = [case for case, _ in self._waiting]
        self._waiting = []
        return cases


class Replay:
    """The answers of a Hypothesis run drawn again up to a case that failed out of order.

    ``judged``: the outcome of each case already checked in the run; ``unchecked``:
    the cases still deferred when the late failure came, passed over until it is met
    (after that, Hypothesis is shrinking and every new case is checked).
    """

    def __init__(self, found: FoundLate, judged: dict[Case, Outcome], unchecked: list[Case]):
        self.case, self.outcome = found.case, found.outcome
        self.judged = dict(judged)
        self.unchecked = set(unchecked)
        self.met = False

    def known(self, case: Case) -> Outcome | None:
        """The outcome the case already had in this run, if it was judged."""
        if case == self.case:
            self.met = True
            return self.outcome
        return self.judged.get(case)

    def passes_over(self, case: Case) -> bool:
        """Whether the case is one still unchecked before the late failure (a pass to Hypothesis)."""
        return not self.met and case in self.unchecked
