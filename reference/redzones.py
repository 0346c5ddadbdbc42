"""Redzones: every tensor a kernel receives is a view into a larger allocation.

AddressSanitizer's model for host memory, applied to a kernel's arguments.
The margins of each allocation hold poison, so a kernel that reads past a
tensor reads NaN (or a trap block id, or a length that runs into poison) on
every run, and a kernel that writes there changes bits nobody may change.

    K/V caches      blocks before the first and after the last
    block_table     extra columns, and an extra row, all pointing at the first
                    block after the cache (a NaN block)
    q, k, v         rows past the last token
    seq_lens        entries past the last sequence: a length that runs into the
                    table's extra columns
    query_start_loc entries past the end: a start that runs into out's guard rows
    sinks           entries past the last head
    k_scale/v_scale entries past the per-tensor scale
    scale caches    blocks before the first and after the last, like the caches
    out             guard rows past the last token (the harness allocates it)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

CACHE_BLOCKS_BEFORE = 1
CACHE_BLOCKS_AFTER = 2
TABLE_EXTRA_COLUMNS = 2
TABLE_EXTRA_ROWS = 1
TOKEN_ROWS_AFTER = 2
LENGTHS_AFTER = 2
SINKS_AFTER = 2
SCALES_AFTER = 2
OUT_GUARD_ROWS = 2


@dataclass(frozen=True)
class Allocation:
    """A tensor the kernel receives (``view``) and the allocation around it (``base``)."""

    base: torch.Tensor
    index: tuple[slice, ...]  # view = base[index], along the leading dimensions

    @property
    def view(self) -> torch.Tensor:
        return self.base[self.index]

    def margin(self) -> torch.Tensor:
        """bool over the leading dimensions of ``base``: True outside the view."""
        mask = torch.ones(self.base.shape[: len(self.index)], dtype=torch.bool, device=self.base.device)
        mask[self.index] = False
        return mask

    def clone(self) -> "Allocation":
        return Allocation(self.base.clone(), self.index)

    def sides(self) -> list[tuple[str, tuple[slice, ...]]]:
        """The margins by name ("before", "after", "extra columns", "extra rows") as indices into ``base``."""
        found = []
        for dim, cut in enumerate(self.index):
            size = self.base.shape[dim]
            start, stop, _ = cut.indices(size)
            lead = tuple(self.index[:dim])
            if start > 0:
                found.append(("before the start", lead + (slice(0, start),)))
            if stop < size:
                side = "past the end" if dim == 0 else "past the last column"
                found.append((side, lead + (slice(stop, size),)))
        return found


def surround(tensor: torch.Tensor, before: int, after: int, fill) -> Allocation:
    """``tensor`` copied into an allocation with ``before``/``after`` rows of ``fill`` around it."""
    base = torch.empty((tensor.shape[0] + before + after, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    _fill_rows(base, slice(0, before), fill)
    _fill_rows(base, slice(before + tensor.shape[0], base.shape[0]), fill)
    base[before: before + tensor.shape[0]] = tensor
    return Allocation(base, (slice(before, before + tensor.shape[0]),))


def _fill_rows(base: torch.Tensor, rows: slice, fill) -> None:
    if callable(fill):
        part = base[rows]
        if part.numel():
            base[rows] = fill(part.shape).to(base.dtype)
    else:
        base[rows] = fill


def table(block_table: torch.Tensor, trap_block: int) -> Allocation:
    """The block table inside a wider, taller allocation whose extra entries all hold ``trap_block``."""
    rows, cols = block_table.shape
    base = torch.full((rows + TABLE_EXTRA_ROWS, cols + TABLE_EXTRA_COLUMNS), trap_block,
                      dtype=block_table.dtype, device=block_table.device)
    base[:rows, :cols] = block_table
    return Allocation(base, (slice(0, rows), slice(0, cols)))
