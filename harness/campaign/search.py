"""The search: Hypothesis runs until the examples or the time are spent, or a failure is shrunk.

A campaign bounded by wall time runs Hypothesis in chunks: the first is short
(nothing is timed yet), later ones fill a share of the time left at the pace
so far.  Each chunk is seeded from the campaign's search seed, so a seeded
campaign draws the same cases (``harness.campaign.upcoming`` draws them ahead).

Every failing case met is remembered as it is met, so a failure survives
whatever ends the search: a flaky replay, Hypothesis giving up, a shrink that
runs out of time, Ctrl-C.  On a GPU a case whose binary another process
compiles is put off (``harness.campaign.deferrals``); a put-off case that fails
later is found again by replaying the same seeded run, for Hypothesis to shrink.
"""
from __future__ import annotations

import hashlib
import math
import os
import random
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from hypothesis import HealthCheck, Phase, given, reject, seed as hypothesis_seed, settings as hypothesis_settings, target
from hypothesis.errors import HypothesisException, Unsatisfiable

from nanfuzz.harness.campaign import reach
from nanfuzz.harness.campaign.deferrals import Deferrals, FoundLate, Replay
from nanfuzz.harness.campaign.profiles import Profile
from nanfuzz.harness.campaign.result import check_record, declined_record, put_off_record
from nanfuzz.harness.campaign.settings import Settings
from nanfuzz.harness.campaign.upcoming import UPCOMING_CASES
from nanfuzz.harness.judge.check import Outcome, Verdict
from nanfuzz.harness.launch.shared_compiles import Skipped
from nanfuzz.harness.launch.worker import CLAIMED, UNBUILT, Declined, Deferred
from nanfuzz.harness.report import coverage
from nanfuzz.reference.case import Case
from nanfuzz.reference.errors import NanfuzzError
from nanfuzz.strategies import STRATEGY_VERSION
from nanfuzz.strategies.steady import steady_draws

if TYPE_CHECKING:
    from nanfuzz.harness.campaign.runner import CampaignRunner

# Examples per Hypothesis run when a campaign is bounded by wall time: the
# first run is short (nothing is timed yet), later runs fill this share of the
# time left, so they shrink geometrically toward the deadline and the last
# overshoots it by about one example.
_CHUNK = 250
# Examples per Hypothesis run while production targets are unmet, whatever bounds the campaign:
# each run aims at what the ones before it left (``harness.campaign.reach``).
_AIMED_CHUNK = 32
_FIRST_CHUNK = {"cpu": 2, "cuda": 32}
_CHUNK_SHARE = 0.5
# How often the end of a Hypothesis run looks whether the binaries of the cases it put off have landed.
_LANDING_POLL = 0.01
# In a time-bounded GPU campaign's last seconds a check compiles nothing: a case whose launch needs a
# binary no process has built is left unchecked, as if the budget had run out before it was drawn
# (a worker compiling a production kernel took 14 jobs of vLLM's ROCM_ATTN 17 s past a 50 s budget).
# The last seconds: the longest compile a check of the campaign has made so far, or a compile farm's
# task has taken (it builds the same entries' cases), at least this.
LEAST_COMPILE_RESERVE = 10.0

# How long a large case checked while the compile farm runs waits for device memory: the farm's tasks
# hold theirs until their compiles end (tens of seconds), where an idle worker gives its back within a
# second of a want.  Past it the case is put off until the farm ends (``_UNTIL_THE_FARM_ENDS``) and the
# search goes on; beside a farm, a production case's check waited 14 s, only to find its binary unbuilt.
# The large cases after it get one look at the ledger, until one of them gets its memory: four in a row
# each waited the whole 2 s.
FARM_BUSY_PATIENCE = 2.0
_UNTIL_THE_FARM_ENDS = Skipped(claim="", landed="", claimed=False)  # no marker to watch: ready once no farm runs


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


def database_label(kernel_name: str, device: str, focus_label: str, caps, pool, pool_seed: int,
                   tier: str = "small") -> str:
    """What a stored choice sequence means a case under; Hypothesis hashes it into the database key,
    so entries of another kernel, device, focus, strategy version, capabilities, pool (its round and
    growth included) or size tier never replay."""
    caps_id = hashlib.sha256(repr(caps).encode()).hexdigest()[:12]
    pool_id = hashlib.sha256(repr(pool).encode()).hexdigest()[:12] if pool else ""
    return (f"nanfuzz:{kernel_name}:{device}:{focus_label}:strategies-v{STRATEGY_VERSION}:caps-{caps_id}"
            + (f":pool{len(pool)}/{pool_seed}/{pool_id}" if pool else "") + ("" if tier == "small" else f":{tier}"))


def search_seed(settings: Settings, profile: Profile) -> int:
    """The Hypothesis seed of a campaign's chunks (``chunk_seed``): the campaign's seed; 0 under
    a derandomized profile; else a fresh random one, so that no two unseeded campaigns (the
    jobs of one run among them) draw the same later chunks."""
    if settings.seed is not None:
        return settings.seed
    return 0 if profile.derandomize else random.SystemRandom().randrange(2 ** 32)


def chunk_seed(search_seed: int, chunk_index: int) -> int:
    return search_seed * 1_000_003 + chunk_index


def first_chunk(max_examples: int, time_budget: float | None, device: str, aiming: bool = False) -> int:
    """How many examples the campaign's first Hypothesis run may draw (later ones fit the time left);
    ``aiming``: at production targets still unmet, at most ``_AIMED_CHUNK``."""
    first = max_examples if time_budget is None else max(1, min(max_examples, _CHUNK, _FIRST_CHUNK[device]))
    return min(first, _AIMED_CHUNK) if aiming else first


def split_check_time(phase_times: dict[str, float], outcome: Outcome, round_trip: float) -> None:
    """Where a check's wall time went beside its phases (``check``'s timings), into ``phase_times``:
    waiting for device memory, admission (the rest of the judging process's time for it: the memory
    ledger, setting up and cleaning up) and the handoff (the case to the worker and the outcome
    back, the worker's own loop; ``round_trip`` is the search's wall time for the check).
    ``nanfuzz bench`` counts what is left of a campaign's time as generation."""
    phases = sum(outcome.timings.values())
    within = outcome.seconds or phases + outcome.memory_waited
    spend(phase_times, "memory wait", outcome.memory_waited)
    spend(phase_times, "admission", within - phases - outcome.memory_waited)
    spend(phase_times, "handoff", round_trip - within)


def spend(phase_times: dict[str, float], phase: str, seconds: float) -> None:
    phase_times[phase] = phase_times.get(phase, 0.0) + max(0.0, seconds)


class Search:
    """One campaign's search, over the state its runner holds (kernel, subject, journal, clock...)."""

    def __init__(self, run: CampaignRunner):
        self.run = run
        self.campaign = run.campaign
        self.first: tuple[Outcome, Case] | None = None  # the first failure met
        self.best: tuple[Outcome, Case] | None = None   # the latest failure of the first's verdict
        self.defers = getattr(run.subject, "defers", False)  # can its worker put off a case whose binary compiles elsewhere?
        self.deferrals = Deferrals()
        self.farm_holds_memory = False  # a large case was put off for memory the farm held, none checked since
        self.judged: dict[Case, Outcome] = {}  # this Hypothesis run's outcomes, for a replay up to a late failure
        self.replay: Replay | None = None      # the replay under way, if any
        self.calls, self.drawn_ahead = 0, False  # see _target
        self.longest_compile = 0.0  # seconds, the longest a check's worker spent compiling (``_compiles_too_late``)
        self.strategy = None  # each Hypothesis run's own (``CampaignRunner.strategy``)
        self.phases = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target] + (
            [Phase.shrink] if run.settings.shrink else [])

    # -- the chunks ------------------------------------------------------------------
    def __call__(self) -> None:
        """Hypothesis runs until the examples or the time are spent, or a failure is shrunk."""
        campaign, run = self.campaign, self.run
        remaining = run.max_examples - campaign.examples  # the known failures replayed first are examples too
        chunk_index = 0
        while remaining > 0:
            size = self._chunk_size(remaining)
            if size is None:
                break
            before = campaign.examples
            if not self._run_chunk(size, chunk_index):
                break
            remaining -= max(1, campaign.examples - before)
            chunk_index += 1
        if self.best is not None and campaign.failure is None:
            campaign.failure, campaign.failing_case = self.best

    def _chunk_size(self, remaining: int) -> int | None:
        """The next Hypothesis run's examples; None once the time budget is spent."""
        run, campaign = self.run, self.campaign
        elapsed = time.perf_counter() - run.start
        if run.time_budget is not None and elapsed >= run.time_budget and campaign.examples:
            return None  # at least one example, however late: a campaign that tried nothing is no pass
        aiming = run.aiming
        if not campaign.examples:
            return first_chunk(remaining, run.time_budget, run.settings.device, aiming)
        most = min(remaining, _AIMED_CHUNK) if aiming else remaining  # then aim again at what is still unmet
        if run.time_budget is None:
            return most
        per_example = elapsed / campaign.examples  # a share of the time left, at the pace so far
        return max(1, min(most, _CHUNK, int(_CHUNK_SHARE * (run.time_budget - elapsed) / max(per_example, 1e-6))))

    def _run_chunk(self, size: int, chunk_index: int) -> bool:
        """One Hypothesis run (drawn again up to a late failure); False when the search is over."""
        campaign, run = self.campaign, self.run
        self.judged.clear()
        if chunk_index:
            run.grow_pool()
            run.add_entries_it_takes()
        self.strategy = run.strategy()
        try:
            while True:
                # the run's calls, counted afresh each time it is drawn (again), for ``_target``
                self.calls, self.drawn_ahead = 0, chunk_index == 0 and run.pool is not None
                try:
                    with steady_draws():
                        self._hypothesis_run(size, chunk_index)()
                    if self.replay is None:
                        self._check_remaining()
                    break
                except FoundLate as late:  # draw the run again, up to the late failure, for Hypothesis to shrink
                    self.replay = Replay(late, self.judged, self.deferrals.remaining())
        except KernelFailed as failure:
            campaign.failure, campaign.failing_case = failure.outcome, failure.case
            return False
        except _Aborted as aborted:
            if self.first is None:
                raise aborted.error from None
            # a failure is found: nothing after it may cost it (the repro is the smallest one so far)
            campaign.notes.append(f"{run.kernel.name}: shrinking stopped: {aborted.error}; the repro is the "
                                  "smallest failing case found by then")
            return False
        except StopRequested:
            if run.hooks.interrupted is not None and run.hooks.interrupted():
                campaign.interrupted = True
            return False
        except KeyboardInterrupt:
            campaign.interrupted = True
            return False
        except HypothesisException as exc:
            # e.g. a failure that did not repeat when Hypothesis replayed it (Flaky)
            declined = campaign.statistics.declined
            if self.first is None and isinstance(exc, Unsatisfiable) and declined and not campaign.examples:
                raise NanfuzzError(f"kernel {run.kernel.name} declined every case drawn ({sum(declined.values())}; "
                                   f"{', '.join(declined)}): say in its Capabilities what it takes") from None
            if self.first is None:
                raise NanfuzzError(f"kernel {run.kernel.name}: Hypothesis stopped the campaign: {exc}".splitlines()[0]) from None
            campaign.notes.append(f"{run.kernel.name}: Hypothesis stopped shrinking ({type(exc).__name__}): the failure "
                                  "did not repeat on every run; the repro is the last failing case seen")
            return False
        finally:
            campaign.deferred = self.deferrals.count
        if self.replay is not None:  # the run drawn again never met the late failure: it stands unshrunk
            campaign.notes.append(f"{run.kernel.name}: the failure was found while its binary compiled, out of order, "
                                  "and Hypothesis did not draw it again; the repro is the failing case as found, unshrunk")
            return False
        return True

    def _hypothesis_run(self, size: int, chunk_index: int):
        run = self.run
        property_ = given(case=self.strategy)(lambda case: self._run_case(case))
        property_.hypothesis.inner_test._hypothesis_internal_add_digest = database_label(
            run.kernel.name, run.settings.device, run.settings.focus.label(), run.caps, run.pool, run.pool_seed,
            run.tier).encode()
        property_ = hypothesis_seed(chunk_seed(run.search_seed, chunk_index))(property_)
        # settings after @seed: @seed alone would switch the example database off
        return hypothesis_settings(
            max_examples=size, deadline=None, database=run.database, phases=self.phases, report_multiple_bugs=False,
            suppress_health_check=list(HealthCheck), print_blob=False)(property_)

    # -- one case ---------------------------------------------------------------------
    def _run_case(self, case: Case) -> None:
        run = self.run
        self._stop_if_asked()
        if self.first is not None and time.perf_counter() - run.start - self.campaign.time_to_first_failure > run.settings.shrink_budget:
            self.campaign.notes.append(f"{run.kernel.name}: shrinking stopped after {run.settings.shrink_budget:.0f} s; "
                                       "the repro is the smallest failing case found by then")
            raise StopRequested()
        self._decline_if_asked(case)
        if self.replay is not None:
            known = self.replay.known(case)
            if known is not None:
                self._target(known)
                if known.failed:
                    raise _FAILURE_TYPES[known.verdict](known, case)
                return
            if self.replay.passes_over(case):
                return
        if self.deferrals and self.first is None:  # after a failure, cases put off no longer matter
            self._check_landed()
        run.waiting(case, self.campaign)
        self._stop_if_asked()  # the budget may have run out while it waited for the farm
        defer = self._deferring()
        if defer == UNBUILT and case.large:
            defer = self._large_case_s_deferral(case)
            if defer is None:
                return
        outcome = self._judge(case, defer)
        if outcome is not None:
            tallied = time.perf_counter()
            self._target(outcome)
            self._spent("tally", time.perf_counter() - tallied)
        if outcome is not None and outcome.failed:
            raise _FAILURE_TYPES[outcome.verdict](outcome, case)

    def _target(self, outcome: Outcome) -> None:
        """Tell Hypothesis what to climb toward (targeted property-based testing): more dead slots
        addressed by the kernel's loads (under the interpreter), an error closer to the bound, and
        more of the Triton kernels the campaign has launched rarely (at most ``reach.QUOTA`` times:
        a 3D or v2 path, a reduction), so that it climbs toward the paths a kernel seldom takes.

        With a specialisation pool the first ``UPCOMING_CASES`` cases of the first run report nothing:
        Hypothesis keeps a mutation only if its targets do not fall, so reported targets would make
        the search stray from the cases a compile farm drew ahead for it (``harness.campaign.upcoming``)."""
        self.calls += 1
        if not self.run.settings.targeting or (self.drawn_ahead and self.calls <= UPCOMING_CASES):
            return
        reads = outcome.reads or {}
        if reads.get("traced"):
            target(float(reads["dead_slots"]), label="dead slots addressed")
        ratio, bound = outcome.evidence.get("max_error_ratio"), outcome.evidence.get("bound")
        if ratio is not None and bound and math.isfinite(ratio):
            target(ratio / bound, label="error over the bound")
        if outcome.paths:
            counts = self.campaign.statistics.counts
            target(float(sum(counts[f"path:{name}"] <= reach.QUOTA for name in outcome.paths)),
                   label="kernel paths launched rarely")

    def _judge(self, case: Case, defer: str | None) -> Outcome | None:
        """Check one case and count it; None when the worker put it off (``harness.campaign.deferrals``)
        or it was declined for memory (after a failure is found, a check waits for memory as long
        as shrinking may last)."""
        run, campaign = self.run, self.campaign
        run.journal.record(case)
        checked = time.perf_counter()
        patience = run.finding_patience if self.first is not None else run.search_patience()
        beside_the_farm = defer == UNBUILT and case.large and run.waiting.farm_running()
        if beside_the_farm:  # once the farm held one's memory, the next look only, until one gets it
            patience = min(patience, 0.0 if self.farm_holds_memory else FARM_BUSY_PATIENCE)
        try:
            outcome = (run.subject.check(case, defer=defer, patience=patience) if defer
                       else run.subject.check(case, patience=patience))
        except NanfuzzError as exc:
            raise _Aborted(exc) from None
        if (self.first is None and not isinstance(outcome, (Deferred, Declined)) and outcome.failed
                and outcome.may_be_the_machine_s):
            try:
                outcome = run.second_look(case, outcome)  # still journaled: a campaign killed now leaves it
            except NanfuzzError as exc:
                raise _Aborted(exc) from None
        round_trip = time.perf_counter() - checked  # a second look's replays beside the last one's phases: handoff
        run.journal.clear()
        self._past_the_budget(outcome, checked, round_trip)
        if isinstance(outcome, Declined) and outcome.memory_taken and beside_the_farm:
            self.farm_holds_memory = True
            self._put_off_for_the_farm(case, checked, round_trip)
            return None
        if case.large:
            self.farm_holds_memory = False  # it got its memory (or never waited for it)
        if isinstance(outcome, Deferred):
            self._put_off(case, outcome, checked, round_trip)
            return None
        if isinstance(outcome, Declined):
            self._spent("memory wait", round_trip)  # waiting for memory that did not come free (or judging out of it)
            campaign.declined(outcome, shrinking=self.first is not None)
            return None
        returned = time.perf_counter()
        self.longest_compile = max(self.longest_compile, outcome.compiled_seconds or 0.0)
        campaign.note_early(check_record(outcome, checked - run.start, returned - checked))
        split_check_time(campaign.phase_times, outcome, round_trip)
        campaign.count(outcome)
        if campaign.time_to_first_example is None:
            campaign.time_to_first_example = time.perf_counter() - run.start
        campaign.statistics.add(case, outcome.paths, coverage.observed(outcome))
        campaign.accuracy.add(outcome.evidence)
        if outcome.failed:
            if self.first is None:
                campaign.time_to_first_failure = time.perf_counter() - run.start
                campaign.examples_to_first_failure = campaign.examples
                self.first = self.best = (outcome, case)
            elif outcome.verdict is self.first[0].verdict:
                self.best = (outcome, case)
        if self.first is None:
            self.judged[case] = outcome
        self._spent("tally", time.perf_counter() - returned)
        if run.hooks.on_example is not None:
            run.hooks.on_example(campaign)
        return outcome

    def _put_off(self, case: Case, deferred: Deferred, checked: float, round_trip: float) -> None:
        """Count a case put off for a binary (``deferred.skipped``) and queue it, unless no farm will
        build that binary and a compile would outlast the budget.  One that nobody compiles yet waits
        for the farm only while the farm's task of its entry is not stuck (``Skipped.stuck``)."""
        run, campaign = self.run, self.campaign
        self._spent("handoff", round_trip)  # the case to the worker, and back put off
        campaign.note_early(put_off_record(deferred, checked - run.start, round_trip))
        if self._compiles_too_late() and not run.waiting.farm_running():
            campaign.left_at_budget_end += 1
            return
        skipped = deferred.skipped
        if not skipped.claimed and not skipped.stuck:
            skipped = replace(skipped, stuck=run.waiting.stuck_marker(case) or "")
        self.deferrals.add(case, skipped)

    def _put_off_for_the_farm(self, case: Case, checked: float, waited: float) -> None:
        """A large case whose memory stayed taken for ``FARM_BUSY_PATIENCE`` while the farm ran: put off
        until the farm ends, then checked with the search's whole wait."""
        self._spent("memory wait", waited)
        self.campaign.note_early(put_off_record(Deferred(_UNTIL_THE_FARM_ENDS, waited, waited), checked - self.run.start,
                                                waited))
        self.deferrals.add(case, _UNTIL_THE_FARM_ENDS)

    def _large_case_s_deferral(self, case: Case) -> str | None:
        """What a large case's check may put off while the farm runs (``UNBUILT``); None where the case
        was put off here, without sending it to its worker, as the farm has built nothing of its entry:
        sent, its check would build its batches on the device and reserve their memory, maybe waiting
        for that, only to find its binary missing.  It waits for the farm's first task of the entry,
        or until that task is stuck (waiting for device memory, or given up).  A case whose entry's
        task is stuck already is checked now, compiling what it needs (``CLAIMED``): its check's memory
        may come sooner than the farm's.  A small case is always sent: finding its binary missing costs
        its worker milliseconds, and another entry's task may have built it already (entries share
        binaries)."""
        markers = self.run.waiting.unbuilt(case)
        if markers is None:
            return UNBUILT
        done, stuck = markers
        if os.path.exists(stuck):
            return CLAIMED
        nobody_compiles_it = Skipped(claim="", landed=done, claimed=False, stuck=stuck)  # no claim: the markers
        self._put_off(case, Deferred(nobody_compiles_it), time.perf_counter(), 0.0)
        return None

    def _past_the_budget(self, outcome, checked: float, seconds: float) -> None:
        """A search's check under way when the time budget ran out (``Campaign.passed_budget``)."""
        run = self.run
        if run.time_budget is None or self.first is not None or isinstance(outcome, Deferred):
            return
        ran_out = run.start + run.time_budget
        if checked < ran_out < checked + seconds:
            started = checked - run.start
            record = (declined_record(started, seconds) if isinstance(outcome, Declined)
                      else check_record(outcome, started, seconds))
            self.campaign.passed_budget({**record, "budget_s": run.time_budget,
                                         "past_s": round(checked + seconds - ran_out, 3)})

    def _spent(self, phase: str, seconds: float) -> None:
        spend(self.campaign.phase_times, phase, seconds)

    def _decline_if_asked(self, case: Case) -> None:
        """A case the kernel's ``supports()`` declines is counted (once, not again in a replay) and
        drawn again: to Hypothesis it is an unsatisfied assumption, no example."""
        try:
            reason = self.run.kernel.declines(case)
        except NanfuzzError as exc:
            raise _Aborted(exc) from None
        if reason is not None:
            if self.replay is None:
                self.campaign.statistics.decline(reason, case)
            reject()

    def _stop_if_asked(self) -> None:
        hooks = self.run.hooks
        if hooks.interrupted is not None and hooks.interrupted():
            raise StopRequested()
        if self.first is None and hooks.should_stop is not None and hooks.should_stop():
            raise StopRequested()
        if self.first is None and self._out_of_time():
            raise StopRequested()  # a run sized at an early, faster pace (a production case compiles for seconds)

    def _out_of_time(self) -> bool:
        run = self.run
        return (run.time_budget is not None and self.campaign.examples > 0
                and time.perf_counter() - run.start >= run.time_budget)

    # -- cases put off while their binaries compile --------------------------------------
    def _deferring(self) -> str | None:
        """What a check may put off now (``worker.CLAIMED``, ``UNBUILT``): nothing once a failure is found;
        a binary nobody has built while a farm runs (it will build it) or in the budget's last seconds
        (``_compiles_too_late``)."""
        if not self.defers or self.first is not None:
            return None
        return UNBUILT if self.run.waiting.farm_running() or self._compiles_too_late() else CLAIMED

    def _compiles_too_late(self) -> bool:
        """Would a compile begun now outlast the time budget (``LEAST_COMPILE_RESERVE``)?  Never once a
        failure is found (its shrink checks every case it meets), nor before a first example (a campaign
        that tried nothing is no pass, however short its budget)."""
        run = self.run
        if run.time_budget is None or self.first is not None or not self.campaign.examples:
            return False
        left = run.start + run.time_budget - time.perf_counter()
        if left < max(LEAST_COMPILE_RESERVE, self.longest_compile):
            return True
        return left < self.run.waiting.slowest_task()

    def _judge_late(self, case: Case, defer: str | None) -> None:
        """Check a case put off earlier; a failure ends the run (``FoundLate``)."""
        self._stop_if_asked()
        outcome = self._judge(case, defer)
        if outcome is not None and outcome.failed:
            raise FoundLate(case, outcome)

    def _check_landed(self) -> None:
        """The put-off cases whose binaries have landed, checked now (one whose compile failed in
        another process, compiling it here)."""
        for case, built in self.deferrals.landed(self.run.waiting.farm_running()):
            self._judge_late(case, self._deferring() if built or self._compiles_too_late() else CLAIMED)

    def _check_remaining(self) -> None:
        """The run is over: every case still put off is checked as soon as its binaries land, and
        once no farm runs, each in turn, waiting for whatever another process still compiles."""
        while self.deferrals:
            self._stop_if_asked()
            if self.run.waiting.farm_running():
                self._check_landed()
                polled = time.perf_counter()
                time.sleep(_LANDING_POLL)
                self._spent("compile", time.perf_counter() - polled)  # waiting for binaries being compiled
                continue
            for case in self.deferrals.remaining():
                self._judge_late(case, UNBUILT if self.defers and self._compiles_too_late() else None)
