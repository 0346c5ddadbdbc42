"""Checks that wait for a compile go to the back of the queue (harness.campaign.deferrals): a case whose
binary another process is compiling is put off, checked once the binary lands, and a failure
found that way is shrunk as if it had been found in order; a passing campaign still checks
every case it drew, once."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from nanfuzz.harness.launch import shared_compiles
from nanfuzz.harness.judge.check import Outcome, Verdict
from nanfuzz.harness.campaign.deferrals import Deferrals, FoundLate, Replay
from nanfuzz.harness.campaign.result import EARLY_EXAMPLES
from nanfuzz.harness.campaign.runner import fuzz
from nanfuzz.harness.launch.subjects import worker_spec
from nanfuzz.harness.registry import resolve
from nanfuzz.harness.campaign.settings import Settings
from nanfuzz.harness.launch.shared_compiles import Skipped
from nanfuzz.harness.launch.worker import CLAIMED, UNBUILT, Deferred, Supervised
from tests import subjects
from tests.cases import consecutive_case

KERNEL = resolve("paged_decode@masked")  # only its capabilities: the subjects below judge the cases


class PuttingOff:
    """A subject whose worker, asked to defer, puts off every ``every``-th new case it meets for as
    long as that case's binary compiles "in another process": the binary lands ``lands_after``
    checks later, or never (``lands_after=None``: only a check that may wait gets a verdict)."""

    defers = True

    def __init__(self, claims: Path, fails, every: int = 3, lands_after: int | None = 4):
        self.claims, self.fails, self.every, self.lands_after = claims, fails, every, lands_after
        self.calls = 0
        self.asked: list = []        # new cases asked to be checked with deferral allowed, in order
        self.checked: list = []      # cases judged, in order
        self.put_off: list = []      # cases put off, in order (a case drawn again may be put off again)
        self._claim: dict = {}       # case -> the claim of its binary
        self._landing: list[tuple[Path, int]] = []

    def check(self, case, *, digest=False, explain=False, defer=False, patience=None):
        self.calls += 1
        for claim, at in self._landing:
            if self.calls >= at and claim.exists():
                claim.unlink()
                claim.with_suffix(".landed").touch()
        if defer and case not in self.asked:
            self.asked.append(case)
            if len(self.asked) % self.every == 0:
                claim = self._claim[case] = self.claims / f"claim-{len(self.asked)}"
                claim.write_text(str(os.getpid()))  # a live holder: this process
                if self.lands_after is not None:
                    self._landing.append((claim, self.calls + self.lands_after))
        claim = self._claim.get(case)
        if defer and claim is not None and claim.exists():
            self.put_off.append(case)
            return Deferred(Skipped(str(claim), str(claim.with_suffix(".landed"))))
        self.checked.append(case)
        if self.fails(case):
            return Outcome(Verdict.NONFINITE, "NONFINITE: planted", {})
        return Outcome(Verdict.PASS, "PASS", {})

    def close(self):
        pass


def _three_long(case) -> bool:
    # a usual batch's (the interpreter's long batches hold five sequences or more, the first of 1025
    # keys or more: they would meet it in the first cases drawn)
    return len(case.sequences) >= 3 and 5 <= case.sequences[0].seq_len < 1024


def _campaign(tmp_path, subject, **overrides):
    settings = Settings(device="cpu", state_dir=tmp_path / "state", use_database=False, replays=0)
    return fuzz(KERNEL, settings, subject=subject, check_leftovers=False, **overrides)


def _shape(case):
    return [(s.query_len, s.seq_len) for s in case.sequences]


@pytest.mark.parametrize("lands_after", [2, None])
def test_a_failure_checked_late_is_shrunk_to_what_the_in_order_search_finds(tmp_path, lands_after):
    in_order = PuttingOff(tmp_path, _three_long)
    in_order.defers = False
    late = PuttingOff(tmp_path, _three_long, every=1, lands_after=lands_after)  # each case put off once
    expected = _campaign(tmp_path, in_order, max_examples=200, seed=3)
    found = _campaign(tmp_path, late, max_examples=200, seed=3)
    assert expected.failed and found.failed
    assert found.deferred == len(late.put_off) > 1
    first_failure = next(case for case in late.checked if _three_long(case))
    assert first_failure in late.put_off and late.put_off.index(first_failure) < len(late.put_off) - 1
    assert _shape(found.failing_case) == _shape(expected.failing_case) == [(1, 5), (0, 0), (0, 0)]
    assert not any("unshrunk" in note for note in found.notes), found.notes


def test_a_failure_put_off_is_found_after_cases_drawn_later_and_timed_when_found(tmp_path):
    subject = PuttingOff(tmp_path, _three_long, every=1, lands_after=3)  # every case is put off once
    campaign = _campaign(tmp_path, subject, max_examples=200, seed=3, shrink=False)
    assert campaign.failed and _three_long(campaign.failing_case)
    first = subject.checked.index(campaign.failing_case)
    assert subject.put_off.index(campaign.failing_case) < len(subject.put_off) - 1  # drawn before others
    assert campaign.examples_to_first_failure == first + 1
    assert len(subject.asked) < 20  # checked once its binary landed, while the search still drew cases


def test_a_passing_campaign_checks_every_case_it_drew_once_whatever_was_put_off(tmp_path):
    in_order = PuttingOff(tmp_path, lambda case: False)
    in_order.defers = False
    late = PuttingOff(tmp_path, lambda case: False, lands_after=None)  # nothing lands before the run ends
    expected = _campaign(tmp_path, in_order, max_examples=60, seed=5)
    found = _campaign(tmp_path, late, max_examples=60, seed=5)
    assert not found.failed and found.deferred > 0
    assert sorted(map(repr, late.checked)) == sorted(map(repr, in_order.checked))
    assert found.examples == expected.examples == len(late.checked)


def test_a_case_put_off_among_the_first_examples_is_kept_in_place_with_what_it_cost(tmp_path):
    order = []  # what the subject did with each case it was asked, in turn

    class Costing(PuttingOff):
        def check(self, case, *, digest=False, explain=False, defer=False, patience=None):
            outcome = super().check(case, digest=digest, explain=explain, defer=defer, patience=patience)
            order.append("put off" if isinstance(outcome, Deferred) else outcome.verdict.value)
            if isinstance(outcome, Deferred):
                return Deferred(outcome.skipped, 0.25, 0.0, (("materialize", 0.2), ("kernel", 0.01)))
            return outcome

    subject = Costing(tmp_path, lambda case: False, every=3, lands_after=2)
    campaign = _campaign(tmp_path, subject, max_examples=100, seed=5)
    early = campaign.early_examples
    put_off = [record for record in early if record["verdict"] == "put off"]
    judged = [record for record in early if record["verdict"] != "put off"]
    assert campaign.examples > EARLY_EXAMPLES
    assert put_off and len(judged) == EARLY_EXAMPLES  # beyond the examples' count, not in place of them
    assert all(r["judged_s"] == 0.25 and r["phases"] == {"materialize": 0.2, "kernel": 0.01} for r in put_off)
    assert [r["at_s"] for r in early] == sorted(r["at_s"] for r in early)  # in the order they were checked
    assert [r["verdict"] for r in early] == order[:len(early)]  # each in its place among the checks


def test_nothing_is_put_off_once_a_failure_is_found(tmp_path):
    asked = []

    class Recording(PuttingOff):
        def check(self, case, *, digest=False, explain=False, defer=False, patience=None):
            asked.append((defer, bool(self.checked) and any(map(_three_long, self.checked))))
            return super().check(case, digest=digest, explain=explain, defer=defer, patience=patience)

    campaign = _campaign(tmp_path, Recording(tmp_path, _three_long), max_examples=200, seed=3)
    assert campaign.failed
    assert not any(defer for defer, after_failure in asked if after_failure)


def test_deferrals_give_back_the_cases_whose_binary_landed_or_that_nobody_compiles_without_a_farm(tmp_path):
    live, ended, dead, landed = (tmp_path / name for name in ("live", "ended", "dead", "landed"))
    for claim in (live, landed):
        claim.write_text(str(os.getpid()))
    dead.write_text("999999999")  # no such process: its claim is void
    (tmp_path / "landed.group").touch()
    while_farm_runs = Deferrals()
    without_farm = Deferrals()
    for deferrals in (while_farm_runs, without_farm):
        for case_seed, claim in enumerate((live, ended, dead, landed)):  # nobody compiled them when put off
            deferrals.add(consecutive_case([(1, 20)], seed=case_seed), Skipped(str(claim), str(claim) + ".group", False))
    # a farm may still compile what nobody compiles now: only a landed binary is ready
    assert [(case.data_seed, built) for case, built in while_farm_runs.landed(farm_running=True)] == [(3, True)]
    assert [(case.data_seed, built) for case, built in without_farm.landed(farm_running=False)] == [
        (1, False), (2, False), (3, True)]
    assert without_farm and without_farm.count == 4
    assert [case.data_seed for case in without_farm.remaining()] == [0] and not without_farm


def test_a_binary_whose_compile_elsewhere_ended_without_landing_is_compiled_by_the_check(tmp_path):
    # the farm's compile of it failed, or its process died: waiting for the farm to finish would
    # only delay the failure the check meets when it compiles the binary itself
    claimed_then, nobody_then = tmp_path / "claimed", tmp_path / "nobody"
    deferrals = Deferrals()
    deferrals.add(consecutive_case([(1, 20)], seed=0), Skipped(str(claimed_then), str(tmp_path / "a.group"), True))
    deferrals.add(consecutive_case([(1, 20)], seed=1), Skipped(str(nobody_then), str(tmp_path / "b.group"), False))
    nobody_then.write_text(str(os.getpid()))  # a farm process takes it up after the case was put off
    assert [(case.data_seed, built) for case, built in deferrals.landed(farm_running=True)] == [(0, False)]
    nobody_then.unlink()  # ... and ends without landing it
    assert [(case.data_seed, built) for case, built in deferrals.landed(farm_running=True)] == [(1, False)]
    assert not deferrals


def test_a_replay_answers_judged_cases_and_passes_over_unchecked_ones_until_the_failure():
    passed, failing, unchecked = (consecutive_case([(1, 20)], seed=s) for s in range(3))
    failure = Outcome(Verdict.NONFINITE, "NONFINITE", {})
    replay = Replay(FoundLate(failing, failure), {passed: Outcome(Verdict.PASS, "PASS", {})}, [unchecked])
    assert replay.passes_over(unchecked) and replay.known(unchecked) is None
    assert replay.known(passed).verdict is Verdict.PASS
    assert replay.known(failing) is failure
    assert not replay.passes_over(unchecked)  # shrinking now: every new case is checked


def test_a_worker_puts_off_a_case_whose_binary_another_process_compiles_or_nobody_has_built(tmp_path,
                                                                                           monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    claim = tmp_path / subjects.ELSEWHERE_KEY / shared_compiles.CLAIM_FILE
    claim.parent.mkdir()
    claim.write_text(str(os.getpid()))  # this process compiles it
    subject = Supervised(worker_spec(subjects.compiles_elsewhere, Settings(device="cpu")), launch_timeout=5.0,
                         prefer_fork=True)  # a plain fork: the worker sees this test's cache folder
    subject.defers = True  # as on a GPU, where workers share compiles
    windowed = consecutive_case([(1, 20)], window=4)
    try:
        put_off = subject.check(windowed, defer=CLAIMED)
        assert isinstance(put_off, Deferred) and put_off.skipped.claim == str(claim)
        # what the check spent before it put the case off: the batches built, the launch begun
        phases = dict(put_off.phases)
        assert phases["materialize"] > 0 and "kernel" in phases and put_off.seconds >= sum(phases.values())
        assert shared_compiles.claim_pending(put_off.skipped.claim) and not os.path.exists(put_off.skipped.landed)
        assert subject.check(consecutive_case([(1, 20)]), defer=CLAIMED).verdict is Verdict.PASS
        claim.unlink()  # the other process is gone: nobody compiles it now
        unbuilt = subject.check(windowed, defer=UNBUILT)  # a farm would: the worker leaves it to the farm
        assert isinstance(unbuilt, Deferred) and not claim.exists()
        assert subject.check(windowed, defer=CLAIMED).verdict is Verdict.PASS  # compiled in the worker
        assert os.path.exists(put_off.skipped.landed) and not claim.exists()
        assert subject.check(windowed, defer=UNBUILT).verdict is Verdict.PASS  # built: nothing to skip
        assert subject.restarts == 0 and not subject._clock.in_launch and not subject._clock.compiling
    finally:
        subject.close()


def test_a_case_whose_earlier_launch_faulted_the_device_takes_the_crash_instead_of_being_put_off(tmp_path,
                                                                                                monkeypatch):
    """A put-off case's output is never read, so an illegal address one of its earlier launches made
    would surface in the next case's first CUDA call; a launch that raises looks for it first."""
    from nanfuzz.harness.judge import runs
    from nanfuzz.harness.launch.processes import plain_fork_context

    if plain_fork_context() is None:  # a GPU session, say: its workers come from the fork server
        pytest.skip("the simulated fault reaches a worker only through a plain fork of this process")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    claim = tmp_path / subjects.ELSEWHERE_KEY / shared_compiles.CLAIM_FILE
    claim.parent.mkdir()
    claim.write_text(str(os.getpid()))
    fault = RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.setattr(runs, "pending_fault", lambda device: fault)  # a plain fork: the worker has it too
    subject = Supervised(worker_spec(subjects.compiles_elsewhere, Settings(device="cpu")), launch_timeout=5.0,
                         prefer_fork=True)
    subject.defers = True
    try:
        outcome = subject.check(consecutive_case([(1, 20)], window=4), defer=CLAIMED)
        assert subject._plain_fork
        assert isinstance(outcome, Outcome) and outcome.verdict is Verdict.CRASH and outcome.fatal
        assert "illegal memory access" in outcome.summary and outcome.evidence["device_fault"]
        assert subject.restarts == 1  # its context is dead: the next case gets a fresh worker
    finally:
        subject.close()


class FarmFinishingAfter:
    """Stands for a compile farm's handle: it runs until it has been asked ``polls`` times."""

    per_binary = True

    def __init__(self, polls: int):
        self.polls = polls
        self.folder = ""  # no tasks' markers to read

    def running(self) -> bool:
        self.polls -= 1
        return self.polls > 0

    def peek(self) -> bool:
        return self.polls > 0

    def wait_for(self, kernel, case) -> float:
        return 0.0

    def unbuilt(self, kernel, case) -> tuple[str, str] | None:
        return None

    def stuck_marker(self, kernel, case) -> str | None:
        return None


def test_while_a_farm_runs_nothing_waits_for_a_binary_and_the_end_of_the_run_waits_for_the_farm(tmp_path):
    asked = []

    class Recording(PuttingOff):
        def check(self, case, *, digest=False, explain=False, defer=None, patience=None):
            asked.append((defer, farm.peek()))
            return super().check(case, digest=digest, explain=explain, defer=defer, patience=patience)

    subject = Recording(tmp_path, lambda case: False, every=2, lands_after=None)  # lands when the farm is done
    farm = FarmFinishingAfter(polls=400)
    campaign = _campaign(tmp_path, subject, max_examples=60, seed=5, farm=farm)
    assert not campaign.failed and campaign.deferred > 0
    assert all(defer == UNBUILT for defer, running in asked if running)  # never a blocking check meanwhile
    assert any(defer is None for defer, running in asked if not running)  # the rest, once the farm is done
    assert len(set(map(repr, subject.checked))) == len(set(map(repr, subject.asked)))
    # the end of the run, polling for the farm's binaries, is waiting for compiles, not generation
    assert campaign.phase_times.get("compile", 0.0) > 0.005, campaign.phase_times


class FarmStuckOnItsTasks(FarmFinishingAfter):
    """Stands for a per-binary farm whose task of every entry waits for device memory (``stuck``)."""

    def __init__(self, stuck: Path, polls: int):
        super().__init__(polls)
        self.stuck = stuck

    def stuck_marker(self, kernel, case) -> str | None:
        return str(self.stuck)


def test_a_case_put_off_for_a_binary_nobody_compiles_is_checked_once_the_farm_s_task_of_it_is_stuck(tmp_path):
    asked = []

    class NobodyCompiles(PuttingOff):
        """Puts off each new case once, for a binary nobody compiles (left to the farm)."""

        def check(self, case, *, digest=False, explain=False, defer=None, patience=None):
            asked.append((case, defer, farm.peek()))
            if defer == UNBUILT and case not in self.put_off:
                self.put_off.append(case)
                name = f"binary-{len(self.put_off)}"
                return Deferred(Skipped(str(tmp_path / name), str(tmp_path / f"{name}.landed"), claimed=False))
            return super().check(case, digest=digest, explain=explain, defer=defer, patience=patience)

    stuck = tmp_path / "task.stuck"
    stuck.touch()
    subject = NobodyCompiles(tmp_path, lambda case: False, every=10**9)
    farm = FarmStuckOnItsTasks(stuck, polls=400)
    campaign = _campaign(tmp_path, subject, max_examples=30, seed=5, farm=farm)
    assert not campaign.failed and campaign.deferred == len(subject.put_off) > 0
    again = _asked_again(asked, subject.put_off)
    assert again and all(defer == CLAIMED and running for defer, running in again)  # not at the farm's end
    stuck.unlink()  # the farm's task compiling: such a case waits for it, as before
    asked.clear()
    subject = NobodyCompiles(tmp_path, lambda case: False, every=10**9)
    farm = FarmStuckOnItsTasks(stuck, polls=400)
    campaign = _campaign(tmp_path, subject, max_examples=30, seed=5, farm=farm)
    again = _asked_again(asked, subject.put_off)
    assert again and not any(running for defer, running in again)


def _asked_again(asked, put_off) -> list:
    """(defer, whether the farm ran) of each late check of a case put off (a case drawn again is asked
    to be checked with deferral allowed, as any new case)."""
    met, again = set(), []
    for case, defer, running in asked:
        if case in put_off and repr(case) in met and defer != UNBUILT:
            again.append((defer, running))
        met.add(repr(case))
    return again


@pytest.mark.parametrize("taken", [True, False])
def test_a_large_case_whose_memory_the_farm_holds_is_put_off_until_the_farm_ends_never_declined(
        tmp_path, monkeypatch, taken):
    # a farm's compiling tasks give back nothing until their compiles end: a large case's check waits
    # moments for memory beside the farm, not the search's whole wait; a case that never fits is declined
    from nanfuzz.harness.campaign.search import FARM_BUSY_PATIENCE
    from nanfuzz.harness.launch.worker import Declined
    from nanfuzz.reference import case as case_module

    monkeypatch.setattr(case_module, "LARGE_ELEMENTS", 0)  # every case drawn counts as large
    asked, declined_beside = [], []

    class MemoryHeldByTheFarm(PuttingOff):
        """Every new case's memory is held while the farm runs (for a wait the farm's patience allows)."""

        def check(self, case, *, digest=False, explain=False, defer=None, patience=None):
            asked.append((case, patience, farm.peek()))
            if farm.peek() and (patience is None or patience > FARM_BUSY_PATIENCE):
                raise AssertionError(f"a large case waits {patience} s for memory beside the farm")
            if farm.peek() and case not in self.put_off:
                self.put_off.append(case)
                declined_beside.append(len(asked) - 1)
                return Declined("this case needs about 9 GiB of GPU memory and 2 GiB are free", memory_taken=taken)
            return super().check(case, digest=digest, explain=explain, defer=defer, patience=patience)

    in_order = PuttingOff(tmp_path, lambda case: False)
    in_order.defers = False
    subject = MemoryHeldByTheFarm(tmp_path, lambda case: False, every=10**9)
    farm = FarmFinishingAfter(polls=120)
    campaign = _campaign(tmp_path, subject, max_examples=30, seed=5, farm=farm)
    expected = _campaign(tmp_path, in_order, max_examples=30, seed=5)
    assert not campaign.failed and subject.put_off
    if not taken:
        assert campaign.declined_for_memory == len(subject.put_off) and campaign.deferred == 0
        return
    assert campaign.declined_for_memory == 0 and campaign.deferred == len(subject.put_off)
    # after one is put off, the next gets one look, until one gets its memory
    beside = [(n, patience) for n, (case, patience, running) in enumerate(asked) if running]
    expected = [0.0 if m > 0 and beside[m - 1][0] in declined_beside else FARM_BUSY_PATIENCE for m in range(len(beside))]
    assert [patience for _, patience in beside] == expected and 0.0 in expected
    late = [patience for case, patience, running in asked if case in subject.put_off and not running]
    assert len(late) == len(subject.put_off) and all(patience > FARM_BUSY_PATIENCE for patience in late)
    assert sorted(map(repr, subject.checked)) == sorted(map(repr, in_order.checked))  # each once, as in order
    put_off = [record for record in campaign.early_examples if record["verdict"] == "put off"]
    assert len(put_off) == len(subject.put_off)


def test_a_late_failure_the_redrawn_run_never_meets_stands_unshrunk_with_a_note(tmp_path, monkeypatch):
    # a Hypothesis that drew differently the second time: the failure found is still the campaign's
    from nanfuzz.harness.campaign import deferrals

    monkeypatch.setattr(deferrals.Replay, "known", lambda self, case: None if case == self.case else
                        self.judged.get(case))
    monkeypatch.setattr(deferrals.Replay, "passes_over", lambda self, case: case == self.case or
                        case in self.unchecked)
    only: list = []  # the one case that fails: the first long one checked

    def fails(case) -> bool:
        if _three_long(case) and not only:
            only.append(case)
        return case in only

    subject = PuttingOff(tmp_path, fails, every=1, lands_after=3)
    campaign = _campaign(tmp_path, subject, max_examples=200, seed=3)
    assert campaign.failed and campaign.failing_case == only[0]  # as found
    assert any("unshrunk" in note for note in campaign.notes), campaign.notes


class CompilingNewShapes:
    """A GPU-like subject on a clock moved by hand: a case of a shape it has not compiled yet takes
    ``compile_s`` (its binary compiled in the worker), unless the check may put such a case off
    (``UNBUILT``); any other case takes 0.1 s."""

    defers = True

    def __init__(self, tmp_path, now: list, compile_s: float = 3.0):
        self.tmp_path, self.now, self.compile_s = tmp_path, now, compile_s
        self.built: set = set()
        self.compiles_began: list[float] = []  # when each compile began, on the clock
        self.checked_at: list[float] = []      # when each check that got a verdict began

    def check(self, case, *, digest=False, explain=False, defer=None, patience=None):
        g = case.geometry
        shape = (g.num_q_heads, g.num_kv_heads, g.head_size, g.block_size, g.dtype)
        if shape not in self.built and defer == UNBUILT:
            n = len(self.built)
            return Deferred(Skipped(str(self.tmp_path / f"claim-{n}"), str(self.tmp_path / f"landed-{n}")))
        self.checked_at.append(self.now[0])
        outcome = Outcome(Verdict.PASS, "PASS", {})
        if shape not in self.built:
            self.compiles_began.append(self.now[0])
            self.built.add(shape)
            self.now[0] += self.compile_s
            outcome.compiled_seconds = self.compile_s
        else:
            self.now[0] += 0.1
        return outcome

    def close(self):
        pass


def _budget_run(tmp_path, monkeypatch, reserve: float, compile_s: float = 3.0, budget: float = 30.0,
                examples: int = 100_000, farm=None):
    import time as time_module
    import types

    from nanfuzz.harness.campaign import runner, search

    now = [0.0]
    clock = types.SimpleNamespace(perf_counter=lambda: now[0], process_time=time_module.process_time,
                                  time=time_module.time, sleep=time_module.sleep)
    monkeypatch.setattr(runner, "time", clock)
    monkeypatch.setattr(search, "time", clock)
    monkeypatch.setattr(search, "LEAST_COMPILE_RESERVE", reserve)
    subject = CompilingNewShapes(tmp_path, now, compile_s)
    campaign = _campaign(tmp_path, subject, max_examples=examples, time_budget=budget, seed=4, farm=farm)
    return campaign, subject, now[0]


def test_in_the_budget_s_last_seconds_no_check_begins_a_compile(tmp_path, monkeypatch):
    campaign, subject, ended = _budget_run(tmp_path, monkeypatch, reserve=10.0)
    assert not campaign.failed and subject.compiles_began
    assert max(subject.compiles_began) < 20.0  # none with less than 10 s of the 30 s budget left
    assert ended < 30.0 + 0.1 + 1e-9  # the last check began before the budget ran out, and compiled nothing
    assert any(at >= 20.0 for at in subject.checked_at)  # cases of shapes already built are still checked
    count = campaign.left_at_budget_end
    assert count > 0 and campaign.notes.count(
        f"{KERNEL.name}: {count} case{'s' if count > 1 else ''} drawn in the time budget's last seconds "
        f"{'were' if count > 1 else 'was'} left unchecked, as a compile of a binary no process had built "
        "would have run past the budget") == 1
    # without the reserve the same search compiles in those seconds, and runs past the budget
    campaign, subject, ended = _budget_run(tmp_path, monkeypatch, reserve=0.0)
    assert max(subject.compiles_began) >= 20.0 and campaign.left_at_budget_end == 0


def test_the_reserve_is_the_longest_compile_seen_when_that_is_longer(tmp_path, monkeypatch):
    campaign, subject, ended = _budget_run(tmp_path, monkeypatch, reserve=1.0, compile_s=4.0)
    assert max(subject.compiles_began) < 30.0 - 4.0 and ended < 30.1  # 4 s compiles: none in the last 4 s
    assert campaign.left_at_budget_end > 0  # (with a reserve of 1 s alone, one began 26.2 s in)


class FarmDoneAlready(FarmFinishingAfter):
    """Stands for a per-binary farm that finished before the campaign's first case, its tasks' markers
    left in ``folder``: each ``(ok, seconds, seconds of them waiting for memory)``."""

    def __init__(self, folder: Path, tasks):
        super().__init__(polls=0)  # never running
        folder.mkdir()
        self.folder = str(folder)
        for n, (ok, seconds, memory_wait) in enumerate(tasks):
            (folder / f"entry.{n}.done").write_text(json.dumps({"ok": ok, "seconds": seconds,
                                                                "memory_wait": memory_wait}))


def test_the_reserve_is_the_farm_s_slowest_task_when_that_is_longer(tmp_path, monkeypatch):
    # its slowest built task: 13 s, 1 s of them waiting for memory; one given up, one mostly waiting
    farm = FarmDoneAlready(tmp_path / "farm", [(True, 13.0, 1.0), (False, 40.0, 0.0), (True, 40.0, 35.0)])
    campaign, subject, ended = _budget_run(tmp_path, monkeypatch, reserve=1.0, compile_s=3.0, farm=farm)
    assert max(subject.compiles_began) < 30.0 - 12.0 and campaign.left_at_budget_end > 0
    assert max(subject.compiles_began) >= 10.0  # the waits for memory are not compiling
    campaign, subject, ended = _budget_run(tmp_path, monkeypatch, reserve=1.0, compile_s=3.0)
    assert max(subject.compiles_began) >= 30.0 - 12.0  # without the farm's tasks: compiles until 3 s are left


def test_a_budget_shorter_than_the_reserve_still_compiles_its_first_example(tmp_path, monkeypatch):
    # every shape new, none built by anyone: the first case compiles, as a campaign must judge one
    campaign, subject, ended = _budget_run(tmp_path, monkeypatch, reserve=10.0, budget=5.0, examples=300)
    assert campaign.examples >= 1 and subject.compiles_began[0] == 0.0 and ended < 10.0


def test_jobs_cases_left_at_the_budget_s_end_are_summed_in_one_note():
    from nanfuzz.harness.campaign.jobs import _merge
    from nanfuzz.harness.campaign.result import Campaign

    jobs = []
    for left in (2, 3):
        job = Campaign(kernel="k", device="cuda", examples=10, left_at_budget_end=left)
        job.note_left_at_budget_end()
        jobs.append((job, (0.0, 1.0)))
    merged = _merge("k", "cuda", jobs, 0.0)
    assert merged.left_at_budget_end == 5
    assert [note for note in merged.notes if "left unchecked" in note] == [
        "k: 5 cases drawn in the time budget's last seconds were left unchecked, as a compile of a binary no "
        "process had built would have run past the budget"]


class FarmBuildingEntries(FarmFinishingAfter):
    """Stands for a per-binary farm that builds the pool entries one at a time, in the order the search
    first asks about them: each ``every`` looks at it, the first entry still waiting is done."""

    def __init__(self, folder: Path, polls: int, every: int = 4):
        super().__init__(polls)
        self.folder, self.every = folder, every
        self.waiting: list = []  # entries met and not yet built, in order
        self.built: set = set()
        self.looks = 0
        self.unstuck_answers = 0  # cases of an unbuilt entry whose task was not stuck

    def _marker(self, entry, state: str = "done") -> Path:
        return self.folder / f"entry-{abs(hash(entry))}.{state}"

    def unbuilt(self, kernel, case) -> tuple[str, str] | None:
        from nanfuzz.harness.launch.farm import entry_of

        self.looks += 1
        if self.waiting and self.looks % self.every == 0:
            self._finish(self.waiting.pop(0))
        entry = entry_of(case)
        if entry in self.built:
            return None
        if entry not in self.waiting:
            self.waiting.append(entry)
        stuck = self._marker(entry, "stuck")
        self.unstuck_answers += not stuck.exists()
        return str(self._marker(entry)), str(stuck)

    def _finish(self, entry) -> None:
        self._marker(entry).touch()
        self.built.add(entry)

    def is_built(self, case) -> bool:
        from nanfuzz.harness.launch.farm import entry_of

        return entry_of(case) in self.built or not self.peek()


class FarmStuckOnEntries(FarmBuildingEntries):
    """As ``FarmBuildingEntries``, but each entry's task gets stuck (waiting for memory, say) instead of
    being built; it marks nothing done while it runs."""

    def _finish(self, entry) -> None:
        self._marker(entry, "stuck").touch()


def _unbuilt_entries_run(tmp_path, name: str, farm_kind=FarmBuildingEntries):
    """A campaign beside a farm that builds its entries one at a time: the cases its worker was sent
    while their entry was unbuilt, the campaign, its subject (its ``farm`` beside it) and the same
    search run in order."""
    sent_unbuilt = []

    class Recording(PuttingOff):
        def check(self, case, *, digest=False, explain=False, defer=None, patience=None):
            if not farm.is_built(case):
                sent_unbuilt.append((case, defer, farm.peek()))
            return super().check(case, digest=digest, explain=explain, defer=defer, patience=patience)

    in_order = PuttingOff(tmp_path, lambda case: False)
    in_order.defers = False
    subject = Recording(tmp_path, lambda case: False, every=10**9)  # its worker never puts a case off itself
    farm = subject.farm = farm_kind(tmp_path / name, polls=300)
    farm.folder.mkdir()
    expected = _campaign(tmp_path, in_order, max_examples=60, seed=5)
    campaign = _campaign(tmp_path, subject, max_examples=60, seed=5, farm=farm)
    return sent_unbuilt, campaign, subject, in_order, expected


def test_a_large_case_of_an_entry_the_farm_has_built_nothing_of_is_put_off_before_its_worker_sees_it(
        tmp_path, monkeypatch):
    from nanfuzz.reference import case as case_module

    monkeypatch.setattr(case_module, "LARGE_ELEMENTS", 0)  # every case drawn counts as large
    sent_unbuilt, campaign, subject, in_order, expected = _unbuilt_entries_run(tmp_path, "farm")
    assert not sent_unbuilt
    assert not campaign.failed and campaign.deferred > 0 and subject.put_off == []
    put_off = [record for record in campaign.early_examples if record["verdict"] == "put off"]
    assert put_off and all(record["seconds"] == 0 and record["judged_s"] == 0 for record in put_off)
    assert sorted(map(repr, subject.checked)) == sorted(map(repr, in_order.checked))  # each once, as in order
    assert campaign.examples == expected.examples


def test_a_large_case_put_off_for_a_farm_task_that_is_stuck_is_checked_while_the_farm_runs(tmp_path, monkeypatch):
    # its check's memory may come sooner than the farm's: it compiles what it needs itself
    from nanfuzz.reference import case as case_module

    monkeypatch.setattr(case_module, "LARGE_ELEMENTS", 0)
    sent_unbuilt, campaign, subject, in_order, expected = _unbuilt_entries_run(tmp_path, "farm", FarmStuckOnEntries)
    assert not campaign.failed and campaign.deferred > 0
    while_running = [defer for _, defer, running in sent_unbuilt if running]
    assert while_running and set(while_running) == {CLAIMED}  # each compiling what it needs, the farm still at work
    assert campaign.deferred == subject.farm.unstuck_answers  # a case whose entry's task was stuck: sent at once
    assert sorted(map(repr, subject.checked)) == sorted(map(repr, in_order.checked))
    assert campaign.examples == expected.examples


def test_a_small_case_goes_to_its_worker_whatever_the_farm_has_built(tmp_path):
    # its worker finds a missing binary in milliseconds, and another entry's task may have built it
    sent_unbuilt, campaign, subject, in_order, expected = _unbuilt_entries_run(tmp_path, "farm")
    assert sent_unbuilt and campaign.deferred == 0
    assert sorted(map(repr, subject.checked)) == sorted(map(repr, in_order.checked))


def test_the_farm_s_first_unfinished_task_of_an_entry_is_its_first_upcoming_case(tmp_path):
    from nanfuzz.harness.launch.farm import FarmHandle, _marker, entry_of

    case = consecutive_case([(1, 3), (1, 17)])
    kernel = "nanfuzz.kernels:paged_decode"
    for sample in ("2", "u3.1", "u3", "u12", "0"):
        _marker(tmp_path, kernel, entry_of(case), sample, "planned").touch()
    handle = FarmHandle(str(tmp_path), per_binary=True)
    first = [str(_marker(tmp_path, kernel, entry_of(case), "u3", state)) for state in ("done", "stuck")]
    assert handle.unbuilt(kernel, case) == tuple(first)
    assert handle.unbuilt("another:kernel", case) is None  # an entry the farm does not build
    assert FarmHandle(str(tmp_path)).unbuilt(kernel, case) is None  # workers wait for whole entries there
    Path(first[1]).touch()  # waiting for memory: the search sends the case (a check may get memory sooner)
    assert handle.unbuilt(kernel, case) == tuple(first) and handle.stuck_marker(kernel, case) == first[1]
    Path(first[0]).touch()
    assert handle.stuck_marker(kernel, case) == str(_marker(tmp_path, kernel, entry_of(case), "u3.1", "stuck"))
    Path(first[1]).unlink()
    _marker(tmp_path, kernel, entry_of(case), "0", "done").touch()
    assert handle.unbuilt(kernel, case) is None  # something of it is built: a check finds out the rest
