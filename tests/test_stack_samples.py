"""``nanfuzz bench --stacks``: the search thread's stacks, sampled fairly, and which of them are checks."""
from __future__ import annotations

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
