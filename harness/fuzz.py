"""The campaign runner: generate, check in a supervised worker, shrink, never lose a failure.

One runner serves the CLI, the self-check, ``--jobs`` (``harness.parallel``
runs it once per job process), the gate's shards, bench and the pytest
plugin.  Everything it is told comes in one ``Settings`` object.

A case goes to the journal before it goes to the subject (a worker process,
``harness.worker``), so even a campaign process killed outright leaves its
case behind for the next run to replay.  Every failing case Hypothesis
meets is remembered as it is met, so a failure survives whatever ends the
search: a flaky replay, Hypothesis giving up, a shrink that runs out of
time, Ctrl-C.  With an example database (``harness.example_db``), the
kernel's known failures (``harness.known_failures``) run before the search,
and a failure found is kept there for every later campaign.
"""
from __future__ import annotations

import hashlib
import random
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from hypothesis import HealthCheck, Phase, given, seed as hypothesis_seed, settings as hypothesis_settings
from hypothesis.errors import HypothesisException

from nanfuzz.harness import known_failures
from nanfuzz.harness import encodings
from nanfuzz.harness.check import Outcome, Verdict
from nanfuzz.harness.deferrals import Deferrals, FoundLate, Replay
from nanfuzz.harness.journal import Journal, leftovers
from nanfuzz.harness.kernel import Kernel
from nanfuzz.harness.profiles import Profile, get_profile
from nanfuzz.harness.settings import Settings
from nanfuzz.harness.accuracy import Accuracy
from nanfuzz.harness.statistics import Statistics
from nanfuzz.harness.precompile import Farm, FarmHandle, Plan, default_processes
from nanfuzz.harness.processes import fork_server_context
from nanfuzz.harness.upcoming import UPCOMING_CASES, upcoming_cases
from nanfuzz.harness.worker import CLAIMED, UNBUILT, Deferred, InProcess, Supervised, WorkerSpec
from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.case import Case
from nanfuzz.reference.errors import NanfuzzError
from nanfuzz.strategies import STRATEGY_VERSION, paged_cases
from nanfuzz.strategies.cases import campaign_pool

# Examples per Hypothesis run when a campaign is bounded by wall time: the
# first run is short (nothing is timed yet), later runs fill this share of the
# time left, so they shrink geometrically toward the deadline and the last
# overshoots it by about one example.
_CHUNK = 250
_FIRST_CHUNK = {"cpu": 2, "cuda": 32}
_CHUNK_SHARE = 0.5
# Shrinking stops after this long and reports the smallest failing case so far:
# a HANG costs a launch timeout per candidate, and a gate must finish.
DEFAULT_SHRINK_BUDGET = 600.0
# The first examples of a campaign whose timing it keeps (``Campaign.early_examples``): as many
# as it draws in advance for the compile farm (``harness.upcoming``).
EARLY_EXAMPLES = UPCOMING_CASES
# How often the end of a Hypothesis run looks whether the binaries of the cases it put off have landed.
_LANDING_POLL = 0.01


class KernelFailed(Exception):
    """Raised inside the property so that Hypothesis shrinks the case."""

    def __init__(self, outcome: Outcome, case: Case):
        super().__init__(outcome.summary)
        self.outcome = outcome
        self.case = case


class StopRequested(KeyboardInterrupt):
    """Ends a campaign between examples (a sibling job found a failure, the shrink budget ran out).

    A KeyboardInterrupt to Hypothesis, so that it stops without shrinking
    further, reporting or saving the unfinished example to the database.
    """


class _Aborted(KeyboardInterrupt):
    """Carries a usage or configuration error (NanfuzzError) out of Hypothesis, which would
    otherwise take it for a failure of the kernel and try to shrink it."""

    def __init__(self, error: NanfuzzError):
        super().__init__(str(error))
        self.error = error


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
    notes: list[str] = field(default_factory=list)  # one line each, for the user
    statistics: Statistics = field(default_factory=Statistics)  # what the generated cases exercised
    accuracy: Accuracy = field(default_factory=Accuracy)        # how close passing outputs came to the bound
    interrupted: bool = False
    worker_restarts: int = 0
    time_to_first_example: float | None = None  # seconds from the start to the first example judged
    # where a cold start's time goes, example by example (``EARLY_EXAMPLES`` of them): see ``note_early``
    early_examples: list[dict] = field(default_factory=list)
    compiles: int | None = None   # kernel specialisations the campaign's workers compiled or loaded (GPU)
    deferred: int = 0             # checks put off while a binary they needed compiled elsewhere (GPU)
    farm: dict | None = None      # what its own compile farm did (Farm.summary())
    # CPU seconds: the campaign's own process (judging included where the kernel runs in it), and the
    # judging of its examples wherever it ran; against elapsed time they show a busy or a waiting host
    cpu_seconds: float = 0.0
    judging_cpu_seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return self.failure is not None

    def note_early(self, outcome: Outcome, started: float, seconds: float) -> None:
        """One of the campaign's first examples: when its check started (seconds from the campaign's
        start), how long it took, how much of that it waited for a binary another process was
        compiling, and how much its worker spent compiling (or loading) binaries itself."""
        if len(self.early_examples) < EARLY_EXAMPLES:
            self.early_examples.append({
                "at_s": round(started, 3), "seconds": round(seconds, 3),
                "farm_wait_s": round(outcome.timings.get("compile", 0.0), 3),
                "compiled_s": round(outcome.compiled_seconds, 3), "verdict": outcome.verdict.value})

    def count(self, outcome: Outcome) -> None:
        self.examples += 1
        self.judging_cpu_seconds += outcome.cpu_seconds
        self.verdicts[outcome.verdict.value] = self.verdicts.get(outcome.verdict.value, 0) + 1
        for phase, seconds in outcome.timings.items():
            self.phase_times[phase] = self.phase_times.get(phase, 0.0) + seconds


def make_subject(kernel: Kernel, settings: Settings, prefer_fork: bool = False):
    """The kernel behind a supervised worker, or in this process with ``isolation=False``.

    A worker rebuilds the kernel from its import path; a Kernel made on the
    fly in the caller's code has none, and runs in this process instead.
    ``prefer_fork``: see ``Supervised``.
    """
    return subject_for(kernel, settings, worker_spec(kernel, settings) if settings.isolation else None, prefer_fork)


def subject_for(kernel: Kernel, settings: Settings, spec: WorkerSpec | None, prefer_fork: bool = False,
                device_opened=None):
    """``make_subject`` for a caller that has ``kernel``'s ``worker_spec`` already (None: in this process)."""
    if spec is None or not settings.isolation:
        return InProcess(kernel, settings.device)
    return Supervised(spec, launch_timeout=settings.timeout, prefer_fork=prefer_fork, device_opened=device_opened)


def worker_spec(kernel: Kernel, settings: Settings) -> WorkerSpec | None:
    """How another process loads ``kernel`` (None for a Kernel made on the fly, which has no import path)."""
    if not reachable_by_path(kernel):
        return None
    from nanfuzz.harness.registry import import_path, kernel_sources

    return WorkerSpec(kernel=import_path(kernel), device=settings.device, cuda_index=settings.cuda_index,
                      **kernel_sources(kernel, settings.sources))


def campaign_capabilities(kernel: Kernel, settings: Settings) -> tuple[Capabilities, list[str]]:
    """What the campaign draws cases under (the kernel's capabilities, its focus, what the
    device's Triton runs), and a note for each KV-cache encoding left out."""
    interpreter = settings.device == "cpu"
    caps = settings.focus.apply(kernel.capabilities, kernel.name)
    if interpreter and not caps.runnable_dtypes(interpreter=True):
        raise NanfuzzError(f"kernel {kernel.name}: no dtype of {', '.join(caps.dtypes)} runs under Triton's interpreter; "
                           "use --device cuda")
    caps, skipped = encodings.runnable(caps, settings.device)
    if not caps.kv_cache_dtypes and not caps.token_head_dtypes:
        raise NanfuzzError(f"kernel {kernel.name}: no KV cache it takes runs here ({'; '.join(skipped)})")
    return caps, skipped


def campaign_pool_of(caps: Capabilities, settings: Settings, pool_seed: int | None = None) -> tuple[tuple | None, int]:
    """The campaign's specialisation pool (None: free draws) and the seed that picked it."""
    interpreter = settings.device == "cpu"
    pool_size = settings.pool_size
    if pool_size is None:
        # the kernel's own pool is for compiles, and under the interpreter nothing compiles
        pool_size = 0 if interpreter else (caps.specialisation_pool or 0)
    pool_seed = pool_seed if pool_seed is not None else (settings.seed or 0)
    return (campaign_pool(caps, pool_size, pool_seed, interpreter=interpreter) if pool_size else None), pool_seed


def compile_plan(kernel: Kernel, settings: Settings, pool_seed: int | None = None) -> Plan | None:
    """What a compile farm (``harness.precompile``) builds ahead of ``kernel``'s campaign:
    None under the interpreter, without a pool, or for a kernel no other process can load."""
    if settings.device == "cpu" or settings.compile_jobs == 0:
        return None
    try:
        caps, _ = campaign_capabilities(kernel, settings)
    except NanfuzzError:
        return None  # the campaign itself says why
    pool, _ = campaign_pool_of(caps, settings, pool_seed)
    return _plan(worker_spec(kernel, settings) if pool else None, caps, pool, settings)


def _plan(spec: WorkerSpec | None, caps: Capabilities, pool, settings: Settings) -> Plan | None:
    if settings.device == "cpu" or settings.compile_jobs == 0 or not pool or spec is None:
        return None
    return Plan(spec, caps, settings.focus.poison_classes, pool)


def start_farm(plans: list[Plan | None], settings: Settings, after=None) -> Farm | None:
    """A compile farm for the plans there are (None when there is none); ``after``: see ``Farm``."""
    plans = [p for p in plans if p is not None]
    if not plans:
        return None
    return Farm(plans, settings.compile_jobs or default_processes(), after=after)


def reachable_by_path(kernel: Kernel) -> bool:
    """Does resolving the kernel's import path in a fresh process give this kernel's code?"""
    from nanfuzz.harness.registry import import_path, kernel_sources, resolve

    try:
        again = resolve(import_path(kernel), **kernel_sources(kernel))
    except NanfuzzError:
        return False
    return again.name == kernel.name and _code(again.run) == _code(kernel.run)


def _code(run) -> tuple:
    """What a run function is, across two resolutions (each may build its own partial or closure)."""
    run = getattr(run, "func", run)  # functools.partial
    return getattr(run, "__module__", None), getattr(run, "__qualname__", None), getattr(run, "__code__", None)


def recover_leftovers(kernel: Kernel, settings: Settings, subject=None) -> tuple[Campaign | None, list[str]]:
    """Cases that campaigns which died unobserved left in flight, replayed before anything else.

    A leftover that crashes or hangs again is the campaign's failure; one that
    does not is a note, never a verdict (the process may have died of a signal
    from outside).  Returns the failure, if any, and the notes.  Without a
    ``subject``, one is started only if there is a leftover to replay.
    """
    cases = leftovers(settings.state_dir, kernel.name)
    if cases and subject is None:
        subject = make_subject(kernel, settings)
        try:
            return _replay_leftovers(kernel, settings, subject, cases)
        finally:
            subject.close()
    return _replay_leftovers(kernel, settings, subject, cases)


def _replay_leftovers(kernel, settings, subject, cases) -> tuple[Campaign | None, list[str]]:
    notes: list[str] = []
    for case in cases:
        outcome = subject.check(case, digest=True)
        if outcome.verdict in (Verdict.CRASH, Verdict.HANG):
            notes.append(f"{kernel.name}: a campaign process died while running this case earlier; "
                         f"replayed in a fresh worker it gives {outcome.verdict.value}")
            return Campaign(kernel=kernel.name, device=settings.device, failure=outcome, failing_case=case,
                            recovered_crash=True, notes=notes), notes
        notes.append(f"{kernel.name}: a campaign process died while running a case earlier; replayed in a fresh "
                     f"worker it gives {outcome.verdict.value}, so the death was not this kernel's doing (no verdict)")
    return None, notes


class _FarmWait:
    """Before a case: wait while the compile farm still builds its entry (time kept as the "compile" phase)."""

    def __init__(self, farm: FarmHandle | None, kernel: Kernel):
        from nanfuzz.harness.registry import import_path

        self.farm = farm
        self.kernel = import_path(kernel) if farm is not None else None  # what the farm's plan names it by

    def farm_running(self) -> bool:
        if self.farm is not None and not self.farm.running():
            self.farm = None  # done for good (the entries it held are built or given up): no more looks
        return self.farm is not None

    def __call__(self, case: Case, campaign: Campaign) -> None:
        if self.farm is None:
            return
        waited = self.farm.wait_for(self.kernel, case)
        if waited:
            campaign.phase_times["compile"] = campaign.phase_times.get("compile", 0.0) + waited


def fuzz(kernel: Kernel, settings: Settings | None = None, *, on_example: Callable[[Campaign], None] | None = None,
         should_stop: Callable[[], bool] | None = None, interrupted: Callable[[], bool] | None = None,
         pool_seed: int | None = None, subject=None, check_leftovers: bool = True,
         shrink_budget: float = DEFAULT_SHRINK_BUDGET, farm: FarmHandle | None = None, **overrides) -> Campaign:
    """Run a campaign; the result holds the shrunk failure, if any (repros are the caller's job).

    ``settings`` fields may be overridden by keyword (``device=``, ``max_examples=``, ...).
    ``should_stop`` is asked before each example while no failure is found
    (a sibling job found one); ``interrupted`` before every example, shrinking
    included (stop now, keep the smallest failure so far).  ``pool_seed``
    picks the specialisation pool (default: the seed, else 0).  ``farm``: the
    compile farm of a caller that started one for this campaign (jobs, the
    self-check); otherwise a GPU campaign with a pool starts its own.
    """
    settings = (settings or Settings()).replace(**overrides) if overrides else (settings or Settings())
    profile = get_profile(settings.profile) if not isinstance(settings.profile, Profile) else settings.profile
    device = settings.device
    interpreter = device == "cpu"
    caps, skipped = campaign_capabilities(kernel, settings)
    pool, pool_seed = campaign_pool_of(caps, settings, pool_seed)
    max_examples = settings.max_examples or profile.max_examples
    time_budget = settings.time_budget if settings.time_budget is not None else profile.time_budget
    use_database = settings.use_database
    if use_database is None:  # an example database named explicitly is one to use
        use_database = bool(settings.example_db) or profile.use_database
    campaign = Campaign(kernel=kernel.name, device=device)
    campaign.notes += [f"{kernel.name}: {note}" for note in skipped]
    start, cpu_start = time.perf_counter(), time.process_time()

    own_subject = subject is None
    farm_needed = farm is None and own_subject and bool(pool)
    # one look-up of how another process loads the kernel, for the worker and the farm both
    spec = worker_spec(kernel, settings) if (own_subject and settings.isolation) or farm_needed else None
    own_farm = None
    seeded = search_seed(settings, profile)
    plan = _plan(spec, caps, pool, settings) if farm_needed else None
    # the farm opens its GPU contexts after the worker's: sixteen at once take seconds each
    device_opened = fork_server_context().Event() if plan is not None and settings.isolation else None
    try:
        if own_subject:  # the worker first: the campaign waits for it, the farm works ahead
            subject = subject_for(kernel, settings, spec, device_opened=device_opened)
        if plan is not None:  # which compiles the search's first cases first, in the order it meets them
            plan = replace(plan, upcoming=upcoming_cases(campaign_strategy(caps, settings, pool), chunk_seed(seeded, 0),
                                                         first_chunk(max_examples, time_budget, device), UPCOMING_CASES))
            own_farm = start_farm([plan], settings, after=device_opened)
            farm = own_farm.handle if own_farm else None
        waiting = _FarmWait(farm, kernel)
        if check_leftovers:
            leftover, notes = recover_leftovers(kernel, settings, subject)
            campaign.notes += notes
            if leftover is not None:
                return leftover
        database = _database(settings, campaign) if use_database else None
        known_key = known_failures.key(kernel.name, device, settings.focus.label())
        with Journal(settings.state_dir, kernel.name) as journal:
            if journal.note:
                campaign.notes.append(journal.note)
            if database is None or not _replay_known(kernel, caps, campaign, subject, journal, database, known_key,
                                                     interpreter, start, on_example):
                _search(kernel, settings, profile, caps, campaign, subject, journal, start, max_examples, time_budget,
                        database, pool, pool_seed, on_example, should_stop, interrupted, shrink_budget, waiting,
                        search_seed=seeded)
        if database is not None and campaign.failed:
            known_failures.remember(database, known_key, campaign.failing_case)
        if campaign.failed and settings.replays and not campaign.interrupted:
            _replay_found(campaign, subject, settings.replays)
    finally:
        if own_subject and subject is not None:
            campaign.worker_restarts = getattr(subject, "restarts", 0)
            campaign.compiles = getattr(subject, "specialisations", None)
            subject.close()
        if own_farm is not None:
            own_farm.close()
            campaign.farm = own_farm.summary()
    campaign.elapsed = time.perf_counter() - start
    campaign.cpu_seconds = time.process_time() - cpu_start
    if campaign.failure is not None and campaign.time_to_first_failure is not None:
        campaign.shrink_time = campaign.elapsed - campaign.time_to_first_failure
    return campaign


def _replay_known(kernel, caps, campaign, subject, journal, database, key, interpreter, start, on_example) -> bool:
    """Replay the kernel's known failures (see ``harness.known_failures``) before any search.

    True when one fails again: it is the campaign's failure, shrunk when it was found."""
    for raw, case in known_failures.known(database, key):
        if caps.unsupported(case, interpreter=interpreter):
            continue  # the kernel's capabilities changed since; the entry may still matter elsewhere
        journal.record(case)
        outcome = subject.check(case)
        journal.clear()
        campaign.count(outcome)
        campaign.statistics.add(case)
        campaign.accuracy.add(outcome.evidence)
        if on_example is not None:
            on_example(campaign)
        if outcome.failed:
            campaign.failure, campaign.failing_case = outcome, case
            campaign.time_to_first_failure = time.perf_counter() - start
            campaign.examples_to_first_failure = campaign.examples
            campaign.notes.append(f"{kernel.name}: a known failure from the example database fails again")
            return True
        known_failures.forget(database, key, raw)
    return False


def database_label(kernel_name: str, device: str, focus_label: str, caps, pool, pool_seed: int) -> str:
    """What a stored choice sequence means a case under; Hypothesis hashes it into the database key,
    so entries of another kernel, device, focus, strategy version, capabilities or pool never replay."""
    caps_id = hashlib.sha256(repr(caps).encode()).hexdigest()[:12]
    return (f"nanfuzz:{kernel_name}:{device}:{focus_label}:strategies-v{STRATEGY_VERSION}:caps-{caps_id}"
            + (f":pool{len(pool)}/{pool_seed}" if pool else ""))


def campaign_strategy(caps: Capabilities, settings: Settings, pool):
    """What the campaign's search draws its cases from (and ``harness.upcoming`` draws ahead)."""
    return paged_cases(caps, interpreter=settings.device == "cpu", poison_classes=settings.focus.poison_classes,
                       pool=pool)


def search_seed(settings: Settings, profile: Profile) -> int:
    """The Hypothesis seed of a campaign's chunks (``chunk_seed``): the campaign's seed; 0 under
    a derandomized profile; else a fresh random one, so that no two unseeded campaigns (the
    jobs of one run among them) draw the same later chunks."""
    if settings.seed is not None:
        return settings.seed
    return 0 if profile.derandomize else random.SystemRandom().randrange(2 ** 32)


def chunk_seed(search_seed: int, chunk_index: int) -> int:
    return search_seed * 1_000_003 + chunk_index


def first_chunk(max_examples: int, time_budget: float | None, device: str) -> int:
    """How many examples the campaign's first Hypothesis run may draw (later ones fit the time left)."""
    return max_examples if time_budget is None else max(1, min(max_examples, _CHUNK, _FIRST_CHUNK[device]))


def _search(kernel, settings, profile, caps, campaign, subject, journal, start, max_examples, time_budget,
            database, pool, pool_seed, on_example, should_stop, interrupted, shrink_budget, waiting, *,
            search_seed: int) -> None:
    """Hypothesis runs until the examples or the time are spent, or a failure is shrunk."""
    device = settings.device
    seen: dict = {}  # "first": (outcome, case); "best": the latest failure of the first's verdict
    defers = getattr(subject, "defers", False)  # can its worker put off a case whose binary compiles elsewhere?
    farm_running = waiting.farm_running
    deferrals = Deferrals()
    judged: dict[Case, Outcome] = {}  # this Hypothesis run's outcomes, for a replay up to a late failure
    replay: Replay | None = None      # the replay under way, if any

    def deferring() -> str | None:
        """What a check may put off now (``worker.CLAIMED``, ``UNBUILT``): nothing once a failure is found."""
        if not defers or "first" in seen:
            return None
        return UNBUILT if farm_running() else CLAIMED

    def judge(case: Case, defer: str | None) -> Outcome | None:
        """Check one case and count it; None when the worker put it off (``harness.deferrals``)."""
        journal.record(case)
        checked = time.perf_counter()
        try:
            outcome = subject.check(case, defer=defer) if defer else subject.check(case)
        except NanfuzzError as exc:
            raise _Aborted(exc) from None
        journal.clear()
        if isinstance(outcome, Deferred):
            deferrals.add(case, outcome.skipped)
            return None
        campaign.note_early(outcome, checked - start, time.perf_counter() - checked)
        campaign.count(outcome)
        if campaign.time_to_first_example is None:
            campaign.time_to_first_example = time.perf_counter() - start
        campaign.statistics.add(case)
        campaign.accuracy.add(outcome.evidence)
        if outcome.failed:
            if "first" not in seen:
                campaign.time_to_first_failure = time.perf_counter() - start
                campaign.examples_to_first_failure = campaign.examples
                seen["first"] = seen["best"] = (outcome, case)
            elif outcome.verdict is seen["first"][0].verdict:
                seen["best"] = (outcome, case)
        if "first" not in seen:
            judged[case] = outcome
        if on_example is not None:
            on_example(campaign)
        return outcome

    def stop_if_asked() -> None:
        if interrupted is not None and interrupted():
            raise StopRequested()
        if "first" not in seen and should_stop is not None and should_stop():
            raise StopRequested()

    def judge_late(case: Case, defer: str | None) -> None:
        """Check a case put off earlier; a failure ends the run (``FoundLate``)."""
        stop_if_asked()
        outcome = judge(case, defer)
        if outcome is not None and outcome.failed:
            raise FoundLate(case, outcome)

    def check_landed() -> None:
        """The put-off cases whose binaries have landed, checked now (one whose compile failed in
        another process, compiling it here)."""
        for case, built in deferrals.landed(farm_running()):
            judge_late(case, deferring() if built else CLAIMED)

    def check_remaining() -> None:
        """The run is over: every case still put off is checked as soon as its binaries land, and
        once no farm runs, each in turn, waiting for whatever another process still compiles."""
        while deferrals:
            stop_if_asked()
            if farm_running():
                check_landed()
                time.sleep(_LANDING_POLL)
                continue
            for case in deferrals.remaining():
                judge_late(case, None)

    def run_case(case: Case) -> None:
        stop_if_asked()
        if "first" in seen and time.perf_counter() - start - campaign.time_to_first_failure > shrink_budget:
            campaign.notes.append(f"{kernel.name}: shrinking stopped after {shrink_budget:.0f} s; "
                                  "the repro is the smallest failing case found by then")
            raise StopRequested()
        if replay is not None:
            known = replay.known(case)
            if known is not None:
                if known.failed:
                    raise _FAILURE_TYPES[known.verdict](known, case)
                return
            if replay.passes_over(case):
                return
        if deferrals and "first" not in seen:  # after a failure, cases put off no longer matter
            check_landed()
        waiting(case, campaign)
        outcome = judge(case, deferring())
        if outcome is not None and outcome.failed:
            raise _FAILURE_TYPES[outcome.verdict](outcome, case)

    strategy = campaign_strategy(caps, settings, pool)
    phases = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target] + ([Phase.shrink] if settings.shrink else [])

    def hypothesis_run(size: int, chunk_index: int):
        property_ = given(case=strategy)(lambda case: run_case(case))
        property_.hypothesis.inner_test._hypothesis_internal_add_digest = database_label(
            kernel.name, device, settings.focus.label(), caps, pool, pool_seed).encode()
        property_ = hypothesis_seed(chunk_seed(search_seed, chunk_index))(property_)
        # settings after @seed: @seed alone would switch the example database off
        return hypothesis_settings(
            max_examples=size, deadline=None, database=database, phases=phases, report_multiple_bugs=False,
            suppress_health_check=list(HealthCheck), print_blob=False)(property_)

    remaining = max_examples
    chunk_index = 0
    while remaining > 0:
        elapsed = time.perf_counter() - start
        if time_budget is not None and elapsed >= time_budget and campaign.examples:
            break  # at least one example, however late: a campaign that tried nothing is no pass
        if not campaign.examples:
            size = first_chunk(remaining, time_budget, device)
        elif time_budget is None:
            size = remaining
        else:  # a share of the time left, at the pace so far
            per_example = elapsed / campaign.examples
            size = max(1, min(remaining, _CHUNK, int(_CHUNK_SHARE * (time_budget - elapsed) / max(per_example, 1e-6))))
        before = campaign.examples
        judged.clear()
        try:
            while True:
                try:
                    hypothesis_run(size, chunk_index)()
                    if replay is None:
                        check_remaining()
                    break
                except FoundLate as late:  # draw the run again, up to the late failure, for Hypothesis to shrink
                    replay = Replay(late, judged, deferrals.remaining())
        except KernelFailed as failure:
            campaign.failure, campaign.failing_case = failure.outcome, failure.case
            return
        except _Aborted as aborted:
            raise aborted.error from None
        except StopRequested:
            if interrupted is not None and interrupted():
                campaign.interrupted = True
            break
        except KeyboardInterrupt:
            campaign.interrupted = True
            break
        except HypothesisException as exc:
            # e.g. a failure that did not repeat when Hypothesis replayed it (Flaky)
            if "first" not in seen:
                raise NanfuzzError(f"kernel {kernel.name}: Hypothesis stopped the campaign: {exc}".splitlines()[0]) from None
            campaign.notes.append(f"{kernel.name}: Hypothesis stopped shrinking ({type(exc).__name__}): the failure "
                                  "did not repeat on every run; the repro is the last failing case seen")
            break
        finally:
            campaign.deferred = deferrals.count
        if replay is not None:  # the run drawn again never met the late failure: it stands unshrunk
            campaign.notes.append(f"{kernel.name}: the failure was found while its binary compiled, out of order, and "
                                  "Hypothesis did not draw it again; the repro is the failing case as found, unshrunk")
            break
        remaining -= max(1, campaign.examples - before)
        chunk_index += 1
    if "best" in seen:
        campaign.failure, campaign.failing_case = seen["best"]


def _database(settings: Settings, campaign: Campaign):
    from nanfuzz.harness.example_db import open_database

    return open_database(settings.example_db, settings.examples_path, campaign.notes.append)


def _replay_found(campaign: Campaign, subject, replays: int) -> None:
    """Run the reported case again in the subject: how often does it repeat, bit for bit?"""
    outcome = campaign.failure
    runs = 1 if outcome.verdict is Verdict.HANG else replays  # each HANG replay costs a whole timeout
    repeated = 0
    digests = set()
    final = None
    for n in range(runs):
        again = subject.check(campaign.failing_case, digest=True, explain=n == 0)
        if again.verdict is outcome.verdict:
            repeated += 1
            final = final or again
            if again.output_sha256:
                digests.add(again.output_sha256)
    if final is not None:
        final.evidence = {**final.evidence, "repeated": f"{repeated}/{runs}"}
        campaign.failure = final
    else:
        outcome.evidence = {**outcome.evidence, "repeated": f"0/{runs}"}
    if repeated < runs:
        campaign.notes.append(f"{campaign.kernel}: the reported {outcome.verdict.value} repeated on {repeated} of "
                              f"{runs} replays in a fresh run: a flaky or nondeterministic failure")
    if len(digests) > 1:
        campaign.notes.append(f"{campaign.kernel}: replays of the failing case gave {len(digests)} different outputs")
