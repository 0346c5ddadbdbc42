"""Compile a campaign's kernel specialisations ahead of its search, on the host's cores.

On a GPU a campaign with a specialisation pool (``strategies.specialisations``)
meets a known, finite set of compile-time combinations, and compiling them is
most of a cold campaign's time: one compile takes a second or more, in one
process at a time.  A ``Farm`` compiles the whole pool at once, one process
per core, while the campaign's worker is still starting; it runs below the
campaign's priority, and its processes open their GPU contexts once the
worker has opened its own.  Each entry stands for a few cases
(``sample_cases``: derandomized Hypothesis draws, so decode and mixed
batches both occur, and integer arguments meet their specialisations);
each case is a task of its own.  Farm processes open their GPU contexts one after
another, before taking a task (many opened at once each take seconds).  A farm
process materialises the task's case on the device (a large case as its stand-in,
``harness.launch.stand_in``: caches of a few blocks) and calls the kernel with every
Triton launch turned into a compile-only warm-up (``JITFunction.run(warmup=True)``)
that also loads the binary and builds its launcher: nothing runs on the
device, and the binaries (and launchers) land in Triton's on-disk cache,
where the campaign's worker (and every job of a ``--jobs`` run) loads them
in milliseconds.  A campaign's own first cases, drawn ahead of its search
(``harness.campaign.upcoming``) while the farm's processes start (``Farm.schedule``),
go out first, in the order the search meets them,
each to two processes at once: a farm process skips a binary another
process is compiling (``shared_compiles.install(skip_claimed=True)``) and
goes on to the case's next launch, so a mixed batch's decode and prefill
kernels compile side by side rather than one after the other.  Then the
samples go out sample by sample: every entry's first case before any
entry's second, so no entry's binaries queue behind one another while
processes are free.  A plan may ask for fewer samples (``Plan.samples``; where its
campaign draws production cases, its production sample stays among them), and a
campaign that shares the farm with others waits for its own plan alone
(``FarmHandle.for_plan``).

A task the farm did once is marked as built beside Triton's cache
(``BuiltMarks``), with the source hash of every Triton function it launched.
A later farm over the same cache skips a task whose mark still matches
those functions' current sources, and starts no process at all when every
task is built: a warm campaign starts in the time its worker takes.  A mark
that no longer describes the cache costs speed only (the worker compiles).

A worker that needs a binary a farm process (or another worker) is compiling
waits for that binary alone and loads it (``harness.launch.shared_compiles``), and
compiles what nobody is compiling; a fuzzing campaign's worker rather puts
the case off and checks others meanwhile, and while the farm runs leaves
to it what nobody compiles yet (``harness.campaign.deferrals``), unless the
farm's task of the case's entry is ``stuck``: waiting for device memory, or
ended without building its case (the case then compiles what it needs).  Where claims cannot be installed (a Triton
without ``knobs``, a cache manager of the user's own), the campaign instead
waits before each case while the farm still holds any task of the case's
entry (``FarmHandle.wait_for``).

A farm process that dies, or spends longer than its task timeout on one
task (a kernel under review may crash or hang in its host code too), gives
up only that task: the campaign's worker then compiles what it needs itself,
as it would without a farm, and meets whatever the kernel does there.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from nanfuzz.harness.judge.outcome import one_line
from nanfuzz.harness.launch import shared_compiles
from nanfuzz.harness.launch.isolation import end_group, isolate
from nanfuzz.harness.launch.processes import interpret_if_cpu, start
from nanfuzz.harness.launch.stand_in import compile_stand_in
from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.case import Case
from nanfuzz.strategies.geometry import Shape
from nanfuzz.strategies.specialisations import Specialisation

SAMPLES_PER_ENTRY = 4
TASK_TIMEOUT = 300.0   # seconds one task may take in a farm process (big kernels compile for tens of seconds on ROCm)
# Farm processes run at a lower priority than the campaign's own: what they compile ahead
# is needed later, while a worker's own compile or check is needed now.
NICENESS = 10
# How long farm processes wait for a campaign's worker to open its GPU context before
# opening theirs (one context takes a fraction of a second alone, seconds among many).
DEVICE_WAIT = 3.0
# Farm processes given each upcoming case: with one, a case's launches compile one after
# another in one process (a decode kernel, then a prefill kernel), and the search waits for both.
UPCOMING_COPIES = 2
_POLL = 0.02
_FINISHED = "FINISHED"


@dataclass(frozen=True)
class Plan:
    """A campaign's pool, as a farm process rebuilds it: the kernel as a worker loads it
    (``harness.launch.worker.WorkerSpec``), the capabilities its cases are drawn under, and the entries."""

    spec: object                     # WorkerSpec
    capabilities: Capabilities       # after the campaign's focus and the device's encodings
    poison_classes: tuple[str, ...] | None
    entries: tuple[Specialisation, ...]
    upcoming: tuple[Case, ...] = ()  # the campaign's first cases, in order (``harness.campaign.upcoming``)
    tier: str = "small"              # the campaign's size tier: with production cases, each entry gets one
    samples: int = SAMPLES_PER_ENTRY  # sample cases built per entry after the upcoming ones (0: none)

    def sample_numbers(self) -> tuple[int, ...]:
        """Which of an entry's ``sample_cases`` the plan builds: its first ``samples``, except that
        where the campaign draws production cases, the last of fewer than all is the production one
        (the launches a long sequence switches to, which a shrink of a production failure keeps)."""
        if self.tier == "small" or not 1 < self.samples < SAMPLES_PER_ENTRY:
            return tuple(range(self.samples))
        return (*range(self.samples - 1), SAMPLES_PER_ENTRY - 1)


def entry_of(case: Case) -> Specialisation:
    """The pool entry a case was drawn from: its compile-time part."""
    g = case.geometry
    kv = case.kv_cache
    cache = kv if kv.extended else (kv.dtype, kv.quantized and kv.token_head)
    return Specialisation(Shape(g.dtype, g.num_q_heads, g.num_kv_heads, g.head_size, g.block_size, g.head_size_v),
                          case.causal, case.sliding_window, case.sinks, cache)


def entry_key(kernel: str, entry: Specialisation) -> str:
    return hashlib.sha256(repr((kernel, entry)).encode()).hexdigest()[:20]


def _marker(folder, kernel: str, entry: Specialisation, sample: int | str, state: str) -> Path:
    """A task's marker in the farm's folder: ``planned`` when the farm starts, ``done`` when it is built or
    given up, ``stuck`` while it waits for device memory and for good once it ends without building its
    case.  ``sample``: the number of one of the entry's sample cases, or ``u<n>`` for upcoming case n."""
    return Path(folder) / f"{entry_key(kernel, entry)}.{sample}.{state}"


class BuiltMarks:
    """Which tasks (an entry's sample cases) a farm built into this Triton cache, in a folder beside it.

    A mark holds what the task launched: each Triton function's module, name
    and ``cache_key`` (a hash of its source and of the functions it calls).
    A task counts as built while every one of those still hashes the same,
    so an edited kernel is built again; an entry, while each of its samples is.
    """

    VERSION = 3  # 3: an entry's production sample is its longest draw

    def __init__(self, folder: Path | None = None):
        self.folder = Path(folder) if folder is not None else _triton_cache_dir() / "nanfuzz-built"

    def key(self, plan: Plan, entry: Specialisation, sample: int) -> str:
        import torch
        import triton

        spec = plan.spec
        what = (self.VERSION, spec.kernel, spec.device, spec.vllm_src, spec.aiter_src, spec.fa_src, spec.sglang_src,
                spec.lmdeploy_src, entry, sample, plan.capabilities, plan.poison_classes, SAMPLES_PER_ENTRY,
                triton.__version__, torch.__version__)
        return hashlib.sha256(repr(what).encode()).hexdigest()[:32]

    def is_built(self, plan: Plan, entry: Specialisation, sample: int | None = None) -> bool:
        """Whether ``entry``'s case ``sample`` (None: each of its cases) is built."""
        if sample is None:
            return all(self.is_built(plan, entry, i) for i in range(SAMPLES_PER_ENTRY))
        try:
            mark = json.loads((self.folder / self.key(plan, entry, sample)).read_text())
            return all(_current_key(module, name) == key for module, name, key in mark["functions"])
        except (OSError, ValueError, KeyError, TypeError):
            return False

    def mark(self, plan: Plan, entry: Specialisation, functions: list[tuple[str, str, str]],
             sample: int | None = None) -> None:
        """Record ``entry``'s case ``sample`` (None: each of them) as built, having launched
        ``functions``; a cache folder that cannot be written only loses the mark."""
        for i in range(SAMPLES_PER_ENTRY) if sample is None else (sample,):
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                path = self.folder / self.key(plan, entry, i)
                temporary = path.with_suffix(f".{os.getpid()}.tmp")
                temporary.write_text(json.dumps({"kernel": plan.spec.kernel, "entry": repr(entry), "sample": i,
                                                 "functions": sorted(set(functions))}))
                os.replace(temporary, path)
            except OSError:
                return


def _triton_cache_dir() -> Path:
    try:
        from triton import knobs

        return Path(knobs.cache.dir)
    except (ImportError, AttributeError):  # Triton before knobs
        return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def _current_key(module: str, name: str) -> str | None:
    """The ``cache_key`` the Triton function ``module.name`` has now (None when it is gone)."""
    from nanfuzz.harness.adapters.loader import loaded_module
    from nanfuzz.harness.registry import LIBRARIES

    try:
        found = sys.modules.get(module) or loaded_module(module)
        if found is None and module.partition(".")[0] not in LIBRARIES:  # never import a whole vLLM for this
            found = importlib.import_module(module)
        for part in name.split("."):
            found = getattr(found, part)
        while not hasattr(found, "cache_key") and hasattr(found, "fn"):  # an autotuner or heuristics around it
            found = found.fn
        return found.cache_key
    except Exception:
        return None


@dataclass(frozen=True)
class FarmHandle:
    """What a campaign (in any process) needs to wait for the farm's entries: its folder.
    ``per_binary``: the workers wait for each binary they need instead (``harness.launch.shared_compiles``).
    ``plan``: the campaign's own plan of several (``for_plan``), whose tasks alone it waits for."""

    folder: str
    per_binary: bool = False
    plan: int | None = None

    def for_plan(self, plan: int) -> "FarmHandle":
        """The handle of one plan's campaign: running while that plan has tasks left, so that once
        they are done its worker compiles what else it meets instead of waiting for other plans."""
        return replace(self, plan=plan)

    def running(self) -> bool:
        """Is the farm still compiling (some task, of ``plan`` where given, not done, and it has not
        been closed)?"""
        folder = Path(self.folder)
        if not folder.exists() or (folder / _FINISHED).exists():
            return False
        return self.plan is None or not (folder / f"{_FINISHED}.{self.plan}").exists()

    def unbuilt(self, kernel: str, case: Case) -> tuple[str, str] | None:
        """The ``done`` and ``stuck`` markers of the farm's first task of ``case``'s entry, while the
        farm holds tasks of that entry and has finished none of them: a check of the case would only
        build its batches, reserve its memory and find its binary missing, unless that task is stuck.
        None otherwise, and for a farm whose workers wait for whole entries (``wait_for``)."""
        if not self.per_binary:
            return None
        planned = self._entry_tasks(kernel, case)
        if not planned or any(_done_of(path).exists() for path in planned):
            return None
        return str(_done_of(planned[0])), str(_stuck_of(planned[0]))

    def stuck_marker(self, kernel: str, case: Case) -> str | None:
        """The ``stuck`` marker of the farm's first task of ``case``'s entry not done yet (None where
        none is left): a case waiting for a binary nobody compiles yet waits no longer once it is there."""
        for path in self._entry_tasks(kernel, case):
            if not _done_of(path).exists():
                return str(_stuck_of(path))
        return None

    def _entry_tasks(self, kernel: str, case: Case) -> list[Path]:
        """The ``planned`` markers of the farm's tasks of ``case``'s entry, in the order it runs them."""
        prefix = entry_key(kernel, entry_of(case)) + "."
        return sorted(Path(self.folder).glob(prefix + "*.planned"),
                      key=lambda path: _task_order(path.name[len(prefix):-len(".planned")]))

    def wait_for(self, kernel: str, case: Case, limit: float = TASK_TIMEOUT + 60.0) -> float:
        """Wait while the farm still holds a task of ``case``'s entry; the seconds waited (0 when it does not)."""
        if self.per_binary:
            return 0.0
        folder = Path(self.folder)
        held = [_done_of(planned) for planned in self._entry_tasks(kernel, case)]
        if all(done.exists() for done in held):
            return 0.0
        start = time.monotonic()
        while not all(done.exists() for done in held) and not (folder / _FINISHED).exists() and folder.exists():
            if time.monotonic() - start > limit:
                break
            time.sleep(_POLL)
        return time.monotonic() - start


def _done_of(planned: Path) -> Path:
    """The ``done`` marker of the task whose ``planned`` marker this is."""
    return planned.with_name(planned.name[:-len("planned")] + "done")


def _stuck_of(planned: Path) -> Path:
    """The ``stuck`` marker of the task whose ``planned`` marker this is."""
    return planned.with_name(planned.name[:-len("planned")] + "stuck")


class FinishedTasks:
    """How long the farm's tasks took, read from their ``done`` markers as they appear (at most once a
    second): the longest built so far, its wait for memory left out (seconds; 0 before any)."""

    def __init__(self, folder: str):
        self.folder = folder
        self._slowest = 0.0
        self._read: set[str] = set()
        self._read_at = -float("inf")  # when (monotonic) the folder was last listed

    def slowest(self) -> float:
        if time.monotonic() - self._read_at >= 1.0:
            self._read_at = time.monotonic()
            self._read_new()
        return self._slowest

    def _read_new(self) -> None:
        try:
            names = os.listdir(self.folder)
        except OSError:  # the farm was closed: what was read stands
            return
        for name in names:
            if not name.endswith(".done") or name in self._read:
                continue
            self._read.add(name)
            try:
                result = json.loads(Path(self.folder, name).read_text())
            except (OSError, ValueError):
                continue
            if result.get("ok") and result.get("seconds") is not None:
                self._slowest = max(self._slowest, result["seconds"] - result.get("memory_wait", 0.0))


class Farm:
    """Farm processes compiling ``plans``' tasks, plan by plan: a plan's upcoming cases in order,
    then each sample case of each of its entries, its first samples before its later ones.

    ``close()`` stops it whatever it is doing; what it compiled stays in
    Triton's cache.  ``summary()`` says what it did.
    """

    def __init__(self, plans: list[Plan], processes: int, task_timeout: float = TASK_TIMEOUT,
                 marks: BuiltMarks | None = None, after=None, device_wait: float = DEVICE_WAIT,
                 first_cases_later: bool = False, prefer_fork: bool = False):
        """``after``: an event (of the fork server's context) the farm processes wait for, up to
        ``device_wait`` seconds, before their first device work: a worker's opened GPU context.
        ``first_cases_later``: the processes start now, and the plans' upcoming cases come with
        ``schedule`` (drawing them takes the campaign's process a while, which the processes spend
        starting, loading the kernel and opening their devices); no task goes out before.
        ``prefer_fork``: the processes are plain forks of this one where that is safe (a campaign's
        process fresh from its run's fork server, see ``harness.launch.worker.Supervised``)."""
        self.folder = tempfile.mkdtemp(prefix="nanfuzz-compiles-")
        self._per_binary = plans[0].spec.device == "cuda" and shared_compiles.available()
        self.handle = FarmHandle(self.folder, self._per_binary)
        self._plans = list(plans)
        self.task_timeout = task_timeout
        self._marks = marks or BuiltMarks()
        every = [(p, e, i) for p, plan in enumerate(plans) for i in plan.sample_numbers()
                 for e in range(len(plan.entries))]
        self._samples = [(p, e, i) for p, e, i in every if not self._marks.is_built(plans[p], plans[p].entries[e], i)]
        # A farm that runs anyway takes every upcoming case: an entry's built mark covers its
        # samples, and a case of the entry may still meet a binary they did not (a prefill where
        # they were decodes).  On a warm cache (nothing unbuilt) no farm starts for them; a plan
        # without samples has no marks to tell a warm cache by, so its cases are built anyway.
        warm = not self._samples and all(plan.samples for plan in plans)
        self._tasks: list[tuple[int, int, int | str]] = []
        self._entries = sum(len(plan.entries) for plan in plans)
        self.already_built = len(every) - len(self._samples)
        self._processes = []
        self.started = time.monotonic()
        self.started_at = time.time()  # the wall clock, which farm processes stamp their tasks' ends with
        self.finished_at: float | None = None
        self.scheduled_at: float | None = None  # when the tasks went out (``schedule``; the wall clock)
        self._stopping = threading.Event()
        self._closed: dict | None = None
        # per plan, its tasks not yet done (``FarmHandle.for_plan``); None once all are; no plan is
        # done before its tasks are scheduled
        self._open: dict[int, set[int] | None] = {}
        self._open_lock = threading.Lock()
        expected = len(self._samples) + (0 if first_cases_later else len(_upcoming_tasks(plans)))
        if warm or not (expected or first_cases_later):  # a warm cache: nothing to start
            self._schedule_none()
            return
        self._context = _farm_context(prefer_fork, plans[0].spec.device)
        plain_fork = self._context.get_start_method() == "fork"
        self._queue = self._context.Queue()
        count = max(1, processes if first_cases_later else min(processes, expected))
        # per farm process: the task it is on (-1: none) and since when (CLOCK_MONOTONIC)
        self._current = self._context.RawArray("l", [-1] * count)
        self._since = self._context.RawArray("d", count)
        # per farm process: set once it has opened its GPU context (the next one opens its own then)
        self._turns = [self._context.Event() for _ in range(count)]  # kept: a child unpickles them later
        for slot in range(count):
            process = self._context.Process(target=_serve, name="nanfuzz-compile", daemon=True, args=(
                slot, self._plans, self._queue, self._current, self._since, self.folder, self._marks, after,
                self._turns, device_wait))
            if plain_fork:
                start(process, forked_by_server=False, plain_fork=True)
            else:
                process.start()
            self._processes.append(process)
        self._monitor = threading.Thread(target=self._watch, daemon=True, name="nanfuzz-compile-watch")
        if not first_cases_later:
            self.schedule({})
        self._monitor.start()

    @property
    def plain_forked(self) -> bool:
        """Are its processes plain forks of the process that started it?"""
        return bool(self._processes) and self._context.get_start_method() == "fork"

    @property
    def awaits_first_cases(self) -> bool:
        """Whether its processes wait for ``schedule`` (a warm cache started none: no case is worth drawing)."""
        return bool(self._processes) and not self._open

    def schedule(self, first_cases: dict[int, tuple[Case, ...]], at_once: int = 1,
                 campaigns: list[int] | None = None) -> None:
        """Send out the tasks, plan by plan: each plan's upcoming cases (``first_cases`` by plan number,
        else the plan's own ``upcoming``) in the order its campaign meets them, then its samples.
        ``at_once``: the campaigns run that many at a time, in order; the plans of campaigns that
        start together take turns, their first cases before any of their samples.  ``campaigns``:
        per plan, its campaign's place in the run (default: the plan's number), since a campaign
        with nothing to compile ahead has no plan but still runs in its group."""
        if self._open or not self._processes:  # scheduled already, or a warm cache
            return
        self._plans = [replace(plan, upcoming=first_cases.get(p, plan.upcoming)) for p, plan in enumerate(self._plans)]
        copies = UPCOMING_COPIES if self._per_binary else 1  # without claims a second copy would only wait
        # plan by plan: a campaign meets its later entries before the campaigns after it start
        self._tasks = _in_turn(_upcoming_tasks(self._plans, copies), self._samples, max(1, at_once), campaigns)
        self.scheduled_at = time.time()
        for task in self._tasks:
            self._marker(*task, "planned").touch()
        for t, (p, e, sample) in enumerate(self._tasks):
            case = self._plans[p].upcoming[_upcoming_number(sample)] if isinstance(sample, str) else None
            self._queue.put((t, (p, e, sample), case))
        for _ in self._processes:
            self._queue.put(None)
        with self._open_lock:
            self._open = {p: {t for t, task in enumerate(self._tasks) if task[0] == p} for p in range(len(self._plans))}
        self._note_plans_done()

    def _schedule_none(self) -> None:
        """No process, no task: the farm is done as it starts."""
        self._open = {p: None for p in range(len(self._plans))}
        for p in range(len(self._plans)):
            Path(self.folder, f"{_FINISHED}.{p}").touch()
        self.finished_at = self.started
        Path(self.folder, _FINISHED).touch()
        self._monitor = None

    def _marker(self, plan: int, entry: int, sample: int | str, state: str) -> Path:
        return _marker(self.folder, self._plans[plan].spec.kernel, self._plans[plan].entries[entry], sample, state)

    def _give_up(self, task: int, why: str) -> None:
        done = self._marker(*self._tasks[task], "done")
        if not done.exists():
            _touch(self._marker(*self._tasks[task], "stuck"))
            done.write_text(json.dumps({"ok": False, "error": why, "seconds": None}))

    def _note_plans_done(self) -> None:
        """Mark each plan whose tasks are all done (built or given up) as finished."""
        with self._open_lock:
            for plan, open_tasks in self._open.items():
                if open_tasks is None:
                    continue
                open_tasks -= {t for t in open_tasks if self._marker(*self._tasks[t], "done").exists()}
                if not open_tasks:
                    try:
                        Path(self.folder, f"{_FINISHED}.{plan}").touch()
                    except OSError:  # the farm was closed meanwhile: its folder is gone, and every wait with it
                        pass
                    self._open[plan] = None

    def _watch(self) -> None:
        """Give up the task of a farm process that died or overran its task; mark the end."""
        while not self._stopping.is_set():
            alive = 0
            for slot, process in enumerate(self._processes):
                task = self._current[slot]
                if process.exitcode is None:
                    alive += 1
                    if task >= 0 and time.monotonic() - self._since[slot] > self.task_timeout:
                        end_group(process.pid)
                        process.kill()
                        self._give_up(task, f"no result in {self.task_timeout:g} s")
                elif task >= 0:
                    self._give_up(task, f"the compile process died (exit status {process.exitcode})")
                    self._current[slot] = -1
            self._note_plans_done()
            if not alive:
                break
            time.sleep(0.1)
        self.finished_at = time.monotonic()
        if os.path.isdir(self.folder):
            Path(self.folder, _FINISHED).touch()

    def wait(self, timeout: float | None = None) -> bool:
        """Until every task is done (True) or ``timeout`` passes (False)."""
        if self._monitor is None:
            return True
        self._monitor.join(timeout)
        return not self._monitor.is_alive()

    def summary(self) -> dict:
        """Pool entries; tasks (their sample cases, and the campaign's upcoming cases, each upcoming
        case as many tasks as it has copies) built before, compiled, given up, not yet built (a campaign
        that ends before its farm leaves the rest unbuilt); launches skipped
        because another process was compiling their binary; compile seconds summed over the farm
        processes; seconds from the farm's start to its end (None while it runs)."""
        if self._closed is not None:
            return self._closed
        results = []
        for task in self._tasks:
            done = self._marker(*task, "done")
            try:
                results.append(json.loads(done.read_text()))
            except (OSError, ValueError):
                pass
        seconds = sum(r["seconds"] or 0.0 for r in results)
        failed = [r["error"] for r in results if not r["ok"]]
        return {"entries": self._entries, "tasks": len(self._tasks) + self.already_built,
                "upcoming": sum(isinstance(sample, str) for _, _, sample in self._tasks),
                "already_built": self.already_built, "compiled": len(results) - len(failed), "given_up": len(failed),
                "unbuilt": len(self._tasks) - len(results),
                "skipped_launches": sum(r.get("skipped", 0) for r in results),
                "processes": len(self._processes), "compile_seconds": round(seconds, 3),
                "slowest_task_seconds": round(max((r["seconds"] or 0.0 for r in results), default=0.0), 3),
                "wall_seconds": None if self.finished_at is None else round(self.finished_at - self.started, 3),
                # from the farm's start to its tasks sent out: the campaigns' first cases drawn meanwhile
                "scheduled_seconds": None if self.scheduled_at is None else round(self.scheduled_at - self.started_at, 3),
                # from the farm's start to its first task built: processes started, devices opened, a compile
                "first_built_seconds": min((round(r["at"] - self.started_at, 3) for r in results
                                            if r["ok"] and "at" in r), default=None),
                "first_error": failed[0] if failed else None}

    def close(self) -> None:
        """Stop the farm; ``summary()`` still answers afterwards."""
        if self._closed is not None:
            return
        self._stopping.set()
        for process in self._processes:
            end_group(process.pid)  # and whatever a kernel's host code started there
            if process.exitcode is None:
                process.kill()
        for process in self._processes:
            process.join(timeout=5)
        if self._processes:
            # tasks no process took may fill the queue's pipe; its feeder thread, joined at exit,
            # would then hold the campaign's process alive after its verdict
            self._queue.cancel_join_thread()
            self._queue.close()
        if self._monitor is not None:
            self._monitor.join(timeout=5)
        if self.finished_at is None:
            self.finished_at = time.monotonic()
        self._closed = self.summary()
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> "Farm":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _upcoming_tasks(plans: list[Plan], copies: int = 1) -> list[tuple[int, int, str]]:
    """Tasks for the plans' upcoming cases, in the order the campaign meets them: the second case
    of an entry often launches a kernel its first did not (a prefill after a decode), and is
    needed as soon.  Each case is ``copies`` tasks in a row: ``u<n>``, then ``u<n>.1`` ..."""
    tasks = []
    for p, plan in enumerate(plans):
        index = {entry: e for e, entry in enumerate(plan.entries)}
        for n, case in enumerate(plan.upcoming):
            e = index.get(entry_of(case))
            if e is not None:
                tasks.extend((p, e, f"u{n}" + (f".{c}" if c else "")) for c in range(copies))
    return tasks


def _in_turn(upcoming: list[tuple[int, int, str]], samples: list[tuple[int, int, int]],
             at_once: int, campaigns: list[int] | None = None) -> list[tuple[int, int, int | str]]:
    """The tasks in the order they go out: plans in groups of ``at_once`` campaigns (those that run
    together; ``campaigns``: per plan, its campaign's place in the run, else the plan's number);
    in a group, every plan's upcoming cases before any sample, the plans taking turns (each one's
    n-th task before any one's (n+1)-th), upcoming cases and samples each in their given order
    within a plan."""
    def group(plan: int) -> int:
        return (plan if campaigns is None else campaigns[plan]) // at_once

    rank: dict[tuple, int] = {}
    for tasks in (upcoming, samples):
        seen: dict[int, int] = {}  # per plan, its tasks of this kind so far
        for task in tasks:
            rank[task] = seen.get(task[0], 0)
            seen[task[0]] = rank[task] + 1
    return sorted(upcoming + samples, key=lambda task: (group(task[0]), isinstance(task[2], int), rank[task], task[0]))


def _task_order(sample: str) -> tuple[int, int, int]:
    """Where a task of one entry goes out among that entry's others (``_in_turn``): its upcoming
    cases in the order met (``u3`` before ``u3.1`` before ``u4``), then its samples by number."""
    if sample.startswith("u"):
        number, _, copy = sample[1:].partition(".")
        return (0, int(number), int(copy or 0))
    return (1, int(sample), 0)


def _upcoming_number(sample: str) -> int:
    """The index in ``Plan.upcoming`` of an upcoming task's case (``u3``, ``u3.1`` -> 3)."""
    return _task_order(sample)[1]


def default_processes() -> int:
    """One farm process per core this process may use: the campaign's own processes mostly wait
    for compiles while the farm runs."""
    from nanfuzz.harness.launch.backend import usable_cores

    return max(1, usable_cores())


# -- a farm process ------------------------------------------------------------------

def _serve(slot, plans, queue, current, since, folder, marks, after=None, turns=None,
           device_wait: float = DEVICE_WAIT) -> None:
    isolate()  # a kernel's host code runs here too: a session of its own, and death with its parent
    try:
        os.nice(NICENESS)
    except OSError:
        pass
    interpret_if_cpu(plans[0].spec.device)  # before any @triton.jit import (the harness's own tests)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    _compile_only()
    from nanfuzz.harness.launch.backend import host_threads

    shared_compiles.install(skip_claimed=True)  # another process's binary: on to the next launch
    # the first plan's kernel is loaded while the campaign's process may still draw the first cases and
    # while the device turns come round; but a spec pinned to a device opens it as it loads: after the turn
    pinned = plans[0].spec.device == "cuda" and plans[0].spec.cuda_index is not None
    kernel = None if pinned else _preload(plans[0])
    if plans[0].spec.device == "cuda" and turns is not None:
        if not _open_device_in_turn(slot, turns, plans[0].spec.memory, after, device_wait):
            return  # the device has no room for another context: the campaign compiles what is left
        after = None
    if pinned:
        kernel = _preload(plans[0])
    with host_threads(plans[0].spec.device, own_process=True):  # sixteen of these share the cores
        _compile_tasks(plans, queue, current, since, folder, slot, marks, after, device_wait, kernel)


def _preload(plan: Plan):
    """The plan's kernel, or None where loading it fails (its first task meets that again and reports it)."""
    try:
        return plan.spec.load()
    except BaseException:
        return None


# What a compile process leaves the device for the cases of every campaign on it: it opens its
# context, and reserves a task's tensors, only while a quarter of the device stays free beside them
# (a context is about half a GiB, a production task's tensors a few GiB, and sixteen processes a
# campaign, several campaigns a device, would otherwise fill it and keep the checks waiting).
FARM_ROOM_SHARE = 4


def _farm_context(prefer_fork: bool, device: str):
    """Where the farm's processes come from: plain forks of this process where asked and safe (a GPU
    farm's only where such a fork can still use the GPU), else the fork server.  A campaign's
    process beside others would otherwise start a fork server of its own, an interpreter importing
    torch and Triton, seconds before its farm's first compile."""
    from nanfuzz.harness.launch.processes import fork_keeps_the_gpu, fork_server_context, plain_fork_context

    plain = plain_fork_context() if prefer_fork else None
    if plain is not None and (device != "cuda" or fork_keeps_the_gpu()):
        return plain
    return fork_server_context()


def _room_for_a_context(memory) -> bool:
    """Does the memory governor leave room on this process's GPU for another context (True where it
    cannot tell: the device's own failure is for the task to meet)?"""
    try:
        import torch

        from nanfuzz.harness.judge.memory import governor

        share = governor(memory, torch.device("cuda", torch.cuda.current_device()))
    except Exception:
        return True
    return share.open_context(share.device.total() // FARM_ROOM_SHARE)


def _open_device_in_turn(slot: int, turns: list, memory, after=None, device_wait: float = DEVICE_WAIT) -> bool:
    """Open this process's GPU context before taking a task: once the worker has opened its own
    (``after``), and the farm process before this one has opened its.  Sixteen contexts opened at
    once took 2.3 to 2.8 s each on an H200 host; one after another, 0.2 s each, so the first tasks,
    the campaign's first cases, start compiling at once.  False where the memory governor finds no
    room for another context; a device that fails to open otherwise is left for the task to meet."""
    try:
        if after is not None:
            after.wait(device_wait)
        if slot:
            turns[slot - 1].wait(device_wait)
        import torch

        if not _room_for_a_context(memory):
            return False
        torch.zeros(1, device="cuda")
    except Exception:
        pass
    finally:
        turns[slot].set()
    return True


def _compile_tasks(plans, queue, current, since, folder, slot, marks, after=None,
                   device_wait: float = DEVICE_WAIT, preloaded=None) -> None:
    """Take tasks until the farm's end: each ``(number, (plan, entry, sample), its case)``, where an
    upcoming case (``sample`` ``u<n>``) comes with the task; ``preloaded``: the first plan's kernel."""
    kernels: dict = {} if preloaded is None else {0: preloaded}
    samples: dict = {}
    waited = after is None
    while True:
        item = queue.get()
        if item is None:
            return
        task, (plan_index, entry_index, sample), upcoming = item
        since[slot] = time.monotonic()
        current[slot] = task
        plan = plans[plan_index]
        entry = plan.entries[entry_index]
        stuck = _marker(folder, plan.spec.kernel, entry, sample, "stuck")
        started = time.perf_counter()
        try:
            kernel = kernels.get(plan_index) or kernels.setdefault(plan_index, plan.spec.load())
            if isinstance(sample, str):  # an upcoming case of the campaign: its binaries, no mark
                cases, number = [upcoming], 0
            else:
                cases, number = samples.get((plan_index, entry_index)), sample
                if cases is None:
                    cases = samples[plan_index, entry_index] = sample_cases(plan, entry)
            _LAUNCHED.clear()
            _SKIPPED[0] = 0
            if not waited:  # the kernel and its cases are ready; the device comes next
                after.wait(device_wait)
                waited = True
                since[slot] = time.monotonic()
            # (a small entry may have fewer distinct cases than samples)
            memory_wait = _compile_case(kernel, plan, cases[number], stuck) if number < len(cases) else 0.0
            if not isinstance(sample, str):
                marks.mark(plan, entry, list(_LAUNCHED), sample)
            result = {"ok": True, "error": None, "skipped": _SKIPPED[0], "memory_wait": memory_wait}
        except BaseException as exc:  # the kernel's own failure is for the campaign to find
            result = {"ok": False, "error": one_line(exc)}
            _touch(stuck)
        shared_compiles.release_claims()  # a compile that raised leaves its claim
        result["seconds"] = time.perf_counter() - started
        result["at"] = time.time()
        done = _marker(folder, plan.spec.kernel, entry, sample, "done")
        done.with_suffix(".tmp").write_text(json.dumps(result))
        os.replace(done.with_suffix(".tmp"), done)  # whole, or not there
        current[slot] = -1


# (module, name, cache_key) of each Triton function the current task launched
_LAUNCHED: set[tuple[str, str, str]] = set()
# launches of the current task whose binary another process was compiling
_SKIPPED = [0]


def _compile_only() -> None:
    """Every Triton launch in this process compiles (or loads from the cache) without running;
    a launch whose binary another process is compiling is skipped (``ClaimedElsewhere``)."""
    from triton.runtime.jit import JITFunction

    launch = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        _LAUNCHED.add((self.fn.__module__, self.fn.__qualname__, self.cache_key))
        try:
            binary = launch(self, *args, grid=grid, warmup=True, **kwargs)
        except shared_compiles.ClaimedElsewhere:
            _SKIPPED[0] += 1
            return None
        _build_launcher(binary)
        return binary

    JITFunction.run = run


def _build_launcher(binary) -> None:
    """Load ``binary`` and build its host-side launcher, as its first real launch would: some
    Tritons (3.6) compile a C launcher per kernel signature there, a few tenths of a second, into
    the same on-disk cache, where the worker then finds it.  A binary that cannot load (too much
    shared memory, say) is the kernel's to fail in the worker, where the campaign sees it."""
    load = getattr(binary, "_init_handles", None)
    if load is None:
        return
    try:
        load()
    except Exception:
        pass


def sample_cases(plan: Plan, entry: Specialisation, count: int = SAMPLES_PER_ENTRY) -> list[Case]:
    """``count`` cases of ``entry`` as the campaign draws them, the simplest first (same every time),
    and where the campaign draws production cases, the last of them one at production size (the
    launches real kernels switch to for long sequences; never a huge cache: farm processes share
    the device).  That one is the case with the longest sequence of a few derandomized draws (the
    last of them had 387 keys in some entries, short of a split-KV partition's 1024)."""
    from nanfuzz.strategies import paged_cases
    from nanfuzz.strategies.production import PRODUCTION_SIZE
    from nanfuzz.strategies.steady import drawn

    production = plan.tier != "small" and count > 1
    found = drawn(paged_cases(plan.capabilities, poison_classes=plan.poison_classes, pool=(entry,)), count - production)
    if production:
        large = drawn(paged_cases(plan.capabilities, poison_classes=plan.poison_classes, pool=(entry,),
                                  tier="production",
                                  production=replace(PRODUCTION_SIZE, huge_cache_bytes=0, max_live_keys=1 << 17)), 8)
        found.append(max(large, key=lambda case: case.max_seq_len))
    return found


def _compile_case(kernel, plan: Plan, case: Case, stuck: Path | None = None) -> float:
    """Launch ``case`` compile-only, its tensors' device memory reserved first (``_reserve_politely``:
    a task whose memory stays taken is given up, and the campaign compiles it when it meets it; the
    ``stuck`` marker is there while it waits); the seconds it waited for that memory."""
    import torch

    from nanfuzz.harness.judge.memory import governor

    device = torch.device("cuda", torch.cuda.current_device()) if plan.spec.device == "cuda" else torch.device("cpu")
    share = governor(plan.spec.memory, device)
    waited = _reserve_politely(share, compile_footprint(kernel, case), stuck)
    try:
        batch = compile_batch(case, device)
        share.built()
        g = case.geometry
        out = torch.empty(case.num_tokens, g.num_q_heads, g.v_head_size, dtype=batch.q.dtype, device=device)
        kernel(batch, out)
        del batch, out
    finally:
        share.give_back()
    return waited


def compile_batch(case: Case, device):
    """The batch ``_compile_case`` launches: ``case`` itself, materialised; a large case's stand-in
    (``harness.launch.stand_in``: the same binaries, caches of a few blocks) built on the device."""
    from nanfuzz.reference.materialize import materialize

    return _built_on_device(compile_stand_in(case), device) if case.large else materialize(case, device)


def compile_footprint(kernel, case: Case) -> int:
    """About what ``_compile_case`` holds on the device: the batch, and the output and a layout copy at
    most (a large case: its stand-in's ``large_build_footprint``)."""
    from nanfuzz.harness.judge.large import large_build_footprint
    from nanfuzz.harness.judge.runs import case_bytes

    if not case.large:
        return 2 * case_bytes(case)
    stand_in = compile_stand_in(case)
    return large_build_footprint(stand_in, kernel.copies_caches_of(stand_in))


# How long, in all, a farm process asks again for device memory the campaign's own checks hold (a
# mixed-size case being checked can hold most of a GPU for a second or two).  It never waits in
# line: its want in the ledger would stand ahead of the campaign's next check.  A task given up at
# once leaves its binary to nobody until the farm ends, and the cases put off for it wait that long
# (on an 80 GB GPU one seed's farm gave up 178 of its 208 tasks so).  The patience is the process's,
# not each task's: where the device stays full (campaigns sharing it), the farm gives up as before
# once it is spent, instead of every task waiting in turn.
MEMORY_PATIENCE = 20.0
_MEMORY_POLL = 0.2
_patience_left = [MEMORY_PATIENCE]


def _reserve_politely(share, need: int, stuck: Path | None = None) -> float:
    """``share.reserve(need)`` without a place in line and only while ``FARM_ROOM_SHARE`` of the device,
    and no less than ``need`` itself, stays free beside it for the campaign's checks, asked again every
    ``_MEMORY_POLL`` s while this process's ``MEMORY_PATIENCE`` lasts; ``TooLargeForDevice`` once it is
    spent, and at once for a case that would not leave that room on the device however empty.
    ``stuck`` is there while it asks again (the campaign's cases waiting for this task then stop
    waiting).  The seconds it asked for.

    The room grows with the task: a farm task is one of the campaign's own upcoming cases, and the
    check of its like, coming meanwhile, needs as much.  With a quarter of an 80 GB H100 left, a farm
    task of a 37 GiB production case held the device while it compiled, and the search's check of
    another such case waited 10 s for it; such a task now leaves its case to the check, which
    compiles what it needs (on an H200 both fit)."""
    from nanfuzz.harness.judge.memory import TooLargeForDevice

    room = max(share.device.total() // FARM_ROOM_SHARE, need)
    first = time.monotonic()
    while True:
        started = time.monotonic()
        try:
            share.reserve(need, patience=0.0, headroom=room)
            break
        except TooLargeForDevice:
            if _patience_left[0] <= 0 or share.larger_than_device(need + room):
                raise  # the task ends without building: its marker stays
        if stuck is not None:
            _touch(stuck)
        time.sleep(_MEMORY_POLL)
        _patience_left[0] -= time.monotonic() - started
    if stuck is not None:
        with contextlib.suppress(OSError):
            stuck.unlink()
    return time.monotonic() - first


def _touch(marker: Path) -> None:
    with contextlib.suppress(OSError):  # the farm was closed meanwhile: nobody waits for the marker
        marker.touch()


def _built_on_device(case: Case, device):
    """A large case's batch as a check builds it (``harness.judge.check.LargeCaseCheck``): only its
    written blocks are made, on the device, in caches of a pool of this task's own, freed with it.
    Built on the host, a production case's caches take gigabytes of the host's memory in each of the
    farm's processes at once."""
    from nanfuzz.harness.judge.large import built_in_pool, large_batch
    from nanfuzz.harness.judge.pool import CachePool

    build, caches = built_in_pool(case, device, CachePool())
    return large_batch(case, build.small, caches)
