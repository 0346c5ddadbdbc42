"""Which keys a query may read, and which cache slots no query may read.

This module is the specification of the allowed-key set (see the design
notes); the oracle, the poisoner and the repro picture all ask it.  The
union of one sequence's allowed sets (``Sequence.live_range`` and
``live_blocks``) lives in the case model, whose validity rules need it.
"""
from __future__ import annotations

import enum
import functools
from dataclasses import replace

import numpy as np

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


def allowed_mask(position, key, seq_len, window: int, causal: bool):
    """``allowed`` over tensors: ``position`` and ``key`` (tensors) and ``seq_len`` (a tensor or an
    int) broadcast against each other; a bool tensor of the broadcast shape."""
    import torch  # here: the CLI imports this module before it may import torch

    position, key = torch.broadcast_tensors(position, key)
    mask = (key >= 0) & (key < seq_len)
    if causal:
        mask = mask & (key <= position)
    if window > 0:
        distance = (position - key) if causal else (position - key).abs()
        mask = mask & (distance < window)
    return mask


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
    """``live[block][offset]``: may some query of the batch read this slot?  (Lists, for small
    cases; ``liveness`` is the same as an array, at any size.)"""
    return liveness(case).tolist()


def slot_reasons(case: Case) -> list[list[Dead]]:
    """``reasons[block][offset]``: every reason a slot is dead (empty when it is live).  (Lists,
    for small cases; ``reasons`` is the same as an array of ``Dead`` bits, at any size.)"""
    return [[_DEAD[why] for why in row] for row in reasons(case).tolist()]


def poison_dead_slots_only(case: Case) -> Case:
    """``case`` with the poison sites that are live in it left out (every dead slot if none is left):
    a case a change made (a sequence kept alone, a capability narrowed) poisons no slot it made live."""
    sites = case.poison.sites
    if sites is None:
        return case
    live = liveness(case)
    dead = tuple(s for s in sites if not (live[s.block].any() if s.offset is None else live[s.block, s.offset]))
    return replace(case, poison=replace(case.poison, sites=dead or None))


def liveness(case: Case) -> np.ndarray:
    """bool ``[num_blocks, block_size]``, read-only: may some query of the batch read this slot?"""
    return _layout(*_layout_key(case))[0]


def reasons(case: Case) -> np.ndarray:
    """uint8 ``[num_blocks, block_size]``, read-only: the ``Dead`` bits of each slot (0: live)."""
    return _layout(*_layout_key(case))[1]


# Liveness and dead-slot reasons depend on the block layout alone, not on the
# poison or the data seed; the strategy, validation, materialisation and the
# evidence all ask for them, several times per case, so they are memoised on
# these fields (a case's own hash would miss across poison variants).  A
# production-size layout is tens of megabytes: a few are kept, not hundreds.
def _layout_key(case: Case) -> tuple:
    g = case.geometry
    return g.num_blocks, g.block_size, case.sequences, case.sliding_window, case.padding_block


def _memoised(compute):
    cached = functools.lru_cache(maxsize=16)(compute)

    @functools.wraps(compute)
    def lookup(*key):
        try:
            return cached(*key)
        except TypeError:  # an unhashable hand-built case (lists for tuples)
            return compute(*key)

    lookup.cache_clear = cached.cache_clear
    return lookup


# Dead flags by value: IntFlag arithmetic is slow, so flags are combined as
# plain ints and turned into ``Dead`` only on the way out.
_DEAD = {value: Dead(value) for value in range(2 ** len(Dead))}
_TAIL, _OUT_OF_WINDOW, _NULL_BLOCK, _PADDING, _UNREFERENCED, _NO_QUERY = (
    int(f) for f in (Dead.TAIL, Dead.OUT_OF_WINDOW, Dead.NULL_BLOCK, Dead.PADDING, Dead.UNREFERENCED, Dead.NO_QUERY))


def _mark(grid: np.ndarray, table: np.ndarray, start: int, end: int, block_size: int, value) -> None:
    """``grid[slot] |= value`` for the slots of keys ``[start, end)`` of a sequence whose used
    table entries are ``table``: whole blocks at once, the two partial ends by slices."""
    if start >= end:
        return
    bs = block_size
    first, last = start // bs, (end - 1) // bs
    if first == last:
        grid[table[first], start - first * bs:end - first * bs] |= value
        return
    grid[table[first], start - first * bs:] |= value
    grid[table[last], :end - last * bs] |= value
    if last > first + 1:
        grid[table[first + 1:last]] |= value


@_memoised
def _layout(num_blocks: int, block_size: int, sequences: tuple[Sequence, ...], window: int,
            padding_block: int) -> tuple[np.ndarray, np.ndarray]:
    """(liveness, reasons) arrays of a layout; see ``liveness`` and ``reasons``."""
    bs = block_size
    live = np.zeros((num_blocks, bs), dtype=bool)
    why = np.zeros((num_blocks, bs), dtype=np.uint8)
    referenced = np.zeros(num_blocks, dtype=bool)
    padded = False
    for seq in sequences:
        used = seq.used_blocks(bs)
        padded = padded or len(seq.block_table) > used
        if not used:
            continue
        table = np.asarray(seq.block_table[:used], dtype=np.int64)
        referenced[table] = True
        lo, hi = seq.live_range(window)
        _mark(live, table, lo, hi, bs, True)
        if seq.seq_len % bs:  # the rest of the last block is tail
            why[table[-1], seq.seq_len % bs:] |= _TAIL
        if seq.query_len == 0:
            _mark(why, table, 0, seq.seq_len, bs, _NO_QUERY)
        else:  # keys below the live range [lo, seq_len) expired
            _mark(why, table, 0, lo, bs, _OUT_OF_WINDOW)
    extra = np.where(referenced, 0, _UNREFERENCED).astype(np.uint8)
    extra[NULL_BLOCK] |= _NULL_BLOCK
    if padded:
        extra[padding_block] |= _PADDING
    why = np.where(live, np.uint8(0), why | extra[:, None])
    live.setflags(write=False)
    why.setflags(write=False)
    return live, why


def dead_slots(case: Case) -> list[tuple[int, int]]:
    """Every dead slot, the ones a careless kernel is likeliest to read first.

    Slots reached through a sequence's table (tail, out-of-window) come
    before null, padding and unreferenced blocks, so that a strategy that
    picks "dead slot number 0" shrinks toward a slot that matters.
    """
    return list(_dead_slots(*_layout_key(case)))


@_memoised
def _dead_slots(*key) -> tuple[tuple[int, int], ...]:
    why = _layout(*key)[1]
    reached = (why & (_TAIL | _OUT_OF_WINDOW)) != 0
    first = np.argwhere(reached)
    then = np.argwhere((why != 0) & ~reached)
    return tuple(map(tuple, np.concatenate([first, then]).tolist()))
