"""Keeping a process that runs a kernel's code away from its campaign, and from outliving it.

A worker, a compile-farm process and the import probe each lead a session of
their own (``isolate``): a kernel that signals its process group
(``os.killpg(0, ...)``) reaches only that process and the processes it started,
never the campaign, and the campaign ends the whole group when it stops the
process (``end_group``), so a kernel's children go with their worker.  Such a
process also dies the moment the process that forked it does (Linux's
``PR_SET_PDEATHSIG``; elsewhere within a second, by a watching thread): a kernel
that kills the fork server its worker came from is a CRASH of the very case that
did it, and no worker runs on after its campaign.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from typing import Callable

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_PARENT_POLL = 1.0     # seconds between a watching thread's looks at its parent, where prctl is missing
# Signals a process that runs a kernel takes as any program does, whatever its parent did with them.
_DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def isolate() -> None:
    """In a fresh child process, first thing: a session of its own, death with its parent, the
    default action for SIGTERM and SIGHUP (a kernel that raises them dies of them), and Ctrl-C
    ignored (the campaign decides when its processes stop)."""
    parent = os.getppid()
    try:
        os.setsid()
    except OSError:
        pass  # already a group leader: nothing to leave
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for signum in _DEFAULT_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)
    if not _die_with_parent():
        threading.Thread(target=_watch_parent, args=(parent,), daemon=True, name="nanfuzz-parent-watch").start()
    if os.getppid() != parent:  # the parent died before the request took effect
        end_own_group()


_holding = [0]                         # how deep this process is in ``interrupts_held``
_held: list[Callable[[], None]] = []   # what signal handlers left to do once it is over


@contextlib.contextmanager
def interrupts_held():
    """While this process starts a child: the interrupt a signal handler raises waits
    (``hold_while_starting``) until the child is started.  Raised inside the handlers that run
    around a fork, it would be swallowed with a traceback; in the middle of a fork server's
    hand-over, it would leave the child without its instructions."""
    _holding[0] += 1
    try:
        yield
    finally:
        _holding[0] -= 1
        if not _holding[0] and _held:
            first = _held[0]
            _held.clear()
            first()


def hold_while_starting(act: Callable[[], None]) -> bool:
    """For a signal handler: True when ``act`` (raising an interrupt) must wait for a child being
    started, and is kept to run as soon as it is; False when it may run now."""
    if not _holding[0]:
        return False
    _held.append(act)
    return True


def end_group(pid: int | None) -> None:
    """SIGKILL to the process group that the isolated process ``pid`` leads (it and whatever it
    started); nothing where no such group is left."""
    if pid is None:
        return
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def end_own_group() -> None:
    """This process and every process of its group, now (only where it leads the group)."""
    if os.getpgid(0) == os.getpid():
        os.killpg(0, signal.SIGKILL)
    os._exit(0)


def _die_with_parent() -> bool:
    """Ask Linux for SIGKILL when the thread that forked this process ends; False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(_PARENT_POLL)
        if os.getppid() != parent:
            end_own_group()
