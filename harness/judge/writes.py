"""What a kernel changed: output bits that differ, and bits of its inputs it wrote or read.

A batch's allocations are views into one buffer (``PagedBatch.in_one_buffer``),
so whether a kernel wrote anywhere in it is one comparison against its clone;
only a write found is located, input by input and redzone side by side.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nanfuzz.harness.judge.evidence import span
from nanfuzz.harness.judge.runs import launch, no_events
from nanfuzz.harness.kernel import Kernel
from nanfuzz.reference.batch import PagedBatch
from nanfuzz.reference.case import Case
from nanfuzz.reference.materialize import materialize
from nanfuzz.reference.redzones import shared_buffer
from nanfuzz.reference.semantics import liveness


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


@dataclass(frozen=True)
class Written:
    """A region a kernel wrote into: an input (``places``: where in it) or a side of its redzone."""

    label: str                      # "value_cache at block 3 slots 0-2 (live)", "the redzone past the end of q"
    tensor: str                     # the input's name
    places: tuple[tuple[int, ...], ...] = ()  # inside the input: (block, slot), (row,) or (sequence, column)


# Where a write into an input is named by more than its first dimension: caches by block and slot,
# the block table by sequence and column.
_CACHES = ("key_cache", "value_cache", "k_scale_cache", "v_scale_cache", "k_zero_cache", "v_zero_cache")
_PLACE_DIMS = {**dict.fromkeys(_CACHES, 2), "block_table": 2}
_ROWS = ("q", "k", "v")
_PLACES_KEPT = 64  # places recorded per input in the evidence (a kernel may overwrite a whole cache)


def written_regions(batch: PagedBatch, pristine: PagedBatch) -> list[Written]:
    """The inputs, with where in each, and the redzone sides whose bits changed."""
    now, before = batch.bases(), pristine.bases()
    found = []
    for name, allocation in batch.allocations.items():
        changed = bits(before[name]) != bits(now[name])
        index = allocation.index
        dims = max(len(index), _PLACE_DIMS.get(name, 1))
        inside = ~allocation.margin()
        inside = inside.view(*inside.shape, *([1] * (dims - len(index)))).expand(changed.shape[:dims])
        hits = (_rows(changed, dims) & inside).nonzero()
        if hits.numel():
            starts = torch.tensor([cut.indices(size)[0] for cut, size in zip(index, changed.shape)]
                                  + [0] * (dims - len(index)), device=hits.device)
            places = tuple(tuple(p) for p in (hits - starts).tolist())
            found.append(Written(f"{name} at {where_written(name, places, batch.case)}", name, places[:_PLACES_KEPT]))
        for side, where in allocation.sides():
            mask = torch.zeros(changed.shape[: len(index)], dtype=torch.bool, device=changed.device)
            mask[where] = True
            if bool((_rows(changed, len(index)) & mask).any()):
                found.append(Written(f"the redzone {side} of {name}", name))
    return found


def _rows(changed: torch.Tensor, dims: int) -> torch.Tensor:
    """``changed`` reduced to its leading ``dims`` dimensions: did anything in that row change?"""
    return changed.flatten(dims).any(-1) if changed.dim() > dims else changed


def where_written(name: str, places: tuple[tuple[int, ...], ...], case: Case) -> str:
    """Where in an input the kernel wrote: "block 3 slots 0-2 (live)", "rows 0-2", "entries [0][1]"."""
    if name in _CACHES:
        live = liveness(case)
        blocks: dict[int, list[int]] = {}
        for block, slot in places:
            blocks.setdefault(block, []).append(slot)
        shown = []
        for block, slots in list(blocks.items())[:3]:
            alive = sum(bool(live[block, slot]) for slot in slots)
            state = "live" if alive == len(slots) else "dead" if not alive else f"{alive} live"
            shown.append(f"block {block} slot{'s' if len(slots) > 1 else ''} {span(slots)} ({state})")
        more = len(blocks) - len(shown)
        return ", ".join(shown) + (f" and {more} more block{'s' if more > 1 else ''}" if more > 0 else "")
    if name == "block_table":
        entries = ", ".join(f"[{s}][{c}]" for s, c in places[:6])
        return f"entr{'ies' if len(places) > 1 else 'y'} {entries}" + (", ..." if len(places) > 6 else "")
    first = [place[0] for place in places]
    noun = ("row", "rows") if name in _ROWS else ("entry", "entries")
    return f"{noun[len(first) > 1]} {span(first)}"


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
