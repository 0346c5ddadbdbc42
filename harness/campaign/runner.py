"""The campaign runner: generate, check in a supervised worker, shrink, never lose a failure.

One runner serves the CLI, the self-check, ``--jobs`` (``harness.campaign.jobs``
runs it once per job process), the gate's shards, bench and the pytest
plugin.  Everything it is told comes in one ``Settings`` object; how a caller
watches and steers it comes in ``Hooks``.

A campaign is a ``CampaignRunner`` whose stages are its methods: prepare (the
worker, the compile farm), recover the cases dead campaigns left, replay the
kernel's known failures, search (``harness.campaign.search``), remember the
failure, confirm it by replays, and summarise.  A case goes to the journal
before it goes to the subject (a worker process, ``harness.launch.worker``), so
even a campaign process killed outright leaves its case behind for the next
run to replay.  With an example database (``harness.campaign.example_db``), the
kernel's known failures (``harness.campaign.known_failures``) run before the
search, and a failure found is kept there for every later campaign.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from typing import Callable

from nanfuzz.harness.campaign import known_failures, paths_seen, reach
from nanfuzz.harness.campaign.accepted_entry import entry_it_takes
from nanfuzz.harness.campaign.capability_hint import name_the_capability
from nanfuzz.harness.campaign.expired_blocks import drop_expired_blocks
from nanfuzz.harness.campaign.hypothesis_home import hypothesis_files_in
from nanfuzz.harness.campaign.journal import Journal
from nanfuzz.harness.campaign.leftovers import recover_leftovers
from nanfuzz.harness.campaign.one_sequence import cut_to_one_sequence
from nanfuzz.harness.campaign.profiles import Profile, get_profile
from nanfuzz.harness.campaign.result import Campaign
from nanfuzz.harness.campaign.scope import (campaign_capabilities, campaign_pool_of, campaign_strategy,
                                            campaign_targets, campaign_tier, plan_for, start_farm)
from nanfuzz.harness.campaign.search import Search, chunk_seed, first_chunk, search_seed, spend
from nanfuzz.harness.campaign.stack_samples import sampling_this_thread
from nanfuzz.harness.campaign.settings import Settings
from nanfuzz.harness.campaign.upcoming import UPCOMING_CASES, upcoming_cases
from nanfuzz.harness.judge import reads
from nanfuzz.harness.judge.check import Verdict
from nanfuzz.harness.judge.outcome import Outcome
from nanfuzz.harness.report.statistics import Statistics
from nanfuzz.harness.kernel import Kernel
from nanfuzz.harness.launch.farm import SAMPLES_PER_ENTRY, FarmHandle, FinishedTasks, Plan
from nanfuzz.harness.launch.processes import fork_server_context, run_queue_seconds
from nanfuzz.harness.launch.subjects import subject_for, worker_spec
from nanfuzz.harness.launch.worker import Declined
from nanfuzz.reference.case import Case
from nanfuzz.reference.errors import NanfuzzError


@dataclass(frozen=True)
class Hooks:
    """How a caller watches and steers a campaign.  ``on_example`` is told after every example;
    ``should_stop`` is asked before each example while no failure is found (a sibling job found
    one); ``interrupted`` before every example, shrinking included (stop now, keep the smallest
    failure so far)."""

    on_example: Callable[[Campaign], None] | None = None
    should_stop: Callable[[], bool] | None = None
    interrupted: Callable[[], bool] | None = None


class _FarmWait:
    """Before a case: wait while the compile farm still builds its entry (time kept as the "compile" phase)."""

    def __init__(self, farm: FarmHandle | None, kernel: Kernel):
        from nanfuzz.harness.registry import import_path

        self.farm = farm
        self.kernel = import_path(kernel) if farm is not None else None  # what the farm's plan names it by
        self._tasks = FinishedTasks(farm.folder) if farm is not None else None

    def farm_running(self) -> bool:
        if self.farm is not None and not self.farm.running():
            self.farm = None  # done for good (the entries it held are built or given up): no more looks
        return self.farm is not None

    def slowest_task(self) -> float:
        """The longest compile task the farm has finished, its memory wait left out (seconds; 0
        without a farm: ``FinishedTasks``)."""
        return self._tasks.slowest() if self._tasks is not None else 0.0

    def unbuilt(self, case: Case) -> tuple[str, str] | None:
        """While the farm runs and has built nothing of ``case``'s entry: the markers its first task of
        that entry leaves when done and while stuck (``FarmHandle.unbuilt``)."""
        return self.farm.unbuilt(self.kernel, case) if self.farm_running() else None

    def stuck_marker(self, case: Case) -> str | None:
        """While the farm runs: the ``stuck`` marker of its first task of ``case``'s entry not done yet
        (``FarmHandle.stuck_marker``)."""
        return self.farm.stuck_marker(self.kernel, case) if self.farm_running() else None

    def __call__(self, case: Case, campaign: Campaign) -> None:
        if self.farm is None:
            return
        waited = self.farm.wait_for(self.kernel, case)
        if waited:
            campaign.phase_times["compile"] = campaign.phase_times.get("compile", 0.0) + waited


# Between looks, while a campaign waits for its first cases to be drawn, at whether its run is still there.
_FIRST_CASES_LOOK = 0.5

# The shortest wait for memory a drawn case gets, however little of the budget is left: other
# processes give back what they hold within a second of a want.
_LEAST_WAIT = 5.0


def require_a_judged_case(campaign: Campaign) -> None:
    """A campaign that judged nothing because its every case was declined for memory passes
    nothing: one line and exit 2, never a silent pass."""
    if campaign.declined_for_memory and not campaign.examples and not campaign.failed:
        raise NanfuzzError(f"kernel {campaign.kernel}: every case drawn ({campaign.declined_for_memory}) was declined "
                           "for memory, so nothing was judged; see the note above, or run where the device has room")


def worker_start_steps(subject) -> dict[str, float]:
    """When ``subject``'s first worker's main began, had loaded the kernel and was ready (the wall
    clock), named as start steps (``worker_began``...); empty for a subject without a worker."""
    return {f"worker_{step}": at for step, at in (getattr(subject, "ready_times", None) or {}).items()}


def note_worker_start(campaign: Campaign, subject) -> None:
    """``subject``'s worker's start steps, in the campaign's."""
    campaign.startup.update(worker_start_steps(subject))


def note_paths(campaign: Campaign, state_dir) -> None:
    """The kernel paths earlier campaigns reached and this one did not, kept on the campaign and noted."""
    if not campaign.examples or campaign.interrupted:
        return
    campaign.paths_missed = paths_seen.remember(state_dir, campaign.kernel, campaign.statistics.paths())
    if campaign.paths_missed:
        campaign.notes.append(f"{campaign.kernel}: Triton kernels earlier campaigns launched and this one never did: "
                              + ", ".join(campaign.paths_missed))


def fuzz(kernel: Kernel, settings: Settings | None = None, *, hooks: Hooks | None = None, subject=None,
         farm: FarmHandle | None = None, search_seed: int | None = None, start_after=None,
         prefer_fork: bool = False, **overrides) -> Campaign:
    """Run a campaign; the result holds the shrunk failure, if any (repros are the caller's job).

    ``settings`` fields may be overridden by keyword (``device=``, ``max_examples=``, ...).
    ``subject``: a worker the caller keeps between campaigns (jobs, bench); ``farm``: the compile
    farm of a caller that started one for this campaign (jobs, the self-check); otherwise a GPU
    campaign with a pool starts its own.  ``search_seed``: the seed of its search, where the caller
    picked it to draw the first cases ahead (``CampaignRunner.first_cases``).  ``start_after``: an
    event set once they are drawn and sent to the farm; the campaign starts its worker meanwhile,
    and its search waits for it (``harness.campaign.compile_ahead``).  ``prefer_fork``: the caller's
    process is fresh from the fork server and runs no torch op itself (``Supervised``).
    """
    settings = settings or Settings()
    if overrides:
        settings = settings.replace(**overrides)
    return CampaignRunner(kernel, settings, hooks or Hooks(), subject, farm, search_seed, start_after,
                          prefer_fork).run()


class CampaignRunner:
    """One campaign against one kernel: what it is, once, and its stages as methods."""

    def __init__(self, kernel: Kernel, settings: Settings, hooks: Hooks, subject=None, farm: FarmHandle | None = None,
                 seed: int | None = None, start_after=None, prefer_fork: bool = False):
        self.kernel, self.settings, self.hooks = kernel, settings, hooks
        self.profile = settings.profile if isinstance(settings.profile, Profile) else get_profile(settings.profile)
        self.caps, skipped = campaign_capabilities(kernel, settings)
        self.tier = campaign_tier(kernel, settings)
        self.pool, self.pool_seed = campaign_pool_of(self.caps, settings, tier=self.tier)
        # how often the pool grew, and the examples run and the clock when it last did (or the campaign began)
        self.pool_growth, self._grown_at, self._grown_when = 0, 0, time.perf_counter()
        # targets the kernel kept declining: looked at once each (``add_entries_it_takes``), the entries
        # the pool took for them, and each such target's declines before it did
        self._looked_at: set[str] = set()
        self._taken: tuple = ()
        self._forgiven: dict[str, int] = {}
        self.targets = campaign_targets(self.caps, settings, self.pool, self.tier)
        self.max_examples = settings.max_examples or self.profile.max_examples
        self.time_budget = settings.time_budget if settings.time_budget is not None else self.profile.time_budget
        self.search_seed = search_seed(settings, self.profile) if seed is None else seed
        # a failure's checks (shrinking, replays) wait for memory as a drawn case does, however little
        # of the time budget is left: each that gets none leaves the failure as found (never lost)
        self.finding_patience = settings.memory.search_wait
        self.campaign = Campaign(kernel=kernel.name, device=settings.device, seed=self.search_seed,
                                 statistics=Statistics.for_capabilities(self.caps, self.targets))
        if self.pool is not None:
            self.campaign.pool_seed, self.campaign.pool_round = self.pool_seed, settings.pool_round
        self.campaign.notes += [f"{kernel.name}: {note}" for note in skipped]
        self._check_read_tracing()
        # one moment on both clocks: a campaign's ``began_s`` plus its elapsed time ends no later than it did
        self.start, self._cpu_start, began = time.perf_counter(), time.process_time(), time.time()
        self._queued_start = run_queue_seconds()
        self.campaign.startup["started"] = began
        self.subject, self._own_subject = subject, subject is None
        self.farm, self._own_farm = farm, None
        self.waiting: _FarmWait | None = None
        self.database = None
        self.journal: Journal | None = None
        self.start_after = start_after  # an event the search waits for (``fuzz``)
        self.prefer_fork = prefer_fork  # its own worker: see ``fuzz``

    def run(self) -> Campaign:
        try:
            self.prepare()
            self.await_first_cases()
            # every case this campaign hands its subject is journaled first, a dead campaign's replays included
            with Journal(self.settings.state_dir, self.kernel.name) as self.journal, \
                    hypothesis_files_in(self.settings.state_dir):
                if self.journal.note:
                    self.campaign.notes.append(self.journal.note)
                leftover = self.recover_leftovers()
                if leftover is not None:
                    return leftover
                self.database = self._open_database()
                # the worker's start, the farm's, the first cases drawn ahead: no example's own time
                spend(self.campaign.phase_times, "startup", time.perf_counter() - self.start)
                if not self.replay_known_failures():
                    with sampling_this_thread(self.settings.sample_stacks, self.settings.isolation) as \
                            self.campaign.stacks:
                        Search(self)()
                    self._judged_something()
                self.after_the_finding()
        except KeyboardInterrupt:  # Ctrl-C or a stop signal outside the search (which keeps its own)
            if not self.campaign.failed:
                raise
            self.campaign.interrupted = True  # the failure found stands, unconfirmed
        finally:
            closing = time.perf_counter()
            self.close()
            spend(self.campaign.phase_times, "close", time.perf_counter() - closing)
        if self._own_subject and self.settings.remember_paths:  # jobs' paths: the run that merges them
            note_paths(self.campaign, self.settings.state_dir)
        return self.summarise()

    # -- the stages ----------------------------------------------------------------------
    def prepare(self) -> None:
        """The worker first (the campaign waits for it), then a compile farm that works ahead of it,
        compiling the search's first cases first, in the order it meets them."""
        settings = self.settings
        farm_needed = self.farm is None and self._own_subject and bool(self.pool)
        # one look-up of how another process loads the kernel, for the worker and the farm both
        spec = worker_spec(self.kernel, settings) if (self._own_subject and settings.isolation) or farm_needed else None
        plan = plan_for(spec, self.caps, self.pool, settings, self.tier) if farm_needed else None
        # the farm opens its GPU contexts after the worker's: sixteen at once take seconds each
        device_opened = fork_server_context().Event() if plan is not None and settings.isolation else None
        if self._own_subject:
            self.subject = subject_for(self.kernel, settings, spec, prefer_fork=self.prefer_fork,
                                       device_opened=device_opened)
            self.campaign.startup["worker_started"] = time.time()  # its process started, from here
        if plan is not None:
            # its processes start while this one draws the search's first cases, which they build first
            self._own_farm = start_farm([plan], settings, after=device_opened, first_cases_later=True,
                                        prefer_fork=self.prefer_fork)
            self.farm = self._own_farm.handle if self._own_farm else None
            self.campaign.startup["farm_started"] = time.time()
            if self._own_farm is not None and self._own_farm.awaits_first_cases:
                self._own_farm.schedule({0: self.first_cases()})
        self.waiting = _FarmWait(self.farm, self.kernel)

    def await_first_cases(self) -> None:
        """Wait while the run that started this campaign draws its first cases for the farm (``fuzz``'s
        ``start_after``; the worker started in ``prepare`` loads meanwhile).  A run gone meanwhile
        (this process's parent, the fork server, ends with it) leaves nobody to report to."""
        if self.start_after is None:
            return
        parent = os.getppid()
        while not self.start_after.wait(_FIRST_CASES_LOOK):
            if os.getppid() != parent:
                raise NanfuzzError(f"kernel {self.kernel.name}: the run that started this campaign ended "
                                   "before its first cases were drawn")
        self.campaign.startup["first_cases_drawn"] = time.time()

    def farm_plan(self, spec, samples: int = SAMPLES_PER_ENTRY) -> Plan | None:
        """What a compile farm builds ahead of this campaign, but its first cases (``first_cases``):
        ``samples`` cases of each pool entry; None where nothing compiles per case.  For a caller
        that starts one farm for several campaigns (the self-check), which runs this one with
        ``search_seed=self.search_seed``."""
        plan = plan_for(spec, self.caps, self.pool, self.settings, self.tier)
        return None if plan is None else replace(plan, samples=samples)

    def first_cases(self, count: int = UPCOMING_CASES) -> tuple[Case, ...]:
        """The first ``count`` cases this campaign's search meets, in order (``harness.campaign.upcoming``)."""
        if not count:
            return ()
        settings = self.settings
        return upcoming_cases(self.strategy(), chunk_seed(self.search_seed, 0),
                              first_chunk(self.max_examples, self.time_budget, settings.device, self.aiming), count,
                              declines=self.kernel.declines)

    def recover_leftovers(self) -> Campaign | None:
        """The failure a case left by a dead campaign gives again, if any (notes for the others)."""
        if not self.settings.check_leftovers:
            return None
        leftover, notes = recover_leftovers(self.kernel, self.settings, self.subject, self.journal,
                                            self.finding_patience)
        self.campaign.notes += notes
        return leftover

    def replay_known_failures(self) -> bool:
        """Replay the kernel's known failures (see ``harness.campaign.known_failures``) before any
        search.  True when one fails again: it is the campaign's failure, shrunk when it was found."""
        if self.database is None:
            return False
        campaign = self.campaign
        interpreter = self.settings.device == "cpu"
        for raw, case in known_failures.known(self.database, self._known_key()):
            if self.caps.unsupported(case, interpreter=interpreter) or self.kernel.declines(case):
                continue  # the kernel's capabilities changed since; the entry may still matter elsewhere
            self.journal.record(case)
            outcome = self.subject.check(case, patience=self.finding_patience)
            self.journal.clear()
            if isinstance(outcome, Declined):  # kept for a later campaign to replay
                campaign.notes.append(f"{self.kernel.name}: a known failure from the example database was not "
                                      f"replayed: {outcome.reason}; it stays in the database")
                continue
            campaign.tally(case, outcome)
            if self.hooks.on_example is not None:
                self.hooks.on_example(campaign)
            if outcome.failed:
                campaign.found(outcome, case, time.perf_counter() - self.start)
                campaign.notes.append(f"{self.kernel.name}: a known failure from the example database fails again")
                return True
            known_failures.forget(self.database, self._known_key(), raw)
        return False

    def after_the_finding(self) -> None:
        """Remember the failure, cut it down to one sequence and its window's dead blocks away where it
        can be, confirm it, name the capability it hangs on: nothing here may cost the finding, so a step
        that cannot go on is a note and the failure stands as found."""
        steps = (("remembering it", self.remember_failure),
                 ("cutting it down to one sequence", self.cut_to_one_sequence),
                 ("cutting the blocks below its window", self.drop_expired_blocks), ("replaying it", self.confirm),
                 ("judging it without each declared feature", self.name_the_capability))
        for what, step in steps:
            if not self.campaign.failed:
                return
            try:
                step()
            except NanfuzzError as exc:
                self.campaign.notes.append(f"{self.kernel.name}: the failure stands as found; {what} stopped: {exc}")

    def cut_to_one_sequence(self) -> None:
        self._cut_further(cut_to_one_sequence)

    def drop_expired_blocks(self) -> None:
        self._cut_further(drop_expired_blocks)

    def _cut_further(self, cut) -> None:
        """The shrunk failure made smaller by ``cut`` where that fails the same (``one_sequence``,
        ``expired_blocks``), and the smaller one remembered beside it."""
        if not self.settings.shrink or self.campaign.interrupted:  # --no-shrink: the case as found, at once
            return
        if cut(self.campaign, self.caps, self._check_journaled, self.kernel, self.settings.device == "cpu"):
            self.remember_failure()  # beside the shrunk one, remembered before the cut's runs

    def name_the_capability(self) -> None:
        if not self.campaign.interrupted:
            name_the_capability(self.campaign, self.caps, self._check_journaled, self.kernel,
                                self.settings.device == "cpu", expected=self.kernel.expect == "caught")

    def _check_journaled(self, case: Case, **options):
        """The subject's check of a case after the search (journaled as the search's are)."""
        self.journal.record(case)
        answer = self.subject.check(case, patience=self.finding_patience, **options)
        self.journal.clear()
        return answer

    def remember_failure(self) -> None:
        """A failure found goes into the example database, for every later campaign to replay first."""
        if self.database is not None and self.campaign.failed:
            known_failures.remember(self.database, self._known_key(), self.campaign.failing_case)

    def confirm(self) -> None:
        """Run the reported case again in the subject: how often does it repeat, bit for bit?"""
        campaign, replays = self.campaign, self.settings.replays
        if not campaign.failed or not replays or campaign.interrupted:
            return
        outcome = campaign.failure
        planned = runs = 1 if outcome.verdict is Verdict.HANG else replays  # each HANG replay costs a whole timeout
        repeated, passed, digests, final, declined = 0, 0, set(), None, None
        for n in range(planned):
            again = self._check_journaled(campaign.failing_case, digest=True, explain=n == 0)
            if isinstance(again, Declined):  # the failure stands as found, its replays untold
                declined, runs = again, n
                break
            passed += again.verdict is Verdict.PASS
            if again.verdict is outcome.verdict:
                repeated += 1
                final = final or again
                if again.output_sha256:
                    digests.add(again.output_sha256)
        if declined is not None:
            campaign.notes.append(f"{campaign.kernel}: the reported {outcome.verdict.value} was replayed {runs} of "
                                  f"{planned} times: {declined.reason}; the failure stands as found")
        if outcome.may_be_the_machine_s and runs and passed == runs:
            self.clear_the_machine_s_failure(outcome, runs)
            return
        if final is not None:
            final.evidence = {**final.evidence, "repeated": f"{repeated}/{runs}"}
            campaign.failure = final
        elif runs:
            outcome.evidence = {**outcome.evidence, "repeated": f"0/{runs}"}
        else:
            outcome.evidence = {**outcome.evidence, "repeated": "not replayed"}
        if repeated < runs:
            campaign.notes.append(f"{campaign.kernel}: the reported {outcome.verdict.value} repeated on {repeated} of "
                                  f"{runs} replays in a fresh run: a flaky or nondeterministic failure")
        if len(digests) > 1:
            campaign.notes.append(f"{campaign.kernel}: replays of the failing case gave {len(digests)} different outputs")

    def second_look(self, case: Case, failure: Outcome) -> Outcome:
        """A failure the machine can cause (``Outcome.may_be_the_machine_s``) met in the search, looked
        at again before it counts: the same case in fresh workers, as ``confirm`` replays a failure
        found.  If every replay passes, the first passing one stands for the example and the search
        goes on (no sibling job stopped, no shrink spent on a case that does not fail); otherwise
        ``failure``."""
        runs = 1 if failure.verdict is Verdict.HANG else self.settings.replays
        passed = None
        for _ in range(runs):
            if self.hooks.interrupted is not None and self.hooks.interrupted():
                return failure  # a stop under way (whose Ctrl-C may have ended the server): the search ends it
            again = self.subject.check(case, patience=self.finding_patience)
            if isinstance(again, Declined) or again.verdict is not Verdict.PASS:
                return failure
            passed = passed or again
        if passed is None:
            return failure  # no replays asked for: the failure is judged as met
        self.campaign.notes.append(self._the_machine_s_note(failure, runs, kept=False))
        return passed

    def clear_the_machine_s_failure(self, failure: Outcome, runs: int) -> None:
        """A HANG, or the death of the fork server a worker came from, whose case passed every replay in
        a fresh worker.  A kernel that loops forever, or kills the server, does so again; a launch that
        ran past the timeout once met a device or host too busy (campaigns sharing a GPU, a starved
        CPU), a server that died once was ended from outside (the host short of memory), and a gate
        must not fail a kernel for its machine.  The case stays in the example database, which the
        next campaign replays first."""
        campaign = self.campaign
        campaign.notes.append(self._the_machine_s_note(failure, runs, kept=self.database is not None))
        campaign.failure = campaign.failing_case = None
        campaign.time_to_first_failure = campaign.examples_to_first_failure = campaign.shrink_time = None

    def _the_machine_s_note(self, failure: Outcome, runs: int, kept: bool) -> str:
        what = failure.summary.removeprefix(f"{failure.verdict.value}: ")
        cause = ("a launch slowed by a busy device or host" if failure.verdict is Verdict.HANG
                 else "a server ended from outside the kernel (the host short of memory, say)")
        stays = " (the case stays in the example database, and the next campaign replays it first)" if kept else ""
        replays = "replayed in a fresh worker" if runs == 1 else f"replayed {runs} times in fresh workers"
        return (f"{self.campaign.kernel}: {what}, but the same case {replays} passed: {cause}, not reported as a "
                f"{failure.verdict.value}{stays}")

    def close(self) -> None:
        """The worker and the farm this campaign started, stopped, with what they counted."""
        campaign = self.campaign
        if self._own_subject and self.subject is not None:
            note_worker_start(campaign, self.subject)
            campaign.worker_restarts = getattr(self.subject, "restarts", 0)
            campaign.compiles = getattr(self.subject, "specialisations", None)
            self.subject.close()
        if self._own_farm is not None:
            self._own_farm.close()
            campaign.farm = self._own_farm.summary()

    def summarise(self) -> Campaign:
        campaign = self.campaign
        campaign.elapsed = time.perf_counter() - self.start
        campaign.cpu_seconds = time.process_time() - self._cpu_start
        queued = run_queue_seconds()
        if queued is not None and self._queued_start is not None:
            campaign.run_queue_seconds = queued - self._queued_start
        campaign.note_declines()
        campaign.note_reads()
        campaign.note_past_budget()
        campaign.note_left_at_budget_end()
        self.note_unreached()
        if self.pool_growth:
            campaign.notes.append(f"{self.kernel.name}: the specialisation pool grew {self.pool_growth} time"
                                  f"{'s' if self.pool_growth > 1 else ''}, to {len(self.pool)} entries")
        if campaign.failure is not None and campaign.time_to_first_failure is not None:
            campaign.shrink_time = campaign.elapsed - campaign.time_to_first_failure
        return campaign

    def search_patience(self) -> float:
        """How long a drawn case waits for device memory: the governor's wait, within what is left of
        the time budget (a case that gets none is declined, and a campaign sharing its device ends
        near its budget instead of a whole wait past it)."""
        wait = self.settings.memory.search_wait
        if self.time_budget is None:
            return wait
        left = self.time_budget - (time.perf_counter() - self.start)
        return max(_LEAST_WAIT, min(wait, left))

    # -- what the search draws from ------------------------------------------------------
    def strategy(self):
        """What the next Hypothesis run draws from: the pool as it stands, its production cases aimed
        at the targets the examples so far have not met (``harness.campaign.reach``)."""
        return campaign_strategy(self.caps, self.settings, self.pool, self.tier,
                                 reach.aims(self.targets, self.campaign.statistics, self._forgiven)
                                 if self.targets else None)

    @property
    def aiming(self) -> bool:
        """Are targets within reach still unmet?  Then Hypothesis runs stay short, so that each one
        aims at what the ones before it left."""
        return bool(self.targets) and bool(reach.unmet(self.targets, self.campaign.statistics, self._forgiven))

    def grow_pool(self) -> None:
        """Between Hypothesis runs: a few entries more for a pool the campaign has drawn from long
        enough (``harness.campaign.reach.pool_growth_due``)."""
        now = time.perf_counter()
        if not self.pool or not reach.pool_growth_due(self.campaign.examples - self._grown_at, now - self._grown_when,
                                                      len(self.pool), self.pool_growth):
            return
        self.pool_growth += 1
        self._grown_at, self._grown_when = self.campaign.examples, now
        grown, _ = campaign_pool_of(self.caps, self.settings, self.pool_seed, self.tier, self.pool_growth)
        self.pool = grown + tuple(entry for entry in self._taken if entry not in grown)

    def add_entries_it_takes(self) -> None:
        """Between Hypothesis runs: for each target the kernel's supports() keeps declining (looked at
        once), an entry with its situation that the kernel takes (``harness.campaign.accepted_entry``)
        joins the pool, and the search aims at the target again."""
        if not self.pool or not self.targets:
            return
        statistics = self.campaign.statistics
        served: dict = {}  # entry taken: the targets it was taken for
        for name in reach.declined(self.targets, statistics, self._forgiven):
            if name in self._looked_at:
                continue
            self._looked_at.add(name)
            entry = entry_it_takes(name, self.targets, self.caps, self.settings, self.pool, f"{self.pool_seed}:{name}",
                                   lambda case: self.kernel.declines(case) is None, tried_first=self._taken)
            if entry is None:
                continue
            if entry not in self.pool:
                self.pool, self._taken = self.pool + (entry,), self._taken + (entry,)
            self._forgiven[name] = statistics.declined_targets[name]
            served.setdefault(entry, []).append(name)
        for entry, names in served.items():
            shape = entry.shape
            self.campaign.notes.append(
                f"{self.kernel.name}: the kernel declined every drawn case reaching {', '.join(names)}; the pool took "
                f"an entry it takes ({shape.dtype}, {shape.num_q_heads} query heads over {shape.num_kv_heads}, head "
                f"{shape.head_size}, {shape.block_size}-slot blocks)")

    def note_unreached(self) -> None:
        if self.targets:
            self.campaign.note_unreached()

    # -- helpers -------------------------------------------------------------------------
    def _judged_something(self) -> None:
        """A usage error for a campaign whose every case was declined for memory: no pass.  (A job's
        campaign leaves it to its run, which merges every job's.)"""
        campaign = self.campaign
        if self._own_subject and not campaign.failed and not campaign.examples and not campaign.interrupted:
            require_a_judged_case(campaign)

    def _check_read_tracing(self) -> None:
        """--strict-reads needs traced loads (a usage error where there are none); under an interpreter
        that cannot be traced, a note says the read coverage is not measured."""
        settings = self.settings
        why = "a GPU launch's loads are not traced" if settings.device != "cpu" else reads.unavailable()
        if why and settings.strict_reads:
            raise NanfuzzError(f"--strict-reads needs the kernel's loads traced under Triton's interpreter "
                               f"(--device cpu), and here {why}")
        if why and settings.device == "cpu":
            self.campaign.notes.append(f"{self.kernel.name}: read coverage not measured: {why}")

    def _open_database(self):
        settings, use = self.settings, self.settings.use_database
        if use is None:  # an example database named explicitly is one to use
            use = bool(settings.example_db) or self.profile.use_database
        if not use:
            return None
        from nanfuzz.harness.campaign.example_db import open_database

        return open_database(settings.example_db, settings.examples_path, self.campaign.notes.append)

    def _known_key(self) -> bytes:
        return known_failures.key(self.kernel.name, self.settings.device, self.settings.focus.label())
