"""Where a campaign's search thread spends its wall time, sampled: ``nanfuzz bench --stacks``.

Bench's phases time what nanfuzz itself brackets (a check's materialisation,
launch, oracle, verdict, the handoff to the worker...); what is left over is
"generation".  When generation is far above the campaign's own CPU, the thread
waits somewhere no phase brackets.  Every few milliseconds an interval timer's
signal looks at the search thread's Python stack, whether it computes or
blocks, and gives the stack it sees the microseconds since the sample before,
outermost frame first (the "collapsed" lines flame-graph tools read:
``frame;frame;frame microseconds``).
"""
from __future__ import annotations

import signal
import sys
import threading
import time
from collections import Counter
from contextlib import contextmanager
from typing import Iterator

INTERVAL = 0.005  # seconds between samples: a few hundred a second cost the search well under 1%
# The search's frame that hands a case to its subject: a sample whose next frame is the subject's
# ``check`` is inside a check (bench's phases); the journal and the tally run beside it.
JUDGE_FRAME = "nanfuzz.harness.campaign.search:Search._judge"
_DEPTH = 80  # frames kept per sample, innermost first: deeper ones are the runner's own, the same in every sample


def frame_name(frame) -> str:
    code = frame.f_code
    return f"{frame.f_globals.get('__name__', '?')}:{getattr(code, 'co_qualname', code.co_name)}"


def stack_of(frame) -> str:
    """``frame``'s stack as one collapsed line, outermost first."""
    names = []
    while frame is not None and len(names) < _DEPTH:
        names.append(frame_name(frame))
        frame = frame.f_back
    return ";".join(reversed(names))


class _TimerSampler:
    """The calling (main) thread's stacks, from an interval timer's signal: its handler runs in that
    thread between two bytecodes, or as a blocking call the signal interrupted returns, so a burst of
    drawing and a wait in ``select`` are seen alike."""

    def __init__(self, interval: float):
        self.interval = interval
        self.counts: Counter[str] = Counter()
        self._last = 0.0
        self._previous = None
        self._sampling = False

    def start(self) -> None:
        self._previous = signal.signal(signal.SIGALRM, self._sample)
        signal.siginterrupt(signal.SIGALRM, False)  # calls that can resume do, rather than fail with EINTR
        self._last = time.perf_counter()
        signal.setitimer(signal.ITIMER_REAL, self.interval, self.interval)

    def stop(self) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self._previous)

    def _sample(self, signum, frame) -> None:
        # A signal can land while a sample is being taken (a thread descheduled for longer than the
        # interval): Python runs this handler again inside the first.  That one is skipped, and the
        # time is the next sample's; counted in both, the samples added up to more than the search ran.
        if self._sampling:
            return
        self._sampling = True
        try:
            now = time.perf_counter()
            since, self._last = now - self._last, now
            if frame is not None:  # the time since the last sample, in the frame the thread is in now
                self.counts[stack_of(frame)] += round(1e6 * since)
        finally:
            self._sampling = False


class _ThreadSampler:
    """Thread ``thread_id``'s stacks, looked at by a thread of its own: for a search outside the main
    thread, or where the timer's signal is taken.  It waits for the GIL while the search computes."""

    def __init__(self, thread_id: int, interval: float):
        self.thread_id, self.interval = thread_id, interval
        self.counts: Counter[str] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="nanfuzz-stack-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        last = time.perf_counter()
        while not self._stop.wait(self.interval):
            frame = sys._current_frames().get(self.thread_id)
            now = time.perf_counter()
            if frame is not None:
                self.counts[stack_of(frame)] += round(1e6 * (now - last))
            last = now
            del frame


def _timer_is_free() -> bool:
    return (hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, signal.SIG_IGN, None)
            and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0))


@contextmanager
def sampling_this_thread(interval: float | None, signals: bool = True) -> Iterator[Counter | None]:
    """The stacks of the calling thread while the block runs, with the microseconds each was seen for
    (None when ``interval`` is None).  ``signals``: the timer's signal may interrupt the thread (not
    where a kernel runs in it, ``--no-isolation``: a driver's call need not resume after one)."""
    if interval is None:
        yield None
        return
    timer = signals and _timer_is_free()
    sampler = _TimerSampler(interval) if timer else _ThreadSampler(threading.get_ident(), interval)
    sampler.start()
    try:
        yield sampler.counts
    finally:
        sampler.stop()


def in_a_check(stack: str) -> bool:
    """Whether the sampled ``stack`` is inside the subject's check of a case."""
    names = stack.split(";")
    try:
        handed = names[names.index(JUDGE_FRAME) + 1]
    except (ValueError, IndexError):
        return False
    return handed.rpartition(".")[2] == "check"


def innermost(counts: Counter, outside_checks: bool = False, top: int = 12) -> list[tuple[str, int]]:
    """The innermost frames the thread was in most (``outside_checks``: over the samples outside the
    subject's checks, bench's generation and tally)."""
    frames: Counter[str] = Counter()
    for stack, n in counts.items():
        if not (outside_checks and in_a_check(stack)):
            frames[stack.rpartition(";")[2]] += n
    return frames.most_common(top)


def summed(total: Counter | None, part: Counter | None) -> Counter | None:
    """``total`` with ``part``'s samples added (None: nothing sampled), for campaigns merged."""
    return total if part is None else (total or Counter()) + part


def collapsed(counts: Counter, root: str) -> str:
    """Flame-graph input: one line per stack, under the frame ``root`` (the kernel's name)."""
    return "".join(f"{root};{stack} {n}\n" for stack, n in sorted(counts.items()))
