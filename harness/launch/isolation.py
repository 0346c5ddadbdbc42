"""Keeping a process that runs a kernel's code away from its campaign, and from outliving it.

A worker, a compile-farm process and the import probe each lead a session of
their own (``isolate``): a kernel that signals its process group
(``os.killpg(0, ...)``) reaches only that process and the processes it started,
never the campaign, and the campaign ends the whole group when it stops the
process (``end_group``), so a kernel's children go with their worker.  Such a
process also dies the moment the process that forked it does (Linux's
``PR_SET_PDEATHSIG``; elsewhere within a second, by a watching thread): a kernel
that kills the fork server its worker came from is a CRASH of the very case that
did it, and no worker runs on after its campaign.  Each one forks a guard into its
group first, which ends the group when the process dies, however it dies: what a
kernel started goes with its worker even when the campaign is killed outright.

The ``nanfuzz`` command itself adopts the orphans of its descendants (Linux's
``PR_SET_CHILD_SUBREAPER``) and, as it ends, ends every group an isolated
process left behind (``outlived_by_nothing``): a job killed while it shrank takes
its worker with it, and what that worker's kernel started would otherwise run on
(holding the command's output open) after the command is gone.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
import warnings
from typing import Callable

_PR_SET_PDEATHSIG = 1         # <linux/prctl.h>
_PR_SET_CHILD_SUBREAPER = 36
_PARENT_POLL = 1.0     # seconds between a watching thread's looks at its parent, where prctl is missing
# Signals a process that runs a kernel takes as any program does, whatever its parent did with them.
_DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_GUARD_SIGNAL = signal.SIGUSR2  # what tells a group's guard that the process it guards has died


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
    if hasattr(signal, "pthread_sigmask"):  # a plain fork starts with it blocked (``ctrl_c_blocked``)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    for signum in _DEFAULT_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)
    if not _die_with_parent():
        threading.Thread(target=_watch_parent, args=(parent,), daemon=True, name="nanfuzz-parent-watch").start()
    if os.getppid() != parent:  # the parent died before the request took effect
        end_own_group()
    _start_guard()


def _start_guard() -> None:
    """A process of this group that outlives this one by a moment: when this process dies, however
    it dies (SIGKILL with its parent included), the guard ends the group, and so whatever this
    process's kernel started.  It is forked before any kernel code runs and waits, idle, for
    Linux's death signal (elsewhere it looks at its parent every second)."""
    leader = os.getpid()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # a fork beside a watching thread (no prctl)
        if os.fork():
            return
    try:
        # a kernel signalling its group ends its worker; the guard then ends the rest
        for signum in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)
        # blocked and waited for, not handled: a death signal that came between the look at the
        # parent and a pause would be handled only after the pause, which nothing else would end
        signal.pthread_sigmask(signal.SIG_BLOCK, {_GUARD_SIGNAL})
        watched = _prctl(_PR_SET_PDEATHSIG, _GUARD_SIGNAL)
        while os.getppid() == leader:
            if watched:
                signal.sigtimedwait({_GUARD_SIGNAL}, _PARENT_POLL)
            else:
                time.sleep(_PARENT_POLL)
    finally:
        _end_guarded_group(leader)


def _end_guarded_group(leader: int) -> None:
    with contextlib.suppress(OSError):
        os.killpg(leader, signal.SIGKILL)  # the guard is of that group: this ends it too
    os._exit(0)


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


@contextlib.contextmanager
def ctrl_c_blocked(blocked: bool):
    """Ctrl-C blocked in this thread (where ``blocked`` and the platform can), for a child forked
    meanwhile to inherit; one that reaches this process meanwhile is delivered as the block ends."""
    if not blocked or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


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
    return _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(_PARENT_POLL)
        if os.getppid() != parent:
            end_own_group()


@contextlib.contextmanager
def outlived_by_nothing():
    """Around a whole command: orphans of its descendants become its children, and on the way out
    every process group below it other than its own (an isolated process's, with whatever that
    process's kernel started) is ended.  Processes of its own group (the fork server, the jobs,
    multiprocessing's helpers) end as they always do."""
    if not _prctl(_PR_SET_CHILD_SUBREAPER, 1):
        yield
        return
    try:
        yield
    finally:
        _end_groups_below()


def _end_groups_below() -> None:
    own = os.getpgid(0)
    ended = []
    for pid in _descendants(os.getpid()):
        try:
            group = os.getpgid(pid)
            if group != own:
                os.killpg(group, signal.SIGKILL)
                ended.append(pid)
        except (ProcessLookupError, PermissionError):
            continue
    for pid in ended:  # the adopted ones are this process's children now: no zombies left behind
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)


def _descendants(root: int) -> list[int]:
    """Every process below ``root``, from the process table's parent links."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # ended meanwhile
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        below = children.get(todo.pop(), [])
        found.extend(below)
        todo.extend(below)
    return found


def _prctl(option: int, value: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
