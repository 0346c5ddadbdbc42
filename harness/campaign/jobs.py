"""Several campaigns against one kernel at once, one process each, on one device.

A campaign spends most of its time in Python (Hypothesis, building the case,
the verdict) while the GPU idles, so ``jobs`` processes sharing the device
run that many times the examples.  Job ``i`` runs the ordinary campaign
runner (``harness.campaign.runner``) with seed ``seed + i`` (its own random draws when
no seed is given).  For kernels that compile per shape, every job draws from
the campaign's one pool (picked by ``seed``, else 0), which a compile farm
(``harness.launch.farm``) builds once for all of them on the host's cores
while the jobs start: a cold run pays each compile once, not once per job.
Each job has its own supervised worker and its own
journal, and they share the example database.  The first job to fail asks
the others to stop and shrinks; the merged campaign reports its failure, the
examples of all jobs, and times measured from the start of the whole run.

Ctrl-C, SIGTERM or SIGHUP, to the run's process or to its whole group: every
job stops at once (out of the check under way), keeps the smallest failure it
had, and the run reports it; jobs that do not answer within two seconds are
killed.
"""
from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

from nanfuzz.harness.campaign import journal
from nanfuzz.harness.campaign.settings import Settings
from nanfuzz.harness.campaign.stop_signals import STOP_SIGNALS, quiet_about_interrupts
from nanfuzz.harness.device import DeviceProperties
from nanfuzz.harness.kernel import Kernel
from nanfuzz.harness.launch.isolation import hold_while_starting
from nanfuzz.harness.launch.processes import has_ended as _gone, interpret_if_cpu, start as start_process
from nanfuzz.reference.errors import NanfuzzError

_WARMUP_SEED = 1_000_003
_READY_TIMEOUT = 600.0
_INTERRUPT_GRACE = 2.0


@dataclass(frozen=True)
class JobOrders:
    """What job ``index`` runs: the kernel by import path, its settings (its seed and share of the
    examples), the seed of the pool every job shares, and how many unmeasured examples come first."""

    index: int
    kernel_spec: str
    settings: Settings
    pool_seed: int
    warmup: int
    stands_in_for: DeviceProperties | None = None  # the kernel's, which its import path may not give


@dataclass(frozen=True)
class JobLinks:
    """What the jobs of one run share with it: ``stop`` (a job found a failure, or one died),
    ``interrupt`` (a signal reached the run), the ``results`` queue, the warm-up barrier ``ready``,
    ``listening[i]`` (job i's signal handler is in place), ``examples[i]`` (the measured examples
    job i has run so far, a shrink's candidates included), ``shrinking[i]`` (job i is shrinking a
    failure), the compile farm's handle and the GPU's fp8 skips (``encodings.told_gpu_skips``)."""

    stop: object
    interrupt: object
    results: object
    ready: object
    listening: object
    examples: object
    shrinking: object
    farm: object = None
    gpu_skips: tuple | None = None


@dataclass(frozen=True)
class _Spread:
    """How a run spreads its examples: over ``jobs`` jobs, seeds from ``seed``, one pool, its start."""

    jobs: int
    max_examples: int
    seed: int | None
    pool_seed: int
    warmup: int
    start: float


def _run_job(orders: JobOrders, links: JobLinks) -> None:
    """A job process: one campaign, after ``orders.warmup`` unmeasured examples and
    a wait at ``links.ready`` until every job has warmed up (so the measured
    campaigns run side by side).

    Puts ``(index, campaign, (started, ended))`` or ``(index, error, None)``.
    """
    index, settings, pool_seed, farm = orders.index, orders.settings, orders.pool_seed, links.farm
    stop_event, interrupt_event, results = links.stop, links.interrupt, links.results
    campaigning = [False]  # a stop raises in a campaign, which keeps what it found; elsewhere it only asks

    def interrupt(signum, frame):
        interrupt_event.set()
        if campaigning[0]:
            campaigning[0] = False
            if not hold_while_starting(_raise_interrupt):
                raise KeyboardInterrupt  # out of the check under way, however long

    for signum in (signal.SIGINT, *STOP_SIGNALS):
        signal.signal(signum, interrupt)
    sys.unraisablehook = quiet_about_interrupts(sys.unraisablehook)  # one a callback swallowed: the event stops it
    links.listening[index] = 1
    interpret_if_cpu(settings.device)  # before the kernel's module is imported
    from nanfuzz.harness.judge.encodings import told_gpu_skips

    told_gpu_skips(links.gpu_skips)  # a job that initialised CUDA could not fork its workers
    try:
        from nanfuzz.harness.campaign.runner import Hooks, fuzz, note_worker_start
        from nanfuzz.harness.launch.subjects import make_subject
        from nanfuzz.harness.registry import resolve_for_process

        kernel = resolve_for_process(orders.kernel_spec, settings.sources, orders.stands_in_for)
        subject = make_subject(kernel, settings, prefer_fork=True)  # a job runs no torch op itself
        try:
            if orders.warmup:
                fuzz(kernel, settings.replace(max_examples=orders.warmup, seed=pool_seed + _WARMUP_SEED, shrink=False,
                                              use_database=False, replays=0),
                     pool_seed=pool_seed, subject=subject, check_leftovers=False,
                     hooks=Hooks(interrupted=interrupt_event.is_set), farm=farm)
                try:
                    links.ready.wait(timeout=_READY_TIMEOUT)
                except threading.BrokenBarrierError:
                    pass  # a job died or took too long warming up: start anyway
            started = time.time()

            def note_example(campaign) -> None:
                links.examples[index] = campaign.examples
                if campaign.time_to_first_failure is not None:
                    links.shrinking[index] = 1
                    stop_event.set()

            hooks = Hooks(on_example=note_example, should_stop=stop_event.is_set, interrupted=interrupt_event.is_set)
            campaigning[0] = not interrupt_event.is_set()
            try:
                campaign = fuzz(kernel, settings, hooks=hooks, pool_seed=pool_seed, subject=subject,
                                check_leftovers=False, farm=farm)
            finally:
                campaigning[0] = False
            campaign.compiles = subject.specialisations
            note_worker_start(campaign, subject)
        finally:
            subject.close()
    except NanfuzzError as exc:
        stop_event.set()
        results.put((index, str(exc), None))
        return
    except KeyboardInterrupt:
        results.put((index, "interrupted", None))
        return
    results.put((index, campaign, (started, time.time())))


def _raise_interrupt() -> None:
    raise KeyboardInterrupt


def split(total: int, jobs: int) -> list[int]:
    """``total`` examples over ``jobs`` jobs, the first ones taking the remainder."""
    return [total // jobs + (1 if i < total % jobs else 0) for i in range(jobs)]


def fuzz_parallel(kernel: Kernel, settings: Settings | None = None, *, warmup: int = 0, farm=None,
                  pool_seed: int | None = None, on_progress: Callable[[int, bool], None] | None = None,
                  **overrides):
    """One campaign of ``settings.max_examples`` spread over ``settings.jobs`` processes; see the module notes.

    ``warmup``: each job first runs that many unmeasured examples (its
    compiles, imports, caches); the campaign's times then run from the
    earliest measured start to the last job's end.  ``farm``: a compile
    farm's handle the caller started for this campaign (else one starts here).
    ``pool_seed`` picks the jobs' one pool (default: the settings', else the seed, else 0).
    ``on_progress(examples, shrinking)``: told, a few times a second while the jobs run, the
    examples all of them have run and whether one of them is shrinking a failure
    (``harness.report.progress`` prints it).
    """
    from nanfuzz.harness.campaign.leftovers import recover_leftovers
    from nanfuzz.harness.campaign.scope import compile_plan, start_farm
    from nanfuzz.harness.campaign.profiles import get_profile

    settings = (settings or Settings()).replace(**overrides)
    jobs = settings.jobs
    if jobs < 1:
        raise NanfuzzError(f"--jobs={jobs} must be >= 1")
    profile = get_profile(settings.profile)
    max_examples = settings.max_examples or profile.max_examples
    if max_examples < jobs:
        raise NanfuzzError(f"{max_examples} examples cannot be shared by {jobs} jobs; use fewer jobs")
    seed = settings.seed
    if seed is None and profile.derandomize:
        seed = 0
    if pool_seed is None:  # one pool for every job
        pool_seed = settings.pool_seed if settings.pool_seed is not None else seed if seed is not None else 0
    start = time.time()
    own_farm = start_farm([compile_plan(kernel, settings, pool_seed)], settings) if farm is None else None
    try:
        leftover, notes = recover_leftovers(kernel, settings)
        if leftover is not None:
            return leftover
        spread = _Spread(jobs, max_examples, seed, pool_seed, warmup, start)
        merged = _run_jobs(kernel, settings, spread, notes, farm if own_farm is None else own_farm.handle,
                           on_progress)
    finally:
        if own_farm is not None:
            own_farm.close()
    if own_farm is not None:
        merged.farm = own_farm.summary()
    from nanfuzz.harness.campaign.runner import note_paths

    note_paths(merged, settings.state_dir)
    return merged


def _run_jobs(kernel, settings, spread: _Spread, notes, farm, on_progress=None):
    from nanfuzz.harness.campaign.result import Campaign
    from nanfuzz.harness.registry import import_path
    from nanfuzz.harness.judge.encodings import gpu_skips_for
    from nanfuzz.harness.launch.processes import fork_server_context

    # Not fork: a forked child of a process that used CUDA cannot use it.  Jobs come from the
    # workers' fork server, which has imported torch, Triton and the campaign runner but never
    # touched a GPU, so fourteen jobs start in milliseconds instead of importing torch each.
    context = fork_server_context()
    links = JobLinks(stop=context.Event(), interrupt=context.Event(), results=context.Queue(),
                     ready=context.Barrier(spread.jobs), listening=context.RawArray("b", spread.jobs),
                     examples=context.RawArray("q", spread.jobs), shrinking=context.RawArray("b", spread.jobs),
                     farm=farm, gpu_skips=gpu_skips_for(settings.device))
    processes = []
    done: dict[int, tuple] = {}
    died: list[int] = []
    interrupted = False
    try:
        for i, examples in enumerate(split(spread.max_examples, spread.jobs)):
            job_seed = None if spread.seed is None else spread.seed + i
            orders = JobOrders(i, import_path(kernel), job_settings(settings, examples, job_seed, kernel),
                               spread.pool_seed, spread.warmup, kernel.stands_in_for)
            processes.append(context.Process(target=_run_job, daemon=False, name=f"nanfuzz-job-{i}",
                                             args=(orders, links)))
            start_process(processes[-1])  # a stop meanwhile waits until the job runs, then stops it too
        _collect(processes, links, done, died, deadline=None, on_progress=on_progress)
    except KeyboardInterrupt:
        interrupted = True
        links.interrupt.set()
        links.ready.abort()
        _interrupt(processes, links.listening)  # a job deep in a long check stops now, as its own Ctrl-C would stop it
        try:
            _collect(processes, links, done, died, deadline=time.time() + _INTERRUPT_GRACE)
        except KeyboardInterrupt:
            pass
    finally:
        for p in processes:
            if p.pid is None:
                continue  # never started
            p.join(timeout=0 if interrupted else 60)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
                if interrupted:  # ended by the stop, not by its kernel: no case for the next run
                    journal.drop(settings.state_dir, kernel.name, p.pid)
    errors = [payload for payload, _ in done.values() if isinstance(payload, str) and payload != "interrupted"]
    finished = [v for v in done.values() if isinstance(v[0], Campaign)]
    if errors and not died and not any(c.failed for c, _ in finished):
        raise NanfuzzError(errors[0])
    measured_from = min((span[0] for _, span in finished), default=spread.start) if spread.warmup else spread.start
    merged = _merge(kernel.name, settings.device, finished, measured_from)
    merged.startup["started"] = spread.start  # its steps from the run's start, warm-ups included
    merged.seed = spread.seed  # job i searched with seed + i (unseeded: each its own random seed)
    if finished:
        merged.pool_seed, merged.pool_round = finished[0][0].pool_seed, finished[0][0].pool_round
    merged.notes = notes + merged.notes + [f"{kernel.name}: a job stopped: {error}" for error in dict.fromkeys(errors)]
    if interrupted:
        merged.interrupted = True
        merged.note_unreached()  # none for a run cut short
    if died and not merged.failed and not merged.interrupted:
        _recover_a_dead_job_s_case(kernel, settings, merged)
    if died and not merged.failed:
        from nanfuzz.harness.launch.processes import fork_server_end

        server = fork_server_end()
        why = f"; the fork server the jobs came from {server}" if server else ""
        raise NanfuzzError(f"kernel {kernel.name}: a job process died outside the kernel's launches "
                           f"(exit status {processes[died[0]].exitcode}{why}); run with --jobs 1 to see why")
    if not merged.interrupted:
        from nanfuzz.harness.campaign.runner import require_a_judged_case

        require_a_judged_case(merged)
    merged.elapsed = max((span[1] for _, span in finished), default=time.time()) - measured_from
    return merged


def _recover_a_dead_job_s_case(kernel, settings, merged) -> None:
    """A job that died left the case it was checking in its journal (a kernel that kills the process
    it runs under takes the job with it): replayed in a fresh worker, a case that fails again is the
    campaign's failure, as a dead campaign's case is the next run's (``harness.campaign.leftovers``)."""
    from nanfuzz.harness.campaign.leftovers import recover_leftovers

    leftover, notes = recover_leftovers(kernel, settings)
    merged.notes += notes
    if leftover is not None:
        merged.failure, merged.failing_case = leftover.failure, leftover.failing_case
        merged.recovered_crash = True


def job_settings(settings: Settings, examples: int, seed: int | None, kernel: Kernel) -> Settings:
    """One job's settings: a campaign of its own (``jobs=1``) among ``settings.jobs`` on the device,
    which it says (``campaigns_per_device``), so that it draws no case a campaign alone on the device
    may draw (a huge cache: ``scope.campaign_production_size``)."""
    from nanfuzz.harness.registry import kernel_sources

    return settings.replace(jobs=1, max_examples=examples, seed=seed,
                            campaigns_per_device=settings.campaigns_per_device * settings.jobs,
                            **kernel_sources(kernel, settings.sources))


def _interrupt(processes, listening) -> None:
    """Ctrl-C to every job still running whose handler is in place (a stop signal may have reached
    this process alone); a job not yet listening meets the interrupt event before its first example."""
    for i, p in enumerate(processes):
        if listening[i] and p.exitcode is None and p.pid is not None:
            try:
                os.kill(p.pid, signal.SIGINT)
            except ProcessLookupError:
                pass


def _collect(processes, links: JobLinks, done, died, deadline, on_progress=None) -> None:
    """Results until every job has answered or died (or ``deadline`` passes); ``on_progress`` is told
    the jobs' examples and whether one is shrinking on each turn of the loop."""
    def report() -> None:
        if on_progress is not None and any(links.examples):  # from the first example: start-up is not searching
            on_progress(sum(links.examples), any(links.shrinking))

    results = links.results
    while len(done) + len(died) < len(processes):
        if deadline is not None and time.time() >= deadline:
            return
        report()
        try:
            index, payload, span = results.get(timeout=0.2)
            done[index] = (payload, span)
            continue
        except queue.Empty:
            pass
        for i, p in enumerate(processes):
            # a job that exits without a result died: the campaign runner never lets a kernel kill it,
            # so this is the job process itself
            if i not in done and i not in died and p.exitcode is not None and results.empty() and _gone(p):
                died.append(i)
                links.stop.set()
                links.ready.abort()  # jobs still warming up must not wait for it
    report()  # every job's last count: each wrote it before its result


def _merge(kernel_name: str, device: str, results: list, start: float):
    from nanfuzz.harness.campaign.result import Campaign, add_known
    from nanfuzz.harness.campaign.stack_samples import summed

    merged = Campaign(kernel=kernel_name, device=device, busy_seconds=0.0)
    first_failure_at = None
    for campaign, (started, _) in results:
        merged.busy_seconds += campaign.elapsed
        merged.cpu_seconds += campaign.cpu_seconds
        merged.judging_cpu_seconds += campaign.judging_cpu_seconds
        merged.run_queue_seconds = add_known(merged.run_queue_seconds, campaign.run_queue_seconds)
        merged.examples += campaign.examples
        merged.notes += [note for note in campaign.notes if note not in merged.notes]  # each job says the same
        merged.worker_restarts += campaign.worker_restarts
        merged.deferred += campaign.deferred
        merged.left_at_budget_end += campaign.left_at_budget_end
        merged.declined_for_memory += campaign.declined_for_memory
        merged.stacks = summed(merged.stacks, campaign.stacks)
        merged.judging_out_of_memory += campaign.judging_out_of_memory
        merged.memory_waits += campaign.memory_waits
        merged.memory_wait_seconds += campaign.memory_wait_seconds
        merged.memory_wait_causes.update(campaign.memory_wait_causes)
        if campaign.past_budget is not None:
            merged.passed_budget(campaign.past_budget)
        if campaign.compiles is not None:
            merged.compiles = (merged.compiles or 0) + campaign.compiles
        if campaign.time_to_first_example is not None:
            first = started - start + campaign.time_to_first_example
            if merged.time_to_first_example is None or first < merged.time_to_first_example:
                merged.time_to_first_example = first
                # the earliest job's first examples, timed from the run's start
                merged.early_examples = [{**e, "at_s": round(started - start + e["at_s"], 3)}
                                         for e in campaign.early_examples]
        for step, at in campaign.startup.items():  # each step as soon as the first job took it
            if step != "started":
                merged.startup[step] = min(at, merged.startup.get(step, at))
        merged.statistics.merge(campaign.statistics)
        merged.accuracy.merge(campaign.accuracy)
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
    merged.interrupted = any(campaign.interrupted for campaign, _ in results)
    # over every job's draws, each in place of the jobs' own notes
    merged.note_declines()
    merged.note_unreached()
    merged.note_reads()
    merged.note_past_budget()
    merged.note_left_at_budget_end()
    return merged
