"""How nanfuzz starts its processes: a fork server, or a plain fork where that is safe.

Nothing here imports torch, so the CLI starts the fork server first thing,
for the backend the environment points to (``likely_backend``), before it
imports torch to choose the backend: the server's own imports (torch,
Triton, nanfuzz: seconds) then overlap with the CLI's.  Triton must know
whether it interprets when it is imported, so a server started for the
other backend than the one chosen is restarted (``restart_fork_server``).
Each process forked from it also sets ``TRITON_INTERPRET`` for its own
device before it imports a kernel (``interpret_if_cpu``).
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import time

from nanfuzz.harness.launch.isolation import ctrl_c_blocked, interrupts_held


def fork_server_context():
    """Workers (and ``--jobs`` jobs, and compile-farm processes) are forked from a fork server that
    has imported torch, Triton and nanfuzz, and hashed Triton's installation (``warm_start``),
    but never touched a GPU (a forked CUDA context is unusable): a fresh worker after a crash
    costs a fork, not a second of imports.  Where there is no fork server, they are spawned."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["nanfuzz.harness.launch.fork_server_signals",  # first: see there
                                    "torch", "triton", "nanfuzz.harness.judge.check", "nanfuzz.harness.registry",
                                    "nanfuzz.harness.campaign.runner", "nanfuzz.harness.launch.warm_start"])
    return context


def start_fork_server(device: str | None = None) -> None:
    """Start the fork server now, so that its imports overlap with the caller's own start-up.
    ``device``: the backend it is for ("cpu": Triton's interpreter, which Triton must know when
    it is imported); None: the one this process's environment says."""
    if fork_server_context().get_start_method() != "forkserver":
        return
    from multiprocessing import forkserver

    before = os.environ.get("TRITON_INTERPRET")
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # for the server alone: it is started with this environment
    try:
        forkserver.ensure_running()
    finally:
        if device == "cpu" and before is None:
            del os.environ["TRITON_INTERPRET"]
        elif device == "cpu":
            os.environ["TRITON_INTERPRET"] = before


def restart_fork_server() -> None:
    """Stop the fork server, if one runs (once its imports are done), and start one with this
    process's environment: for a server started for the other backend than the one chosen."""
    if fork_server_context().get_start_method() != "forkserver":
        return
    from multiprocessing import forkserver

    stop = getattr(forkserver._forkserver, "_stop", None)
    if stop is None:  # a Python without it: a fresh server object; the old server ends with this process
        forkserver._forkserver = forkserver.ForkServer()
    else:
        stop()
    start_fork_server()


def start(process, forked_by_server: bool = True, plain_fork: bool = False) -> None:
    """``process.start()``; for a process of ``fork_server_context()``, from a fresh fork server
    where a kernel killed the last one (also where the server dies as it forks).  ``plain_fork``:
    a process forked from this one, whose main begins with ``isolation.isolate()``; it is forked
    with Ctrl-C blocked, so that one reaching it before ``isolate`` ignores it waits, and is
    dropped, instead of running this process's handler in the child."""
    if forked_by_server and fork_server_died():
        restart_fork_server()
    with interrupts_held(), ctrl_c_blocked(plain_fork):
        try:
            process.start()
        except (EOFError, OSError):
            if not (forked_by_server and fork_server_died()):
                raise
            restart_fork_server()
            process.start()


def _fork_server_pid() -> int | None:
    """The pid of the fork server this process started, where one was started and can be looked at."""
    if fork_server_context().get_start_method() != "forkserver" or not hasattr(os, "waitid"):
        return None
    from multiprocessing import forkserver

    return getattr(forkserver._forkserver, "_forkserver_pid", None)


def _ended(pid: int):
    """``pid``'s end (``os.waitid``'s result) without reaping it; None while it runs."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)


def fork_server_died() -> bool:
    """Whether the fork server this process started has ended (a kernel may kill it): looked at
    without reaping it, so that multiprocessing still sees it gone and starts another."""
    pid = _fork_server_pid()
    if pid is None:
        return False
    try:
        if _ended(pid) is not None:
            return True
    except ChildProcessError:
        return True
    return _dying(pid)


def fork_server_end() -> str | None:
    """How the fork server this process started ended ("killed by SIGKILL", "exited with status 1"),
    looked at without reaping it; None while it runs or where that cannot be told."""
    pid = _fork_server_pid()
    if pid is None:
        return None
    for _ in range(40):  # a server with a SIGKILL pending dies when next scheduled
        try:
            ended = _ended(pid)
        except ChildProcessError:
            return None
        if ended is not None or not _dying(pid):
            break
        time.sleep(0.025)
    if ended is None:
        return None
    if ended.si_code == os.CLD_EXITED:
        return f"exited with status {ended.si_status}"
    try:
        return f"killed by {signal.Signals(ended.si_status).name}"
    except ValueError:
        return f"killed by signal {ended.si_status}"


def run_queue_seconds() -> float | None:
    """Seconds the calling thread has waited on a CPU's run queue, runnable but not running (Linux'
    ``schedstat``); None where the kernel does not say.  Against its wall time beside its CPU time,
    it tells a process short of cores from one that sleeps or blocks."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not ended (a zombie has ended: it waits to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def has_ended(process) -> bool:
    """Whether a process of ``fork_server_context()`` that multiprocessing reports ended has ended
    (``exitcode`` set).  Its exit status comes through the fork server it was forked from; where that
    server died first (a kernel can kill it; so can the host running out of memory), multiprocessing
    reads 255 for a process still running, which goes on to put its result as any does."""
    return process.exitcode is not None and (process.exitcode != 255 or not running(process.pid))


def _dying(pid: int) -> bool:
    """Whether a fatal signal has been sent to ``pid`` that it has not yet died of (Linux marks such
    a process with a pending SIGKILL at once): a kill is over when ``kill()`` returns, the death
    comes when the process is next scheduled."""
    try:
        with open(f"/proc/{pid}/status") as f:
            status = f.read()
    except OSError:
        return False
    kill = 1 << (signal.SIGKILL - 1)
    return any(line.startswith(("SigPnd:", "ShdPnd:")) and int(line.split()[1], 16) & kill
               for line in status.splitlines())


def likely_backend(device: str | None) -> str | None:
    """The backend ``harness.launch.backend.choose_backend`` will pick, where the environment tells without
    importing torch; None where only torch can tell.  A wrong guess costs a restarted fork server."""
    if device in ("cpu", "cuda"):
        return device
    if device is not None:
        return None
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    if not sys.platform.startswith("linux"):
        return None
    if any(os.environ.get(name, "x").strip() in ("", "-1")
           for name in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")):
        return None  # devices hidden: torch decides
    return "cuda" if os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/kfd") else "cpu"


def plain_fork_context():
    """A plain fork, for the workers of a process that is itself fresh from the fork server
    and runs no torch op (a job of a ``--jobs`` run): its copy of the imports is all a
    worker needs, so the job saves starting a fork server of its own (another interpreter
    importing torch).  None, at the moment of forking, where a fork would copy a GPU
    context or other threads."""
    import threading

    import torch

    if ("fork" not in multiprocessing.get_all_start_methods() or threading.active_count() > 1
            or torch.cuda.is_initialized()):
        return None
    return multiprocessing.get_context("fork")


def fork_keeps_the_gpu() -> bool:
    """Could a plain fork of this process use the GPU?  torch marks the forks of a process that asked
    its driver anything (``is_available``, ``device_count``) unable to, with no context opened and
    nothing the parent can look at; only a fork can tell, so one is forked to look and exits."""
    import torch

    from nanfuzz.harness.launch.isolation import ctrl_c_blocked

    with ctrl_c_blocked(True):  # the child only looks and exits: a Ctrl-C is this process's alone
        pid = os.fork()
        if pid == 0:
            poisoned = True
            try:
                poisoned = torch.cuda._is_in_bad_fork()
            finally:
                os._exit(1 if poisoned else 0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def interpret_if_cpu(device: str) -> None:
    """In a process fresh from the fork server: a CPU campaign's kernels run under Triton's interpreter
    (which Triton reads when a kernel module is imported)."""
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
