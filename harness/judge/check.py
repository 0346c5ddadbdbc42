"""Run one kernel on one case and judge it: the verdicts of the design notes.

Three launches per case: the poisoned batch, the same batch again (two
launches on identical inputs must agree bit for bit), and the batch with
different finite garbage in every dead slot and redzone (LEAK).  HANG and a
crash that kills the process are the supervisor's verdicts
(``harness.launch.worker``); this module judges what a launch that returns gives.

On a GPU the host waits for the device twice per case, not once per launch:
after the poisoned run (with the oracle queued behind it, and the
finite-garbage run's batch built on the host meanwhile), and after the
repeated and the finite-garbage runs (with the verdict's flags queued behind
them).  For the supervisor's watchdog a launch lasts until the wait for it
has returned, so a kernel that never ends is a HANG of its launch wherever
the host first waits for it; a device fault that surfaces in the wait (or in
the oracle's work before it) is a CRASH of the runs waited for.  With
fourteen processes sharing one GPU, each wait is a turn in the GPU's queue
of contexts: three fewer per case gave a ``--jobs 14`` campaign 12-14% more examples a second.
A kernel is expected to order its work on the current stream, as PyTorch's
own operators do; each wait also waits for every other stream.
"""
from __future__ import annotations

import enum
import functools
import hashlib
import time
import traceback
from dataclasses import dataclass, field

import torch

from nanfuzz.harness.judge import encodings
from nanfuzz.harness.judge.evidence import classes_line, describe_rows, span
from nanfuzz.harness.kernel import Kernel
from nanfuzz.harness.judge.tolerance import effective_precision, row_errors
from nanfuzz.reference.case import Case
from nanfuzz.reference.errors import NanfuzzError
from nanfuzz.reference.batch import PagedBatch
from nanfuzz.reference.materialize import build_on_host, materialize, refill_dead_slots
from nanfuzz.reference.oracle import attend_in
from nanfuzz.reference.precision import FLOAT64, same_precision
from nanfuzz.reference.redzones import OUT_GUARD_ROWS, shared_buffer

GUARD_ROWS = OUT_GUARD_ROWS  # canary rows after the last token's output row


class Verdict(str, enum.Enum):
    """In order of severity; a check reports the first that applies."""

    CRASH = "CRASH"
    HANG = "HANG"
    NONFINITE = "NONFINITE"
    NONDETERMINISTIC = "NONDETERMINISTIC"
    LEAK = "LEAK"
    MISMATCH = "MISMATCH"
    CLOBBER = "CLOBBER"
    PASS = "PASS"


@dataclass
class Outcome:
    verdict: Verdict
    summary: str
    evidence: dict = field(default_factory=dict)
    output_sha256: str | None = None
    timings: dict = field(default_factory=dict)
    cpu_seconds: float = 0.0  # CPU time of the process that judged it (a worker, or the caller's)
    # a supervised GPU worker's own Triton compiles (and cache loads) during the check, its waits
    # for other processes' compiles left out (those are the "compile" timing)
    compiled_seconds: float = 0.0
    # a CRASH that left the device context unusable (sticky CUDA/HIP error): the worker must be replaced
    fatal: bool = False

    @property
    def failed(self) -> bool:
        return self.verdict is not Verdict.PASS

    def to_dict(self) -> dict:
        return {"verdict": self.verdict.value, "summary": self.summary, "evidence": self.evidence,
                "output_sha256": self.output_sha256}


def _sync(device: torch.device) -> None:
    """Wait for the device: asleep on a blocking event, not spinning (a GPU's default wait spins
    a core, and a ``--jobs`` run has more processes waiting than the host has cores), then for
    every stream (a kernel may launch on its own)."""
    if device.type == "cuda":
        stream = torch.cuda.current_stream(device)
        event = _blocking_event(stream.device_index)
        event.record(stream)
        event.synchronize()
        torch.cuda.synchronize(device)


@functools.cache
def _blocking_event(device_index: int) -> torch.cuda.Event:
    """One event per device, recorded again for each wait."""
    return torch.cuda.Event(blocking=True)


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    if not t.is_floating_point():
        return t
    return t.view({1: torch.uint8, 2: torch.int16}.get(t.element_size(), torch.int32))


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()


# A check holds the batch, its pristine copy and two more copies for the later runs.
_COPIES_HELD = 5


def case_bytes(case: Case) -> int:
    """About what one copy of a case's tensors (redzones included) takes."""
    from nanfuzz.reference.materialize import TORCH_DTYPES
    from nanfuzz.reference.redzones import CACHE_BLOCKS_AFTER, CACHE_BLOCKS_BEFORE

    g = case.geometry
    element = torch.empty((), dtype=TORCH_DTYPES[g.dtype]).element_size()
    caches = 2 * (g.num_blocks + CACHE_BLOCKS_BEFORE + CACHE_BLOCKS_AFTER) * g.block_size * g.num_kv_heads
    tokens = (case.num_tokens + 2) * (g.num_q_heads + 2 * g.num_kv_heads)
    return (caches + tokens) * g.head_size * element


def refuse_if_too_large(case: Case, device: torch.device) -> None:
    """A usage error, before anything is allocated, for a case the device's free memory cannot hold."""
    needed = _COPIES_HELD * case_bytes(case)
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        import os

        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if needed > free:
        raise NanfuzzError(f"this case needs about {needed / 2**30:.1f} GiB of {device.type} memory and "
                           f"{free / 2**30:.1f} GiB are free; refusing it before allocating anything")


def _no_events(event: str) -> None:
    pass


def _launch(kernel: Kernel, batch, device, events=_no_events, *, wait: bool = True
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch on ``batch``.  ``wait=False``, on a GPU: return without waiting for the device, the
    launch still open for the watchdog until ``_await_runs`` has waited for it, so whatever
    waits for the device in between (the oracle may) is timed as the launch."""
    case = batch.case
    g = case.geometry
    buffer = torch.full((case.num_tokens + GUARD_ROWS, g.num_q_heads, g.head_size), float("nan"),
                        dtype=batch.q.dtype, device=device)
    out = buffer[: case.num_tokens]
    events("launch")
    result = kernel(batch, out)
    if wait or device.type != "cuda":
        _sync(device)
        events("returned")
    return result, out, buffer


def _await_runs(device, events, when: str) -> Outcome | None:
    """Wait for the runs launched without waiting (and the work queued behind them), then close
    their launch for the watchdog: None, or the CRASH of a device fault they raised."""
    if device.type != "cuda":
        return None
    try:
        _sync(device)
    except BaseException as exc:  # an asynchronous fault of the kernel surfaces here
        return _crash(exc, when)
    events("returned")
    return None


# Driver errors after which a CUDA or HIP context is dead for the rest of the process.
_FATAL_SIGNS = ("illegal memory access", "illegal address", "misaligned address", "unspecified launch failure",
                "device-side assert", "an illegal instruction", "hipErrorIllegalAddress", "hipErrorLaunchFailure",
                "memory access fault", "CUDA error: launch failure", "context is destroyed")


def _device_fault(exc: BaseException) -> bool:
    """Whether ``exc`` reports a fault that leaves the device context unusable."""
    text = f"{type(exc).__name__}: {exc}".lower()
    return any(sign.lower() in text for sign in _FATAL_SIGNS)


def _crash(exc: BaseException, when: str) -> Outcome:
    frames = traceback.format_exception(type(exc), exc, exc.__traceback__)
    message = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
    fatal = _device_fault(exc)
    return Outcome(Verdict.CRASH, f"CRASH {when}: {message}",
                   {"error": message, "traceback": "".join(frames[-6:])[-4000:], "device_fault": fatal},
                   fatal=fatal)


def check(kernel: Kernel, case: Case, device: str | torch.device = "cpu", *,
          interpreter: bool | None = None, digest_pass: bool = True, events=_no_events,
          explain: bool = False) -> Outcome:
    """Judge ``kernel`` on ``case`` (see ``_judge_case``); ``Outcome.cpu_seconds`` is this
    process's CPU time for it, which tells a busy host from one waiting for the device."""
    started = time.process_time()
    outcome = _judge_case(kernel, case, device, interpreter=interpreter, digest_pass=digest_pass, events=events,
                          explain=explain)
    outcome.cpu_seconds = time.process_time() - started
    return outcome


def _judge_case(kernel: Kernel, case: Case, device: str | torch.device = "cpu", *,
                interpreter: bool | None = None, digest_pass: bool = True, events=_no_events,
                explain: bool = False) -> Outcome:
    """Judge ``kernel`` on ``case``.  ``Outcome.timings`` holds seconds per phase:
    materialize (every batch), kernel (every launch), oracle (the gather of the live keys
    and the float64 pass), reference (the same-precision pass from the same gather, and
    the row errors: harness/judge/tolerance.py), verdict (the rest).  They are the host's
    seconds: on a GPU the host waits for the device only in the verdict phase (see the
    module notes), so the device time of the launches, the oracle and the reference is
    counted there.  ``digest_pass=False`` leaves a PASS without its output digest (a
    copy to the host and a hash that a fuzz loop has no use for).  ``events`` is told
    "launch" before each launch and "returned" once the host has waited for it (the
    supervisor's watchdog).
    Whatever the kernel raises, ``SystemExit`` included, is a CRASH."""
    device = torch.device(device)
    if interpreter is None:
        interpreter = device.type == "cpu"
    refuse_if_too_large(case, device)
    reason = kernel.capabilities.unsupported(case, interpreter=interpreter)
    if reason:
        raise NanfuzzError(f"kernel {kernel.name} does not support this case: {reason}")
    encodings.require(case, "cpu" if interpreter else "cuda")
    g = case.geometry
    timings = {"materialize": 0.0, "kernel": 0.0, "oracle": 0.0, "reference": 0.0, "verdict": 0.0}
    t0 = time.perf_counter()
    host = build_on_host(case)
    batch = host.in_one_buffer(device)
    snapshot = batch.clone()
    timings["materialize"] += time.perf_counter() - t0

    # -- the poisoned run ------------------------------------------------------
    t0 = time.perf_counter()
    try:
        result, out, buffer = _launch(kernel, batch, device, events, wait=False)
    except BaseException as exc:  # the kernel's own failure is the finding, SystemExit included
        return _crash(exc, "on the poisoned run")
    timings["kernel"] += time.perf_counter() - t0
    expected_shape = (case.num_tokens, g.num_q_heads, g.head_size)
    if tuple(result.shape) != expected_shape:
        return Outcome(Verdict.CRASH, f"CRASH: kernel returned shape {tuple(result.shape)}, expected {expected_shape}",
                       {"error": "wrong output shape"})

    precision = effective_precision(kernel.capabilities.precision, interpreter)
    t0 = time.perf_counter()

    def lap(i: int) -> None:  # the gather and the float64 pass are the oracle's, the other pass the reference's
        nonlocal t0
        now = time.perf_counter()
        timings[("oracle", "reference")[i]] += now - t0
        t0 = now

    try:
        reference, yardstick = attend_in(batch, (FLOAT64, same_precision(g.dtype, precision)), lap)
        errors = row_errors(result.double(), reference, yardstick, g.dtype, precision)
    except BaseException as exc:
        if _device_fault(exc):  # the poisoned run's fault, met where the oracle first waits for the device
            return _crash(exc, "on the poisoned run")
        # or met as another error by a library the oracle sets up on a context that fault killed
        # (cuBLAS: "CUBLAS_STATUS_NOT_INITIALIZED"): waiting for the run names the fault
        fault = _await_runs(device, events, "on the poisoned run") if not isinstance(exc, KeyboardInterrupt) else None
        if fault is not None:
            return fault
        raise
    timings["reference"] += time.perf_counter() - t0

    t0 = time.perf_counter()
    outcome = _judge(kernel, case, batch, snapshot, host, result, out, buffer, reference, errors, device, timings, events)
    if outcome.output_sha256 is None and digest_pass:  # only a PASS comes back without one
        outcome.output_sha256 = digest(result)
    timings["verdict"] += time.perf_counter() - t0 - timings.pop("_later_runs")
    outcome.timings = timings
    if explain and outcome.verdict in (Verdict.NONFINITE, Verdict.NONDETERMINISTIC, Verdict.LEAK):
        try:
            reads = redzone_reads(kernel, case, device, events)
        except BaseException:  # a kernel that only crashes here keeps the verdict it had
            reads = []
        if reads:
            outcome.evidence["reads_past_tensors"] = reads
            outcome.summary += "; it reads " + ", ".join(reads)
    return outcome


def _differing(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elements whose bits differ, NaN against NaN counting as equal."""
    differs = _bits(a) != _bits(b)
    if a.is_floating_point():
        differs &= ~(torch.isnan(a) & torch.isnan(b))
    return differs


def _rerun(kernel, make_batch, device, events, timings, when) -> tuple[torch.Tensor | None, Outcome | None]:
    """Build a batch and launch on it: (output, None), or (None, the CRASH).  Its times go to
    their phases and to ``_later_runs`` (which the verdict phase must not count)."""
    t0 = time.perf_counter()
    batch = make_batch()
    t1 = time.perf_counter()
    try:
        output, _, _ = _launch(kernel, batch, device, events, wait=False)
    except BaseException as exc:
        return None, _crash(exc, when)
    t2 = time.perf_counter()
    timings["materialize"] += t1 - t0
    timings["kernel"] += t2 - t1
    timings["_later_runs"] += t2 - t0
    return output, None


def _max_change(other: torch.Tensor, result64: torch.Tensor, where: torch.Tensor) -> float:
    return float((other.double() - result64).abs().nan_to_num(float("inf"))[where].max())


def _judge(kernel, case, batch, snapshot, host, result, out, buffer, reference, errors, device, timings, events) -> Outcome:
    """The first verdict that applies.  ``timings`` gets the later runs' materialisation
    and launches under their own phases, and their sum under ``_later_runs``."""
    timings["_later_runs"] = 0.0
    result64 = result.double()
    nonfinite = ~torch.isfinite(result64) & torch.isfinite(reference)
    # The garbage run's batch is built while the device still runs the poisoned run and the oracle.
    t0 = time.perf_counter()
    garbage_batch = refill_dead_slots(host, garbage_seed=1).in_one_buffer(device)
    built = time.perf_counter() - t0
    timings["materialize"] += built
    timings["_later_runs"] += built

    # -- NONFINITE -------------------------------------------------------------
    crash = _await_runs(device, events, "on the poisoned run")
    if crash:
        return crash
    if nonfinite.any():
        ev = describe_rows(case, nonfinite)
        value = "NaN" if torch.isnan(result64[nonfinite]).any() else "Inf"
        return Outcome(Verdict.NONFINITE,
                       f"NONFINITE: {ev['bad_rows']}/{ev['total_rows']} output rows hold {value} where the oracle is "
                       f"finite (tokens {span(ev['tokens'])}, heads {span(ev['heads'])}, sequences {span(ev['sequences'])}); "
                       f"poison they can reach: {classes_line(ev)}", ev, digest(result))

    # -- NONDETERMINISTIC: the same inputs again, bit-identical output ----------
    # Its flag is read back from the device with the later verdicts' flags: one wait, not two.
    unstable = None
    if kernel.capabilities.deterministic:
        repeat, crash = _rerun(kernel, snapshot.clone, device, events, timings, "on the repeated run")
        if crash:
            return crash
        unstable = _differing(repeat, result)

    def nondeterministic() -> Outcome:
        ev = describe_rows(case, unstable)
        ev["max_change"] = _max_change(repeat, result64, unstable)
        return Outcome(Verdict.NONDETERMINISTIC,
                       f"NONDETERMINISTIC: {ev['bad_rows']}/{ev['total_rows']} output rows differ between two "
                       f"launches on identical inputs (max change {ev['max_change']:.3g}; tokens "
                       f"{span(ev['tokens'])}, heads {span(ev['heads'])})", ev, digest(result))

    # -- LEAK: different finite garbage in every dead slot, bit-identical output
    other, crash = _rerun(kernel, lambda: garbage_batch, device, events, timings, "on the finite-garbage run")
    if crash:
        return nondeterministic() if unstable is not None and bool(unstable.any()) else crash
    differs = _differing(other, result)
    if not kernel.capabilities.deterministic:
        # two launches of this kernel may differ anyway: only a change beyond the bound is a leak
        differs &= (other.double() - result64).abs().nan_to_num(float("inf")) > errors.allowed_change()
    off = errors.off()
    ratio = errors.ratio
    # The remaining verdicts' flags, read back from the device in one go.
    guarded = result.data_ptr() == out.data_ptr()
    written_guard = ~torch.isnan(buffer[case.num_tokens:]).all() if guarded else torch.zeros((), dtype=torch.bool, device=device)
    written_inputs = _any_written(batch, snapshot)
    zero = torch.zeros((), dtype=torch.float64, device=device)
    worst_error = errors.kernel.max() if errors.kernel.numel() else zero
    worst_ratio = ratio.max() if ratio.numel() else zero
    unstable_any = unstable.any() if unstable is not None else torch.zeros((), dtype=torch.bool, device=device)
    read = torch.stack([worst_error, worst_ratio, *(f.double() for f in (
        unstable_any, differs.any(), off.any(), written_guard, written_inputs))])
    crash = _await_runs(device, events, "on the repeated run or the finite-garbage run"
                        if unstable is not None else "on the finite-garbage run")
    if crash:
        return crash
    max_error, max_ratio, *flags = read.tolist()
    unstable_hit, leaks, mismatches, guard_hit, inputs_hit = (f != 0 for f in flags)

    if unstable_hit:
        return nondeterministic()

    if leaks:
        ev = describe_rows(case, differs)
        ev["max_change"] = _max_change(other, result64, differs)
        return Outcome(Verdict.LEAK,
                       f"LEAK: {ev['bad_rows']}/{ev['total_rows']} output rows change when only dead slots change "
                       f"(max change {ev['max_change']:.3g}; tokens {span(ev['tokens'])}, heads {span(ev['heads'])})",
                       ev, digest(result))

    # -- MISMATCH ----------------------------------------------------------------
    if mismatches:
        ev = describe_rows(case, off[..., None].expand_as(result64))
        ev.update(_worst_row(errors, result64, reference))
        return Outcome(Verdict.MISMATCH,
                       f"MISMATCH: {ev['bad_rows']}/{ev['total_rows']} output rows off the oracle beyond the bound; "
                       f"worst token {ev['worst'][0]} head {ev['worst'][1]}: {ev['ratio']:.3g}x the {errors.arithmetic} "
                       f"reference's error, bound {errors.bound:g}x (error {ev['max_abs_error']:.3g} vs "
                       f"{ev['reference_error']:.3g}; element {ev['worst'][2]}: {ev['worst_value']:.6g}, "
                       f"expected {ev['worst_expected']:.6g})", ev, digest(result))

    # -- CLOBBER -----------------------------------------------------------------
    written = ["output guard rows past the last token"] if guard_hit else []
    if inputs_hit:
        written += _written_regions(batch, snapshot) or ["the memory between its inputs' allocations"]
    if written:
        return Outcome(Verdict.CLOBBER, f"CLOBBER: the kernel wrote into {', '.join(written)}",
                       {"written": written}, digest(result))
    return Outcome(Verdict.PASS, "PASS", {"max_abs_error": max_error, "max_error_ratio": max_ratio,
                                          "arithmetic": errors.arithmetic, "bound": errors.bound})


def _worst_row(errors, result64: torch.Tensor, reference: torch.Tensor) -> dict:
    """Where the kernel's error is the largest multiple of the reference's, in both units."""
    ratio = errors.ratio
    worst = int(torch.argmax(ratio.nan_to_num(float("inf")).flatten()))
    t, h = divmod(worst, ratio.shape[1])
    row = (result64[t, h] - reference[t, h]).abs().nan_to_num(float("inf"))
    d = int(torch.argmax(row))
    return {"worst": [t, h, d], "ratio": float(ratio[t, h]), "bound": errors.bound, "arithmetic": errors.arithmetic,
            "max_abs_error": float(errors.kernel[t, h]), "reference_error": float(errors.reference[t, h]),
            "worst_value": float(result64[t, h, d]), "worst_expected": float(reference[t, h, d])}


def redzone_reads(kernel: Kernel, case: Case, device: str | torch.device, events=_no_events) -> list[str]:
    """Which float redzones the kernel reads: each one, in turn, gets finite garbage instead of NaN;
    a margin whose change changes the output was read.  Costs a launch per margin (report time only)."""
    device = torch.device(device)
    batch = materialize(case, device)
    pristine = batch.clone()
    reference, _, _ = _launch(kernel, batch, device, events)
    again, _, _ = _launch(kernel, pristine.clone(), device, events)
    if bool(_differing(again, reference).any()):
        return []  # a nondeterministic kernel: a changed output says nothing about what it read
    found = []
    for name, allocation in pristine.allocations.items():
        if not allocation.base.is_floating_point():
            continue
        for side, where in allocation.sides():
            trial = pristine.clone()
            region = trial.allocations[name].base[where]
            trial.allocations[name].base[where] = torch.full_like(region, 0.5)
            output, _, _ = _launch(kernel, trial, device, events)
            if bool(_differing(output, reference).any()):
                found.append(f"the redzone {side} of {name}")
    return found


def _rows(changed: torch.Tensor, dims: int) -> torch.Tensor:
    """``changed`` reduced to its leading ``dims`` dimensions: did anything in that row change?"""
    return changed.flatten(dims).any(-1) if changed.dim() > dims else changed


def _any_written(batch: PagedBatch, snapshot: PagedBatch) -> torch.Tensor:
    """bool scalar on the device: does any bit of ``batch``'s buffer differ from ``snapshot``'s?
    (Both are in one buffer each: ``PagedBatch.in_one_buffer`` and its clone.)"""
    return (shared_buffer(batch.allocations) != shared_buffer(snapshot.allocations)).any()


def _written_regions(batch: PagedBatch, snapshot: PagedBatch) -> list[str]:
    """The labels of the regions (inputs and their redzones' sides) whose bits changed."""
    now, before = batch.bases(), snapshot.bases()
    changed = {name: _bits(before[name]) != _bits(now[name]) for name in before}
    hits = [(_rows(changed[name], inside.dim()) & inside).any() for name, inside in _regions(batch)]
    flags = torch.stack(hits).tolist() if hits else []
    return [label for (label, _), hit in zip(_region_labels(batch), flags) if hit]


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
