"""Several campaigns against one kernel at once, one process each, on one device.

A campaign spends most of its time in Python (Hypothesis, building the case,
the verdict) while the GPU idles, so ``jobs`` processes sharing the device
run that many times the examples.  Job ``i`` fuzzes with seed ``seed + i``
(its own random draws when no seed is given) and, for kernels that compile
per shape, pool ``seed + i`` (or ``i``), so the same jobs meet the same pools,
database entries and compiles run after run.  Each keeps its pending-case
file in ``<state>/jobs/<i>`` and shares the example database.  The first job to fail asks the others to stop and shrinks; the
merged campaign reports its failure, the examples of all jobs, and times
measured from the start of the whole run.
"""
from __future__ import annotations

import multiprocessing
import queue
import shutil
import threading
import time
from pathlib import Path

import nanfuzz.harness.fuzz as fuzz_module
from nanfuzz.harness.fuzz import Campaign
from nanfuzz.harness.kernel import Kernel
from nanfuzz.reference.errors import NanfuzzError

_WARMUP_SEED = 1_000_003
_READY_TIMEOUT = 600.0


def _run_job(index: int, kernel_spec: str, device: str, state_dir: str, examples_dir: str, options: dict,
             warmup: int, stop_event, results, ready) -> None:
    """A job process: one campaign, after ``warmup`` unmeasured examples and
    a wait at ``ready`` until every job has warmed up (so the measured
    campaigns run side by side).

    Puts ``(index, campaign, (started, ended))`` or ``(index, error, None)``.
    """
    fuzz_module.STATE_DIR = Path(state_dir)
    fuzz_module.EXAMPLES_DIR = examples_dir

    def note_failure(campaign: Campaign) -> None:
        if campaign.time_to_first_failure is not None:
            stop_event.set()

    try:
        from nanfuzz.harness.registry import resolve

        kernel = resolve(kernel_spec)
        if warmup:
            fuzz_module.fuzz(kernel, device=device, max_examples=warmup, seed=options["pool_seed"] + _WARMUP_SEED,
                             pool_seed=options["pool_seed"], profile=options["profile"], shrink=False,
                             use_database=False, pool_size=options["pool_size"])
            try:
                ready.wait(timeout=_READY_TIMEOUT)
            except threading.BrokenBarrierError:
                pass  # a job died or took too long warming up: start anyway
        started = time.time()
        campaign = fuzz_module.fuzz(kernel, device=device, on_example=note_failure,
                                    should_stop=stop_event.is_set, **options)
    except NanfuzzError as exc:
        stop_event.set()
        results.put((index, str(exc), None))
        return
    results.put((index, campaign, (started, time.time())))


def split(total: int, jobs: int) -> list[int]:
    """``total`` examples over ``jobs`` jobs, the first ones taking the remainder."""
    return [total // jobs + (1 if i < total % jobs else 0) for i in range(jobs)]


def fuzz_parallel(kernel: Kernel, *, jobs: int, device: str = "cpu", max_examples: int, seed: int | None = None,
                  profile=None, focus=None, time_budget: float | None = None, shrink: bool = True,
                  use_database: bool | None = None, pool_size: int | None = None, warmup: int = 0) -> Campaign:
    """One campaign of ``max_examples`` spread over ``jobs`` processes; see the module notes.

    ``warmup``: each job first runs that many unmeasured examples (its
    compiles, imports, caches); the campaign's times then run from the
    earliest measured start to the last job's end.
    """
    kernel_name = kernel.name
    if jobs < 1:
        raise NanfuzzError(f"--jobs={jobs} must be >= 1")
    if max_examples < jobs:
        raise NanfuzzError(f"{max_examples} examples cannot be shared by {jobs} jobs; use fewer jobs")
    from nanfuzz.harness.profiles import get_profile

    profile = get_profile(profile) if profile is None or isinstance(profile, str) else profile
    # Job i fuzzes pool i (or seed + i): the same jobs meet the same pools, database entries and compiles.
    if seed is None and profile.derandomize:
        seed = 0
    state = fuzz_module.STATE_DIR
    examples_dir = fuzz_module.EXAMPLES_DIR or str((state / "examples").absolute())
    job_dirs = [state / "jobs" / str(i) for i in range(jobs)]
    leftover = fuzz_module.take_leftover_crash(kernel_name, device, [state, *sorted((state / "jobs").glob("*"))])
    if leftover is not None:
        return leftover
    for d in job_dirs:
        shutil.rmtree(d, ignore_errors=True)
    common = dict(profile=profile, time_budget=time_budget, shrink=shrink, use_database=use_database,
                  pool_size=pool_size, **({"focus": focus} if focus is not None else {}))
    # spawn, not fork: a forked child of a process that used CUDA cannot use it
    context = multiprocessing.get_context("spawn")
    stop_event, results, ready = context.Event(), context.Queue(), context.Barrier(jobs)
    start = time.time()
    processes = []
    for i, (job_dir, examples) in enumerate(zip(job_dirs, split(max_examples, jobs))):
        job_seed = None if seed is None else seed + i
        options = dict(common, max_examples=examples, seed=job_seed, pool_seed=i if job_seed is None else job_seed)
        processes.append(context.Process(target=_run_job, daemon=True, args=(
            i, kernel.resolvable, device, str(job_dir.absolute()), examples_dir, options, warmup,
            stop_event, results, ready)))
        processes[-1].start()
    done: dict[int, tuple] = {}
    died: list[int] = []
    try:
        while len(done) + len(died) < jobs:
            try:
                index, payload, span = results.get(timeout=0.5)
                done[index] = (payload, span)
                continue
            except queue.Empty:
                pass
            for i, p in enumerate(processes):
                # a job that exits without a result died (a kernel that kills its process)
                if i not in done and i not in died and p.exitcode is not None and results.empty():
                    died.append(i)
                    stop_event.set()
                    ready.abort()  # jobs still warming up must not wait for it
    finally:
        for p in processes:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    errors = [payload for payload, _ in done.values() if isinstance(payload, str)]
    if errors and not died:
        raise NanfuzzError(errors[0])
    finished = [v for v in done.values() if isinstance(v[0], Campaign)]
    measured_from = min((span[0] for _, span in finished), default=start) if warmup else start
    merged = _merge(kernel_name, device, finished, measured_from)
    if died:
        _recover_crash(merged, kernel_name, [job_dirs[i] for i in died])
    for d in job_dirs:
        shutil.rmtree(d, ignore_errors=True)
    merged.elapsed = max((span[1] for _, span in finished), default=time.time()) - measured_from
    return merged


def _merge(kernel_name: str, device: str, results: list[tuple[Campaign, tuple[float, float]]],
           start: float) -> Campaign:
    merged = Campaign(kernel=kernel_name, device=device, busy_seconds=0.0)
    first_failure_at = None
    for campaign, (started, _) in results:
        merged.busy_seconds += campaign.elapsed
        merged.examples += campaign.examples
        for verdict, n in campaign.verdicts.items():
            merged.verdicts[verdict] = merged.verdicts.get(verdict, 0) + n
        for phase, seconds in campaign.phase_times.items():
            merged.phase_times[phase] = merged.phase_times.get(phase, 0.0) + seconds
        if campaign.failed:
            found_at = started - start + (campaign.time_to_first_failure or 0.0)
            if first_failure_at is None or found_at < first_failure_at:
                first_failure_at = found_at
                merged.failure, merged.failing_case = campaign.failure, campaign.failing_case
                merged.time_to_first_failure = found_at if campaign.time_to_first_failure is not None else None
                merged.shrink_time = campaign.shrink_time
                merged.recovered_crash = campaign.recovered_crash
                merged.examples_to_first_failure = campaign.examples_to_first_failure  # in the job that found it
    return merged


def _recover_crash(merged: Campaign, kernel_name: str, job_dirs: list[Path]) -> None:
    """A job process died: its pending case is the crash, which outranks any other failure."""
    for d in job_dirs:
        case = fuzz_module.recover_pending(kernel_name, d)
        if case is not None:
            crashed = fuzz_module.crash_campaign(kernel_name, merged.device, case, "a job process")
            merged.failure, merged.failing_case, merged.recovered_crash = crashed.failure, case, True
            return
    raise NanfuzzError(f"kernel {kernel_name}: a job process died outside a kernel launch; "
                       "run with --jobs 1 to see why")
