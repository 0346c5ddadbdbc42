"""What a campaign found and what it ran: the result every front door reports from."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from nanfuzz.harness.campaign.upcoming import UPCOMING_CASES
from nanfuzz.harness.judge.accuracy import Accuracy
from nanfuzz.harness.judge.check import Outcome
from nanfuzz.harness.report import coverage
from nanfuzz.harness.report.statistics import UNREACHED_NOTE, Statistics
from nanfuzz.reference.case import Case

# Past this share of drawn cases declined by a kernel's supports(), a campaign says so: each
# declined case is drawn again, so the examples lean away from what it declines, and a
# constraint that common belongs in Capabilities, where the strategies honour it and shrink within it.
DECLINE_NOTE_SHARE = 0.10
_DECLINE_NOTE = "of the cases drawn were declined by its supports()"

_SHRINK_DECLINE_NOTE = "a case met while shrinking did not get its device memory in time"

# The first examples of a campaign whose timing it keeps (``Campaign.early_examples``): as many
# as it draws in advance for the compile farm (``harness.campaign.upcoming``).
EARLY_EXAMPLES = UPCOMING_CASES
PUT_OFF = "put off"  # an early record's verdict where the worker put its case off (kept beside the examples)

# A check begun before the time budget ran out and ended this long past it gets a note: a budget
# stops new checks, not one under way (a worker compiling a new binary, a wait for device memory).
PAST_BUDGET_NOTE_S = 5.0
_PAST_BUDGET_NOTE = "past its time budget"
_LEFT_AT_BUDGET_END_NOTE = ("left unchecked, as a compile of a binary no process had built would have run past "
                            "the budget")


def _record(started: float, seconds: float, verdict: str, *, judged: float = 0.0, memory_wait: float = 0.0,
            farm_wait: float = 0.0, compiled: float = 0.0, phases=()) -> dict:
    """The one shape of an early example's record (``Campaign.note_early``), ``started`` seconds from
    the campaign's start, ``seconds`` its round trip, ``phases`` (phase, seconds) pairs."""
    return {"at_s": round(started, 3), "seconds": round(seconds, 3), "judged_s": round(judged, 3),
            "memory_wait_s": round(memory_wait, 3), "farm_wait_s": round(farm_wait, 3),
            "compiled_s": round(compiled, 3), "verdict": verdict,
            "phases": {phase: round(spent, 4) for phase, spent in phases}}


def check_record(outcome: Outcome, started: float, seconds: float) -> dict:
    """A check's record: its verdict, and how its time divided."""
    return _record(started, seconds, outcome.verdict.value, judged=outcome.seconds,
                   memory_wait=outcome.memory_waited, farm_wait=outcome.timings.get("compile", 0.0),
                   compiled=outcome.compiled_seconds, phases=outcome.timings.items())


def put_off_record(deferred, started: float, seconds: float) -> dict:
    """The record of a case its worker put off (``worker.Deferred``): what the check spent before the
    launch that needed a binary still compiling elsewhere (a case's batches built, then left)."""
    return _record(started, seconds, PUT_OFF, judged=deferred.seconds, memory_wait=deferred.memory_waited,
                   phases=[(phase, spent) for phase, spent in deferred.phases if spent])


def declined_record(started: float, seconds: float) -> dict:
    """The record of a case declined for memory: its time was the wait."""
    return _record(started, seconds, "declined for memory", memory_wait=seconds)


def add_known(total: float | None, part: float | None) -> float | None:
    """``total`` plus ``part`` where the platform measured them (None: not measured, as a run queue
    off Linux)."""
    return total if part is None else (total or 0.0) + part


@dataclass
class Campaign:
    kernel: str
    device: str
    seed: int | None = None  # the search's seed, so that any run can be repeated (``--seed``)
    pool_seed: int | None = None   # its specialisation pool's seed and round, where it had a pool
    pool_round: int | None = None  # (``--pool-seed``, ``--pool-round``)
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
    # the check under way when the time budget ran out that ended furthest past it (``passed_budget``)
    past_budget: dict | None = None
    # cases drawn in the time budget's last seconds whose launch needed a binary nobody had built:
    # left unchecked rather than compiled past the budget (``search.LEAST_COMPILE_RESERVE``)
    left_at_budget_end: int = 0
    compiles: int | None = None   # kernel specialisations the campaign's workers compiled or loaded (GPU)
    deferred: int = 0             # checks put off while a binary they needed compiled elsewhere (GPU)
    declined_for_memory: int = 0  # cases skipped: their device memory did not come free (harness.judge.memory)
    stacks: Counter | None = None  # the search thread's stacks, sampled (Settings.sample_stacks)
    judging_out_of_memory: int = 0  # of those, cases whose judging ran out of memory, twice
    memory_waits: int = 0         # checks that waited for device memory before they built anything
    memory_wait_seconds: float = 0.0
    memory_wait_causes: Counter = field(default_factory=Counter)  # those waits by what stood in the way
    paths_missed: list[str] = field(default_factory=list)  # Triton kernels earlier campaigns reached, this one not
    farm: dict | None = None      # what its own compile farm did (Farm.summary())
    # CPU seconds: the campaign's own process (judging included where the kernel runs in it), and the
    # judging of its examples wherever it ran; against elapsed time they show a busy or a waiting host
    cpu_seconds: float = 0.0
    judging_cpu_seconds: float = 0.0
    run_queue_seconds: float | None = None  # its search's thread runnable but waiting for a core (Linux)
    # wall-clock times of the steps of its start that it saw: started, worker_loaded and worker_ready
    # (its worker had imported the kernel; had opened its device too), farm_started (its own farm)
    startup: dict[str, float] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return self.failure is not None

    def startup_seconds(self, since: float | None = None) -> dict[str, float]:
        """Seconds from ``since`` (a wall-clock time; by default its own start) to each step of its start."""
        since = self.startup.get("started") if since is None else since
        if since is None:
            return {}
        return {f"{step}_s": round(at - since, 3) for step, at in self.startup.items() if step != "started"}

    def note_early(self, record: dict) -> None:
        """A check among the campaign's first examples (``check_record``): when it started (seconds from
        the campaign's start), how long it took, how much of that the judging process spent on it (the
        rest is the handoff: the case to the worker and the outcome back), how much it waited for device
        memory, how much for a binary another process was compiling, how much its worker spent compiling
        (or loading) binaries itself, and its check's phases (materialise, kernel, oracle...; what the
        judging process spent beside them and the memory wait is its admission).  Checks whose case was
        put off (``put_off_record``) are kept in place among them, beyond the ``EARLY_EXAMPLES`` examples'
        count: the time between two examples is theirs."""
        if sum(early["verdict"] != PUT_OFF for early in self.early_examples) < EARLY_EXAMPLES:
            self.early_examples.append(record)

    def passed_budget(self, record: dict) -> None:
        """A check under way when the ``record["budget_s"]`` time budget ran out, which ended
        ``record["past_s"]`` past it (a ``check_record``): kept if no other ended further past."""
        if self.past_budget is None or record["past_s"] > self.past_budget["past_s"]:
            self.past_budget = record

    def note_past_budget(self) -> None:
        """A passing campaign's note (replacing any earlier one: each job's) for the check that ended
        furthest past the time budget, from ``PAST_BUDGET_NOTE_S`` on, and what it spent its time on."""
        self.notes = [note for note in self.notes if _PAST_BUDGET_NOTE not in note]
        record = self.past_budget
        if record is None or record["past_s"] < PAST_BUDGET_NOTE_S or self.failed:
            return
        spent = ((record["compiled_s"], "its worker compiling"), (record["memory_wait_s"], "waiting for device memory"),
                 (record["farm_wait_s"], "waiting for a binary compiling elsewhere"))
        where = ", ".join(f"{what} {seconds:.1f} s" for seconds, what in spent if seconds >= 0.1)
        self.notes.append(f"{self.kernel}: a check under way when the {record['budget_s']:g} s budget ran out ended "
                          f"{record['past_s']:.1f} s {_PAST_BUDGET_NOTE}, after {record['seconds']:.1f} s"
                          + (f" ({where})" if where else "") + "; a time budget stops new checks, not one under way")

    def note_left_at_budget_end(self) -> None:
        """The note (replacing any earlier one: each job's) for the cases left unchecked at the budget's end."""
        self.notes = [note for note in self.notes if _LEFT_AT_BUDGET_END_NOTE not in note]
        if self.left_at_budget_end:
            count = self.left_at_budget_end
            self.notes.append(f"{self.kernel}: {count} case{'s' if count > 1 else ''} drawn in the time budget's last "
                              f"seconds {'were' if count > 1 else 'was'} {_LEFT_AT_BUDGET_END_NOTE}")

    def declined(self, declined, shrinking: bool = False) -> None:
        """A case declined for memory (a ``harness.launch.worker.Declined``): counted, and the first
        of each kind noted."""
        if declined.judging_failed and not self.judging_out_of_memory:
            self.notes.append(f"{self.kernel}: nanfuzz ran out of device memory judging a case, retried it once "
                              f"with its memory reserved again, and ran out again: {declined.reason} (such cases are "
                              "counted as judging_out_of_memory, never as the kernel's verdict; the campaign went on)")
        elif shrinking and not any(_SHRINK_DECLINE_NOTE in note for note in self.notes):
            self.notes.append(f"{self.kernel}: {_SHRINK_DECLINE_NOTE}: {declined.reason}; the repro is the smallest "
                              "failing case that could run")
        elif not shrinking and not declined.judging_failed and not self.declined_for_memory:
            self.notes.append(f"{self.kernel}: a drawn case was skipped: {declined.reason} (such cases are counted as "
                              "declined_for_memory; the campaign went on)")
        self.declined_for_memory += 1
        self.judging_out_of_memory += declined.judging_failed

    def count(self, outcome: Outcome) -> None:
        if outcome.memory_waited > 0:
            self.memory_waits += 1
            self.memory_wait_seconds += outcome.memory_waited
        self.memory_wait_causes.update(outcome.memory_wait_causes)
        self.examples += 1
        self.judging_cpu_seconds += outcome.cpu_seconds
        self.verdicts[outcome.verdict.value] = self.verdicts.get(outcome.verdict.value, 0) + 1
        for phase, seconds in outcome.timings.items():
            self.phase_times[phase] = self.phase_times.get(phase, 0.0) + seconds

    def tally(self, case: Case, outcome: Outcome) -> None:
        """``count`` plus what the case exercised and how close it came to the bound."""
        self.count(outcome)
        self.statistics.add(case, outcome.paths, coverage.observed(outcome))
        self.accuracy.add(outcome.evidence)

    def note_declines(self) -> None:
        """A note (replacing any earlier one) when the kernel declined more than ``DECLINE_NOTE_SHARE``
        of the cases drawn."""
        self.notes = [note for note in self.notes if _DECLINE_NOTE not in note]
        declined = self.statistics.declined
        total = sum(declined.values())
        drawn = total + self.statistics.examples
        if drawn and total > DECLINE_NOTE_SHARE * drawn:
            reasons = ", ".join(f"{reason} ({n})" for reason, n in declined.most_common(3))
            self.notes.append(f"{self.kernel}: {total} ({100 * total / drawn:.0f}%) {_DECLINE_NOTE}: {reasons}; "
                              "a constraint this common belongs in its Capabilities (min_window, "
                              "uniform_query_len, max_query_len, ...), which the strategies draw within")

    def note_unreached(self) -> None:
        """A passing campaign's note (replacing any earlier one: each job's of a run with --jobs) naming
        each production target it did not reach, and why."""
        self.notes = [note for note in self.notes if UNREACHED_NOTE not in note]
        line = self.statistics.unreached_line()
        if line and not self.failed and not self.interrupted and self.examples:
            self.notes.append(f"{self.kernel}: {line}")

    def note_reads(self) -> None:
        """A note (replacing any earlier one) for dead slots the kernel loaded in passing examples."""
        note = coverage.unused_note(self.kernel, self.statistics)
        self.notes = [n for n in self.notes if coverage.UNUSED_NOTE not in n]
        if note:
            self.notes.append(note)

    def found(self, outcome: Outcome, case: Case, at: float) -> None:
        """The first failure, found ``at`` seconds into the campaign."""
        self.failure, self.failing_case = outcome, case
        self.time_to_first_failure = at
        self.examples_to_first_failure = self.examples
