"""Read coverage: which dead slots a launch's loads addressed, under Triton's interpreter.

A PASS says a kernel kept every poisoned value out of its output; it does not
say the kernel ever went near a dead slot.  Under the interpreter every load
of a program goes through one builder method (``create_masked_load``: plain,
masked, block-pointer, descriptor and atomic loads alike) with its pointers
and its mask as numpy arrays, so the poisoned run can record the address of
every lane whose mask is true, and of no other.  Each address is then mapped
to the input it lies in and, for the K/V caches and their scale caches, the
block and slot: a dead slot's class (tail, out-of-window, null block, padding,
unreferenced) comes from ``reference.semantics``, and any address in an
allocation's margin is a redzone read.

A kernel launched on a copy of the cache (a layout conversion) loads from the
copy, not the batch.  Its addresses are traced back by a probe: the adapter
runs again on copies of the batch whose every cache byte holds a digit of its
slot's number, with Triton's launches recorded instead of run, and the bytes
at each loaded address of the copy spell out the slot they came from.  Digits
alternate between two byte ranges from one probe to the next, so a byte the
adapter did not copy from a cache (a zeroed scratch buffer, a constant) never
spells a slot.  A conversion that changes the bytes (dequantising) leaves its
loads unmapped, and counted as such.

The hook points, in Triton 3.6 and 3.9 alike: ``triton.runtime.interpreter``'s
module-level ``interpreter_builder`` (its ``create_masked_load``, which every
load path calls) and ``GridExecutor`` (``_init_args_hst``, which copies a
launch's arguments to the host, and ``__call__``, which runs its programs).  A
Triton without them traces nothing and says why (``unavailable``).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np
import torch

from nanfuzz.harness.judge.outcome import Outcome, Verdict
from nanfuzz.reference.batch import PagedBatch
from nanfuzz.reference.features import POISON_CLASS_FLAGS
from nanfuzz.reference.semantics import slot_reasons

# The inputs whose leading dimensions are (block, slot): a load there names a slot.
SLOTTED = ("key_cache", "value_cache", "k_scale_cache", "v_scale_cache", "k_zero_cache", "v_zero_cache")
REDZONES = "redzones"
CLASSES = (*POISON_CLASS_FLAGS, REDZONES)
# Probe digits: five bits a probe, in bytes 1..31 on even probes and 33..63 on odd ones.  Every
# byte below 0x40 leaves every float encoding finite (the highest exponent bits stay clear), so a
# conversion's copy keeps the bytes exactly; 0 and 32 are never used, so zeroed memory spells nothing.
_DIGIT_BASE = 31
_BANDS = (1, 33)


def unavailable() -> str | None:
    """Why this Triton's interpreter cannot be traced, or None when it can."""
    try:
        from triton.runtime import interpreter
    except Exception as exc:  # noqa: BLE001 - a Triton without an interpreter module
        return f"Triton has no interpreter module ({type(exc).__name__})"
    builder = getattr(interpreter, "interpreter_builder", None)
    executor = getattr(interpreter, "GridExecutor", None)
    missing = [name for name, ok in (
        ("interpreter_builder.create_masked_load", callable(getattr(builder, "create_masked_load", None))),
        ("GridExecutor._init_args_hst", callable(getattr(executor, "_init_args_hst", None))),
        ("GridExecutor.__call__", callable(getattr(executor, "__call__", None)))) if not ok]
    if missing:
        import triton

        return f"Triton {triton.__version__}'s interpreter lacks {', '.join(missing)}"
    return None


# -- recording -------------------------------------------------------------------------

@dataclass
class _Launch:
    name: str
    args: list[tuple[torch.Tensor, torch.Tensor]]  # (tensor as passed, its host copy), in argument order


@dataclass
class LoadTrace:
    """What one traced call did: its launches and, per load, the launch and the addresses it read."""

    launches: list[_Launch] = field(default_factory=list)
    loads: list[tuple[int, np.ndarray]] = field(default_factory=list)
    why_not: str | None = None  # set when nothing could be traced


def _tensor_args(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """A launch's tensor arguments in a fixed order (positional, then keyword), tuples and
    tensor descriptors opened, Triton's reinterpreting wrappers unwrapped."""
    from triton.runtime.jit import TensorWrapper

    found: list[torch.Tensor] = []

    def visit(value) -> None:
        if isinstance(value, (tuple, list)):
            for item in value:
                visit(item)
        elif isinstance(value, TensorWrapper):
            visit(value.base)
        elif isinstance(value, torch.Tensor):
            found.append(value)
        elif hasattr(value, "base") and isinstance(getattr(value, "base"), torch.Tensor):  # a TensorDescriptor
            found.append(value.base)

    for value in (*args, *(kwargs[k] for k in sorted(kwargs))):
        visit(value)
    return found


@contextlib.contextmanager
def traced_loads(enabled: bool = True) -> Iterator[LoadTrace]:
    """Record every interpreted launch inside the block and the addresses of its loads' unmasked lanes."""
    trace = LoadTrace()
    why = unavailable() if enabled else "not asked"
    if why is not None:
        trace.why_not = why
        yield trace
        return
    from triton.runtime import interpreter

    builder, executor = interpreter.interpreter_builder, interpreter.GridExecutor
    load, copy_args = builder.create_masked_load, executor._init_args_hst

    def recording_load(ptrs, mask, *args, **kwargs):
        addresses = ptrs.data
        if mask is not None:
            addresses = addresses[np.broadcast_to(mask.data, addresses.shape)]
        trace.loads.append((len(trace.launches) - 1, np.asarray(addresses, dtype=np.uint64).ravel()))
        return load(ptrs, mask, *args, **kwargs)

    def recording_copy(self, args_dev, kwargs):
        args_hst, kwargs_hst = copy_args(self, args_dev, kwargs)
        trace.launches.append(_Launch(getattr(self.fn, "__name__", "kernel"),
                                      list(zip(_tensor_args(args_dev, kwargs), _tensor_args(args_hst, kwargs_hst)))))
        return args_hst, kwargs_hst

    own = vars(builder).get("create_masked_load")  # an instance's own override, if any, comes back after
    builder.create_masked_load = recording_load
    executor._init_args_hst = recording_copy
    try:
        yield trace
    finally:
        if own is None:
            del builder.create_masked_load  # the class's own method again
        else:
            builder.create_masked_load = own
        executor._init_args_hst = copy_args


@contextlib.contextmanager
def recorded_launches() -> Iterator[list[_Launch]]:
    """Every interpreted launch inside the block recorded with its arguments and not run."""
    from triton.runtime import interpreter

    executor = interpreter.GridExecutor
    run = executor.__call__
    launches: list[_Launch] = []

    def record(self, *args_dev, **kwargs):
        launches.append(_Launch(getattr(self.fn, "__name__", "kernel"),
                                [(t, t) for t in _tensor_args(args_dev, kwargs)]))

    executor.__call__ = record
    try:
        yield launches
    finally:
        executor.__call__ = run


# -- mapping ----------------------------------------------------------------------------

@dataclass
class Reads:
    """The dead slots one launch's loads addressed, by input and class (JSON-ready with ``to_dict``)."""

    traced: bool
    why_not: str | None = None
    # input name -> class -> distinct slots (caches) or elements (other inputs' redzones) addressed
    addressed: dict[str, dict[str, int]] = field(default_factory=dict)
    unmapped: int = 0   # loads from memory no input accounts for: copies the probe could not trace, scratch
    examples: dict[str, list] = field(default_factory=dict)  # input -> a few [block, slot] addressed while dead

    @property
    def dead_slots(self) -> int:
        return sum(n for classes in self.addressed.values() for n in classes.values())

    def to_dict(self) -> dict:
        if not self.traced:
            return {"traced": False, "why_not": self.why_not}
        return {"traced": True, "addressed": self.addressed, "dead_slots": self.dead_slots,
                "unmapped_loads": self.unmapped, "examples": self.examples}


# [block, slot] pairs kept per input as evidence: enough to find the slots in the repro's picture,
# few enough to keep a repro a few hundred bytes.
_EXAMPLES_KEPT = 4


class _Classifier:
    """Dead-slot classes of the batch's inputs, looked up by (input, byte offset in its allocation)."""

    def __init__(self, batch: PagedBatch):
        case = batch.case
        self.case = case
        self.allocations = batch.allocations
        reasons = slot_reasons(case)
        flags = list(POISON_CLASS_FLAGS.values())
        # bits[block][slot]: class bit i set where that slot is dead for reason CLASSES[i]
        self.bits = np.array([[sum(1 << i for i, f in enumerate(flags) if why & f) for why in row] for row in reasons],
                             dtype=np.int64).reshape(case.geometry.num_blocks, case.geometry.block_size)

    def region(self, name: str, offsets: np.ndarray, tally: dict, examples: dict) -> None:
        """Count the dead slots (or redzone elements) of input ``name`` at these byte offsets."""
        allocation = self.allocations[name]
        base = allocation.base
        element = base.element_size()
        lead = len(allocation.index)
        inner = math.prod(base.shape[lead:]) * element
        if name in SLOTTED:
            self._slots(name, offsets, tally, examples)
            return
        rows = np.unravel_index((offsets // inner).astype(np.int64), base.shape[:lead])
        inside = np.ones(offsets.shape, dtype=bool)
        for dim, cut in enumerate(allocation.index):
            start, stop, _ = cut.indices(base.shape[dim])
            inside &= (rows[dim] >= start) & (rows[dim] < stop)
        margin = np.unique(offsets[~inside] // element).size
        if margin:
            tally.setdefault(name, {})[REDZONES] = margin

    def _slots(self, name: str, offsets: np.ndarray, tally: dict, examples: dict) -> None:
        allocation = self.allocations[name]
        base = allocation.base
        g = self.case.geometry
        slot_bytes = math.prod(base.shape[2:]) * base.element_size()
        flat = np.unique(offsets // slot_bytes)  # slot number in the allocation, blocks before the cache included
        first = allocation.index[0].indices(base.shape[0])[0]
        block, slot = flat // g.block_size - first, flat % g.block_size
        inside = (block >= 0) & (block < g.num_blocks)
        counts: dict[str, int] = {}
        if (~inside).any():
            counts[REDZONES] = int((~inside).sum())
        bits = self.bits[block[inside], slot[inside]]
        for i, cls in enumerate(POISON_CLASS_FLAGS):
            hit = (bits >> i) & 1 == 1
            if hit.any():
                counts[cls] = int(hit.sum())
        dead = bits != 0
        if dead.any():
            examples[name] = [[int(b), int(s)] for b, s in zip(block[inside][dead][:_EXAMPLES_KEPT],
                                                             slot[inside][dead][:_EXAMPLES_KEPT])]
        if counts:
            tally[name] = counts


def _storage_span(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def resolve(trace: LoadTrace, batch: PagedBatch, probe: Callable[[int], list[_Launch] | None] | None = None) -> Reads:
    """Map a trace's loads to the batch's inputs: the dead slots they addressed.

    ``probe(round)`` runs the adapter again on probe batch ``round`` (``probe_batch``) and returns its
    launches, for loads from memory the batch does not hold; None: such loads stay unmapped."""
    if trace.why_not is not None:
        return Reads(traced=False, why_not=trace.why_not)
    if not trace.launches:
        return Reads(traced=False, why_not="the kernel made no Triton launch (only a Triton launch's loads are traced)")
    classifier = _Classifier(batch)
    regions = sorted((base.untyped_storage().data_ptr() + base.storage_offset() * base.element_size(), name)
                     for name, base in ((n, a.base) for n, a in batch.allocations.items()))
    starts = np.array([start for start, _ in regions], dtype=np.uint64)
    ends = np.array([start + batch.allocations[n].base.numel() * batch.allocations[n].base.element_size()
                     for start, n in regions], dtype=np.uint64)
    tally: dict[str, dict[str, int]] = {}
    examples: dict[str, list] = {}
    by_region: dict[str, list[np.ndarray]] = {}
    copied: list[tuple[int, int, np.ndarray]] = []  # (launch, argument, byte offsets in its storage)
    unmapped = 0
    for index, launch in enumerate(trace.launches):
        addresses = [a for i, a in trace.loads if i == index]
        if not addresses:
            continue
        addresses = np.unique(np.concatenate(addresses))
        placed = np.zeros(addresses.shape, dtype=bool)
        for arg, (passed, host) in enumerate(launch.args):
            lo, hi = _storage_span(host)
            here = (addresses >= lo) & (addresses < hi) & ~placed
            if not here.any():
                continue
            placed |= here
            device_lo = _storage_span(passed)[0]
            moved = addresses[here] - np.uint64(lo) + np.uint64(device_lo)  # the same byte of the tensor as passed
            slot = np.searchsorted(starts, moved, side="right") - 1
            inside = (slot >= 0) & (moved < ends[np.maximum(slot, 0)])
            for r in np.unique(slot[inside]):
                start, name = regions[r]
                by_region.setdefault(name, []).append(moved[inside & (slot == r)] - np.uint64(start))
            if (~inside).any():
                copied.append((index, arg, (addresses[here][~inside] - np.uint64(lo)).astype(np.int64)))
        unmapped += int((~placed).sum())
    for name, offsets in by_region.items():
        classifier.region(name, np.concatenate(offsets).astype(np.int64), tally, examples)
    if copied:
        unmapped += _map_copies(copied, trace, batch, probe, classifier, tally, examples)
    return Reads(traced=True, addressed=tally, unmapped=unmapped, examples=examples)


# -- tracing copies back to the batch ---------------------------------------------------------

def probe_rounds(batch: PagedBatch) -> int:
    """How many probes spell every slot of the batch's slotted inputs."""
    slots = sum(batch.allocations[n].base.shape[0] * batch.allocations[n].base.shape[1]
                for n in SLOTTED if n in batch.allocations)
    return max(2, math.ceil(math.log(slots + 1, _DIGIT_BASE)))


def probe_batch(batch: PagedBatch, round_: int) -> PagedBatch:
    """A copy of ``batch`` whose every byte of slot s of a slotted input holds digit ``round_`` of s's
    number (inputs numbered one after another, blocks before the cache included)."""
    copy = batch.clone()
    offset = 0
    for name in SLOTTED:
        if name not in copy.allocations:
            continue
        base = copy.allocations[name].base
        slots = base.shape[0] * base.shape[1]
        number = np.arange(offset, offset + slots, dtype=np.int64)
        digit = (number // _DIGIT_BASE ** round_) % _DIGIT_BASE + _BANDS[round_ % 2]
        as_bytes = base.view(torch.uint8).view(slots, -1) if base.is_contiguous() else None
        assert as_bytes is not None, name  # allocations are built contiguous
        as_bytes.copy_(torch.from_numpy(digit.astype(np.uint8))[:, None].expand_as(as_bytes))
        offset += slots
    return copy


def _decode(number: np.ndarray, batch: PagedBatch) -> list[tuple[str, np.ndarray]]:
    """Slot numbers (``probe_batch``'s) split by input, as slot numbers within each allocation."""
    found, offset = [], 0
    for name in SLOTTED:
        if name not in batch.allocations:
            continue
        base = batch.allocations[name].base
        slots = base.shape[0] * base.shape[1]
        mine = (number >= offset) & (number < offset + slots)
        if mine.any():
            found.append((name, number[mine] - offset))
        offset += slots
    return found


def _map_copies(copied, trace: LoadTrace, batch: PagedBatch, probe, classifier: _Classifier,
                tally: dict, examples: dict) -> int:
    """Add the dead slots that loads from copies of the caches addressed; return the loads left unmapped."""
    total = sum(offsets.size for _, _, offsets in copied)
    if probe is None:
        return total
    rounds = [probe(r) for r in range(probe_rounds(batch))]
    if any(r is None or [(l.name, len(l.args)) for l in r] != [(l.name, len(l.args)) for l in trace.launches]
           for r in rounds):
        return total  # the adapter launched differently on the probe: nothing to read back
    slot_offsets: dict[str, list[np.ndarray]] = {}
    mapped = 0
    for launch, arg, offsets in copied:
        width = trace.launches[launch].args[arg][1].element_size()
        number = np.zeros(offsets.shape, dtype=np.int64)
        valid = np.ones(offsets.shape, dtype=bool)
        for r, launches in enumerate(rounds):
            probe_arg = launches[launch].args[arg][1]
            storage = torch.empty(0, dtype=torch.uint8).set_(probe_arg.untyped_storage()).numpy()
            valid &= offsets + width <= storage.size
            element = storage[np.minimum(offsets[:, None] + np.arange(width), storage.size - 1)]
            digit = element[:, 0].astype(np.int64) - _BANDS[r % 2]
            valid &= (element == element[:, :1]).all(axis=1) & (digit >= 0) & (digit < _DIGIT_BASE)
            number += np.clip(digit, 0, _DIGIT_BASE - 1) * _DIGIT_BASE ** r
        for name, slots in _decode(number[valid], batch):
            base = batch.allocations[name].base
            slot_offsets.setdefault(name, []).append(slots * (math.prod(base.shape[2:]) * base.element_size()))
        mapped += int(valid.sum())
    for name, offsets in slot_offsets.items():
        classifier.region(name, np.concatenate(offsets), tally, examples)
    return total - mapped


def probe_runner(run: Callable[[PagedBatch], object], batch: PagedBatch) -> Callable[[int], list[_Launch] | None]:
    """``resolve``'s ``probe``: ``run(probe batch)`` with every launch recorded and not run."""
    def probe(round_: int) -> list[_Launch] | None:
        tagged = probe_batch(batch, round_)
        try:
            with recorded_launches() as launches:
                run(tagged)
        except Exception:  # noqa: BLE001 - an adapter that cannot take the probe leaves copies unmapped
            return None
        return launches
    return probe


# -- the verdict under --strict-reads -------------------------------------------------------------

def judged(outcome: Outcome, trace: LoadTrace, kernel, batch: PagedBatch, pristine: PagedBatch, *,
           strict: bool) -> Outcome:
    """``outcome`` with the dead slots the traced run's loads addressed (``Outcome.reads``), ``pristine``
    (the batch as built, before any launch) giving the probe's copies; with ``strict``, a PASS
    whose loads addressed any is a DEAD_READ instead."""
    case = batch.case
    g = case.geometry

    def launch_on(probed: PagedBatch):
        return kernel(probed, torch.full((case.num_tokens, g.num_q_heads, g.v_head_size), float("nan"),
                                         dtype=probed.q.dtype, device=probed.q.device))

    try:
        found = resolve(trace, batch, probe_runner(launch_on, pristine))
    except Exception as exc:  # noqa: BLE001 - our mapping's failure is no verdict on the kernel
        found = Reads(traced=False, why_not=f"mapping the traced loads failed ({type(exc).__name__}: {exc})")
    outcome.reads = found.to_dict()
    if strict and outcome.verdict is Verdict.PASS and found.dead_slots:
        return dead_read(found, outcome)
    return outcome


def describe(addressed: dict[str, dict[str, int]]) -> str:
    """``value_cache: tail 3, out-of-window 1; q: redzones 2``."""
    return "; ".join(f"{name}: " + ", ".join(f"{cls} {n}" for cls, n in classes.items())
                     for name, classes in addressed.items())


def dead_read(found: Reads, passed: Outcome) -> Outcome:
    """The DEAD_READ of a run that would have passed but whose loads addressed dead slots."""
    return Outcome(Verdict.DEAD_READ,
                   f"DEAD_READ: the kernel's loads addressed {found.dead_slots} dead slot(s) whose values never "
                   f"reached the output ({describe(found.addressed)}); a finding under --strict-reads",
                   {"addressed": found.addressed, "addressed_examples": found.examples},
                   passed.output_sha256, timings=passed.timings, reads=found.to_dict())
