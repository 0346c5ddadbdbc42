"""Progress lines, on a fake clock."""
from __future__ import annotations

import io

import pytest

from nanfuzz.harness.report.progress import Progress, duration


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _progress(stream=None, **options):
    clock = Clock()
    stream = stream if stream is not None else io.StringIO()
    options.setdefault("every", 2.0)
    return Progress("k@v", stream=stream, clock=clock, **options), clock, stream


def test_a_log_gets_a_line_every_half_minute_and_a_terminal_every_two_seconds():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    assert Progress("k@v", stream=io.StringIO()).every == 30.0
    assert Progress("k@v", stream=Terminal()).every == 2.0


def test_at_most_one_line_every_period():
    progress, clock, stream = _progress(target_examples=100, every=2.0)
    for examples in range(1, 11):
        clock.now += 0.5
        progress.update(examples)
    assert stream.getvalue().count("\n") == 2  # at 2.0 s and 4.0 s, not at every example
    progress.finish()
    assert stream.getvalue().count("\n") == 3


def test_examples_of_the_target_rate_and_time_left():
    progress, clock, stream = _progress(target_examples=100)
    clock.now += 1.0
    progress.update(1)           # the rate counts from here: start-up is left out
    clock.now += 2.0
    progress.update(21)          # 20 examples in 2 s
    assert stream.getvalue() == "k@v: 21/100 examples (21%), 3s, 10.0 ex/s, searching, about 8s left\n"


def test_a_time_budget_bounds_the_estimate():
    progress, clock, stream = _progress(target_examples=1000, time_budget=60)
    progress.update(0)
    clock.now += 30
    progress.update(60)          # 2/s: 470 s to the target, but 30 s left of the budget
    assert stream.getvalue() == "k@v: 60/1000 examples (6%), 30s of 1m00s, 2.0 ex/s, searching, about 30s left\n"


def test_no_bound_no_estimate():
    progress, clock, stream = _progress()
    progress.update(0)
    clock.now += 125
    progress.update(250)
    assert stream.getvalue() == "k@v: 250 examples, 2m05s, 2.0 ex/s, searching\n"


def test_shrinking_has_no_estimate():
    progress, clock, stream = _progress(target_examples=100, every=1.0)
    progress.update(0)
    clock.now += 1
    progress.update(10, "searching")
    clock.now += 1
    progress.update(11, "shrinking")
    clock.now += 4
    progress.update(31, "shrinking")
    last = stream.getvalue().splitlines()[-1]
    assert last.endswith("shrinking a failure (20 smaller cases tried, 4s so far)") and "left" not in last


def test_a_shrink_past_the_target_counts_apart_and_never_past_100_percent():
    progress, clock, stream = _progress(target_examples=24, every=1.0)
    progress.update(0)
    clock.now += 1
    progress.update(20, "searching")
    clock.now += 1
    progress.update(21, "shrinking")   # the 21st example failed; Hypothesis shrinks from here
    clock.now += 60
    progress.update(99, "shrinking")
    progress.finish()
    lines = stream.getvalue().splitlines()
    assert lines[-2].startswith("k@v: 21/24 examples (88%), 1m02s, ") and "412%" not in lines[-2]
    assert lines[-2].endswith("shrinking a failure (78 smaller cases tried, 1m00s so far)")
    assert lines[-1].startswith("k@v: 21 examples and 78 smaller cases tried while shrinking in 1m02s")


def test_plain_lines_to_a_file_and_one_rewritten_line_on_a_terminal():
    plain, clock, stream = _progress(target_examples=10, every=1.0)
    for n in range(5):
        clock.now += 1
        plain.update(n)
    plain.finish()
    assert "\r" not in stream.getvalue() and "\x1b" not in stream.getvalue()
    assert stream.getvalue().splitlines()[-1] == "k@v: 4 examples in 5s, 1.0 ex/s, done"

    tty, clock, screen = _progress(Terminal(), target_examples=10, every=1.0)
    for n in range(5):
        clock.now += 1
        tty.update(n)
    tty.finish()
    text = screen.getvalue()
    assert text.startswith("\rk@v: 0/10") and text.count("\n") == 1 and text.endswith("done\x1b[K\n")


def test_a_short_campaign_prints_nothing():
    progress, clock, stream = _progress(target_examples=10)
    progress.update(5)
    clock.now += 1
    progress.finish()
    assert stream.getvalue() == ""


def test_unknown_state_is_refused():
    progress, _, _ = _progress()
    with pytest.raises(ValueError, match="searching"):
        progress.update(1, "waiting")


@pytest.mark.parametrize("seconds, text", [(0, "0s"), (59.4, "59s"), (61, "1m01s"), (3725, "1h02m")])
def test_durations(seconds, text):
    assert duration(seconds) == text
