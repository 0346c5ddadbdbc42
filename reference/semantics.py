"""Which keys a query may read, and which cache slots no query may read.

This module is the specification of the allowed-key set (see the design
notes); the oracle, the poisoner and the repro picture all ask it.
"""
from __future__ import annotations

import enum

from reference.case import NULL_BLOCK, Case, Sequence


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
    """The keys some query of ``seq`` may read, as a half-open range ``[lo, hi)``.

    The union of the queries' allowed sets is contiguous: every query reads
    its own position, and the window reaches back from the first query.
    """
    if seq.query_len == 0:
        return 0, 0
    lo = 0
    if case.sliding_window > 0:
        lo = max(0, seq.context_len - case.sliding_window + 1)
    return lo, seq.seq_len


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
    g = case.geometry
    live = [[False] * g.block_size for _ in range(g.num_blocks)]
    for seq in case.sequences:
        lo, hi = live_key_range(case, seq)
        for key in range(lo, hi):
            live[seq.block_table[key // g.block_size]][key % g.block_size] = True
    return live


def slot_reasons(case: Case) -> list[list[Dead]]:
    """``reasons[block][offset]``: every reason a slot is dead (empty when it is live)."""
    g = case.geometry
    live = slot_liveness(case)
    reasons = [[Dead(0)] * g.block_size for _ in range(g.num_blocks)]
    referenced = [False] * g.num_blocks
    for seq in case.sequences:
        used = -(-seq.seq_len // g.block_size)
        lo, hi = live_key_range(case, seq)
        for j in range(used):
            block = seq.block_table[j]
            referenced[block] = True
            for offset in range(g.block_size):
                key = j * g.block_size + offset
                if key >= seq.seq_len:
                    why = Dead.TAIL
                elif seq.query_len == 0:
                    why = Dead.NO_QUERY
                elif not lo <= key < hi:
                    why = Dead.OUT_OF_WINDOW
                else:
                    continue
                reasons[block][offset] |= why
    for block in range(g.num_blocks):
        extra = Dead(0)
        if block == NULL_BLOCK:
            extra |= Dead.NULL_BLOCK
        if block == case.padding_block and any(len(s.block_table) > -(-s.seq_len // g.block_size) for s in case.sequences):
            extra |= Dead.PADDING
        if not referenced[block]:
            extra |= Dead.UNREFERENCED
        for offset in range(g.block_size):
            reasons[block][offset] |= extra
    for block in range(g.num_blocks):
        for offset in range(g.block_size):
            if live[block][offset]:
                reasons[block][offset] = Dead(0)
    return reasons


def dead_slots(case: Case) -> list[tuple[int, int]]:
    """Every dead slot, the ones a careless kernel is likeliest to read first.

    Slots reached through a sequence's table (tail, out-of-window) come
    before null, padding and unreferenced blocks, so that a strategy that
    picks "dead slot number 0" shrinks toward a slot that matters.
    """
    reasons = slot_reasons(case)
    reached = Dead.TAIL | Dead.OUT_OF_WINDOW
    slots = [
        (block, offset)
        for block, row in enumerate(reasons)
        for offset, why in enumerate(row)
        if why
    ]
    slots.sort(key=lambda s: (not reasons[s[0]][s[1]] & reached, s))
    return slots
