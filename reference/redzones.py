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


# -- a batch's allocations in one device buffer -----------------------------------------
#
# On a GPU a batch's allocations are views into one buffer: moving a batch there,
# copying it and asking whether a kernel wrote into any of it are one operation each
# instead of one per input (a campaign judges hundreds of batches a second, and the
# launches of many small copies and comparisons were a large part of that).

_ALIGN = 256  # bytes: every allocation starts as aligned as one of its own would


def _layout(bases: dict[str, torch.Tensor]) -> tuple[dict[str, int], int]:
    offsets, end = {}, 0
    for name, base in bases.items():
        offsets[name] = end
        end += -(-base.numel() * base.element_size() // _ALIGN) * _ALIGN
    return offsets, max(end, _ALIGN)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _views(buffer: torch.Tensor, like: dict[str, torch.Tensor], offsets: dict[str, int]) -> dict[str, torch.Tensor]:
    return {name: buffer[offsets[name]: offsets[name] + base.numel() * base.element_size()].view(base.dtype)
            .view(base.shape) for name, base in like.items()}


class _Staging:
    """This process's pinned host buffer for host-to-device copies, reused: a copy from
    pinned memory does not make the host wait, and pinning a fresh buffer per copy would."""

    def __init__(self):
        self.buffer: torch.Tensor | None = None
        self.copied = None  # an event after the last copy out of the buffer

    def take(self, nbytes: int) -> torch.Tensor:
        if self.copied is not None:
            self.copied.synchronize()  # long done by the time the next batch is built
        if self.buffer is None or self.buffer.numel() < nbytes:
            self.buffer = torch.empty(1 << max(nbytes - 1, 1).bit_length(), dtype=torch.uint8, pin_memory=True)
        return self.buffer[:nbytes]

    def sent(self, device: torch.device) -> None:
        self.copied = torch.cuda.Event(blocking=True)
        self.copied.record(torch.cuda.current_stream(device))


_staging: list[_Staging] = []
_STAGING_LIMIT = 256 << 20  # bytes: a bigger batch is copied from ordinary memory, waiting, not kept pinned


def move_together(allocations: dict[str, Allocation], device: torch.device) -> dict[str, Allocation]:
    """Copies of host ``allocations`` on ``device``, all in one buffer (on a GPU: moved in one copy).
    Allocations that are already one host buffer laid out so (``materialize.build_on_host``'s)
    are copied whole."""
    bases = {name: a.base for name, a in allocations.items()}
    offsets, total = _layout(bases)
    staged = device.type != "cpu" and total <= _STAGING_LIMIT
    if staged and not _staging:
        _staging.append(_Staging())
    packed = _packed(allocations, offsets, total)
    if packed is not None and not staged:
        host = packed.clone() if device.type == "cpu" else packed
    else:
        host = _staging[0].take(total) if staged else torch.zeros(total, dtype=torch.uint8)
        if packed is not None:
            host.copy_(packed)
        else:
            for name, base in bases.items():
                host[offsets[name]: offsets[name] + base.numel() * base.element_size()] = _as_bytes(base)
    buffer = host
    if device.type != "cpu":
        buffer = torch.empty(total, dtype=torch.uint8, device=device)
        buffer.copy_(host, non_blocking=staged)
        if staged:
            _staging[0].sent(device)
    moved = _views(buffer, bases, offsets)
    return {name: Allocation(moved[name], a.index) for name, a in allocations.items()}


def _packed(allocations: dict[str, Allocation], offsets: dict[str, int], total: int) -> torch.Tensor | None:
    """The one host buffer ``allocations`` are views into, where its layout is ``_layout``'s, else None."""
    buffer = shared_buffer(allocations)
    if buffer is None or buffer.device.type != "cpu" or buffer.numel() != total:
        return None
    for name, a in allocations.items():
        if a.base.storage_offset() * a.base.element_size() != offsets[name] or not a.base.is_contiguous():
            return None
    return buffer


def pack_together(allocations: dict[str, Allocation], device: torch.device) -> dict[str, Allocation]:
    """``move_together`` for allocations on any devices (a large case builds its queries on the
    device and its lengths on the host): each is copied into one buffer on ``device``."""
    bases = {name: a.base for name, a in allocations.items()}
    offsets, total = _layout(bases)
    buffer = torch.empty(total, dtype=torch.uint8, device=device)
    for name, base in bases.items():
        buffer[offsets[name]: offsets[name] + base.numel() * base.element_size()] = _as_bytes(base).to(device)
    moved = _views(buffer, bases, offsets)
    return {name: Allocation(moved[name], a.index) for name, a in allocations.items()}


def shared_buffer(allocations: dict[str, Allocation]) -> torch.Tensor | None:
    """The one byte buffer all of ``allocations`` are views into (``move_together``), else None."""
    bases = [a.base for a in allocations.values()]
    if not bases:
        return None
    storage = bases[0].untyped_storage()
    if any(b.untyped_storage().data_ptr() != storage.data_ptr() for b in bases[1:]):
        return None
    return torch.empty(0, dtype=torch.uint8, device=bases[0].device).set_(storage)


def clone_together(allocations: dict[str, Allocation]) -> dict[str, Allocation]:
    """A deep copy of ``allocations``: one copy of their shared buffer where they have one."""
    buffer = shared_buffer(allocations)
    if buffer is None:
        return {name: a.clone() for name, a in allocations.items()}
    copy = buffer.clone()
    offsets = {name: a.base.storage_offset() * a.base.element_size() for name, a in allocations.items()}
    moved = _views(copy, {name: a.base for name, a in allocations.items()}, offsets)
    return {name: Allocation(moved[name], a.index) for name, a in allocations.items()}


def surround(tensor: torch.Tensor, before: int, after: int, fill) -> Allocation:
    """``tensor`` copied into an allocation with ``before``/``after`` rows of ``fill`` around it."""
    base = torch.empty((tensor.shape[0] + before + after, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    _fill_rows(base, slice(before + tensor.shape[0], base.shape[0]), fill)  # the longer margin first, for
    _fill_rows(base, slice(0, before), fill)                               # a fill that reuses its values
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
