"""The cases a seeded search will draw first, known before it starts.

While every case passes, what Hypothesis draws next depends only on its seed,
its settings and the strategy, never on the kernel: the search's first cases
can be drawn in advance, on the host, in milliseconds each.  The compile farm
(``harness.launch.farm``) builds those cases first, in the order the search
meets them, so a cold campaign's first examples wait for one round of
parallel compiles instead of meeting the pool one compile at a time.  Once a
case fails, the search goes its own way (shrinking), and the farm's other
tasks cover the pool.
"""
from __future__ import annotations

from typing import Callable

from hypothesis import HealthCheck, Phase, given, reject, seed as hypothesis_seed, settings as hypothesis_settings

from nanfuzz.reference.case import Case
from nanfuzz.reference.errors import NanfuzzError
from nanfuzz.strategies.steady import steady_draws

# A GPU search puts off the cases whose binaries are not built yet (``harness.campaign.deferrals``) and
# draws on: it meets several dozen cases while the farm builds its first binaries.
UPCOMING_CASES = 64


class _Enough(KeyboardInterrupt):
    """Stops the drawing run at once (Hypothesis lets a KeyboardInterrupt through untouched)."""


def upcoming_cases(strategy, seed: int, max_examples: int, count: int = UPCOMING_CASES,
                   declines: Callable[[Case], str | None] | None = None) -> tuple[Case, ...]:
    """The first ``count`` cases a search of ``strategy`` under Hypothesis seed ``seed`` and
    ``max_examples`` draws, as long as each passes (the search's own run must match: the same
    strategy, seed and example budget, no example database to replay first, and the kernel's
    ``declines`` turning down the same cases)."""
    drawn: list[Case] = []

    def record(case: Case) -> None:
        try:
            declined = declines is not None and declines(case)
        except NanfuzzError:
            declined = False  # the search meets the same error and reports it
        if declined:
            reject()
        drawn.append(case)
        if len(drawn) >= count:
            raise _Enough()

    run = hypothesis_seed(seed)(given(case=strategy)(record))
    # the search's own settings but for the example database (and shrinking, which starts after a
    # failure): a Hypothesis whose generation heeds any of them then draws alike in both
    phases = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target]
    run = hypothesis_settings(max_examples=max_examples, deadline=None, database=None, phases=phases,
                              report_multiple_bugs=False, suppress_health_check=list(HealthCheck),
                              print_blob=False)(run)
    try:
        with steady_draws():  # as the search draws
            run()
    except _Enough:
        pass
    return tuple(drawn)
