"""Which keys a query may read, and which cache slots no query may read.

This module is the specification of the allowed-key set (see the design
notes); the oracle, the poisoner and the repro picture all ask it.  The
union of one sequence's allowed sets (``Sequence.live_range`` and
``live_blocks``) lives in the case model, whose validity rules need it.
"""
from __future__ import annotations

import enum
import functools

from nanfuzz.reference.case import NULL_BLOCK, Case, Sequence


def allowed(position: int, key: int, seq_len: int, window: int, causal: bool) -> bool:
    """May the query at absolute ``position`` read ``key``?  The scalar definition."""
    if not 0 <= key < seq_len:
        return False
    if causal and key > position:
        return False
    if window > 0:
        distance = position - key if causal else abs(position - key)
        if distance >= window:
            return False
    return True


def live_key_range(case: Case, seq: Sequence) -> tuple[int, int]:
    """The keys some query of ``seq`` may read, as a half-open range ``[lo, hi)``
    (see ``Sequence.live_range``)."""
    return seq.live_range(case.sliding_window)


class Dead(enum.IntFlag):
    """Why a slot is dead for the batch.  A slot can be dead for several reasons."""

    TAIL = 1            # past seq_len in a sequence's last block
    OUT_OF_WINDOW = 2   # below (or, non-causal, beside) every query's window
    NULL_BLOCK = 4      # the reserved block 0
    PADDING = 8         # the block that table padding points at
    UNREFERENCED = 16   # no sequence's table maps a key to it (freed)
    NO_QUERY = 32       # held by a sequence that has no query this step


def slot_liveness(case: Case) -> list[list[bool]]:
    """``live[block][offset]``: may some query of the batch read this slot?"""
    return [list(row) for row in _liveness(*_layout_key(case))]


def slot_reasons(case: Case) -> list[list[Dead]]:
    """``reasons[block][offset]``: every reason a slot is dead (empty when it is live)."""
    return [[_DEAD[why] for why in row] for row in _reason_bits(*_layout_key(case))]


# Liveness and dead-slot reasons depend on the block layout alone, not on the
# poison or the data seed; the strategy, validation, materialisation and the
# evidence all ask for them, several times per case, so they are memoised on
# these fields (a case's own hash would miss across poison variants).
def _layout_key(case: Case) -> tuple:
    g = case.geometry
    return g.num_blocks, g.block_size, case.sequences, case.sliding_window, case.padding_block


def _memoised(compute):
    cached = functools.lru_cache(maxsize=256)(compute)

    @functools.wraps(compute)
    def lookup(*key):
        try:
            return cached(*key)
        except TypeError:  # an unhashable hand-built case (lists for tuples)
            return compute(*key)

    lookup.cache_clear = cached.cache_clear
    return lookup


@_memoised
def _liveness(num_blocks: int, block_size: int, sequences: tuple[Sequence, ...], window: int,
              padding_block: int) -> tuple[tuple[bool, ...], ...]:
    live = [[False] * block_size for _ in range(num_blocks)]
    for seq in sequences:
        for j, offsets in seq.live_blocks(window, block_size).items():
            live[seq.block_table[j]][offsets.start:offsets.stop] = [True] * len(offsets)
    return tuple(tuple(row) for row in live)


# Dead flags by value: IntFlag arithmetic is slow, so flags are combined as
# plain ints and turned into ``Dead`` only on the way out.
_DEAD = {value: Dead(value) for value in range(2 ** len(Dead))}
_TAIL, _OUT_OF_WINDOW, _NULL_BLOCK, _PADDING, _UNREFERENCED, _NO_QUERY = (
    int(f) for f in (Dead.TAIL, Dead.OUT_OF_WINDOW, Dead.NULL_BLOCK, Dead.PADDING, Dead.UNREFERENCED, Dead.NO_QUERY))


@_memoised
def _reason_bits(num_blocks: int, block_size: int, sequences: tuple[Sequence, ...], window: int,
                 padding_block: int) -> tuple[tuple[int, ...], ...]:
    bs = block_size
    live = _liveness(num_blocks, bs, sequences, window, padding_block)
    reasons = [[0] * bs for _ in range(num_blocks)]
    referenced = [False] * num_blocks

    def mark(block: int, start: int, end: int, why: int) -> None:
        if start < end:
            row = reasons[block]
            row[start:end] = [r | why for r in row[start:end]]

    for seq in sequences:
        used = seq.used_blocks(bs)
        lo, _ = seq.live_range(window)
        for j in range(used):
            block = seq.block_table[j]
            referenced[block] = True
            # offsets [0, keys) hold keys < seq_len; the rest of the block is tail
            keys = min(bs, seq.seq_len - j * bs)
            mark(block, keys, bs, _TAIL)
            if seq.query_len == 0:
                mark(block, 0, keys, _NO_QUERY)
            else:  # keys below the live range [lo, seq_len) expired
                mark(block, 0, min(keys, lo - j * bs), _OUT_OF_WINDOW)
    padded = any(len(s.block_table) > s.used_blocks(bs) for s in sequences)
    for block in range(num_blocks):
        extra = 0
        if block == NULL_BLOCK:
            extra |= _NULL_BLOCK
        if block == padding_block and padded:
            extra |= _PADDING
        if not referenced[block]:
            extra |= _UNREFERENCED
        alive = live[block]
        reasons[block] = [0 if alive[o] else why | extra for o, why in enumerate(reasons[block])]
    return tuple(tuple(row) for row in reasons)


def dead_slots(case: Case) -> list[tuple[int, int]]:
    """Every dead slot, the ones a careless kernel is likeliest to read first.

    Slots reached through a sequence's table (tail, out-of-window) come
    before null, padding and unreferenced blocks, so that a strategy that
    picks "dead slot number 0" shrinks toward a slot that matters.
    """
    return list(_dead_slots(*_layout_key(case)))


@_memoised
def _dead_slots(*key) -> tuple[tuple[int, int], ...]:
    reached = _TAIL | _OUT_OF_WINDOW
    first, then = [], []
    for block, row in enumerate(_reason_bits(*key)):
        for offset, why in enumerate(row):
            if why:
                (first if why & reached else then).append((block, offset))
    return tuple(first + then)
