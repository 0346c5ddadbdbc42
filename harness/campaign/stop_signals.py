"""SIGTERM and SIGHUP stop a campaign as Ctrl-C does.

A cancelled CI job, a job's ``timeout-minutes`` and ``timeout(1)`` end a run
with SIGTERM, a closed terminal with SIGHUP; left to their default action they
end the process where it stands, with no line, a failure found (even one being
shrunk) never written and the campaign's other processes left running.  Under
``stopping_on_signals()`` the first of them raises ``Stopped``, a
KeyboardInterrupt, wherever this process's main thread is, and every stage
already takes that as Ctrl-C: jobs stop, the smallest failure so far is kept
and written, every process the campaign started is ended.  The exit status is
then 1 with a finding, else 128 + the signal (``exit_status``).

An interrupt raised while a callback runs (a garbage-collector hook, a
finalizer) is swallowed there; the campaign still stops, at its next example
(``stop_requested``), and the swallowed interrupt prints nothing.
"""
from __future__ import annotations

import contextlib
import signal
import sys

from nanfuzz.harness.launch.isolation import hold_while_starting

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)

_received: list[int] = []  # the stop signals (and Ctrl-C) this process has been sent, in order


class Stopped(KeyboardInterrupt):
    """A stop signal, raised where the main thread is (as SIGINT raises KeyboardInterrupt)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def stopping_on_signals(once: bool = False):
    """SIGTERM and SIGHUP raise ``Stopped`` once (a later one only waits for the stop under way),
    Ctrl-C a KeyboardInterrupt each time; either waits while a child process is being started.
    ``once``: only the first signal of all raises (a campaign of a run that stops it with Ctrl-C
    of its own, which may follow the group's SIGTERM)."""
    def stop(signum, frame):
        _received.append(signum)
        if once and len(_received) > 1:
            return
        if signum == signal.SIGINT:
            interrupt = KeyboardInterrupt
        elif len([s for s in _received if s != signal.SIGINT]) == 1:
            interrupt = Stopped(signum)
        else:
            return
        if not hold_while_starting(lambda: _raise(interrupt)):
            raise interrupt

    _received.clear()
    before = {signum: signal.signal(signum, stop) for signum in (signal.SIGINT, *STOP_SIGNALS)}
    hook = sys.unraisablehook
    sys.unraisablehook = quiet_about_interrupts(hook)
    try:
        yield
    finally:
        sys.unraisablehook = hook
        for signum, handler in before.items():
            signal.signal(signum, handler)


def quiet_about_interrupts(hook):
    """``sys.unraisablehook`` that says nothing of an interrupt a callback swallowed."""
    def unraisable(info) -> None:
        if not isinstance(info.exc_value, KeyboardInterrupt):
            hook(info)
    return unraisable


def stop_requested() -> bool:
    """Has Ctrl-C or a stop signal reached this process (under ``stopping_on_signals``)?"""
    return bool(_received)


def _raise(interrupt) -> None:
    raise interrupt


def stop_signal() -> int:
    """The signal that stopped this process: the first stop signal received, else SIGINT (Ctrl-C)."""
    return _received[0] if _received else signal.SIGINT


def describe(signum: int) -> str:
    return "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"


def exit_status(found: bool) -> int:
    """1 when the campaign found a failure before it stopped, else 128 + the signal (a shell's code)."""
    return 1 if found else 128 + stop_signal()
