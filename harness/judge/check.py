"""Run one kernel on one case and judge it: the verdicts of the design notes.

Three launches per case: the poisoned batch, the same batch again (two
launches on identical inputs must agree bit for bit), and the batch with
different finite garbage in every dead slot and redzone (LEAK).  HANG and a
crash that kills the process are the supervisor's verdicts
(``harness.launch.worker``); this module judges what a launch that returns gives.

On a GPU the host waits for the device twice per case, not once per launch
(``harness.judge.runs``): after the poisoned run (with the oracle queued
behind it, and the finite-garbage run's batch built on the host meanwhile),
and after the repeated and the finite-garbage runs (with the verdict's flags
queued behind them).  With fourteen processes sharing one GPU, each wait is a
turn in the GPU's queue of contexts: three fewer per case gave a ``--jobs 14``
campaign 12-14% more examples a second.
"""
from __future__ import annotations

import time
from dataclasses import replace

import torch

from nanfuzz.harness.adapters.interpreter_builtins import cannot_run_reason
from nanfuzz.harness.judge import encodings, reads
from nanfuzz.harness.judge.evidence import classes_line, describe_rows, span
from nanfuzz.harness.judge.outcome import Outcome, Verdict, crash as _crash, device_fault as _device_fault
from nanfuzz.harness.judge.own_fault import own_fault
from nanfuzz.harness.judge.paths import recording_launches
from nanfuzz.harness.judge.runs import await_runs as _await_runs, check_footprint, digest, launch, no_events
from nanfuzz.harness.judge.accuracy import size_tier
from nanfuzz.harness.judge.tolerance import effective_precision, errors_against, yardstick
from nanfuzz.harness.judge.large import built_in_pool, large_batch, large_check_footprint
from nanfuzz.harness.judge.memory import (HarnessOutOfMemory, JudgingOutOfMemory, MemoryPolicy, governor,
                                          out_of_memory)
from nanfuzz.harness.judge.pool import process_pool
from nanfuzz.harness.judge.writes import (Written, any_written, differing, redzone_reads, where_written,
                                          written_regions)
from nanfuzz.harness.kernel import Kernel
from nanfuzz.reference.batch import PagedBatch
from nanfuzz.reference.case import Case
from nanfuzz.reference.device_build import refill
from nanfuzz.reference import layouts
from nanfuzz.reference.errors import NanfuzzError
from nanfuzz.reference.materialize import build_on_host, host_to_device, refill_dead_slots
from nanfuzz.reference.oracle import attend_and_measure, padded_products
from nanfuzz.reference.precision import FLOAT64, same_precision
from nanfuzz.reference.redzones import clone_together, shared_buffer

__all__ = ["Verdict", "Outcome", "check", "digest"]

# The most multiply-adds an oracle's pass may take on the host rather than on a GPU
# (``CaseCheck._oracle_on_host``): the default size's cases up to about this (most of them) took
# 1.4 ms on average and 6 ms at most for both passes and the summands, on one core.
HOST_ORACLE_PRODUCTS = 1 << 20


def check(kernel: Kernel, case: Case, device: str | torch.device = "cpu", *,
          interpreter: bool | None = None, digest_pass: bool = True, events=no_events,
          explain: bool = False, strict_reads: bool = False, trace_reads: bool | None = None,
          memory: MemoryPolicy | None = None, patience: float | None = None) -> Outcome:
    """Judge ``kernel`` on ``case``.  ``Outcome.timings`` holds seconds per phase:
    materialize (every batch), kernel (every launch), oracle (the gather of the live keys
    and the float64 pass), reference (the same-precision pass from the same gather, and
    the row errors: harness/judge/tolerance.py), verdict (the rest).  They are the host's
    seconds: on a GPU the host waits for the device only in the verdict phase (see the
    module notes), so the device time of the launches, the oracle and the reference is
    counted there.  ``Outcome.cpu_seconds`` is this process's CPU time for it, which tells
    a busy host from one waiting for the device.  ``digest_pass=False`` leaves a PASS
    without its output digest (a copy to the host and a hash that a fuzz loop has no use
    for).  ``events`` is told "launch" before each launch and "returned" once the host
    has waited for it (the supervisor's watchdog).  ``explain``: a NONFINITE,
    NONDETERMINISTIC or LEAK also says which redzones the kernel reads (a launch per
    redzone).  Whatever the kernel raises, ``SystemExit`` included, is a CRASH.  Under the
    interpreter (``trace_reads``, by default) the poisoned run's loads are traced and
    ``Outcome.reads`` says which dead slots they addressed (``harness.judge.reads``); with
    ``strict_reads`` a PASS whose loads addressed any is a DEAD_READ.

    Before anything is built, the case's memory is reserved on the device (``memory``: how this
    process shares it, ``harness.judge.memory``), waiting up to ``patience`` seconds (default:
    the policy's ``search_wait``); ``TooLargeForDevice`` where it does not come free.  Where
    nanfuzz's own allocation fails while judging, or the kernel's during its launch, the check
    runs once more with this process's caches given back and the memory reserved again: a
    harness that still fails is ``TooLargeForDevice`` (never a verdict), a kernel that still
    fails is its CRASH.  A programming error of nanfuzz's own judging code is a ``NanfuzzError``
    naming it (``harness.judge.own_fault``), never a verdict."""
    started, wall = time.process_time(), time.perf_counter()
    device = torch.device(device)
    interpreter = device.type == "cpu" if interpreter is None else interpreter
    kind = LargeCaseCheck if case.large else CaseCheck
    # a large case's batch is pooled on its device: its loads are not traced
    tracing = (interpreter if trace_reads is None else trace_reads) and not case.large
    policy = memory or MemoryPolicy()
    share = governor(policy, device)
    wait = policy.search_wait if patience is None else patience

    def judged() -> Outcome:
        try:
            return kind(kernel, case, device, interpreter, events, strict_reads=strict_reads, trace_reads=tracing,
                        memory=share, patience=wait).judge(digest_pass, explain)
        except Exception as exc:
            fault = own_fault(exc)  # nanfuzz's bug: a usage-level error (exit 2, or a note after a finding)
            if fault:
                raise NanfuzzError(fault) from exc
            raise

    waited, causes = share.waited, share.wait_causes.copy()
    try:
        outcome = judged()
    except HarnessOutOfMemory:
        outcome = None
    if outcome is None or outcome.evidence.get("out_of_memory"):
        share.give_back()
        try:
            outcome = judged()
        except HarnessOutOfMemory as exc:
            raise JudgingOutOfMemory(f"nanfuzz ran out of {'GPU' if device.type == 'cuda' else 'host'} memory "
                                     f"judging this case, twice ({exc}); declined") from None
        if outcome.evidence.get("out_of_memory"):
            outcome.evidence["out_of_memory_twice"] = True  # again with this process's caches given back
    outcome.cpu_seconds = time.process_time() - started
    outcome.memory_waited = share.waited - waited
    outcome.memory_wait_causes = dict(share.wait_causes - causes)
    outcome.seconds = time.perf_counter() - wall
    return outcome


class CaseCheck:
    """One case's runs and their verdict; each stage a method, the first verdict that applies wins.

    How a case's batches are built, copied and compared is this class's (one buffer built on the
    host per batch); a large case's is ``harness.judge.large``'s, through the methods under
    "the batches"."""

    def __init__(self, kernel: Kernel, case: Case, device: torch.device, interpreter: bool, events, *,
                 strict_reads: bool = False, trace_reads: bool = False, memory=None, patience: float = 0.0):
        self.kernel, self.case, self.device, self.events = kernel, case, device, events
        self.memory, self.patience = memory, patience
        self.interpreter = interpreter
        self.strict_reads, self.trace_reads = strict_reads, trace_reads
        self.trace: reads.LoadTrace | None = None
        self.timings = {"materialize": 0.0, "kernel": 0.0, "oracle": 0.0, "reference": 0.0, "verdict": 0.0}
        self._later_runs = 0.0  # the later runs' materialisation and launches, which the verdict phase leaves out

    def judge(self, digest_pass: bool, explain: bool) -> Outcome:
        self._admit()
        try:
            return self._judge(digest_pass, explain)
        finally:
            self._release()
            if self.memory is not None:
                try:
                    self.memory.settle()
                except Exception:  # a context the kernel faulted: the outcome says so, the worker is replaced
                    pass

    def _judge(self, digest_pass: bool, explain: bool) -> Outcome:
        self.launched: dict[str, set[str]] = {}  # the poisoned run's Triton kernels (``judge.paths``)
        self.indexed: set[str] = set()  # what its index buffers point at (``reference.layouts``)
        try:
            outcome = self._poisoned_run() or self._oracle() or self._timed_verdict(digest_pass)
        except HarnessOutOfMemory:
            raise
        except BaseException as exc:  # outside the kernel's launches: nanfuzz's own allocation
            if out_of_memory(exc):
                raise HarnessOutOfMemory(f"{type(exc).__name__}: {exc}".splitlines()[0][:300]) from exc
            raise
        if explain and outcome.verdict in (Verdict.NONFINITE, Verdict.NONDETERMINISTIC, Verdict.LEAK):
            self._explain(outcome)
        outcome.paths = {name: sorted(specs) for name, specs in sorted(self.launched.items())}
        outcome.layout = sorted(self.indexed)
        return outcome

    def _timed_verdict(self, digest_pass: bool) -> Outcome:
        t0 = time.perf_counter()
        outcome = self._verdict()
        if outcome.output_sha256 is None and digest_pass:  # only a PASS comes back without one
            outcome.output_sha256 = digest(self.result)
        self.timings["verdict"] += time.perf_counter() - t0 - self._later_runs
        outcome.timings = self.timings
        if self.trace is not None:
            outcome = self._reads(outcome)
        return outcome

    # -- the stages ----------------------------------------------------------------------
    def _admit(self) -> None:
        """A usage error for a case the kernel cannot take, and the case's memory reserved on the
        device (``TooLargeForDevice`` where it does not come free), before anything is built."""
        kernel, case = self.kernel, self.case
        reason = kernel.capabilities.unsupported(case, interpreter=self.interpreter)
        if reason:
            raise NanfuzzError(f"kernel {kernel.name} does not support this case: {reason}")
        declined = kernel.declines(case)
        if declined:
            raise NanfuzzError(f"kernel {kernel.name} declines this case (its supports()): {declined}")
        encodings.require(case, "cpu" if self.interpreter else "cuda")
        if self.memory is not None:
            self.reserved = self.memory.reserve(self._footprint, self.patience, self._waiting)

    def _waiting(self, on: bool) -> None:
        self.events("memory-wait" if on else "memory-granted")  # the supervisor's clock stops meanwhile

    def _refuse_if_interpreter_cannot_run(self, exc: BaseException) -> None:
        """A usage error, not the kernel's CRASH, where a launch failed for a reason of Triton's
        interpreter (a builtin it has no implementation of): the kernel would run on a GPU."""
        why = cannot_run_reason(exc) if self.interpreter else None
        if why:
            raise NanfuzzError(f"kernel {self.kernel.name} cannot run under Triton's interpreter: {why}; run it on a "
                               "GPU (--device cuda), or leave that path out of what it declares for the interpreter"
                               ) from None

    # -- the batches -----------------------------------------------------------------------
    def _footprint(self) -> int:
        return check_footprint(self.case)

    def _build(self) -> None:
        """The poisoned batch (``self.batch``) and ``self.pristine``, what the judges read."""
        self.host = build_on_host(self.case)
        self.batch = self.host.in_one_buffer(self.device)
        self.pristine = self._pristine_copy()

    def _oracle_on_host(self) -> bool:
        """Does the oracle attend on the host batch, while the device runs the poisoned run?  On a GPU,
        for a case whose passes are small (``HOST_ORACLE_PRODUCTS``): the host computes the oracle's
        few hundred small operations in about the time it takes to launch them, and the GPU, which
        fourteen campaigns share, runs only the kernel's launches and the verdict's comparisons.
        The host batch holds the same bits as the pristine copy on the device."""
        return self.device.type != "cpu" and padded_products(self.case) <= HOST_ORACLE_PRODUCTS

    def _pristine_copy(self) -> PagedBatch:
        """What the judges read: the batch as it was before any launch, on the device.  The oracle,
        the same-precision reference, the repeated run and the checks of every input and redzone
        read it, never a tensor the kernel was handed (it may have written there) nor anything an
        adapter rebound on its batch object (``runs.launch`` hands it an object of its own)."""
        return self.batch.clone()

    def _repeat_batch(self):
        """The poisoned batch again, for the repeated run."""
        return self.pristine.clone()

    def _garbage_batch(self):
        """The batch with seed 1's finite garbage in every dead slot and redzone, built on the host
        while the device runs the poisoned run (launched later, by ``_rerun``)."""
        batch = refill_dead_slots(self.host, garbage_seed=1).in_one_buffer(self.device)
        return lambda: batch

    def _inputs_written(self) -> torch.Tensor:
        """bool scalar on the device: did the poisoned run write any bit of its inputs or their redzones?"""
        return any_written(self.batch, self.pristine)

    def _written_regions(self) -> list[Written]:
        return written_regions(self.batch, self.pristine)

    def _release(self) -> None:
        """After the verdict, whatever it is: what the batches hold that outlives the check."""

    # -- the stages ----------------------------------------------------------------------
    def _poisoned_run(self) -> Outcome | None:
        """Build the batch and its pristine copy, and launch on the poisoned batch (not waiting)."""
        case, g = self.case, self.case.geometry
        t0 = time.perf_counter()
        self._build()
        if self.memory is not None:
            self.memory.built()
        self.timings["materialize"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        try:
            with recording_launches() as self.launched, layouts.recording() as self.indexed, \
                    reads.traced_loads(self.trace_reads) as trace:
                self.result, self.out, self.buffer = launch(self.kernel, self.batch, self.device, self.events,
                                                            wait=False)
        except HarnessOutOfMemory:
            raise
        except BaseException as exc:  # the kernel's own failure is the finding, SystemExit included
            self._refuse_if_interpreter_cannot_run(exc)
            self.timings["kernel"] += time.perf_counter() - t0
            crashed = self._crash(exc, "on the poisoned run")
            crashed.timings = self.timings  # a launch put off for a binary compiling elsewhere says what it cost
            return crashed
        self.trace = trace if self.trace_reads else None
        self.timings["kernel"] += time.perf_counter() - t0
        expected_shape = (case.num_tokens, g.num_q_heads, g.v_head_size)
        if tuple(self.result.shape) != expected_shape:
            return Outcome(Verdict.CRASH, f"CRASH: kernel returned shape {tuple(self.result.shape)}, expected "
                                          f"{expected_shape}", {"error": "wrong output shape"})
        return None

    def _oracle(self) -> Outcome | None:
        """The float64 oracle and the same-precision reference, queued behind the poisoned run,
        and the kernel's error against them row by row."""
        g = self.case.geometry
        precision = effective_precision(self.kernel.capabilities.precision, self.interpreter)
        t0 = time.perf_counter()

        def lap(i: int) -> None:  # the gather and the float64 pass are the oracle's, the other pass the reference's
            nonlocal t0
            now = time.perf_counter()
            self.timings[("oracle", "reference")[i]] += now - t0
            t0 = now

        try:
            rotation = self.kernel.capabilities.rotation_dtype if self.case.kv_cache.rotation != "none" else None
            arithmetic = same_precision(g.dtype, precision, rotation)
            on_host = self._oracle_on_host()
            (reference, same), summands = attend_and_measure(self.host if on_host else self.pristine,
                                                             (FLOAT64, arithmetic), lap)
            yard = yardstick(reference, same, summands, g.dtype, precision, self.case.kv_cache.quantized, rotation)
            if on_host:  # the rows and their yardstick join the kernel's output in one copy
                reference, reference_error, denominator = host_to_device(
                    self.device, reference, yard.reference, yard.denominator)
                yard = replace(yard, reference=reference_error, denominator=denominator)
            self.reference = reference
            self.errors = errors_against(self.result.double(), reference, yard)
        except BaseException as exc:
            if _device_fault(exc):  # the poisoned run's fault, met where the oracle first waits for the device
                return _crash(exc, "on the poisoned run")
            # or met as another error by a library the oracle sets up on a context that fault killed
            # (cuBLAS: "CUBLAS_STATUS_NOT_INITIALIZED"): waiting for the run names the fault
            fault = _await_runs(self.device, self.events, "on the poisoned run") if not isinstance(exc, KeyboardInterrupt) else None
            if fault is not None:
                return fault
            raise
        self.timings["reference"] += time.perf_counter() - t0
        return None

    def _verdict(self) -> Outcome:
        """NONFINITE after the first wait; then the repeat and the finite-garbage runs, and every
        later verdict's flags read back from the device in one go."""
        case, device = self.case, self.device
        self.result64 = self.result.double()
        nonfinite = ~torch.isfinite(self.result64) & torch.isfinite(self.reference)
        # The garbage run's batch is built while the device still runs the poisoned run and the oracle.
        t0 = time.perf_counter()
        garbage_batch = self._garbage_batch()
        built = time.perf_counter() - t0
        self.timings["materialize"] += built
        self._later_runs += built

        crash = _await_runs(device, self.events, "on the poisoned run")
        if crash:
            return crash
        if nonfinite.any():
            return self._nonfinite(nonfinite)

        # Its flag is read back from the device with the later verdicts' flags: one wait, not two.
        self.unstable = None
        if self.kernel.capabilities.deterministic:
            self.repeat, crash = self._rerun(self._repeat_batch, "on the repeated run")
            if crash:
                return crash
            self.unstable = differing(self.repeat, self.result)

        self.other, crash = self._rerun(garbage_batch, "on the finite-garbage run")
        if crash:
            return self._nondeterministic() if self.unstable is not None and bool(self.unstable.any()) else crash
        self.differs = differing(self.other, self.result)
        if not self.kernel.capabilities.deterministic:
            # two launches of this kernel may differ anyway: only a change beyond the bound is a leak
            self.differs &= (self.other.double() - self.result64).abs().nan_to_num(float("inf")) > self.errors.allowed_change()
        flags, crash = self._read_flags()
        if crash:
            return crash
        max_error, max_ratio, unstable_hit, leaks, mismatches, guard_hit, inputs_hit = flags
        if unstable_hit:
            return self._nondeterministic()
        if leaks:
            return self._leak()
        if guard_hit or inputs_hit:
            return self._clobber(guard_hit, inputs_hit)
        if mismatches:
            return self._mismatch()
        return Outcome(Verdict.PASS, "PASS", {"max_abs_error": max_error, "max_error_ratio": max_ratio,
                                              "arithmetic": self.errors.arithmetic, "bound": self.errors.bound,
                                              "tier": size_tier(case)})

    def _reads(self, outcome: Outcome) -> Outcome:
        t0 = time.perf_counter()  # mapping the traced loads is verdict time
        outcome = reads.judged(outcome, self.trace, self.kernel, self.batch, self.host, strict=self.strict_reads)
        self.timings["verdict"] += time.perf_counter() - t0
        return outcome

    # -- the runs after the first -----------------------------------------------------------
    def _rerun(self, make_batch, when: str) -> tuple[torch.Tensor | None, Outcome | None]:
        """Build a batch and launch on it: (output, None), or (None, the CRASH)."""
        t0 = time.perf_counter()
        batch = make_batch()
        t1 = time.perf_counter()
        try:
            output, _, _ = launch(self.kernel, batch, self.device, self.events, wait=False)
        except HarnessOutOfMemory:
            raise
        except BaseException as exc:
            self._refuse_if_interpreter_cannot_run(exc)
            return None, self._crash(exc, when)
        t2 = time.perf_counter()
        self.timings["materialize"] += t1 - t0
        self.timings["kernel"] += t2 - t1
        self._later_runs += t2 - t0
        return output, None

    def _read_flags(self) -> tuple[list, Outcome | None]:
        """The remaining verdicts' flags, read back from the device after the second wait:
        (max error, max ratio, unstable, leaks, mismatches, guard rows written, inputs written)."""
        device, errors = self.device, self.errors
        guarded = self.result.data_ptr() == self.out.data_ptr()
        no = torch.zeros((), dtype=torch.bool, device=device)
        written_guard = ~torch.isnan(self.buffer[self.case.num_tokens:]).all() if guarded else no
        zero = torch.zeros((), dtype=torch.float64, device=device)
        worst_error = errors.kernel.max() if errors.kernel.numel() else zero
        worst_ratio = errors.ratio.max() if errors.ratio.numel() else zero
        unstable_any = self.unstable.any() if self.unstable is not None else no
        read = torch.stack([worst_error, worst_ratio, *(f.double() for f in (
            unstable_any, self.differs.any(), errors.off().any(), written_guard, self._inputs_written()))])
        crash = _await_runs(device, self.events, "on the repeated run or the finite-garbage run"
                            if self.unstable is not None else "on the finite-garbage run")
        if crash:
            return [], crash
        max_error, max_ratio, *flags = read.tolist()
        return [max_error, max_ratio, *(f != 0 for f in flags)], None

    def _crash(self, exc: BaseException, when: str) -> Outcome:
        """The CRASH of a launch that raised; one that ran out of memory says how much the case had."""
        outcome = _crash(exc, when)
        if outcome.evidence.get("out_of_memory"):
            outcome.evidence["reserved_bytes"] = getattr(self, "reserved", None)
        return outcome

    # -- the failing verdicts' evidence ------------------------------------------------------
    def _nonfinite(self, nonfinite: torch.Tensor) -> Outcome:
        ev = describe_rows(self.case, nonfinite)
        value = "NaN" if torch.isnan(self.result64[nonfinite]).any() else "Inf"
        return Outcome(Verdict.NONFINITE,
                       f"NONFINITE: {ev['bad_rows']}/{ev['total_rows']} output rows hold {value} where the oracle is "
                       f"finite (tokens {span(ev['tokens'])}, heads {span(ev['heads'])}, sequences {span(ev['sequences'])}); "
                       f"poison they can reach: {classes_line(ev)}", ev, digest(self.result))

    def _nondeterministic(self) -> Outcome:
        ev = describe_rows(self.case, self.unstable)
        ev["max_change"] = _max_change(self.repeat, self.result64, self.unstable)
        return Outcome(Verdict.NONDETERMINISTIC,
                       f"NONDETERMINISTIC: {ev['bad_rows']}/{ev['total_rows']} output rows differ between two "
                       f"launches on identical inputs (max change {ev['max_change']:.3g}; tokens "
                       f"{span(ev['tokens'])}, heads {span(ev['heads'])})", ev, digest(self.result))

    def _leak(self) -> Outcome:
        ev = describe_rows(self.case, self.differs)
        ev["max_change"] = _max_change(self.other, self.result64, self.differs)
        return Outcome(Verdict.LEAK,
                       f"LEAK: {ev['bad_rows']}/{ev['total_rows']} output rows change when only dead slots change "
                       f"(max change {ev['max_change']:.3g}; tokens {span(ev['tokens'])}, heads {span(ev['heads'])})",
                       ev, digest(self.result))

    def _clobber(self, guard_hit: bool, inputs_hit: bool) -> Outcome:
        written = ["output guard rows past the last token"] if guard_hit else []
        where = {}
        if inputs_hit:
            regions = self._written_regions()
            written += [region.label for region in regions] or ["the memory between its inputs' allocations"]
            where = {region.tensor: region.places for region in regions if region.places}
        return Outcome(Verdict.CLOBBER, f"CLOBBER: the kernel wrote into {'; '.join(written)}",
                       {"written": written, "written_at": where}, digest(self.result))

    def _mismatch(self) -> Outcome:
        errors = self.errors
        ev = describe_rows(self.case, errors.off()[..., None].expand_as(self.result64))
        ev.update(_worst_row(errors, self.result64, self.reference))
        return Outcome(Verdict.MISMATCH,
                       f"MISMATCH: {ev['bad_rows']}/{ev['total_rows']} output rows off the oracle beyond the bound; "
                       f"worst token {ev['worst'][0]} head {ev['worst'][1]}: {ev['ratio']:.3g}x what a correct "
                       f"{errors.arithmetic} kernel may be off, bound {errors.bound:g}x (error {ev['max_abs_error']:.3g} vs "
                       f"{ev['yardstick']:.3g}: the reference's error {ev['reference_error']:.3g} + rounding allowance "
                       f"{ev['allowance']:.3g}; element {ev['worst'][2]}: {ev['worst_value']:.6g}, "
                       f"expected {ev['worst_expected']:.6g})", ev, digest(self.result))

    def _explain(self, outcome: Outcome) -> None:
        try:
            reads = redzone_reads(self.kernel, self.case, self.device, self.events)
        except BaseException:  # a kernel that only crashes here keeps the verdict it had
            reads = []
        if reads:
            outcome.evidence["reads_past_tensors"] = reads
            outcome.summary += "; it reads " + ", ".join(reads)


def _max_change(other: torch.Tensor, result64: torch.Tensor, where: torch.Tensor) -> float:
    return float((other.double() - result64).abs().nan_to_num(float("inf"))[where].max())


def _worst_row(errors, result64: torch.Tensor, reference: torch.Tensor) -> dict:
    """Where the kernel's error is the largest multiple of the reference's, in both units."""
    ratio = errors.ratio
    worst = int(torch.argmax(ratio.nan_to_num(float("inf")).flatten()))
    t, h = divmod(worst, ratio.shape[1])
    row = (result64[t, h] - reference[t, h]).abs().nan_to_num(float("inf"))
    d = int(torch.argmax(row))
    return {"worst": [t, h, d], "ratio": float(ratio[t, h]), "bound": errors.bound, "arithmetic": errors.arithmetic,
            "max_abs_error": float(errors.kernel[t, h]), "reference_error": float(errors.reference[t, h]),
            "yardstick": float(errors.denominator[t, h]),
            "allowance": float(errors.denominator[t, h] - errors.reference[t, h]),
            "worst_value": float(result64[t, h, d]), "worst_expected": float(reference[t, h, d])}


# -- large cases ----------------------------------------------------------------------------
#
# A production-size case's caches run to gigabytes, so nothing of them is built on the host,
# copied per run or cloned: ``reference.device_build`` builds the blocks the case writes,
# ``harness.judge.pool`` lays them into caches that stay allocated from case to case, and each
# later run writes them again.  The judges read the compact build, never the caches a kernel
# saw.  Writes are found in three parts: the small inputs against their pristine copy; the
# case's cache blocks, after the poisoned run, against what was written; and everything else
# of the caches, after the last run, against their background.

class _Inputs:
    """The small inputs alone, as ``written_regions`` reads a batch."""

    def __init__(self, case, allocations):
        self.case, self.allocations = case, allocations

    def bases(self):
        return {name: a.base for name, a in self.allocations.items()}



class LargeCaseCheck(CaseCheck):
    """``CaseCheck`` with a large case's batches (see the notes above)."""

    def _footprint(self) -> int:
        return large_check_footprint(self.case, self.kernel.copies_caches_of(self.case))

    def _oracle_on_host(self) -> bool:
        return False  # nothing of a large case is built on the host

    def _build(self) -> None:
        self._clean = False  # before anything that can fail: ``_release`` reads it
        self.pool = process_pool()
        self.build, self.caches = built_in_pool(self.case, self.device, self.pool)
        self.small = self.build.small
        self.snapshot_small = clone_together(self.small)
        self.batch = self._batch(self.small)
        self.pristine = self._pristine_copy()

    def _batch(self, small) -> PagedBatch:
        return large_batch(self.case, small, self.caches)

    def _pristine_copy(self) -> PagedBatch:
        """The compact build, with the small inputs as they were before the launch."""
        batch = self.build.oracle_batch()
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


    def _written_regions(self) -> list[Written]:
        found = []
        if bool((shared_buffer(self.snapshot_small) != shared_buffer(self.small)).any()):
            found = written_regions(_Inputs(self.case, self.small), _Inputs(self.case, self.snapshot_small))
        ids = self.build.ids
        for name, changed in self._changed.items():
            hits = changed.nonzero()
            if hits.numel():
                places = tuple((int(ids[t]), slot) for t, slot in hits.tolist())
                found.append(Written(f"{name} at {where_written(name, places, self.case)}", name, places[:64]))
        for name, dirty in self._outside.items():
            if bool(dirty):
                found.append(Written(f"{name} outside the blocks holding the case's live keys (or its redzones)", name))
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
