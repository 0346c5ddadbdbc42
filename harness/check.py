"""Run one kernel on one case and judge it: the verdicts of the design notes."""
from __future__ import annotations

import enum
import hashlib
import time
import traceback
from dataclasses import dataclass, field

import torch

from nanfuzz.harness.evidence import classes_line, describe_rows, span
from nanfuzz.harness.kernel import Kernel
from nanfuzz.harness.tolerance import allowed_error
from nanfuzz.reference.case import Case
from nanfuzz.reference.errors import NanfuzzError
from nanfuzz.reference.batch import PagedBatch
from nanfuzz.reference.materialize import materialize, refill_dead_slots
from nanfuzz.reference.oracle import oracle

GUARD_ROWS = 2  # canary rows after the last token's output row


class Verdict(str, enum.Enum):
    """In order of severity; a check reports the first that applies."""

    CRASH = "CRASH"
    NONFINITE = "NONFINITE"
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

    @property
    def failed(self) -> bool:
        return self.verdict is not Verdict.PASS

    def to_dict(self) -> dict:
        return {"verdict": self.verdict.value, "summary": self.summary, "evidence": self.evidence,
                "output_sha256": self.output_sha256}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32) if t.is_floating_point() else t


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()


def _launch(kernel: Kernel, batch, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    case = batch.case
    g = case.geometry
    buffer = torch.full((case.num_tokens + GUARD_ROWS, g.num_q_heads, g.head_size), float("nan"),
                        dtype=batch.q.dtype, device=device)
    out = buffer[: case.num_tokens]
    result = kernel(batch, out)
    _sync(device)
    return result, out, buffer


def _crash(exc: BaseException, when: str) -> Outcome:
    frames = traceback.format_exception(type(exc), exc, exc.__traceback__)
    message = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]
    return Outcome(Verdict.CRASH, f"CRASH {when}: {message}",
                   {"error": message, "traceback": "".join(frames[-6:])[-4000:]})


def check(kernel: Kernel, case: Case, device: str | torch.device = "cpu", *,
          interpreter: bool | None = None, digest_pass: bool = True) -> Outcome:
    """Judge ``kernel`` on ``case``.  ``Outcome.timings`` holds seconds per phase:
    materialize (both batches), kernel (both launches), oracle, verdict (the rest).
    ``digest_pass=False`` leaves a PASS without its output digest (a copy to
    the host and a hash that a fuzz loop has no use for)."""
    device = torch.device(device)
    if interpreter is None:
        interpreter = device.type == "cpu"
    reason = kernel.capabilities.unsupported(case, interpreter=interpreter)
    if reason:
        raise NanfuzzError(f"kernel {kernel.name} does not support this case: {reason}")
    g = case.geometry
    timings = {"materialize": 0.0, "kernel": 0.0, "oracle": 0.0, "verdict": 0.0}
    t0 = time.perf_counter()
    batch = materialize(case, device)
    snapshot = {name: t.clone() for name, t in batch.inputs().items()}
    _sync(device)
    timings["materialize"] += time.perf_counter() - t0

    # -- the poisoned run ------------------------------------------------------
    t0 = time.perf_counter()
    try:
        result, out, buffer = _launch(kernel, batch, device)
    except Exception as exc:  # the kernel's own failure is the finding
        return _crash(exc, "on the poisoned run")
    timings["kernel"] += time.perf_counter() - t0
    expected_shape = (case.num_tokens, g.num_q_heads, g.head_size)
    if tuple(result.shape) != expected_shape:
        return Outcome(Verdict.CRASH, f"CRASH: kernel returned shape {tuple(result.shape)}, expected {expected_shape}",
                       {"error": "wrong output shape"})

    t0 = time.perf_counter()
    reference = oracle(batch)
    _sync(device)
    timings["oracle"] += time.perf_counter() - t0

    t0 = time.perf_counter()
    outcome = _judge(kernel, case, batch, snapshot, result, out, buffer, reference, device, timings)
    if outcome.output_sha256 is None and digest_pass:  # only a PASS comes back without one
        outcome.output_sha256 = digest(result)
    timings["verdict"] += time.perf_counter() - t0 - timings.pop("_leak_run")
    outcome.timings = timings
    return outcome


def _pristine(case: Case, snapshot: dict[str, torch.Tensor]) -> PagedBatch:
    """The batch as materialised, rebuilt from the copies taken before the launch."""
    tensors = {name: t for name, t in snapshot.items() if name != "sinks"}
    return PagedBatch(case=case, sinks=snapshot.get("sinks"), **tensors)


def _judge(kernel, case, batch, snapshot, result, out, buffer, reference, device, timings) -> Outcome:
    """The first verdict that applies.  ``timings`` gets the LEAK run's materialisation
    and launch under their own phases, and their sum under ``_leak_run``."""
    g = case.geometry
    timings["_leak_run"] = 0.0
    result64 = result.double()
    # -- NONFINITE -------------------------------------------------------------
    nonfinite = ~torch.isfinite(result64) & torch.isfinite(reference)
    if nonfinite.any():
        ev = describe_rows(case, nonfinite)
        value = "NaN" if torch.isnan(result64[nonfinite]).any() else "Inf"
        return Outcome(Verdict.NONFINITE,
                       f"NONFINITE: {ev['bad_rows']}/{ev['total_rows']} output rows hold {value} where the oracle is "
                       f"finite (tokens {span(ev['tokens'])}, heads {span(ev['heads'])}, sequences {span(ev['sequences'])}); "
                       f"poison they can reach: {classes_line(ev)}", ev, digest(result))

    # -- LEAK: different finite garbage in every dead slot, bit-identical output
    t0 = time.perf_counter()
    clean = refill_dead_slots(_pristine(case, snapshot), garbage_seed=1)
    _sync(device)
    t1 = time.perf_counter()
    try:
        other, _, _ = _launch(kernel, clean, device)
    except Exception as exc:
        return _crash(exc, "on the finite-garbage run")
    t2 = time.perf_counter()
    timings["materialize"] += t1 - t0
    timings["kernel"] += t2 - t1
    timings["_leak_run"] = t2 - t0
    differs = _bits(other) != _bits(result)
    both_nan = torch.isnan(other) & torch.isnan(result) if result.is_floating_point() else torch.zeros_like(differs)
    differs &= ~both_nan
    error = (result64 - reference).abs()
    tolerance = allowed_error(reference, g.dtype)
    off = error > tolerance
    # The remaining verdicts' flags, read back from the device in one go.
    guarded = result.data_ptr() == out.data_ptr()
    written_guard = ~torch.isnan(buffer[case.num_tokens:]).all() if guarded else torch.zeros((), dtype=torch.bool, device=device)
    now = batch.inputs()
    written_inputs = [(_bits(before) != _bits(now[name])).any() if before.shape == now[name].shape
                      else torch.ones((), dtype=torch.bool, device=device) for name, before in snapshot.items()]
    worst_error = error.max() if error.numel() else torch.zeros((), dtype=torch.float64, device=device)
    read = torch.stack([worst_error, *(f.double() for f in (differs.any(), off.any(), written_guard, *written_inputs))])
    max_error, *flags = read.tolist()
    leaks, mismatches, guard_hit, inputs_hit = flags[0] != 0, flags[1] != 0, flags[2] != 0, [f != 0 for f in flags[3:]]

    if leaks:
        ev = describe_rows(case, differs)
        delta = (other.double() - result64).abs()
        ev["max_change"] = float(delta[differs].max())
        return Outcome(Verdict.LEAK,
                       f"LEAK: {ev['bad_rows']}/{ev['total_rows']} output rows change when only dead slots change "
                       f"(max change {ev['max_change']:.3g}; tokens {span(ev['tokens'])}, heads {span(ev['heads'])})",
                       ev, digest(result))

    # -- MISMATCH ----------------------------------------------------------------
    if mismatches:
        ev = describe_rows(case, off)
        worst = int(torch.argmax((error - tolerance).flatten()))
        t, h, d = worst // (g.num_q_heads * g.head_size), (worst // g.head_size) % g.num_q_heads, worst % g.head_size
        ev.update(max_abs_error=float(error.max()), worst=[t, h, d],
                  worst_value=float(result64[t, h, d]), worst_expected=float(reference[t, h, d]),
                  tolerance=float(tolerance[t, h, d]))
        return Outcome(Verdict.MISMATCH,
                       f"MISMATCH: {ev['bad_rows']}/{ev['total_rows']} output rows off the oracle beyond tolerance "
                       f"(worst token {t} head {h}: {ev['worst_value']:.6g} vs {ev['worst_expected']:.6g}, "
                       f"tolerance {ev['tolerance']:.3g})", ev, digest(result))

    # -- CLOBBER -----------------------------------------------------------------
    written = ["output guard rows past the last token"] if guard_hit else []
    written += [name for name, hit in zip(snapshot, inputs_hit) if hit]
    if written:
        return Outcome(Verdict.CLOBBER, f"CLOBBER: the kernel wrote into {', '.join(written)}",
                       {"written": written}, digest(result))
    return Outcome(Verdict.PASS, "PASS", {"max_abs_error": max_error})
