"""The check of a large case: built on its device, its caches in the process's pool.

A production-size case's caches run to gigabytes, so nothing of them is built
on the host, copied per run or cloned: ``reference.device_build`` builds the
blocks the case writes, ``harness.judge.pool`` lays them into caches that stay
allocated from case to case, and each later run writes them again.  The
judges read the compact build, never the caches a kernel saw.  Writes are
found as for a small case, in three parts: the small inputs against their
pristine copy; the case's cache blocks, after the poisoned run, against what
was written; and everything else of the caches, after the last run, against
their background.
"""
from __future__ import annotations

import torch

from nanfuzz.harness.judge.check import CaseCheck
from nanfuzz.harness.judge.pool import process_pool
from nanfuzz.harness.judge.runs import case_bytes
from nanfuzz.harness.judge.writes import written_regions
from nanfuzz.reference.batch import PagedBatch
from nanfuzz.reference.device_build import build_on_device, refill, written_blocks
from nanfuzz.reference.errors import NanfuzzError
from nanfuzz.reference.redzones import clone_together, shared_buffer


class _Inputs:
    """The small inputs alone, as ``written_regions`` reads a batch."""

    def __init__(self, allocations):
        self.allocations = allocations

    def bases(self):
        return {name: a.base for name, a in self.allocations.items()}


class TooLargeForDevice(NanfuzzError):
    """A case that needs more device memory than is free.  A campaign declines a drawn case
    that raises it (counted, with a note); a repro that does is the usual one-line error."""


def large_case_bytes(case) -> int:
    """About what a large case takes on its device beyond the pool's caches: its compact blocks
    (the poisoned build, the garbage build, a kernel's layout copy), the oracle's gather."""
    g = case.geometry
    blocks = int(written_blocks(case).size)
    element = 4 if g.dtype == "float32" else 2
    compact = 2 * blocks * g.block_size * g.num_kv_heads * g.head_size * element
    gathered = 2 * 8 * sum(s.seq_len for s in case.sequences[:64]) * g.num_kv_heads * g.head_size
    return 3 * compact + min(gathered, 8 << 30)


class LargeCaseCheck(CaseCheck):
    """``CaseCheck`` with a large case's batches (see the module notes)."""

    def _refuse_if_too_large(self) -> None:
        if self.device.type != "cuda":
            return  # the interpreter's production cases are small enough for any host
        pool = process_pool()
        caches = case_bytes(self.case)  # what the pool's buffers must hold
        needed = max(0, caches - pool.held_bytes()) + caches + large_case_bytes(self.case)  # + a layout copy
        free = torch.cuda.mem_get_info(self.device)[0]
        if needed > free:
            raise TooLargeForDevice(f"this case needs about {needed / 2**30:.1f} GiB of GPU memory and "
                                    f"{free / 2**30:.1f} GiB are free; refusing it before allocating anything")

    def _build(self) -> None:
        self.pool = process_pool()
        self.build = build_on_device(self.case, self.device)
        self.caches = self.pool.attach(self.build)
        self.small = self.build.small
        self.snapshot_small = clone_together(self.small)
        self.batch = self._batch(self.small)
        self._clean = False

    def _batch(self, small) -> PagedBatch:
        return PagedBatch.from_allocations(self.case, {**small, **self.caches})

    def _pristine(self):
        return self._oracle_batch

    @property
    def _oracle_batch(self) -> PagedBatch:
        batch = self.build.oracle_batch()
        # the small inputs as they were before the launch
        for name, allocation in self.snapshot_small.items():
            if name != "block_table":
                setattr(batch, name, allocation.view)
        return batch

    def _repeat_batch(self):
        self._changed = self.pool.changed(self.build, self.caches)  # what the poisoned run wrote there
        self.pool.write(self.build, self.caches)
        return self._batch(clone_together(self.snapshot_small))

    def _garbage_batch(self):
        garbage = refill(self.build, garbage_seed=1)

        def make() -> PagedBatch:
            if not hasattr(self, "_changed"):  # no repeated run (a nondeterministic kernel)
                self._changed = self.pool.changed(self.build, self.caches)
            self.pool.write(garbage, self.caches)
            return self._batch(garbage.small)

        return make

    def _inputs_written(self) -> torch.Tensor:
        small = (shared_buffer(self.snapshot_small) != shared_buffer(self.small)).any()
        inside = torch.stack([c.any() for c in self._changed.values()]).any()
        self._outside = self.pool.restore(self.build, self.caches)
        return small | inside | torch.stack(list(self._outside.values())).any()


    def _written_regions(self) -> list[str]:
        found = []
        if bool((shared_buffer(self.snapshot_small) != shared_buffer(self.small)).any()):
            found = written_regions(_Inputs(self.small), _Inputs(self.snapshot_small))
        ids = self.build.ids
        for name, changed in self._changed.items():
            blocks = ids[changed].tolist()
            if blocks:
                shown = ", ".join(map(str, blocks[:8])) + (", ..." if len(blocks) > 8 else "")
                found.append(f"{name} (blocks {shown})")
        for name, dirty in self._outside.items():
            if bool(dirty):
                found.append(f"{name} outside the blocks holding the case's live keys (or its redzones)")
        return found

    def _read_flags(self):
        flags, crash = super()._read_flags()
        if crash is None:
            self._clean = not any(bool(dirty) for dirty in self._outside.values())
        return flags, crash

    def _release(self) -> None:
        # a check that ended before the last run's flags (a crash, NONFINITE) leaves its caches
        # unverified: the pool fills them with their background again before the next case
        if hasattr(self, "pool"):
            self.pool.release(self._clean)

    def _explain(self, outcome) -> None:
        """Redzone reads are measured by a launch per redzone on a host-built batch: not at this size."""
