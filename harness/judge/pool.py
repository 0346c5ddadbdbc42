"""Caches for large cases, allocated once per process and reused from case to case.

A large case (``Case.large``) is built on the device as the blocks it writes
(``reference.device_build``); its caches of gigabytes are views into byte
buffers this pool keeps, one per cache, grown as cases need and never
copied.  Between cases every byte of a buffer holds its background (the
encoding's NaN): a case writes its blocks, its runs read and may scribble,
and ``restore`` puts the background back into those blocks.  Whatever a
previous case left therefore never reaches the next one: ``clean`` checks
the whole region, in one pass on the device, and a kernel that wrote
outside its case's blocks is told (CLOBBER) and its mess refilled.
"""
from __future__ import annotations

import math

import torch

from nanfuzz.reference.device_build import DeviceBuild, background
from nanfuzz.reference.materialize import PARAMETER_CACHES
from nanfuzz.reference.redzones import CACHE_BLOCKS_AFTER, CACHE_BLOCKS_BEFORE, Allocation

CACHE_NAMES = ("key_cache", "value_cache", *PARAMETER_CACHES)
_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _signed(pattern: int, width: int) -> int:
    return pattern - (1 << (8 * width)) if pattern >= 1 << (8 * width - 1) else pattern


class _Buffer:
    def __init__(self):
        self.bytes: torch.Tensor | None = None
        self.pattern: tuple[int, int] | None = None  # what every byte of ``bytes`` holds now, if known
        self.extent = 0                              # how many leading bytes hold it
        self.busy = False                            # attached to a case not yet released

    def region(self, nbytes: int, pattern: tuple[int, int], device: torch.device) -> torch.Tensor:
        """The first ``nbytes`` bytes, all holding ``pattern``."""
        if self.busy:  # the last case never came back (its kernel crashed): nothing is known
            self.pattern, self.extent = None, 0
        self.busy = True
        if self.bytes is None or self.bytes.numel() < nbytes or self.bytes.device != device:
            self.bytes = None  # free the old buffer before taking a larger one
            self.bytes = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self.pattern, self.extent = None, 0
        if self.pattern != pattern or self.extent < nbytes:
            value, width = pattern
            self.bytes[:nbytes].view(_WORD[width]).fill_(_signed(value, width))
            self.pattern, self.extent = pattern, nbytes
        return self.bytes[:nbytes]


class CachePool:
    """This process's caches for large cases (see the module notes)."""

    def __init__(self):
        self._buffers = {name: _Buffer() for name in CACHE_NAMES}

    def held_bytes(self) -> int:
        return sum(b.bytes.numel() for b in self._buffers.values() if b.bytes is not None)

    def drop(self) -> None:
        """Free the buffers no case is attached to (another process waits for the memory); the
        next large case allocates and fills them again."""
        for buffer in self._buffers.values():
            if not buffer.busy:
                buffer.bytes, buffer.pattern, buffer.extent = None, None, 0

    def attach(self, build: DeviceBuild) -> dict[str, Allocation]:
        """The case's caches, each a view into its buffer with the redzone blocks around it, the
        written blocks written: allocations as ``PagedBatch.from_allocations`` takes them."""
        case = build.case
        g = case.geometry
        blocks = CACHE_BLOCKS_BEFORE + g.num_blocks + CACHE_BLOCKS_AFTER
        made = {}
        for name, compact in build.caches.items():
            per_block = math.prod(compact.shape[1:]) * compact.element_size()
            region = self._buffers[name].region(blocks * per_block, background(case, name), compact.device)
            base = region.view(compact.dtype).view(blocks, *compact.shape[1:])
            made[name] = Allocation(base, (slice(CACHE_BLOCKS_BEFORE, CACHE_BLOCKS_BEFORE + g.num_blocks),))
        self.write(build, made)
        return made

    @staticmethod
    def write(build: DeviceBuild, caches: dict[str, Allocation]) -> None:
        """The build's blocks into the attached caches (again, before a later run)."""
        for name, compact in build.caches.items():
            caches[name].view[build.ids] = compact

    @staticmethod
    def changed(build: DeviceBuild, caches: dict[str, Allocation]) -> dict[str, torch.Tensor]:
        """Per cache, bool ``[len(ids), block_size]`` on the device: which slots of the written blocks
        no longer hold what ``build`` wrote (NaN against NaN counting as equal)."""
        found = {}
        for name, compact in build.caches.items():
            now = caches[name].view[build.ids]
            if compact.is_floating_point():
                differs = (_bits(now) != _bits(compact)) & ~(torch.isnan(now) & torch.isnan(compact))
            else:
                differs = now != compact
            found[name] = differs.flatten(2).any(2) if differs.dim() > 2 else differs
        return found

    def restore(self, build: DeviceBuild, caches: dict[str, Allocation]) -> dict[str, torch.Tensor]:
        """The background back into the case's blocks; returns, per cache, a bool scalar on the
        device: did anything outside them change (a write past the case's blocks, or into a redzone)?"""
        dirty = {}
        for name, allocation in caches.items():
            value, width = background(build.case, name)
            base = allocation.base
            words = base.view(torch.uint8).view(_WORD[width]).view(base.shape[0], -1)
            words[build.ids + CACHE_BLOCKS_BEFORE] = _signed(value, width)
            dirty[name] = (words != _signed(value, width)).any()
        return dirty

    def release(self, clean: bool) -> None:
        """The case is over; ``clean``: ``restore`` found nothing written outside its blocks.
        Otherwise the next ``attach`` fills its region with the background again."""
        for buffer in self._buffers.values():
            if buffer.busy and not clean:
                buffer.pattern, buffer.extent = None, 0
            buffer.busy = False


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16}.get(t.element_size(), torch.int32))


_pool: CachePool | None = None


def process_pool() -> CachePool:
    """The pool of this process (a worker's, or a campaign's with ``--no-isolation``)."""
    global _pool
    if _pool is None:
        _pool = CachePool()
    return _pool
