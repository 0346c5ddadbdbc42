"""What a kernel changed: output bits that differ, and bits of its inputs it wrote or read.

A batch's allocations are views into one buffer (``PagedBatch.in_one_buffer``),
so whether a kernel wrote anywhere in it is one comparison against its clone;
only a write found is located, input by input and redzone side by side.
"""
from __future__ import annotations

import torch

from nanfuzz.harness.judge.runs import launch, no_events
from nanfuzz.harness.kernel import Kernel
from nanfuzz.reference.batch import PagedBatch
from nanfuzz.reference.case import Case
from nanfuzz.reference.materialize import materialize
from nanfuzz.reference.redzones import shared_buffer


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    if not t.is_floating_point():
        return t
    return t.view({1: torch.uint8, 2: torch.int16}.get(t.element_size(), torch.int32))


def differing(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elements whose bits differ, NaN against NaN counting as equal."""
    differs = bits(a) != bits(b)
    if a.is_floating_point():
        differs &= ~(torch.isnan(a) & torch.isnan(b))
    return differs


def any_written(batch: PagedBatch, snapshot: PagedBatch) -> torch.Tensor:
    """bool scalar on the device: does any bit of ``batch``'s buffer differ from ``snapshot``'s?
    (Both are in one buffer each: ``PagedBatch.in_one_buffer`` and its clone.)"""
    return (shared_buffer(batch.allocations) != shared_buffer(snapshot.allocations)).any()


def written_regions(batch: PagedBatch, snapshot: PagedBatch) -> list[str]:
    """The labels of the regions (inputs and their redzones' sides) whose bits changed."""
    now, before = batch.bases(), snapshot.bases()
    changed = {name: bits(before[name]) != bits(now[name]) for name in before}
    hits = [(_rows(changed[name], inside.dim()) & inside).any() for name, inside in _regions(batch)]
    flags = torch.stack(hits).tolist() if hits else []
    return [label for (label, _), hit in zip(_region_labels(batch), flags) if hit]


def _rows(changed: torch.Tensor, dims: int) -> torch.Tensor:
    """``changed`` reduced to its leading ``dims`` dimensions: did anything in that row change?"""
    return changed.flatten(dims).any(-1) if changed.dim() > dims else changed


def _region_labels(batch: PagedBatch) -> list[tuple[str, str]]:
    """(label, input name) for every region a kernel must not write: each input, then each redzone side."""
    labels = [(name, name) for name in batch.bases()]
    for name, allocation in batch.allocations.items():
        labels += [(f"the redzone {side} of {name}", name) for side, _ in allocation.sides()]
    return labels


def _regions(batch: PagedBatch) -> list[tuple[str, torch.Tensor]]:
    """(input name, bool mask over the leading dims of its allocation) in ``_region_labels`` order."""
    found = []
    for name, base in batch.bases().items():
        allocation = batch.allocations.get(name)
        found.append((name, ~allocation.margin() if allocation else torch.ones(base.shape[:1], dtype=torch.bool,
                                                                                 device=base.device)))
    for name, allocation in batch.allocations.items():
        for _, where in allocation.sides():
            mask = torch.zeros(allocation.base.shape[: len(allocation.index)], dtype=torch.bool,
                               device=allocation.base.device)
            mask[where] = True
            found.append((name, mask))
    return found


def redzone_reads(kernel: Kernel, case: Case, device: str | torch.device, events=no_events) -> list[str]:
    """Which float redzones the kernel reads: each one, in turn, gets finite garbage instead of NaN;
    a margin whose change changes the output was read.  Costs a launch per margin (report time only)."""
    device = torch.device(device)
    batch = materialize(case, device)
    pristine = batch.clone()
    reference, _, _ = launch(kernel, batch, device, events)
    again, _, _ = launch(kernel, pristine.clone(), device, events)
    if bool(differing(again, reference).any()):
        return []  # a nondeterministic kernel: a changed output says nothing about what it read
    found = []
    for name, allocation in pristine.allocations.items():
        if not allocation.base.is_floating_point():
            continue
        for side, where in allocation.sides():
            trial = pristine.clone()
            region = trial.allocations[name].base[where]
            trial.allocations[name].base[where] = torch.full_like(region, 0.5)
            output, _, _ = launch(kernel, trial, device, events)
            if bool(differing(output, reference).any()):
                found.append(f"the redzone {side} of {name}")
    return found
