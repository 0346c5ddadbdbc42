"""Primitive draws from strategies built once.

A strategy built inside a composite is built (and validated by Hypothesis)
again for every case, which costs more than the draw itself; these are
built once per distinct argument and shared.
"""
from __future__ import annotations

import bisect
import functools
import itertools

from hypothesis import strategies as st

BOOLEANS = st.booleans()


@functools.lru_cache(maxsize=4096)
def integers(lo: int, hi: int) -> st.SearchStrategy[int]:
    return st.integers(lo, hi)


def pick(draw, options, weights: tuple[int, ...] | None = None):
    """One of ``options`` (a sequence), shrinking toward the first; nothing is drawn for a single option.

    ``weights`` (positive integers, one per option) make generation favour
    some options without changing where shrinking goes: one integer is drawn
    over their sum and each option owns a run of it, the first option's run
    starting at zero.
    """
    if len(options) == 1:
        return options[0]
    if weights is None:
        return options[draw(integers(0, len(options) - 1))]
    if len(weights) != len(options):
        raise ValueError(f"{len(weights)} weights for {len(options)} options")
    ends = _run_ends(tuple(weights))
    return options[bisect.bisect_right(ends, draw(integers(0, ends[-1] - 1)))]


@functools.lru_cache(maxsize=64)
def _run_ends(weights: tuple[int, ...]) -> tuple[int, ...]:
    if not weights or min(weights) < 1:
        raise ValueError(f"weights must be positive integers, not {weights}")
    return tuple(itertools.accumulate(weights))
