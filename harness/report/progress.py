"""Progress lines for long campaigns: examples done, rate, time left.

    progress = Progress("paged_decode@masked", target_examples=2000, time_budget=900)
    for ...:
        progress.update(examples, "searching")
    progress.finish()

At most one line every ``every`` seconds (2 on a terminal, 30 in a log), none
for a campaign shorter than that.  On a terminal each line overwrites the last; to a file or a pipe (CI
logs) every line is plain text ending in a newline, with no control codes.
"""
from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

STATES = ("searching", "shrinking")
# Seconds between progress lines: a terminal rewrites one line in place; a CI log keeps every line,
# so there a line every half minute (a 15-minute gate leaves 30 lines, not 450).
TTY_EVERY = 2.0
LOG_EVERY = 30.0


def duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``1h02m``."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Progress:
    """Prints how far a campaign against ``kernel_name`` has come.

    ``target_examples`` and ``time_budget`` bound the campaign (either, both
    or neither); the time left is estimated from whichever ends it first.
    The rate counts from the first ``update``, so start-up (imports, the
    first compile) does not drag it down for the rest of the run.  While
    shrinking there is no estimate: shrinking ends when no smaller failing
    case is left, which no rate predicts.  The smaller cases a shrink tries
    are counted apart from the search's examples, which alone are measured
    against ``target_examples``.
    """

    def __init__(self, kernel_name: str, target_examples: int | None = None, time_budget: float | None = None,
                 stream: TextIO | None = None, every: float | None = None, *,
                 clock: Callable[[], float] = time.monotonic):
        self.kernel_name = kernel_name
        self.target_examples = target_examples
        self.time_budget = time_budget
        self.stream = stream if stream is not None else sys.stderr
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every = every if every is not None else (TTY_EVERY if self._tty else LOG_EVERY)
        self._clock = clock
        self._start = clock()
        self._first: tuple[float, int] | None = None  # (time, examples) at the first update
        self._last_print = self._start
        self._shrink_start: tuple[float, int] | None = None
        self._examples = 0
        self._state = "searching"
        self._printed = False

    def update(self, examples: int, state: str = "searching") -> None:
        """Record ``examples`` done so far; print a line if ``every`` seconds passed since the last."""
        if state not in STATES:
            raise ValueError(f"state={state!r} is not one of {STATES}")
        now = self._clock()
        if self._first is None:
            self._first = (now, examples)
        if state == "shrinking" and self._shrink_start is None:
            self._shrink_start = (now, examples)
        self._examples, self._state = examples, state
        if now - self._last_print >= self.every:
            self._last_print = now
            self._write(self.line(now))

    def _searched(self) -> int:
        """The examples of the search: a shrink's candidates come after them, and count apart."""
        return self._shrink_start[1] if self._shrink_start is not None else self._examples

    def finish(self) -> None:
        """End the report: a last line with the totals, if any line was printed at all."""
        if self._printed:
            now = self._clock()
            elapsed = now - self._start
            rate = f", {self._rate(now):.1f} ex/s" if self._rate(now) is not None else ""
            shrunk = self._examples - self._searched()
            tried = f" and {shrunk} smaller cases tried while shrinking" if shrunk else ""
            self._write(f"{self.kernel_name}: {self._searched()} examples{tried} in {duration(elapsed)}{rate}, done")
            if self._tty:
                self.stream.write("\n")
                self.stream.flush()
            self._printed = False

    def _rate(self, now: float) -> float | None:
        if self._first is None:
            return None
        since, base = self._first
        if now - since <= 0 or self._examples <= base:
            return None
        return (self._examples - base) / (now - since)

    def line(self, now: float | None = None) -> str:
        """The progress line as of ``now`` (default: the clock's time)."""
        now = self._clock() if now is None else now
        elapsed = now - self._start
        parts = []
        searched = self._searched()
        if self.target_examples:
            percent = 100 * searched / self.target_examples
            parts.append(f"{searched}/{self.target_examples} examples ({percent:.0f}%)")
        else:
            parts.append(f"{searched} examples")
        if self.time_budget:
            parts.append(f"{duration(elapsed)} of {duration(self.time_budget)}")
        else:
            parts.append(duration(elapsed))
        rate = self._rate(now)
        if rate is not None:
            parts.append(f"{rate:.1f} ex/s")
        if self._state == "shrinking":
            since, at = self._shrink_start or (now, self._examples)
            parts.append(f"shrinking a failure ({self._examples - at} smaller cases tried, {duration(now - since)} so far)")
        else:
            left = self._time_left(elapsed, rate)
            parts.append("searching" + (f", about {duration(left)} left" if left is not None else ""))
        return f"{self.kernel_name}: " + ", ".join(parts)

    def _time_left(self, elapsed: float, rate: float | None) -> float | None:
        estimates = []
        if self.target_examples and rate:
            estimates.append(max(0, self.target_examples - self._examples) / rate)
        if self.time_budget:
            estimates.append(max(0.0, self.time_budget - elapsed))
        return min(estimates) if estimates else None

    def _write(self, text: str) -> None:
        if self._tty:
            # rewrite the one line in place: carriage return, text, erase to the end of the line
            self.stream.write("\r" + text + "\x1b[K")
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
        self._printed = True
