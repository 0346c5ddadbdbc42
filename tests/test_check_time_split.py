"""Where a check's time goes beside its phases: waiting for memory, admission, the handoff to the
worker and the tallies after it, each counted in its own phase, and so are a campaign's startup
and close, so that ``nanfuzz bench``'s generation (what is left) is Hypothesis's drawing and
engine alone."""
import time

import pytest

from nanfuzz.harness.campaign.runner import fuzz
from nanfuzz.harness.campaign.search import split_check_time
from nanfuzz.harness.judge import memory
from nanfuzz.harness.judge.outcome import Outcome, Verdict
from tests.torch_kernels import torch_kernel

SLOW = 0.03  # seconds a slowed stage adds to every check


def _outcome(seconds: float, waited: float = 0.0, **timings: float) -> Outcome:
    outcome = Outcome(Verdict.PASS, "PASS", timings=timings, memory_waited=waited)
    outcome.seconds = seconds
    return outcome


def test_a_check_s_wall_time_divides_into_memory_wait_admission_and_handoff():
    times = {}
    split_check_time(times, _outcome(0.05, waited=0.02, kernel=0.004, oracle=0.006), round_trip=0.08)
    assert times == pytest.approx({"memory wait": 0.02, "admission": 0.02, "handoff": 0.03})
    # an outcome the supervisor made of a dead worker ran no check to its end: all the rest is handoff
    split_check_time(times, _outcome(0.0, kernel=0.01), round_trip=0.5)
    assert times == pytest.approx({"memory wait": 0.02, "admission": 0.02, "handoff": 0.52})
    split_check_time(times, _outcome(0.01, kernel=0.02), round_trip=0.005)  # clocks a hair apart: never negative
    assert min(times.values()) >= 0.0


@pytest.fixture
def private_state(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def _campaign(**options):
    return fuzz(torch_kernel(), device="cpu", max_examples=6, seed=3, use_database=False, isolation=False, **options)


def test_time_the_memory_ledger_takes_is_admission_not_generation(private_state, monkeypatch):
    plain = _campaign()
    settle = memory.Governor.settle

    def slow_settle(self):
        time.sleep(SLOW)
        settle(self)

    monkeypatch.setattr(memory.Governor, "settle", slow_settle)
    slowed = _campaign()
    assert slowed.examples == plain.examples == 6
    added = (slowed.phase_times["admission"] - plain.phase_times["admission"]) / slowed.examples
    assert added >= SLOW * 0.9
    outside = sum(plain.phase_times.values())
    assert plain.phase_times["admission"] < outside and plain.phase_times["tally"] > 0


def test_time_spent_on_statistics_after_a_check_is_tally(private_state, monkeypatch):
    from nanfuzz.harness.report import statistics

    plain = _campaign()
    add = statistics.Statistics.add

    def slow_add(self, *args, **kwargs):
        time.sleep(SLOW)
        return add(self, *args, **kwargs)

    monkeypatch.setattr(statistics.Statistics, "add", slow_add)
    slowed = _campaign()
    added = (slowed.phase_times["tally"] - plain.phase_times["tally"]) / slowed.examples
    assert added >= SLOW * 0.9
    assert abs(slowed.phase_times["admission"] - plain.phase_times["admission"]) / slowed.examples < SLOW / 2


def _generation(campaign) -> float:
    return campaign.elapsed - sum(campaign.phase_times.values())


def test_a_campaign_s_startup_and_close_are_their_own_phases_not_generation(private_state, monkeypatch):
    from nanfuzz.harness.campaign.runner import CampaignRunner

    plain = _campaign()
    prepare, close = CampaignRunner.prepare, CampaignRunner.close

    def slow_prepare(self):
        time.sleep(10 * SLOW)
        prepare(self)

    def slow_close(self):
        time.sleep(10 * SLOW)
        close(self)

    monkeypatch.setattr(CampaignRunner, "prepare", slow_prepare)
    monkeypatch.setattr(CampaignRunner, "close", slow_close)
    slowed = _campaign()
    assert slowed.examples == plain.examples == 6
    for phase in ("startup", "close"):
        assert slowed.phase_times[phase] - plain.phase_times[phase] >= 10 * SLOW * 0.9, phase
    assert _generation(slowed) - _generation(plain) < 5 * SLOW


class _InProcess:
    """Judges as an in-process subject of the plain torch kernel would, but for what a subclass's
    ``check`` does first."""

    defers = False

    def __init__(self):
        from nanfuzz.harness.campaign.settings import Settings
        from nanfuzz.harness.launch.subjects import make_subject

        self.inner = make_subject(torch_kernel(), Settings(device="cpu", isolation=False))

    def close(self):
        self.inner.close()


class _DecliningEveryThird(_InProcess):
    """Every third case waits ``SLOW`` for memory that never comes free and is declined."""

    calls = 0

    def check(self, case, **options):
        from nanfuzz.harness.launch.worker import Declined

        self.calls += 1
        if self.calls % 3 == 0:
            time.sleep(10 * SLOW)
            return Declined("this case needs more memory than is free; declined")
        return self.inner.check(case, **options)


def test_the_wait_of_a_case_declined_for_memory_is_memory_wait_not_generation(private_state):
    plain = _campaign()
    declining = fuzz(torch_kernel(), device="cpu", max_examples=6, seed=3, use_database=False, isolation=False,
                     subject=_DecliningEveryThird())
    assert declining.examples == 6 and declining.declined_for_memory >= 2
    waited = declining.phase_times.get("memory wait", 0.0)
    assert waited >= declining.declined_for_memory * 10 * SLOW * 0.9, declining.phase_times
    assert _generation(declining) - _generation(plain) < 5 * SLOW


class _HangingOnceEach(_InProcess):
    """Each case's first check is a HANG (the machine's kind of failure); its replay in a fresh
    worker takes ``SLOW`` longer and passes."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def check(self, case, **options):
        if case not in self.seen:
            self.seen.add(case)
            return Outcome(Verdict.HANG, "HANG: the launch ran past its timeout")
        time.sleep(SLOW)
        return self.inner.check(case, **options)


def test_a_second_look_at_a_hang_is_handoff_not_generation(private_state):
    plain = _campaign()
    looked = fuzz(torch_kernel(), device="cpu", max_examples=6, seed=3, use_database=False, isolation=False,
                  subject=_HangingOnceEach())
    assert looked.examples == 6 and not looked.failed  # every HANG passed its replay
    added = (looked.phase_times["handoff"] - plain.phase_times["handoff"]) / looked.examples
    assert added >= SLOW * 0.9, looked.phase_times
    assert _generation(looked) - _generation(plain) < 2 * SLOW
