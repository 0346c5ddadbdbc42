"""A subject that judges nothing: every case it is handed passes, and it keeps them.

A campaign handed one (``fuzz(..., subject=DrawOnly())``) draws, steers, counts and grows its
pool as it would on a GPU, at the GPU's production sizes, without building a tensor or launching
a kernel: what a search reaches, tested in the time its draws take.  ``kernel_like`` gives a
Kernel with a library adapter's capabilities and no code (nothing is ever run).
"""
from __future__ import annotations

from nanfuzz.harness.judge.outcome import Outcome, Verdict
from nanfuzz.harness.kernel import Kernel


class DrawOnly:
    defers = False  # nothing is compiled anywhere

    def __init__(self):
        self.cases = []

    def check(self, case, **_options) -> Outcome:
        self.cases.append(case)
        return Outcome(Verdict.PASS, "PASS")

    def close(self) -> None:
        pass


def kernel_like(name: str, capabilities) -> Kernel:
    def never_run(batch, out):
        raise AssertionError("a DrawOnly campaign runs no kernel")

    return Kernel(name, never_run, capabilities)
