"""A Hypothesis campaign against one kernel: generate, check, shrink, report.

Every case is written to ``<state>/pending/`` before its launch and removed
after a clean finish, so a kernel that kills the process leaves its case
behind; the next campaign against that kernel reports it as a CRASH first.
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from hypothesis import HealthCheck, Phase, given, seed as hypothesis_seed, settings
from hypothesis.database import DirectoryBasedExampleDatabase
from hypothesis.errors import HypothesisException

from nanfuzz.harness.backend import host_threads
from nanfuzz.harness.check import Outcome, Verdict, check
from nanfuzz.harness.focus import Focus
from nanfuzz.harness.profiles import Profile, get_profile
from nanfuzz.harness.kernel import Kernel
from nanfuzz.reference.case import Case
from nanfuzz.reference.errors import NanfuzzError
from nanfuzz.strategies import paged_cases
from nanfuzz.strategies.cases import campaign_pool

STATE_DIR = Path(os.environ.get("NANFUZZ_STATE_DIR", ".nanfuzz"))
# The example database may live elsewhere (shared by several state folders).
EXAMPLES_DIR = os.environ.get("NANFUZZ_EXAMPLES_DIR")
# Examples per Hypothesis run when a campaign is bounded by wall time.
_CHUNK = 250
_FIRST_CHUNK = 10


class KernelFailed(Exception):
    """Raised inside the property so that Hypothesis shrinks the case."""

    def __init__(self, outcome: Outcome, case: Case):
        super().__init__(outcome.summary)
        self.outcome = outcome
        self.case = case


class _StopRequested(KeyboardInterrupt):
    """Ends a campaign between examples when its caller asks (a sibling job found a failure).

    A KeyboardInterrupt to Hypothesis, so that it stops without shrinking,
    reporting or saving the unfinished example to the database.
    """


# One exception class per verdict: Hypothesis then shrinks a NONFINITE case
# toward a smaller NONFINITE case, never into a milder verdict.
_FAILURE_TYPES = {v: type(f"Kernel{v.value.title()}", (KernelFailed,), {}) for v in Verdict}


@dataclass
class Campaign:
    kernel: str
    device: str
    examples: int = 0
    verdicts: dict[str, int] = field(default_factory=dict)
    failure: Outcome | None = None
    failing_case: Case | None = None
    elapsed: float = 0.0
    time_to_first_failure: float | None = None
    examples_to_first_failure: int | None = None
    shrink_time: float | None = None
    phase_times: dict[str, float] = field(default_factory=dict)
    repro_paths: list[str] = field(default_factory=list)
    recovered_crash: bool = False
    busy_seconds: float | None = None  # jobs' campaigns: the sum of their own elapsed times

    @property
    def failed(self) -> bool:
        return self.failure is not None


def safe_name(kernel_name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", kernel_name)


def pending_path(kernel_name: str, state_dir: Path | None = None) -> Path:
    return (state_dir or STATE_DIR) / "pending" / f"{safe_name(kernel_name)}.json"


def _write_pending(path: Path, kernel_name: str, case: Case) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"kernel": kernel_name, "case": case.to_dict()}))
    os.replace(tmp, path)


def recover_pending(kernel_name: str, state_dir: Path | None = None) -> Case | None:
    """A case left behind by a campaign whose process died mid-launch."""
    path = pending_path(kernel_name, state_dir)
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        return Case.from_dict(data["case"])
    except (ValueError, KeyError, NanfuzzError):
        path.unlink()
        return None


def crash_campaign(kernel_name: str, device: str, case: Case, who: str) -> Campaign:
    """What a process that died mid-launch leaves: its pending case, as a CRASH."""
    failure = Outcome(Verdict.CRASH, f"CRASH: {who} died while running this case",
                      {"error": "process died during the launch (found in a pending-case file)"})
    return Campaign(kernel=kernel_name, device=device, failure=failure, failing_case=case, recovered_crash=True)


def take_leftover_crash(kernel_name: str, device: str, state_dirs: list[Path]) -> Campaign | None:
    """The case an earlier campaign's process died on, from the first of ``state_dirs``
    that holds one, as a CRASH; its pending file is removed (the caller reports it)."""
    for state_dir in state_dirs:
        case = recover_pending(kernel_name, state_dir)
        if case is not None:
            pending_path(kernel_name, state_dir).unlink()
            return crash_campaign(kernel_name, device, case, "a previous campaign's process")
    return None


def fuzz(kernel: Kernel, *, device: str = "cpu", max_examples: int | None = None, seed: int | None = None,
         profile: Profile | str | None = None, focus: Focus = Focus(), time_budget: float | None = None,
         shrink: bool = True, use_database: bool | None = None,
         on_example: Callable[[Campaign], None] | None = None,
         should_stop: Callable[[], bool] | None = None, pool_size: int | None = None,
         pool_seed: int | None = None) -> Campaign:
    """Run a campaign; the result holds the shrunk failure, if any (repros are the caller's job).

    ``should_stop`` is asked before each example while no failure is found;
    True ends the campaign there, as a pass over the examples run so far.
    ``pool_size`` overrides the kernel's ``specialisation_pool`` (0: none); the
    pool is drawn from ``pool_seed`` (default: ``seed``, else 0), so the same
    seed meets the same geometries, their example-database entries and compiles.
    """
    profile = get_profile(profile) if not isinstance(profile, Profile) else profile
    interpreter = device == "cpu"
    caps = focus.apply(kernel.capabilities, kernel.name)
    if interpreter and not [d for d in caps.dtypes if d in caps.interpreter_dtypes]:
        raise NanfuzzError(f"kernel {kernel.name}: no dtype of {', '.join(caps.dtypes)} runs under Triton's interpreter; "
                           "use --device cuda")
    max_examples = max_examples or profile.max_examples
    time_budget = time_budget if time_budget is not None else profile.time_budget
    use_database = profile.use_database if use_database is None else use_database
    campaign = Campaign(kernel=kernel.name, device=device)
    start = time.perf_counter()
    pending = pending_path(kernel.name)

    leftover = take_leftover_crash(kernel.name, device, [STATE_DIR])
    if leftover is not None:
        return leftover

    def run_case(case: Case) -> None:
        if should_stop is not None and campaign.time_to_first_failure is None and should_stop():
            raise _StopRequested()
        _write_pending(pending, kernel.name, case)
        outcome = check(kernel, case, device, interpreter=interpreter, digest_pass=False)
        campaign.examples += 1
        campaign.verdicts[outcome.verdict.value] = campaign.verdicts.get(outcome.verdict.value, 0) + 1
        for phase, seconds in outcome.timings.items():
            campaign.phase_times[phase] = campaign.phase_times.get(phase, 0.0) + seconds
        if outcome.failed and campaign.time_to_first_failure is None:
            campaign.time_to_first_failure = time.perf_counter() - start
            campaign.examples_to_first_failure = campaign.examples
        if on_example is not None:
            on_example(campaign)
        if outcome.failed:
            raise _FAILURE_TYPES[outcome.verdict](outcome, case)

    if pool_size is None:
        # the kernel's own pool is for compiles, and under the interpreter nothing compiles
        pool_size = 0 if interpreter else (caps.specialisation_pool or 0)
    pool_seed = pool_seed if pool_seed is not None else (seed or 0)
    pool = campaign_pool(caps, pool_size, pool_seed, interpreter=interpreter) if pool_size else None
    strategy = paged_cases(caps, interpreter=interpreter, poison_classes=focus.poison_classes, pool=pool)
    phases = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target] + ([Phase.shrink] if shrink else [])
    database = DirectoryBasedExampleDatabase(EXAMPLES_DIR or str(STATE_DIR / "examples")) if use_database else None
    remaining = max_examples
    chunk_index = 0
    try:
        while remaining > 0:
            elapsed = time.perf_counter() - start
            if time_budget is not None and elapsed >= time_budget:
                break
            size = remaining
            if time_budget is not None:
                # size each Hypothesis run from the measured cost of an example,
                # so the clock is looked at often enough to keep the budget
                per_example = elapsed / campaign.examples if campaign.examples else None
                fit = _FIRST_CHUNK if per_example is None else int((time_budget - elapsed) / max(per_example, 1e-6))
                size = max(1, min(remaining, _CHUNK, fit))
            property_ = given(case=strategy)(lambda case: run_case(case))
            property_.hypothesis.inner_test._hypothesis_internal_add_digest = (
                f"nanfuzz:{kernel.name}:{device}:{focus.label()}"
                + (f":pool{len(pool)}/{pool_seed}" if pool else "")).encode()
            if seed is not None or chunk_index:
                property_ = hypothesis_seed((seed or 0) * 1_000_003 + chunk_index)(property_)
            # settings after @seed: @seed alone would switch the example database off
            configured = settings(
                max_examples=size, deadline=None, database=database, phases=phases,
                derandomize=profile.derandomize and seed is None, report_multiple_bugs=False,
                suppress_health_check=list(HealthCheck), print_blob=False)(property_)
            before = campaign.examples
            try:
                with host_threads(device):
                    configured()
            except KernelFailed as failure:
                campaign.failure = failure.outcome
                campaign.failing_case = failure.case
                break
            except _StopRequested:
                break
            remaining -= max(1, campaign.examples - before)
            chunk_index += 1
    except HypothesisException as exc:
        raise NanfuzzError(f"kernel {kernel.name}: Hypothesis stopped the campaign: {exc}".splitlines()[0]) from None
    finally:
        if pending.exists():
            pending.unlink()
    campaign.elapsed = time.perf_counter() - start
    if campaign.failure is not None and campaign.time_to_first_failure is not None:
        campaign.shrink_time = campaign.elapsed - campaign.time_to_first_failure
    return campaign


def progress_printer(stream=sys.stderr, every: float = 2.0) -> Callable[[Campaign], None]:
    """A progress line on long runs: examples, rate, first failure."""
    last = [time.perf_counter()]
    started = [time.perf_counter()]

    def show(c: Campaign) -> None:
        now = time.perf_counter()
        if now - last[0] < every:
            return
        last[0] = now
        rate = c.examples / max(now - started[0], 1e-9)
        state = "shrinking" if c.time_to_first_failure is not None else "searching"
        stream.write(f"  {c.kernel}: {c.examples} examples, {rate:.1f}/s, {state}\n")
        stream.flush()

    return show
