"""What an adapter turns the canonical batch into: scheduled sequences, live keys, token indices.

Public helpers (``from nanfuzz import scheduled, token_indices, req_to_token``) for the
layouts kernels take besides vLLM's block table:

- ``scheduled``: the sequences with a query, as a scheduler hands them to a kernel
  (a batch may hold padding sequences with no query, which own no output row);
- ``live_key_ranges``: the keys some query of each sequence may read, ``[lo, hi)``;
- ``token_indices``: the kv_indptr / kv_indices of a token-index (page size 1) or
  paged (any page size dividing the block size) layout, over the cache viewed as
  ``[num_blocks * block_size // page_size, page_size, num_kv_heads, head_size]``;
- ``req_to_token``: SGLang's request-to-token table, one flat slot per position.

Index buffers past a sequence's entries (a CUDA graph's fixed-size buffers) point at
slots of the batch's padding block: dead, and poisoned like every dead slot, so a
kernel that reads past its range reads hostile values on every run.  Everything is
computed on the host from ``batch.case`` and moved to the batch's device in one copy
per tensor: no device sync.

While a check runs its poisoned launch (``recording``), each index buffer these
helpers make is noted by the dead-slot classes its entries point at: what such a
layout lets the kernel reach (the statistics' "layout:" situations).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from nanfuzz.reference.batch import PagedBatch
from nanfuzz.reference.case import Case
from nanfuzz.reference.errors import NanfuzzError
from nanfuzz.reference.features import POISON_CLASS_FLAGS
from nanfuzz.reference.semantics import reasons

# "live": each sequence's live keys; "all": keys [0, seq_len); "context": the live keys
# before its new tokens (an extend kernel's prefix, its new tokens' K/V handed apart).
KEYS = ("live", "all", "context")
INDEXED = "indexed"  # recorded for every index buffer made, whatever its entries point at
_recorders: list[set[str]] = []


@contextlib.contextmanager
def recording() -> Iterator[set[str]]:
    """The dead-slot classes (``features.POISON_CLASS_FLAGS`` names) the entries of every index
    buffer made meanwhile point at, and ``INDEXED`` once one was made."""
    found: set[str] = set()
    _recorders.append(found)
    try:
        yield found
    finally:
        _recorders.remove(found)


def _note(case: Case, pages: np.ndarray, page_size: int) -> None:
    if not _recorders or not len(pages):
        return
    bs = case.geometry.block_size
    slots = (np.asarray(pages, dtype=np.int64)[:, None] * page_size + np.arange(page_size)).reshape(-1)
    why = int(np.bitwise_or.reduce(reasons(case)[slots // bs, slots % bs]))
    classes = {INDEXED} | {name for name, flag in POISON_CLASS_FLAGS.items() if why & int(flag)}
    for found in _recorders:
        found |= classes


@dataclass(frozen=True)
class Scheduled:
    """The sequences of a batch that have a query, and their rows of the batch's tensors.

    When every sequence has a query the tensors are the batch's own (views with their
    redzones); otherwise they are compact copies of those sequences' rows.
    """

    indices: tuple[int, ...]      # which of ``batch.case.sequences``, in order
    block_table: torch.Tensor     # int32 [n, table_width]
    seq_lens: torch.Tensor        # int32 [n]
    query_start_loc: torch.Tensor  # int32 [n + 1]; the rows of ``batch.q`` are unchanged
    max_seq_len: int
    max_query_len: int

    def __len__(self) -> int:
        return len(self.indices)


def scheduled(batch: PagedBatch) -> Scheduled:
    """The sequences with query tokens.  A scheduler (vLLM's among them) hands a kernel no
    sequence without a query; a kernel given one may write a row at its start offset, which
    belongs to the next sequence's first token."""
    case = batch.case
    kept = tuple(i for i, s in enumerate(case.sequences) if s.query_len > 0)
    block_table, seq_lens, query_start_loc = batch.block_table, batch.seq_lens, batch.query_start_loc
    if len(kept) < len(case.sequences):
        index = torch.tensor(kept, dtype=torch.long, device=block_table.device)
        block_table = block_table.index_select(0, index)
        seq_lens = seq_lens.index_select(0, index)
        query_start_loc = torch.cat([query_start_loc.index_select(0, index), query_start_loc[-1:]])
    sequences = [case.sequences[i] for i in kept]
    return Scheduled(kept, block_table, seq_lens, query_start_loc,
                     max((s.seq_len for s in sequences), default=0), max((s.query_len for s in sequences), default=0))


def live_key_ranges(case: Case) -> list[tuple[int, int]]:
    """Per sequence, the keys some query of it may read under the case's window, as ``[lo, hi)``
    (``hi`` is seq_len; empty for a sequence without a query)."""
    return [s.live_range(case.sliding_window) for s in case.sequences]


@dataclass(frozen=True)
class TokenIndices:
    """A token-index layout of the scheduled sequences (``token_indices``).

    Sequence ``i``'s pages are ``kv_indices[kv_indptr[i]:kv_indptr[i + 1]]``, in key order; its
    first page starts at absolute key ``kv_start[i]`` and its last holds ``kv_last_page_len[i]``
    keys.  Entries from ``kv_indptr[-1]`` to the end of ``kv_indices`` (``capacity``) point at
    dead, poisoned pages.
    """

    page_size: int
    kv_indptr: torch.Tensor         # int32 [n + 1]
    kv_indices: torch.Tensor        # int32 [capacity]: page ids in the cache viewed as pages
    kv_start: torch.Tensor          # int32 [n]
    kv_last_page_len: torch.Tensor  # int32 [n]
    sequences: tuple[int, ...]      # which of ``batch.case.sequences`` (the scheduled ones)


def token_indices(batch: PagedBatch, *, page_size: int = 1, keys: str = "live",
                  capacity: int | None = None) -> TokenIndices:
    """The scheduled sequences' keys as flat indices into the cache viewed as pages of ``page_size``
    slots (``batch.key_cache.view(-1, page_size, num_kv_heads, head_size)``; page size 1: one
    index per token, ``view(-1, num_kv_heads, head_size)``).

    ``keys`` "live": each sequence's live key range (``live_key_ranges``), the keys a
    windowed kernel is handed once expired pages are freed; "all": keys ``[0, seq_len)``,
    expired ones included, for a kernel that applies the window itself; "context": the live
    keys before the sequence's new tokens, an extend kernel's prefix.  With a page size
    above 1 the first page may start before the range (``kv_start``).  ``capacity`` pads
    ``kv_indices`` to a fixed length with pages of the padding block."""
    case = batch.case
    bs = case.geometry.block_size
    if keys not in KEYS:
        raise NanfuzzError(f"token_indices(keys={keys!r}) is not one of {KEYS}")
    if page_size < 1 or bs % page_size:
        raise NanfuzzError(f"token_indices(page_size={page_size}): a page must divide the block size {bs}, "
                           "so that each page is contiguous in the cache")
    sequences = tuple(i for i, s in enumerate(case.sequences) if s.query_len > 0)
    per_block = bs // page_size
    indptr, pieces, starts, last = [0], [], [], []
    for i in sequences:
        seq = case.sequences[i]
        lo = 0 if keys == "all" else seq.live_range(case.sliding_window)[0]
        hi = seq.context_len if keys == "context" else seq.seq_len
        first, end = lo // page_size, -(-hi // page_size)  # logical pages [first, end)
        pieces.append(_pages(seq, per_block, first, end))
        indptr.append(indptr[-1] + len(pieces[-1]))
        starts.append(first * page_size)
        last.append(hi - (end - 1) * page_size if end > first else 0)
    pieces.append(dead_pages(case, page_size, _padded_length(indptr[-1], capacity)))
    indices = np.concatenate(pieces)
    _note(case, indices, page_size)
    device = batch.block_table.device
    as_tensor = lambda values: torch.as_tensor(np.asarray(values, dtype=np.int32)).to(device)  # noqa: E731
    return TokenIndices(page_size, as_tensor(indptr), as_tensor(indices), as_tensor(starts), as_tensor(last),
                        sequences)


def _pages(seq, per_block: int, first: int, end: int) -> np.ndarray:
    """The page ids of ``seq``'s logical pages ``[first, end)`` (pages of ``block_size / per_block`` slots)."""
    logical = np.arange(first, end, dtype=np.int64)
    return np.asarray(seq.block_table, dtype=np.int64)[logical // per_block] * per_block + logical % per_block


def req_to_token(batch: PagedBatch, *, width: int | None = None) -> torch.Tensor:
    """int32 ``[n, width]``: row i maps each position of the i-th scheduled sequence to its flat
    slot (``block * block_size + offset``, page size 1); positions at and past its seq_len
    point at slots of the padding block (dead and poisoned), as a CUDA graph's request pool
    holds stale entries there.  ``width`` defaults to the block table's reach."""
    case = batch.case
    bs = case.geometry.block_size
    width = case.table_width * bs if width is None else width
    rows = []
    for s in (s for s in case.sequences if s.query_len > 0):
        if s.seq_len > width:
            raise NanfuzzError(f"req_to_token(width={width}) is narrower than a sequence of {s.seq_len} keys")
        rows.append(np.concatenate([_pages(s, bs, 0, s.seq_len), dead_pages(case, 1, width - s.seq_len)]))
    table = np.stack(rows) if rows else np.zeros((0, width), dtype=np.int64)
    _note(case, table.reshape(-1), 1)
    return torch.as_tensor(table.astype(np.int32)).to(batch.block_table.device)


def dead_pages(case: Case, page_size: int, count: int) -> np.ndarray:
    """``count`` page ids (of ``page_size`` slots) inside the padding block, cycling through it."""
    per_block = case.geometry.block_size // page_size
    return case.padding_block * per_block + np.arange(count, dtype=np.int64) % per_block


def _padded_length(used: int, capacity: int | None) -> int:
    if capacity is None:
        return 0
    if capacity < used:
        raise NanfuzzError(f"token_indices(capacity={capacity}) holds fewer than the batch's {used} entries")
    return capacity - used
