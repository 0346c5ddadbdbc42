"""Sequences, windows and block tables: the batch situations that break masking."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from hypothesis import strategies as st

from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.case import CHUNKED_PREFILL, DECODE, PADDING, PREFILL
from nanfuzz.strategies.draws import integers, pick


@dataclass(frozen=True)
class Lengths:
    query_len: int
    seq_len: int


def allowed_kinds(caps: Capabilities, padding: bool) -> tuple[str, ...]:
    kinds = []
    if caps.min_query_len <= 1:
        kinds.append(DECODE)
    if caps.max_query_len is None or caps.max_query_len > 1:
        kinds += [PREFILL, CHUNKED_PREFILL]
    if padding:
        kinds.append(PADDING)
    return tuple(kinds)


@functools.lru_cache(maxsize=64)
def sequence_lengths(caps: Capabilities, max_len: int, max_query: int, padding: bool = True,
                     query_len: int | None = None):
    """One request; shrinks toward a decode of one key.  ``padding`` allows Q = L = 0;
    ``query_len`` fixes Q for a request with a query (``Capabilities.uniform_query_len``)."""
    if query_len is None:
        kinds = allowed_kinds(caps, padding)
        q_lo = max(1, caps.min_query_len)
        q_hi = min(max_query if caps.max_query_len is None else min(max_query, caps.max_query_len), max_len)
        queries = integers(q_lo, max(q_lo, q_hi))
    else:
        kinds = (DECODE,) if query_len == 1 else (PREFILL, CHUNKED_PREFILL)
        kinds += (PADDING,) if padding else ()
        queries = st.just(query_len)

    @st.composite
    def one(draw) -> Lengths:
        kind = pick(draw, kinds)
        if kind == DECODE:
            return Lengths(1, draw(integers(1, max_len)))
        if kind == PADDING:
            return Lengths(0, 0)
        q = draw(queries)
        if kind == PREFILL:
            return Lengths(q, q)
        context = draw(integers(1, max(1, max_len - q)))
        return Lengths(q, context + q)

    return one()


@functools.lru_cache(maxsize=1024)
def windows(caps: Capabilities, longest: int, block_size: int, causal: bool = True):
    """No window, the narrowest window the kernel takes (one key, or ``Capabilities.min_window``),
    or any width from there up to a little past the longest sequence (``window_only``: never none).

    Random widths against random lengths put the window edge inside a
    block often (a block holding expired and live keys) and leave whole
    blocks below it (freed blocks).
    """
    if not caps.windowed(causal):
        return st.just(0)
    narrowest = caps.min_window
    widths = (st.just(narrowest), st.integers(narrowest + 1, max(narrowest + 1, longest + block_size)))
    return st.one_of(*widths) if caps.window_only else st.one_of(st.just(0), *widths)


@functools.lru_cache(maxsize=64)
def causal_flags(caps: Capabilities):
    return st.sampled_from(caps.modes())
