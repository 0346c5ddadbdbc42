"""``nanfuzz bench``: how fast the fuzz loop runs, and how soon it catches the known bugs.

Throughput: examples per second of fuzz campaigns (no shrinking, no example
database), after a warm-up campaign that takes the first compiles, split
into generation (Hypothesis's drawing and its engine, the journal: a
campaign's time outside every measured phase), materialisation, kernel,
oracle, reference (the same-precision yardstick of MISMATCH), verdict, and
around the checks: memory wait (for device memory), admission (the rest of
the judging process's time for a check: the memory ledger, set-up and
clean-up), handoff (the case to the worker and the outcome back) and tally
(statistics, accuracy and Hypothesis's targets after each check); and a
campaign's startup (its worker started and ready, its compile farm started,
its first cases drawn ahead) and close (worker and farm stopped).  A known-bad
kernel ends a campaign at its first failure, so its campaigns repeat with new
seeds until the count is reached.

With ``jobs``, the throughput is that of several campaigns sharing the
device, one process each (see ``harness.campaign.jobs``).

Detection: for each known-bad kernel (``expect == "caught"``) and each seed,
a campaign from an empty state directory (no example database, no pending
case): seconds and examples to the first failure, and seconds to shrink it.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from nanfuzz.harness.campaign.runner import fuzz, worker_start_steps

from nanfuzz.harness.campaign.scope import compile_plan, start_farm

from nanfuzz.harness.launch.subjects import make_subject
from nanfuzz.harness.kernel import Kernel
from nanfuzz.harness.campaign.jobs import fuzz_parallel
from nanfuzz.harness.campaign.result import add_known
from nanfuzz.harness.campaign.settings import Settings
from nanfuzz.harness.campaign.stack_samples import in_a_check, innermost, summed
from nanfuzz.reference.errors import NanfuzzError

PHASES = ("generation", "materialize", "kernel", "oracle", "reference", "verdict",
          "memory wait", "admission", "handoff", "tally", "startup", "close")
WARMUP_EXAMPLES = 5
DETECT_EXAMPLES = 300  # the CI profile's campaign length: a bug not caught by then counts as missed
_WARMUP_SEED = 1_000_003  # apart from the measured seeds 0, 1, ...
_PROFILE = "dev"  # fixed, so that NANFUZZ_PROFILE or CI=true cannot change what is measured
_POOL_SEED = 0  # the throughput's campaigns share one pool, as a --jobs run's jobs do
_UNBOUNDED = 10**9  # examples of a campaign bounded by time


@dataclass
class Throughput:
    examples: int = 0
    seconds: float = 0.0
    campaigns: int = 0
    phase_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    specialisations: int | None = None  # new kernel specialisations after the warm-up (GPU: compiles)
    busy_seconds: float | None = None  # several jobs: the sum of their own times (phases are shares of it)
    first_example_s: float | None = None  # from the start (worker, farm, warm-up) to the first measured example
    farm: dict | None = None  # what the compile farm did (harness.launch.farm.Farm.summary)
    cpu_seconds: float = 0.0          # the campaigns' own processes
    judging_cpu_seconds: float = 0.0  # judging the examples, wherever it ran (the workers)
    run_queue_seconds: float | None = None  # the campaigns' searches waiting for a core (Linux)
    declined_for_memory: int = 0  # cases drawn and declined for memory (their wait is "memory wait")
    memory_waits: int = 0  # checks that waited for device memory, and by what stood in the way
    memory_wait_causes: Counter = field(default_factory=Counter)
    # seconds from the start to each step of it (Campaign.startup): the first worker loaded and ready,
    # the farm started; with the farm's first task built (farm's summary), where the first example waits
    startup: dict[str, float] | None = None
    stacks: Counter | None = None  # the searches' stacks, sampled (``nanfuzz bench --stacks``)

    def add(self, campaign, campaigns: int = 1) -> None:
        """Count ``campaign`` in; time outside its measured phases is generation."""
        busy = campaign.busy_seconds if campaign.busy_seconds is not None else campaign.elapsed
        self.cpu_seconds += campaign.cpu_seconds
        self.judging_cpu_seconds += campaign.judging_cpu_seconds
        self.declined_for_memory += campaign.declined_for_memory
        self.memory_waits += campaign.memory_waits
        self.memory_wait_causes.update(campaign.memory_wait_causes)
        self.stacks = summed(self.stacks, campaign.stacks)
        self.run_queue_seconds = add_known(self.run_queue_seconds, campaign.run_queue_seconds)
        self.campaigns += campaigns
        self.examples += campaign.examples
        self.seconds += campaign.elapsed
        for phase, seconds in campaign.phase_times.items():
            self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + seconds
        self.phase_seconds["generation"] += busy - sum(campaign.phase_times.values())
        if campaign.busy_seconds is not None:
            self.busy_seconds = (self.busy_seconds or 0.0) + busy
        if self.first_example_s is None:
            self.first_example_s = campaign.time_to_first_example
        if self.startup is None:
            self.startup = campaign.startup_seconds()
        if campaign.farm is not None and self.farm is None:
            self.farm = campaign.farm

    @property
    def per_second(self) -> float:
        return self.examples / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        n = max(self.examples, 1)
        busy = self.busy_seconds or self.seconds
        return {
            "examples": self.examples, "seconds": self.seconds, "campaigns": self.campaigns,
            "examples_per_second": self.per_second,
            "seconds_per_example": {p: s / n for p, s in self.phase_seconds.items()},
            "share": {p: (s / busy if busy > 0 else 0.0) for p, s in self.phase_seconds.items()},
            "busy_seconds": self.busy_seconds,
            "declined_for_memory": self.declined_for_memory,
            "memory_waits": self.memory_waits, "memory_wait_causes": self.memory_wait_causes,
            "specialisations_after_warmup": self.specialisations,
            "time_to_first_example_s": self.first_example_s,
            "startup_s": self.startup,
            "compile_farm": self.farm,
            # CPU per example: far below the phases' seconds, the processes wait (device, scheduler)
            "cpu_seconds_per_example": {"campaign": self.cpu_seconds / n, "judging": self.judging_cpu_seconds / n},
            # the campaigns' searches runnable but without a core: beside their CPU, how much of
            # generation's wall time is the host's cores being busy rather than a wait of their own
            "run_queue_seconds_per_example": {
                "campaign": None if self.run_queue_seconds is None else self.run_queue_seconds / n},
            "stack_samples": None if self.stacks is None else where_the_search_was(self.stacks, self.examples),
        }


def where_the_search_was(stacks: Counter, examples: int) -> dict:
    """The sampled stacks' summary (``stacks``: microseconds by stack): the seconds sampled, those
    outside the subject's checks (generation, the journal, tally), and the innermost frames the search
    was in most, in milliseconds per example, outside the checks and over all."""
    per_example = 1e-3 / max(examples, 1)
    outside = sum(us for stack, us in stacks.items() if not in_a_check(stack))
    return {"sampled_s": 1e-6 * sum(stacks.values()), "outside_checks_s": 1e-6 * outside,
            "ms_per_example_outside_checks": [[frame, us * per_example] for frame, us in innermost(stacks, True)],
            "ms_per_example": [[frame, us * per_example] for frame, us in innermost(stacks)]}


@dataclass
class Detection:
    max_examples: int
    runs: list[dict] = field(default_factory=list)

    @property
    def caught(self) -> list[dict]:
        return [r for r in self.runs if r["caught"]]

    def _stat(self, key: str, how: Callable) -> float | None:
        values = [r[key] for r in self.caught if r[key] is not None]
        return how(values) if values else None

    def to_dict(self) -> dict:
        return {
            "seeds": len(self.runs), "caught": len(self.caught), "max_examples": self.max_examples,
            "time_to_first_failure_s": {"median": self._stat("time_to_first_failure_s", statistics.median),
                                        "max": self._stat("time_to_first_failure_s", max)},
            "examples_to_first_failure": {"median": self._stat("examples_to_first_failure", statistics.median),
                                          "max": self._stat("examples_to_first_failure", max)},
            "shrink_s": {"median": self._stat("shrink_s", statistics.median), "max": self._stat("shrink_s", max)},
            "runs": self.runs,
        }


@dataclass
class KernelBench:
    kernel: str
    expect: str
    throughput: Throughput | None = None
    detection: Detection | None = None
    skipped: str | None = None

    def to_dict(self) -> dict:
        return {"kernel": self.kernel, "expect": self.expect, "skipped": self.skipped,
                "throughput": self.throughput.to_dict() if self.throughput else None,
                "detection": self.detection.to_dict() if self.detection else None}


@contextlib.contextmanager
def fresh_state(settings: Settings) -> Iterator[Settings]:
    """``settings`` with a temporary state directory: no example database, no pending case of an earlier run."""
    with tempfile.TemporaryDirectory(prefix="nanfuzz-bench-") as tmp:
        yield settings.replace(state_dir=Path(tmp), examples_dir=None, profile=_PROFILE, use_database=False,
                               shrink=False, replays=0)


def measure_throughput(kernel: Kernel, settings: Settings, examples: int, warmup: int = WARMUP_EXAMPLES,
                       jobs: int = 1, seconds: float | None = None) -> Throughput:
    """Examples per second over ``examples`` examples, or over ``seconds`` of campaigning.

    Every campaign (warm-up included) draws from the same specialisation
    pool, pool 0; the seeds vary everything else.  A compile farm
    (``harness.launch.farm``) builds the pool from the start, so with
    ``warmup=0`` on an empty Triton cache the figure is the cold start's.
    """
    if seconds is not None:
        settings, examples = settings.replace(time_budget=seconds), _UNBOUNDED
    if jobs > 1:
        return _parallel_throughput(kernel, settings, examples, warmup, jobs)
    total = Throughput()
    started, started_at = time.perf_counter(), time.time()
    with fresh_state(settings) as run:
        farm = start_farm([compile_plan(kernel, run, _POOL_SEED)], run)
        subject = make_subject(kernel, run)  # one worker for the warm-up and every measured campaign
        handle = farm.handle if farm is not None else None
        try:
            if warmup:
                fuzz(kernel, run.replace(max_examples=warmup, seed=_WARMUP_SEED, time_budget=None), subject=subject,
                     pool_seed=_POOL_SEED, farm=handle)
            before = subject.specialisations
            seed = 0
            while total.examples < examples and total.campaigns < examples:
                campaign_start = time.perf_counter()
                campaign = fuzz(kernel, run.replace(max_examples=examples - total.examples, seed=seed),
                                subject=subject, pool_seed=_POOL_SEED, farm=handle)
                if campaign.time_to_first_example is not None and not total.campaigns:
                    # from the bench's start: the worker's and the farm's start-up count
                    campaign.time_to_first_example += campaign_start - started
                seed += 1
                total.add(campaign)
                if seconds is not None:
                    break
            after = subject.specialisations
            total.specialisations = None if before is None or after is None else after - before
            # this bench's worker, started before any campaign
            total.startup = {f"{step}_s": round(at - started_at, 3) for step, at in worker_start_steps(subject).items()}
        finally:
            subject.close()
            if farm is not None:
                farm.close()
                total.farm = farm.summary()
    return total


def _parallel_throughput(kernel: Kernel, settings: Settings, examples: int, warmup: int, jobs: int) -> Throughput:
    """``jobs`` processes on one device, each warmed up on its own; time from the first measured start.

    Phase times are summed over the jobs, so per-example phase times are
    those of one job; examples per second are the whole run's.
    """
    total = Throughput()
    seed = 0
    with fresh_state(settings) as run:
        while total.examples < examples and total.campaigns < examples:
            campaign = fuzz_parallel(kernel, run.replace(jobs=jobs, max_examples=max(jobs, examples - total.examples),
                                                         seed=seed), warmup=warmup, pool_seed=_POOL_SEED)
            seed += jobs
            total.add(campaign, campaigns=jobs)
            if run.time_budget is not None:
                break
    return total


def measure_detection(kernel: Kernel, settings: Settings, seeds: int, max_examples: int = DETECT_EXAMPLES,
                      progress: Callable[[str], None] | None = None) -> Detection:
    """One shrinking campaign per seed, each from an empty database; ``progress``
    gets a line per seed as it ends (long cold-cache runs show where they are)."""
    detection = Detection(max_examples=max_examples)
    for seed in range(seeds):
        with fresh_state(settings) as run:
            campaign = fuzz(kernel, run.replace(max_examples=max_examples, seed=seed, shrink=True))
        detection.runs.append({
            "seed": seed, "caught": campaign.failed,
            "verdict": campaign.failure.verdict.value if campaign.failed else "PASS",
            "examples": campaign.examples, "elapsed_s": campaign.elapsed,
            "time_to_first_failure_s": campaign.time_to_first_failure,
            "examples_to_first_failure": campaign.examples_to_first_failure,
            "shrink_s": campaign.shrink_time,
            # where a cold seed's time goes: its first example, waits for the farm, launches (a compile
            # in the worker counts there), specialisations its worker met, checks it put off while their
            # binaries compiled (``harness.campaign.deferrals``), what its farm built, and
            # its first examples one by one (when each started, waited for the farm, compiled itself)
            "time_to_first_example_s": campaign.time_to_first_example,
            "farm_wait_s": campaign.phase_times.get("compile", 0.0),
            "kernel_s": campaign.phase_times.get("kernel", 0.0),
            "compiles": campaign.compiles,
            "deferred": campaign.deferred,
            "farm": campaign.farm,
            "startup_s": campaign.startup_seconds(),
            "early_examples": campaign.early_examples,
        })
        if progress is not None:
            progress(_seed_line(kernel.name, detection.runs[-1]))
    return detection


def _seed_line(kernel_name: str, run: dict) -> str:
    if not run["caught"]:
        return f"    {kernel_name} seed {run['seed']}: not caught in {run['examples']} examples ({run['elapsed_s']:.2f} s)"
    return (f"    {kernel_name} seed {run['seed']}: {run['verdict']} after {run['examples_to_first_failure']} examples, "
            f"{_s(run['time_to_first_failure_s'])} s; shrink {_s(run['shrink_s'])} s")


def bench(kernels: list[Kernel], *, settings: Settings, examples: int, seeds: int, warmup: int = WARMUP_EXAMPLES,
          detect_examples: int = DETECT_EXAMPLES, skip_unrunnable: bool = False,
          progress: Callable[[str], None] | None = None, jobs: int = 1,
          detect_all: bool = False, seconds: float | None = None) -> list[KernelBench]:
    """Throughput for every kernel (``jobs`` processes at once); detection for the known-bad ones (one process).

    ``detect_all``: time to detect for every kernel (one with a known bug
    that is not a built-in, such as ``vllm:rocm_attn`` with windows).
    ``skip_unrunnable``: a kernel this device cannot run is reported as
    skipped instead of ending the bench (for the default every-built-in run).
    """
    results = []
    for kernel in kernels:
        result = KernelBench(kernel.name, kernel.expect)
        try:
            if examples or seconds:
                result.throughput = measure_throughput(kernel, settings, examples, warmup, jobs, seconds)
            if (kernel.expect == "caught" or detect_all) and seeds > 0:
                result.detection = measure_detection(kernel, settings, seeds, detect_examples, progress)
        except NanfuzzError as exc:
            if not skip_unrunnable:
                raise
            result.skipped = str(exc)
        results.append(result)
        if progress is not None:
            progress(_progress_line(result))
    return results


def _progress_line(r: KernelBench) -> str:
    if r.skipped:
        return f"  {r.kernel}: skipped ({r.skipped})"
    line = (f"  {r.kernel}: {r.throughput.per_second:.2f} examples/s over {r.throughput.examples}"
            if r.throughput else f"  {r.kernel}: no throughput measured")
    if r.detection is not None:
        d = r.detection.to_dict()
        line += f"; caught on {d['caught']}/{d['seeds']} seeds"
    return line


def machine() -> dict:
    import torch
    import triton

    info = {"cpus": os.cpu_count(), "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            "torch": torch.__version__, "triton": triton.__version__, "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def report(results: list[KernelBench], *, device: str, examples: int, seeds: int, started: dict,
           seconds: float) -> dict:
    return {"device": device, "examples": examples, "seeds": seeds, "seconds": seconds,
            "machine_at_start": started, "machine_at_end": machine(),
            "kernels": [r.to_dict() for r in results]}


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.1f}"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _throughput_cells(throughput: Throughput | None) -> list[str]:
    if throughput is None:
        return ["-"] * (len(PHASES) + 5)
    t = throughput.to_dict()
    per = t["seconds_per_example"]
    specs = "-" if t["specialisations_after_warmup"] is None else str(t["specialisations_after_warmup"])
    farm = t["compile_farm"]
    farm_s = "-" if not farm or farm["wall_seconds"] is None else f"{farm['wall_seconds']:.1f}"
    return [f"{t['examples_per_second']:.2f}", *(_ms(per[p]) for p in PHASES), _ms(per.get("compile")), specs,
            _s(t["time_to_first_example_s"]), farm_s]


def table_rows(results: list[KernelBench]) -> list[tuple]:
    rows = [("kernel", "expect", "ex/s", "ms/ex: gen", "mat", "kernel", "oracle", "ref", "verdict", "mem wait",
             "admit", "handoff", "tally", "start", "close", "wait",
             "new specs", "1st ex s", "farm s", "caught", "detect s med/max", "shrink s med/max")]
    for r in results:
        if r.skipped:
            rows.append((r.kernel, r.expect, "skipped", *[""] * (len(rows[0]) - 3)))
            continue
        caught = detect = shrink = "-"
        if r.detection is not None:
            d = r.detection.to_dict()
            caught = f"{d['caught']}/{d['seeds']}"
            detect = f"{_s(d['time_to_first_failure_s']['median'])}/{_s(d['time_to_first_failure_s']['max'])}"
            shrink = f"{_s(d['shrink_s']['median'])}/{_s(d['shrink_s']['max'])}"
        rows.append((r.kernel, r.expect, *_throughput_cells(r.throughput), caught, detect, shrink))
    return rows
