"""``nanfuzz bench --stacks``: the search thread's stacks, sampled fairly, and which of them are checks."""
from __future__ import annotations

import sys
import threading
import time
from collections import Counter

from nanfuzz.harness.campaign import stack_samples
from nanfuzz.harness.campaign.stack_samples import JUDGE_FRAME, in_a_check, innermost, sampling_this_thread


def _computes_for(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _blocks_for(seconds: float) -> None:
    threading.Event().wait(seconds)


def _share_computing(rounds: int = 150) -> float:
    """Bursts of computing shorter than the GIL's switch interval, each followed by a wait as long."""
    with sampling_this_thread(stack_samples.INTERVAL) as stacks:
        for _ in range(rounds):
            _computes_for(0.001)
            _blocks_for(0.001)
    seconds = {name.rpartition(":")[2]: us for name, us in innermost(stacks, top=50)}
    computing = seconds.get("_computes_for", 0)
    return computing / max(1, sum(seconds.values()))


def test_short_bursts_of_computing_get_their_share_of_the_samples():
    assert threading.current_thread() is threading.main_thread()  # where the timer's signal is handled
    assert 0.2 < _share_computing() < 0.8  # about half the wall time


def test_a_thread_looking_from_outside_would_miss_them(monkeypatch):
    monkeypatch.setattr(stack_samples, "_timer_is_free", lambda: False)  # sensitivity: why the timer
    assert _share_computing() < 0.15


def test_nothing_is_sampled_unasked_and_the_timer_is_given_back():
    import signal

    with sampling_this_thread(None) as stacks:
        _computes_for(0.02)
    assert stacks is None
    with sampling_this_thread(0.001) as stacks:
        _computes_for(0.02)
    assert sum(stacks.values()) > 0
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0) and signal.getsignal(signal.SIGALRM) == signal.SIG_DFL


def test_a_sample_is_in_a_check_when_the_search_handed_the_case_to_its_subject():
    handed = f"runner:run;{JUDGE_FRAME};nanfuzz.harness.launch.worker:Supervised.check;selectors:select"
    journal = f"runner:run;{JUDGE_FRAME};nanfuzz.harness.campaign.journal:Journal.record"
    drawing = "runner:run;hypothesis.core:run;nanfuzz.strategies.cases:draw"
    assert in_a_check(handed) and not in_a_check(journal) and not in_a_check(drawing)
    stacks = Counter({handed: 900, journal: 30, drawing: 70})
    assert innermost(stacks) == [("selectors:select", 900), ("nanfuzz.strategies.cases:draw", 70),
                                 ("nanfuzz.harness.campaign.journal:Journal.record", 30)]
    assert innermost(stacks, outside_checks=True) == [("nanfuzz.strategies.cases:draw", 70),
                                                      ("nanfuzz.harness.campaign.journal:Journal.record", 30)]


def test_where_a_kernel_runs_in_the_thread_no_signal_interrupts_it(monkeypatch):
    import signal

    installed = []
    monkeypatch.setattr(signal, "setitimer", lambda *a: installed.append(a))
    with sampling_this_thread(0.001, signals=False) as stacks:  # --no-isolation: a thread looks instead
        _computes_for(0.02)
    assert not installed and sum(stacks.values()) > 0


def test_a_signal_landing_while_a_sample_is_taken_counts_no_time_twice(monkeypatch):
    """A second timer signal inside the handler (a thread descheduled mid-sample) runs the handler
    inside itself: the samples must still add up to no more than the time that passed."""
    clock = iter([1.0, 1.007, 1.009, 1.012, 1.020])  # start, then each look at the clock
    monkeypatch.setattr(stack_samples.time, "perf_counter", lambda: next(clock))
    sampler = stack_samples._TimerSampler(0.005)
    sampler._last = next(clock)
    frame = sys._getframe()
    real_stack_of = stack_samples.stack_of
    nested = [True]

    def slow_stack_of(f):
        if nested.pop() if nested else False:  # the signal lands while the first sample is taken
            sampler._sample(None, frame)
        return real_stack_of(f)

    monkeypatch.setattr(stack_samples, "stack_of", slow_stack_of)
    sampler._sample(None, frame)   # at 1.007, with a signal inside it
    sampler._sample(None, frame)   # at 1.009
    sampler._sample(None, frame)   # at 1.012
    assert sum(sampler.counts.values()) == 12_000  # 1.000 to 1.012: each microsecond once
    plain = stack_samples._TimerSampler(0.005)     # without a signal inside: every interval counted
    clock2 = iter([2.0, 2.005, 2.011])
    monkeypatch.setattr(stack_samples.time, "perf_counter", lambda: next(clock2))
    plain._last = next(clock2)
    plain._sample(None, frame)
    plain._sample(None, frame)
    assert sum(plain.counts.values()) == 11_000
