"""The supervised subject: every materialisation and launch runs in a worker process.

The campaign process (Hypothesis, the example database, verdicts, repros)
never runs the kernel under test in its own address space: libFuzzer's fork
mode and AFL's fork server are the model.  A worker is started once and kept
between examples; when it dies (a signal, ``abort``, ``os._exit``, a ROCm
memory-access fault) or reports a device context that a sticky CUDA/HIP error
has killed, the case it was running is a CRASH and a fresh worker carries
on.  A launch that does not return within the launch timeout is a HANG: the
worker is killed.  The worker marks each launch, and each Triton compile,
on a clock in shared memory (``LaunchClock``), so the watchdog costs no
message per launch and compile time does not count.

``InProcess`` runs the same checks in the campaign's own process
(``--no-isolation``, for debugging with pdb or prints).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import wait

from nanfuzz.harness.device import DeviceProperties
from nanfuzz.harness.judge.check import Outcome, Verdict
from nanfuzz.harness.judge.memory import MemoryPolicy
from nanfuzz.harness.launch.isolation import end_group, isolate
from nanfuzz.harness.launch.processes import (fork_server_context, fork_server_died, fork_server_end,
                                              interpret_if_cpu, plain_fork_context, start)
from nanfuzz.harness.launch.shared_compiles import Skipped
from nanfuzz.reference.errors import NanfuzzError

# A worker imports torch, Triton and the kernel's module before it is ready.
_START_TIMEOUT = 600.0
# Our own work around the launches (materialise, oracle, verdict) of a case
# the memory governor admitted takes well under a minute even under the interpreter
# (a wait for memory is not counted: the governor bounds it).
_HOST_WORK_TIMEOUT = 900.0
# How often an idle worker looks whether another process waits for the memory it holds.
_IDLE_LOOK = 1.0
_LOG_TAIL_LINES = 12
# What multiprocessing reports for a fork-server child whose status never came (the server died).
_NO_STATUS = 255


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to rebuild the subject in a fresh process."""

    kernel: str                 # the import path or name ``resolve`` takes
    device: str                 # "cuda" or "cpu" (Triton's interpreter)
    vllm_src: str | None = None
    aiter_src: str | None = None
    fa_src: str | None = None
    sglang_src: str | None = None
    lmdeploy_src: str | None = None
    cuda_index: int | None = None
    strict_reads: bool = False  # see check(strict_reads=...)
    import_root: str | None = None  # a user kernel's: see resolve(import_root=...)
    # the kernel's declaration of the GPU a CPU run stands in for, which its import path may not give
    # (a Kernel the caller made with dataclasses.replace)
    stands_in_for: DeviceProperties | None = None
    memory: MemoryPolicy = MemoryPolicy()  # how it shares its device's memory (``harness.judge.memory``)

    def load(self):
        """The Kernel, in this process (pinned to ``cuda_index`` on a GPU)."""
        from nanfuzz.harness.registry import resolve

        if self.device == "cuda" and self.cuda_index is not None:
            import torch

            torch.cuda.set_device(self.cuda_index)
        kernel = resolve(self.kernel, vllm_src=self.vllm_src, aiter_src=self.aiter_src, fa_src=self.fa_src,
                         sglang_src=self.sglang_src, lmdeploy_src=self.lmdeploy_src, import_root=self.import_root)
        return kernel if self.stands_in_for is None else dataclasses.replace(kernel, stands_in_for=self.stands_in_for)


class LaunchClock:
    """When the worker's current launch started, whether Triton is compiling, and whether the
    check waits for device memory, in shared memory.

    The worker writes it around every launch; the supervisor reads it only
    when it wakes up to look, so a launch costs no message.  Both sides read
    CLOCK_MONOTONIC, which is one clock for every process of the machine.
    """

    def __init__(self, context):
        self._cells = context.RawArray("d", 3)  # [launch start or 0, compiling 0/1, waiting for memory 0/1]

    def event(self, name: str) -> None:
        if name == "launch":
            self._cells[0] = time.monotonic()
        elif name == "returned":
            self._cells[0] = 0.0
        elif name == "compile":
            self._cells[1] = 1.0
        elif name == "compiled":
            self._cells[1] = 0.0
            if self._cells[0]:
                self._cells[0] = time.monotonic()  # the launch's clock starts after its compile
        elif name == "memory-wait":
            self._cells[2] = 1.0
        elif name == "memory-granted":
            self._cells[2] = 0.0

    @property
    def in_launch(self) -> bool:
        return self._cells[0] != 0.0

    @property
    def compiling(self) -> bool:
        return self._cells[1] != 0.0

    @property
    def waiting_for_memory(self) -> bool:
        return self._cells[2] != 0.0

    def launch_seconds(self, now: float) -> float:
        """How long the current launch has run, compiles excluded (0 outside a launch)."""
        if not self.in_launch or self.compiling:
            return 0.0
        return now - self._cells[0]


# What a check may put off (``Supervised.check(defer=...)``): a case whose launch needs a binary
# another process is compiling; or also one that nobody compiles yet (a compile farm will).
CLAIMED, UNBUILT = "claimed", "unbuilt"


@dataclass(frozen=True)
class Deferred:
    """No verdict yet: a launch of the case needed a binary it did without (``skipped``: where its
    compile is claimed, where it lands, whether anyone was compiling it; see ``harness.campaign.deferrals``).
    ``seconds``, ``memory_waited`` and ``phases`` (name, seconds): what the check spent before it put the case off."""

    skipped: Skipped
    seconds: float = 0.0
    memory_waited: float = 0.0
    phases: tuple = ()


@dataclass(frozen=True)
class Declined:
    """No verdict: the case's memory did not come free (``judge.memory.TooLargeForDevice``), or
    nanfuzz's own allocations failed judging it (``judging_failed``).  A search counts it and goes
    on; a finding's replay notes it and keeps the finding; ``nanfuzz replay`` calls it a usage
    error (``judged``)."""

    reason: str
    judging_failed: bool = False
    memory_taken: bool = False  # held by other processes for the whole wait (``judge.memory.MemoryTaken``)


def judged(answer):
    """A check's answer where only an outcome will do (``nanfuzz replay``): a ``Declined`` is the
    one-line error it stands for."""
    if isinstance(answer, Declined):
        raise NanfuzzError(answer.reason)
    return answer


def declined(exc) -> Declined:
    from nanfuzz.harness.judge.memory import JudgingOutOfMemory, MemoryTaken

    return Declined(str(exc), isinstance(exc, JudgingOutOfMemory), isinstance(exc, MemoryTaken))


class InProcess:
    """The checks in this process (``--no-isolation``): no CRASH survives a dying kernel here."""

    def __init__(self, kernel, device: str, strict_reads: bool = False, memory: MemoryPolicy = MemoryPolicy()):
        import contextlib

        from nanfuzz.harness.launch.compiles import count_specialisations

        self.kernel = kernel
        self.device = device
        self.strict_reads = strict_reads
        self.memory = memory
        self._stack = contextlib.ExitStack()
        self._seen = self._stack.enter_context(count_specialisations(interpreter=device == "cpu"))

    @property
    def specialisations(self) -> int | None:
        return self._seen.count

    defers = False  # this process compiles what it needs itself

    def check(self, case, *, digest: bool = False, explain: bool = False, defer: str | None = None,
              patience: float | None = None) -> Outcome | Declined:
        from nanfuzz.harness.judge.check import check
        from nanfuzz.harness.judge.memory import TooLargeForDevice

        try:
            return check(self.kernel, case, self.device, digest_pass=digest, explain=explain,
                         strict_reads=self.strict_reads, memory=self.memory, patience=patience)
        except TooLargeForDevice as exc:
            return declined(exc)

    def close(self) -> None:
        self._stack.close()


class Supervised:
    """A kernel in a worker process, restarted whenever it dies, faults or hangs."""

    def __init__(self, spec: WorkerSpec, *, launch_timeout: float, prefer_fork: bool = False, device_opened=None):
        """``prefer_fork``: start workers with a plain fork of this process where that is safe
        (``plain_fork_context``), else from the fork server.  ``device_opened``: an event of the
        fork server's context that the worker sets once its GPU context exists (a compile farm
        waits for it, since contexts opened at once take seconds each)."""
        self.spec = spec
        self.device_opened = device_opened
        self.launch_timeout = launch_timeout
        self.restarts = 0
        self.prefer_fork = prefer_fork
        self._context = fork_server_context()
        self._process = None
        self._conn = None
        self._log = None
        self._ready = False
        self.defers = spec.device == "cuda"  # only there do workers share compiles (and can skip one)
        self.specialisations: int | None = 0  # kernel specialisations launched (GPU: compiles), all workers
        # when its first worker's main began, had loaded the kernel and was ready (its device opened), by
        # the wall clock
        self.ready_times: dict[str, float] | None = None
        self._counted = 0
        try:
            self._start()
        except BaseException:  # a stop raised as the worker starts: no one else would end it
            self._stop()
            raise

    # -- lifecycle ---------------------------------------------------------------
    def _start(self) -> None:
        fd, self._log = tempfile.mkstemp(prefix="nanfuzz-worker-", suffix=".log")
        os.close(fd)
        context = (plain_fork_context() if self.prefer_fork else None) or self._context
        self._plain_fork = context is not self._context
        self._forked_by_server = context is self._context and context.get_start_method() == "forkserver"
        parent, child = context.Pipe()
        self._clock = LaunchClock(context)
        process = context.Process(target=_serve, args=(child, self.spec, self._log, self._clock, self.device_opened),
                                  daemon=True, name="nanfuzz-worker")
        self._process, self._conn = process, parent  # a stop raised as it starts still finds it to end
        self._ready = False
        try:
            start(process, self._forked_by_server, plain_fork=self._plain_fork)
        finally:
            child.close()

    def _await_ready(self) -> None:
        if self._ready:
            return
        if self._process is None:
            self._start()
        ready = wait([self._conn, self._process.sentinel], timeout=_START_TIMEOUT)
        message = self._receive() if self._conn in ready else None
        if message is None:
            tail = self._log_tail()
            why = self._death() if ready else f"no answer in {_START_TIMEOUT:.0f} s"  # before _stop forgets the process
            self._stop()
            raise NanfuzzError(f"kernel {self.spec.kernel}: the worker process did not start ({why})"
                               + (f"; it printed: {tail[-1]}" if tail else ""))
        kind, payload = message
        if kind == "error":
            self._stop()
            raise NanfuzzError(payload)
        if kind == "poisoned-fork":
            plain = self._plain_fork
            self._stop()
            if not plain:
                raise NanfuzzError(f"kernel {self.spec.kernel}: the worker process cannot use the GPU (the process "
                                   "it was forked from had touched it)")
            self.prefer_fork = False  # this process touched the GPU: its workers come from the fork server now
            self._start()
            return self._await_ready()
        assert kind == "ready", kind
        self._ready = True
        if self.ready_times is None and isinstance(payload, dict):
            self.ready_times = payload

    def _restart(self) -> None:
        self._counted = self.specialisations or 0
        self._stop()
        self.restarts += 1
        self._start()  # warms up while the campaign generates the next case

    def _stop(self) -> None:
        """End the worker and every process its kernel started (its process group)."""
        if self._process is not None and self._process.pid is not None:  # None: it never started
            end_group(self._process.pid)
            if self._process.is_alive():  # not yet in a group of its own
                self._process.kill()
            self._process.join(timeout=10)
        if self._conn is not None:
            self._conn.close()
        if self._log and os.path.exists(self._log):
            os.unlink(self._log)
        self._process = self._conn = self._log = None

    def close(self) -> None:
        self._stop()

    # -- one case ------------------------------------------------------------------
    def check(self, case, *, digest: bool = False, explain: bool = False, defer: str | None = None,
              patience: float | None = None) -> Outcome | Deferred | Declined:
        """The case's outcome.  ``defer`` (``CLAIMED`` or ``UNBUILT``): where a launch needs such a
        binary, ``Deferred`` at once rather than a wait or a compile (``harness.launch.shared_compiles``).
        ``Declined``: the case's device memory did not come free within ``patience`` seconds
        (default: the memory policy's ``search_wait``)."""
        self._await_ready()
        try:
            return self._check(case, digest, explain, defer if self.defers else None, patience)
        except BaseException:
            # interrupted mid-case (Ctrl-C): the worker's state is unknown, so it goes (the next case starts another)
            self._stop()
            raise

    def _check(self, case, digest: bool, explain: bool, defer: str | None, patience: float | None
               ) -> Outcome | Deferred | Declined:
        try:
            self._conn.send(("check", case, digest, explain, defer, patience))
        except (BrokenPipeError, OSError):
            return self._died(None)
        host_deadline = time.monotonic() + _HOST_WORK_TIMEOUT
        poll = min(1.0, self.launch_timeout / 4)
        while True:
            ready = wait([self._conn, self._process.sentinel], timeout=poll)
            if self._conn in ready:
                message = self._receive()
                if message is None:
                    return self._died(self._clock.in_launch)
                kind, payload = message
                if kind == "error":
                    raise NanfuzzError(payload)
                if kind == "deferred":
                    return Deferred(*payload)
                if kind == "declined":
                    return payload
                assert kind == "outcome", kind
                payload, count = payload
                self.specialisations = self._counted + (count or 0) if count is not None else None
                if self._forked_by_server and fork_server_died():
                    return self._died(None)  # the kernel killed it, and so its own worker: this case's doing
                if payload.fatal:
                    self._restart()
                return payload
            if ready:
                return self._died(self._clock.in_launch)
            now = time.monotonic()
            if self._clock.launch_seconds(now) > self.launch_timeout:
                return self._hung(True)
            if self._clock.waiting_for_memory:
                host_deadline = now + _HOST_WORK_TIMEOUT  # the governor bounds a wait for memory
            elif now > host_deadline and not self._clock.compiling:
                return self._hung(False)

    def _receive(self):
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            return None

    def _death(self) -> str:
        self._process.join(timeout=5)
        code = self._process.exitcode
        if code is None:
            return "the worker stopped answering"
        if code == _NO_STATUS and fork_server_died():
            how = fork_server_end()
            return f"the fork server it was forked from died{f' ({how})' if how else ''}, and the worker with it"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            return f"the worker process was killed by {name}"
        return f"the worker process exited with status {code}"

    def _log_tail(self) -> list[str]:
        try:
            with open(self._log, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 8192))
                text = f.read().decode("utf-8", "replace")
        except (OSError, TypeError):
            return []
        return [line for line in text.splitlines() if line.strip()][-_LOG_TAIL_LINES:]

    def _died(self, in_launch: bool | None) -> Outcome:
        why = self._death()
        with_the_server = self._forked_by_server and fork_server_died()
        if with_the_server:
            in_launch = None  # the worker died when the server did, whatever it was doing then
        tail = self._log_tail()
        where = {True: "during a launch", False: "outside a launch", None: ""}[in_launch]
        detail = f": {tail[-1].strip()[:200]}" if tail else ""
        outcome = Outcome(Verdict.CRASH, f"CRASH: {why}{' ' + where if where else ''}{detail}",
                          {"error": why, "during_launch": in_launch, "worker_output": tail,
                           "fork_server_died": with_the_server})
        self._restart()
        return outcome

    def _hung(self, in_launch: bool) -> Outcome:
        tail = self._log_tail()
        if in_launch:
            summary = f"HANG: a launch did not return within {self.launch_timeout:g} s (compile time excluded)"
        else:
            summary = f"HANG: the case did not finish within {_HOST_WORK_TIMEOUT:g} s outside the kernel's launches"
        outcome = Outcome(Verdict.HANG, summary, {"launch_timeout_s": self.launch_timeout, "during_launch": in_launch,
                                                   "worker_output": tail})
        self._restart()
        return outcome


# -- the worker process ------------------------------------------------------------

def _serve(conn, spec: WorkerSpec, log_path: str, clock: LaunchClock, device_opened=None) -> None:
    """The worker's main: build the subject, then judge cases until the pipe closes."""
    began = time.time()
    try:
        isolate()  # a session of its own, and death with its parent; Ctrl-C ignored from there on
    except KeyboardInterrupt:
        # a Ctrl-C to the campaign's process group reached this worker as it started, before it could
        # ignore it: the campaign stops and ends the worker; the worker carries on until it does.  Only a
        # spawned worker (no fork server: not Linux) can meet it: the fork server's children start with
        # Ctrl-C ignored and a plain fork with it blocked (``processes.start``)
        isolate()
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    interpret_if_cpu(spec.device)  # before any @triton.jit import
    if forked_after_gpu_use():
        conn.send(("poisoned-fork", None))
        return
    try:
        from nanfuzz.harness.launch.backend import host_threads
        from nanfuzz.harness.judge.check import check
        from nanfuzz.harness.judge.memory import TooLargeForDevice

        kernel = spec.load()
        loaded = time.time()
    except NanfuzzError as exc:
        conn.send(("error", str(exc)))
        return
    except BaseException as exc:  # a user's module may fail in any way while importing
        conn.send(("error", f"kernel {spec.kernel}: the worker could not load it ({type(exc).__name__}: {exc})"))
        return

    event = clock.event
    _report_compiles(event)
    from nanfuzz.harness.launch import shared_compiles

    if spec.device == "cuda":
        shared_compiles.install()  # a binary another process is compiling is waited for, not compiled again
        _open_device_context()
        from nanfuzz.harness.launch.warm_start import warm_oracle

        warm_oracle(kernel, "cuda")  # beside the first check's launch, not inside its oracle
    if device_opened is not None:
        device_opened.set()
    conn.send(("ready", {"began": began, "loaded": loaded, "ready": time.time()}))  # when (``Supervised.ready_times``)
    from nanfuzz.harness.launch.compiles import count_specialisations

    idle = _idle_look(spec)
    with host_threads(spec.device, own_process=True), count_specialisations(interpreter=spec.device == "cpu") as seen:
        while True:
            try:
                while not conn.poll(_IDLE_LOOK):
                    idle()
                message = conn.recv()
            except (EOFError, OSError):
                return
            _, case, digest, explain, defer, patience = message
            waited, compiling = shared_compiles.waited_seconds(), _compile_seconds()
            skipping = shared_compiles.skipping_misses(unclaimed=defer == UNBUILT) if defer else contextlib.nullcontext([])
            with skipping as skipped:
                try:
                    outcome = check(kernel, case, spec.device, digest_pass=digest, events=event, explain=explain,
                                    strict_reads=spec.strict_reads, memory=spec.memory, patience=patience)
                except TooLargeForDevice as exc:
                    conn.send(("declined", declined(exc)))
                    continue
                except NanfuzzError as exc:
                    conn.send(("error", str(exc)))
                    continue
                except BaseException as exc:  # the kernel broke our judging (e.g. returned something odd)
                    from nanfuzz.harness.judge.memory import out_of_memory
                    from nanfuzz.harness.judge.outcome import crash as _crash

                    if out_of_memory(exc):  # nanfuzz's own allocation: never the kernel's verdict
                        conn.send(("declined", Declined(f"nanfuzz ran out of memory judging this case "
                                                        f"({type(exc).__name__}); declined", judging_failed=True)))
                        continue
                    outcome = _crash(exc, "while judging the output")
                finally:
                    shared_compiles.release_claims()
                    event("compiled")  # a compile that raised, or a wait that did, leaves no compile open
                    event("returned")  # nor a launch
            if skipped and not outcome.fatal:  # a skipped launch: no verdict, the case comes back later
                conn.send(("deferred", (skipped[0], outcome.seconds or 0.0, outcome.memory_waited,
                                        tuple(outcome.timings.items()))))
                continue
            waited = shared_compiles.waited_seconds() - waited
            _move_compile_waits(outcome, waited)
            outcome.compiled_seconds = max(0.0, _compile_seconds() - compiling - waited)
            if outcome.verdict is Verdict.CRASH and spec.device == "cuda" and not outcome.fatal:
                outcome.fatal = not _device_alive()
            conn.send(("outcome", (outcome, seen.count)))
            if outcome.fatal:
                os._exit(0)  # the context is dead; the campaign starts a fresh worker


def _idle_look(spec: WorkerSpec):
    """What an idle worker does each ``_IDLE_LOOK`` seconds: give back the device memory it holds
    where another process waits for it (``harness.judge.memory``)."""
    import torch

    from nanfuzz.harness.judge.memory import governor

    device = torch.device(spec.device, spec.cuda_index) if spec.device == "cuda" and spec.cuda_index is not None \
        else torch.device(spec.device)
    share = []

    def look() -> None:
        if spec.device == "cuda" and not torch.cuda.is_initialized():
            return  # nothing held before the first case
        try:
            if not share:
                share.append(governor(spec.memory, device))
            share[0].idle()
        except Exception:  # a device in trouble is told by the next case, never by an idle worker's death
            pass

    return look


def forked_after_gpu_use() -> bool:
    """Whether this process is a plain fork of one that had touched the GPU.  Not only an opened
    context: ``torch.cuda.is_available()`` or ``device_count()`` (which an adapter's stand-ins may
    call as its kernel is resolved) start the driver and mark every later fork unable to use CUDA,
    while ``torch.cuda.is_initialized()`` stays False, so the parent cannot tell before forking."""
    import torch

    return torch.cuda._is_in_bad_fork()


def _open_device_context() -> None:
    """Create the GPU context now (about a second), while the campaign still draws its first case;
    a device that fails here fails again in the first check, where it is reported."""
    import torch

    try:
        torch.zeros(1, device="cuda")
    except Exception:
        pass


def _move_compile_waits(outcome: Outcome, seconds: float) -> None:
    """Time spent in launches waiting for another process's compile is the "compile" phase's."""
    if seconds > 0 and "kernel" in outcome.timings:
        outcome.timings["kernel"] = max(0.0, outcome.timings["kernel"] - seconds)
        outcome.timings["compile"] = outcome.timings.get("compile", 0.0) + seconds


def _device_alive() -> bool:
    try:
        import torch

        torch.cuda.synchronize()
        return bool(torch.ones(1, device="cuda").sum().item() == 1)
    except Exception:
        return False


class _CompileClock:
    """Seconds this worker has spent in Triton's compiles (cache loads and waits for other
    processes included), and when the compile under way, if any, started."""

    def __init__(self):
        self.seconds = 0.0
        self.since: float | None = None

    def started(self) -> None:
        self.since = time.monotonic()

    def total(self) -> float:
        """Compile seconds so far; a compile that raised (its end never reported) ends now."""
        if self.since is not None:
            self.seconds += time.monotonic() - self.since
            self.since = None
        return self.seconds


_compiles = _CompileClock()


def _compile_seconds() -> float:
    return _compiles.total()


def _report_compiles(event) -> None:
    """Tell the supervisor when Triton compiles (its watchdog does not count that time), and
    count the seconds (``_compile_seconds``)."""
    try:
        import triton

        runtime = triton.knobs.runtime
        runtime.jit_cache_hook, runtime.jit_post_compile_hook  # noqa: B018 - both must exist
    except (ImportError, AttributeError):
        return
    before, after = runtime.jit_cache_hook, runtime.jit_post_compile_hook

    def starting(*args, **kwargs):
        event("compile")
        _compiles.started()
        return before(*args, **kwargs) if before is not None else None

    def finished(*args, **kwargs):
        event("compiled")
        _compile_seconds()
        return after(*args, **kwargs) if after is not None else None

    runtime.jit_cache_hook, runtime.jit_post_compile_hook = starting, finished
