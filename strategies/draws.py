"""Primitive draws from strategies built once.

A strategy built inside a composite is built (and validated by Hypothesis)
again for every case, which costs more than the draw itself; these are
built once per distinct argument and shared.
"""
from __future__ import annotations

import functools

from hypothesis import strategies as st

BOOLEANS = st.booleans()


@functools.lru_cache(maxsize=4096)
def integers(lo: int, hi: int) -> st.SearchStrategy[int]:
    return st.integers(lo, hi)


def pick(draw, options):
    """One of ``options`` (a sequence), shrinking toward the first; nothing is drawn for a single option."""
    if len(options) == 1:
        return options[0]
    return options[draw(integers(0, len(options) - 1))]
