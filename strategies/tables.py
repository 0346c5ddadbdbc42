"""Block tables: fresh blocks, prefix-shared blocks, and expired entries that
point at the null block or at a block another sequence has reused."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from hypothesis import strategies as st

from nanfuzz.reference.case import NULL_BLOCK
from nanfuzz.strategies.draws import BOOLEANS, integers, pick

# Where a table entry whose keys are all dead (below the window) points.
EXPIRED_TARGETS = ("own", "null", "reused")


@dataclass(frozen=True)
class Tables:
    rows: tuple[tuple[int, ...], ...]
    num_blocks: int
    padding_block: int


def draw_block_tables(draw, lengths, live_blocks, block_size: int) -> Tables:
    """Physical blocks for every sequence, drawn with ``draw`` (a composite strategy's).

    ``live_blocks[s]`` holds the logical blocks of sequence s that hold keys
    some query of s may read (``Sequence.live_blocks``).  Shrinks toward
    identity placement: fresh blocks in order, no sharing, no reuse, no
    padding beyond what lengths need.
    """
    next_id = 1  # block 0 is the null block
    rows: list[list[int]] = []
    holding_live: list[tuple[int, int]] = []  # (sequence, physical block) holding live keys
    for s, (length, live) in enumerate(zip(lengths, live_blocks)):
        used = -(-length.seq_len // block_size)
        row: list[int] = []
        # Prefix caching: the first full, live blocks may be another sequence's.
        shared_from, shared = None, 0
        if s > 0 and draw(BOOLEANS):
            shared_from = draw(integers(0, s - 1))
            donor = rows[shared_from]
            shareable = min(len(donor), length.seq_len // block_size)
            shared = draw(integers(0, shareable)) if shareable else 0
        for j in range(used):
            holds_live = j in live
            if holds_live and j < shared and rows[shared_from][j] != NULL_BLOCK:
                row.append(rows[shared_from][j])
            elif holds_live:
                row.append(next_id)
                next_id += 1
            else:
                target = pick(draw, EXPIRED_TARGETS)
                others = [b for owner, b in holding_live if owner != s]
                if target == "null":
                    row.append(NULL_BLOCK)
                elif target == "reused" and others:
                    row.append(pick(draw, others))
                else:  # own: freed but not yet handed out again
                    row.append(next_id)
                    next_id += 1
            if holds_live:
                holding_live.append((s, row[-1]))
        rows.append(row)

    unreferenced = draw(integers(0, 2))
    dedicated_trap = draw(BOOLEANS)
    num_blocks = next_id + unreferenced + int(dedicated_trap)
    padding_block = num_blocks - 1 if dedicated_trap else NULL_BLOCK

    # Scatter physical ids so that logical order is not physical order.  The
    # order is drawn element by element (a choice per block) so that shrinking
    # keeps the few swaps a failure needs and undoes the rest.
    if num_blocks > 2 and draw(BOOLEANS):
        order = draw(_permutations(num_blocks))
        relabel = {NULL_BLOCK: NULL_BLOCK, **{old: new for old, new in zip(range(1, num_blocks), order)}}
        rows = [[relabel[b] for b in row] for row in rows]
        padding_block = relabel[padding_block]

    width = max(len(r) for r in rows) + draw(integers(0, 2))
    width = max(width, 1)
    padded = tuple(tuple(row + [padding_block] * (width - len(row))) for row in rows)
    return Tables(padded, num_blocks, padding_block)


@functools.lru_cache(maxsize=256)
def _permutations(num_blocks: int):
    return st.permutations(range(1, num_blocks))
