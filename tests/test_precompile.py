"""The compile farm (harness.launch.farm): every entry of a plan is visited once, a campaign
waits for the entries the farm still holds, and a kernel that raises, dies or hangs in the
farm gives up its entry only (the campaign then meets it in its own worker)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from nanfuzz.harness.campaign.runner import fuzz

from nanfuzz.harness.campaign.scope import campaign_capabilities, campaign_pool_of, compile_plan

from nanfuzz.harness.launch.subjects import worker_spec
from nanfuzz.harness.launch.farm import SAMPLES_PER_ENTRY, BuiltMarks, Farm, Plan, entry_key, entry_of, sample_cases
from nanfuzz.harness.registry import resolve
from nanfuzz.harness.campaign.settings import Settings
from nanfuzz.harness.judge.runs import case_bytes
from nanfuzz.harness.kernel import Kernel
from nanfuzz.reference.capabilities import Capabilities

POOL_SIZE, POOL_SEED = 4, 5


def _plan(spec: str) -> Plan:
    kernel = resolve(spec)
    settings = Settings(device="cpu", pool_size=POOL_SIZE)
    caps, _ = campaign_capabilities(kernel, settings)
    pool, _ = campaign_pool_of(caps, settings, POOL_SEED)
    return Plan(worker_spec(kernel, settings), caps, None, pool)


def _windowed(plan: Plan) -> list:
    return [e for e in plan.entries if e.window]


def test_samples_are_cases_of_their_entry_and_the_same_every_time():
    plan = _plan("tests.farm_subjects:slow")
    for entry in plan.entries:
        cases = sample_cases(plan, entry)
        assert len(cases) >= 2 and {entry_of(c) for c in cases} == {entry}
        assert sample_cases(plan, entry) == cases
    assert len({entry_key("k", e) for e in plan.entries}) == len(plan.entries)


def test_no_farm_under_the_interpreter_nor_when_switched_off():
    kernel = resolve("tests.farm_subjects:slow")
    assert compile_plan(kernel, Settings(device="cpu", pool_size=POOL_SIZE)) is None
    assert compile_plan(kernel, Settings(device="cuda", pool_size=POOL_SIZE, compile_jobs=0)) is None
    assert compile_plan(kernel, Settings(device="cuda", pool_size=0)) is None


def test_the_farm_visits_every_entry_and_a_raising_kernel_gives_up_only_its_windowed_ones(tmp_path):
    plan = _plan("tests.farm_subjects:raises")
    assert _windowed(plan) and len(_windowed(plan)) < len(plan.entries)
    with Farm([plan], processes=2, marks=BuiltMarks(tmp_path)) as farm:
        assert farm.wait(timeout=120)
        summary = farm.summary()
        stuck = len(list(Path(farm.folder).glob("*.stuck")))  # the cases waiting for a task given up stop waiting
    assert farm.summary() == summary  # still known once the farm's folder is gone
    assert stuck == summary["given_up"]
    tasks = SAMPLES_PER_ENTRY * len(plan.entries)
    assert summary["entries"] == len(plan.entries) and summary["tasks"] == tasks
    assert summary["given_up"] == SAMPLES_PER_ENTRY * len(_windowed(plan))
    assert summary["compiled"] == tasks - summary["given_up"]
    assert "planted error in the kernel's host code" in summary["first_error"]


# (a task timeout far above what a loaded machine takes for a dying task, and one a hanging task meets)
@pytest.mark.parametrize("spec, task_timeout, why", [("tests.subjects:exits", 600.0, "died"),
                                                     ("tests.subjects:hangs", 3.0, "no result in 3 s")])
def test_a_kernel_that_kills_or_hangs_its_farm_process_costs_only_its_entries(spec, task_timeout, why, tmp_path):
    plan = _plan(spec)
    with Farm([plan], processes=1, task_timeout=task_timeout, marks=BuiltMarks(tmp_path)) as farm:
        assert farm.wait(timeout=1200)
        summary = farm.summary()
        waited = farm.handle.wait_for(plan.spec.kernel, sample_cases(plan, _windowed(plan)[0])[0], limit=3600.0)
        stuck = len(list(Path(farm.folder).glob("*.stuck")))
    assert why in summary["first_error"] and stuck >= 1
    # the one farm process is gone after the first windowed entry's case: the rest are given up, none is lost
    assert summary["given_up"] >= 1 and summary["compiled"] + summary["given_up"] <= summary["tasks"]
    assert waited < 3600.0  # the finished farm ended the wait, not its limit


def test_a_campaign_waits_for_the_entries_the_farm_holds_and_runs_as_usual(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plan = _plan("tests.farm_subjects:slow")
    kernel = resolve("tests.farm_subjects:slow")
    with Farm([plan], processes=1, marks=BuiltMarks(tmp_path / "built")) as farm:
        start = time.monotonic()
        campaign = fuzz(kernel, device="cpu", max_examples=20, seed=1, use_database=False, pool_size=POOL_SIZE,
                        pool_seed=POOL_SEED, farm=farm.handle)
        elapsed = time.monotonic() - start
    # (Hypothesis may end a run a few examples early when its draws repeat; how early depends on its version)
    assert not campaign.failed and 12 <= campaign.examples <= 20
    # each case of a windowed entry takes the farm 0.5 s: the campaign met one before the farm was done with it
    assert campaign.phase_times.get("compile", 0.0) > 0.0
    assert campaign.time_to_first_example is not None and campaign.time_to_first_example < elapsed


def test_a_built_mark_holds_while_the_functions_it_names_hash_the_same(tmp_path, monkeypatch):
    from tests import farm_subjects

    plan = _plan("tests.farm_subjects:slow")
    marks = BuiltMarks(tmp_path)
    first, second = plan.entries[:2]
    assert not marks.is_built(plan, first)
    marks.mark(plan, first, [("tests.farm_subjects", "stamped", "source-hash-1")])
    assert marks.is_built(plan, first) and not marks.is_built(plan, second)
    assert not BuiltMarks(tmp_path / "elsewhere").is_built(plan, first)
    other_plan = Plan(plan.spec, plan.capabilities, ("tail",), plan.entries)
    assert not marks.is_built(other_plan, first)  # another focus draws other cases: built again
    monkeypatch.setattr(farm_subjects.stamped, "cache_key", "source-hash-2")  # the kernel was edited
    assert not marks.is_built(plan, first)
    marks.mark(plan, second, [("tests.farm_subjects", "no_such_function", "source-hash-1")])
    assert not marks.is_built(plan, second)


def test_a_farm_over_built_entries_skips_them_and_starts_nothing_when_all_are_built(tmp_path):
    plan = _plan("tests.farm_subjects:slow")
    marks = BuiltMarks(tmp_path)
    for entry in plan.entries[1:]:
        marks.mark(plan, entry, [("tests.farm_subjects", "stamped", "source-hash-1")])
    with Farm([plan], processes=2, marks=marks) as farm:
        assert farm.wait(timeout=120)
        summary = farm.summary()
    assert summary["entries"] == len(plan.entries)
    assert summary["already_built"] == SAMPLES_PER_ENTRY * (len(plan.entries) - 1)
    assert summary["compiled"] == SAMPLES_PER_ENTRY and summary["processes"] == 2
    marks.mark(plan, plan.entries[0], [("tests.farm_subjects", "stamped", "source-hash-1")])
    with Farm([plan], processes=2, marks=marks) as farm:
        assert farm.wait(timeout=1)
        waited = farm.handle.wait_for(plan.spec.kernel, sample_cases(plan, _windowed(plan)[0])[0])
        summary = farm.summary()
    assert summary["processes"] == 0 and summary["compiled"] == 0
    assert summary["already_built"] == summary["tasks"] == SAMPLES_PER_ENTRY * len(plan.entries)
    assert waited == 0.0


@pytest.mark.parametrize("argv", [["fuzz", "--compile-jobs", "-1"], ["bench", "--compile-jobs", "-2"],
                                  ["bench", "--seconds", "0"]])
def test_a_bad_count_is_one_line_and_exit_2(argv, capsys):
    from nanfuzz.harness.cli import main

    assert main([*argv, "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("nanfuzz: ") and "\n" not in err and argv[1] in err


def test_the_environment_sets_the_farm_size_and_rejects_nonsense():
    from nanfuzz.reference.errors import NanfuzzError

    assert Settings.from_environment({"NANFUZZ_COMPILE_JOBS": "3"}).compile_jobs == 3
    assert Settings.from_environment({"NANFUZZ_COMPILE_JOBS": "0"}).compile_jobs == 0
    assert Settings.from_environment({}).compile_jobs is None
    with pytest.raises(NanfuzzError, match="NANFUZZ_COMPILE_JOBS='many'"):
        Settings.from_environment({"NANFUZZ_COMPILE_JOBS": "many"})


def test_tasks_go_out_sample_by_sample_and_each_sample_is_marked_on_its_own(tmp_path):
    plan = _plan("tests.farm_subjects:slow")
    marks = BuiltMarks(tmp_path)
    marks.mark(plan, plan.entries[0], [("tests.farm_subjects", "stamped", "source-hash-1")], sample=1)
    assert marks.is_built(plan, plan.entries[0], 1) and not marks.is_built(plan, plan.entries[0])
    with Farm([plan], processes=1, marks=marks) as farm:
        order = [(entry, sample) for _, entry, sample in farm._tasks]
    entries = range(len(plan.entries))
    expected = [(e, i) for i in range(SAMPLES_PER_ENTRY) for e in entries if (e, i) != (0, 1)]
    assert order == expected  # every entry's first case before any entry's second, the built one left out


def test_farm_processes_run_below_the_campaign_and_wait_for_its_worker_s_device_a_bounded_time(tmp_path):
    import os

    from nanfuzz.harness.launch.farm import NICENESS
    from nanfuzz.harness.launch.processes import fork_server_context

    plan = _plan("tests.farm_subjects:slow")
    plan = Plan(plan.spec, plan.capabilities, None, plan.entries[:1])  # one entry: one round of tasks
    opened = fork_server_context().Event()
    # it would wait an hour for the worker's device: only the event lets it go on
    with Farm([plan], processes=1, marks=BuiltMarks(tmp_path / "held"), after=opened, device_wait=3600.0) as farm:
        process = farm._processes[0]
        while farm._current[0] < 0:  # until it has taken its first task and waits for the device
            assert process.is_alive()
            time.sleep(0.05)
        assert os.getpriority(os.PRIO_PROCESS, process.pid) - os.getpriority(os.PRIO_PROCESS, 0) == NICENESS
        time.sleep(0.2)
        assert farm.summary()["compiled"] == 0  # no worker has its device yet
        opened.set()  # a worker's device is open: on at once
        assert farm.wait(timeout=600)
        assert farm.summary()["compiled"] == farm.summary()["tasks"]

    never = fork_server_context().Event()
    with Farm([plan], processes=1, marks=BuiltMarks(tmp_path / "bounded"), after=never, device_wait=0.1) as farm:
        assert farm.wait(timeout=600)  # nobody set it: it went on anyway
        assert farm.summary()["compiled"] == farm.summary()["tasks"]


def test_each_upcoming_case_goes_to_as_many_tasks_in_a_row_as_it_has_copies():
    from nanfuzz.harness.launch.farm import _upcoming_number, _upcoming_tasks

    plan = _plan("tests.farm_subjects:slow")
    cases = tuple(sample_cases(plan, plan.entries[1], 1) + sample_cases(plan, plan.entries[0], 1))
    plan = Plan(plan.spec, plan.capabilities, None, plan.entries, cases)
    tasks = _upcoming_tasks([plan], copies=2)
    assert tasks == [(0, 1, "u0"), (0, 1, "u0.1"), (0, 0, "u1"), (0, 0, "u1.1")]
    assert [_upcoming_number(sample) for _, _, sample in tasks] == [0, 0, 1, 1]
    assert _upcoming_tasks([plan]) == [(0, 1, "u0"), (0, 0, "u1")]


def test_a_farm_process_skips_a_launch_whose_binary_another_process_compiles_and_goes_on(monkeypatch):
    from triton.runtime.jit import JITFunction

    from nanfuzz.harness.launch import farm as precompile
    from nanfuzz.harness.launch import shared_compiles

    calls = []

    class Binary:
        def _init_handles(self):  # Triton loads a binary and builds its launcher here
            calls.append(("launcher built", None))

    def launch(self, *args, grid, warmup, **kwargs):
        calls.append((self.fn.__name__, warmup))
        if self.fn.__name__ == "claimed":
            raise shared_compiles.ClaimedElsewhere("another process holds it")
        return binary

    binary = Binary()

    def claimed():
        pass

    def free():
        pass

    monkeypatch.setattr(JITFunction, "run", launch)  # restored after the test, as _compile_only replaces it
    precompile._compile_only()
    precompile._SKIPPED[0] = 0
    assert JITFunction(claimed).run(grid=(1,), warmup=False) is None
    assert JITFunction(free).run(grid=(1,), warmup=False) is binary
    # compile-only, on past the skipped launch, and the compiled binary's launcher built
    assert calls == [("claimed", True), ("free", True), ("launcher built", None)]
    assert precompile._SKIPPED == [1]


def test_a_binary_that_cannot_load_in_a_farm_process_is_left_for_the_worker_to_meet():
    from nanfuzz.harness.launch.farm import _build_launcher

    class TooBig:
        def _init_handles(self):
            raise RuntimeError("out of resources: shared memory")

    _build_launcher(TooBig())  # no error here: the campaign's worker meets it, and reports it
    _build_launcher(object())  # a Triton whose binaries have no such step


def test_farm_processes_open_their_devices_one_after_another_and_a_failure_passes_the_turn(monkeypatch):
    import threading

    import torch

    from nanfuzz.harness.launch import farm as precompile

    opened = []

    def zeros(*args, device=None, **kwargs):
        opened.append(threading.current_thread().name)
        if threading.current_thread().name == "slot0":
            raise RuntimeError("no device here")  # the next process still gets its turn
        time.sleep(0.05)

    monkeypatch.setattr(torch, "zeros", zeros)
    monkeypatch.setattr(precompile, "_room_for_a_context", lambda memory: True)
    turns = [threading.Event() for _ in range(3)]
    worker_device = threading.Event()
    # each waits an hour for its turn at most: only the order of the turns lets them through
    threads = [threading.Thread(target=precompile._open_device_in_turn, args=(slot, turns, None, worker_device, 3600.0),
                                name=f"slot{slot}") for slot in (2, 1, 0)]
    for thread in threads:
        thread.start()
    time.sleep(0.2)
    assert opened == []  # nobody before the worker's own device
    worker_device.set()
    for thread in threads:
        thread.join(600)
    assert opened == ["slot0", "slot1", "slot2"] and all(turn.is_set() for turn in turns)


def test_a_farm_whose_processes_left_before_their_tasks_lets_its_process_exit(tmp_path):
    # hundreds of tasks no process took fill the pipe under the farm's queue; the process that ran the
    # farm (a campaign, which has printed its verdict) must still exit once the farm is closed
    code = textwrap.dedent(f"""
        from dataclasses import replace
        from tests.test_precompile import _plan
        from nanfuzz.harness.launch.farm import BuiltMarks, Farm, sample_cases
        plan = _plan("tests.farm_subjects:leaves_at_once")
        plan = replace(plan, upcoming=sample_cases(plan, plan.entries[0]) * 200)
        with Farm([plan], processes=1, marks=BuiltMarks({str(tmp_path)!r})) as farm:
            farm.wait(timeout=300)
        summary = farm.summary()
        print("closed, given up:", summary["given_up"], "unbuilt:", summary["unbuilt"])
        assert summary["given_up"] + summary["unbuilt"] + summary["compiled"] == summary["tasks"] - summary["already_built"]
    """)
    try:
        proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent.parent, capture_output=True,
                              text=True, timeout=600)
    except subprocess.TimeoutExpired as hung:
        pytest.fail(f"the farm's process never exited: {hung.stdout!r}")
    assert proc.returncode == 0 and "closed, given up: " in proc.stdout, proc.stdout + proc.stderr
    assert int(proc.stdout.split("given up: ")[1].split()[0]) >= 1


def test_a_farm_task_builds_a_large_case_on_its_device_never_on_the_host(monkeypatch):
    # sixteen farm processes each building a production case's caches in host memory would hold
    # gigabytes apiece at once: a large case is built as a check builds it, its written blocks alone
    import torch

    import nanfuzz.reference.case as case_module
    from nanfuzz.harness.launch import farm as precompile
    from nanfuzz.reference import materialize
    from nanfuzz.reference.case import Case, Geometry, Poison, Sequence
    from nanfuzz.reference.device_build import build_on_device

    monkeypatch.setattr(case_module, "LARGE_ELEMENTS", 0)
    case = Case(Geometry(4, 2, 16, 8, 12, "float16"), (Sequence(1, 20, (3, 7, 9)),), poison=Poison("nan", "kv", None),
                data_seed=5).validate()
    assert case.large
    expected = build_on_device(case, "cpu")

    def on_the_host(*args, **kwargs):
        raise AssertionError("a large case was built on the host")

    monkeypatch.setattr(materialize, "build_on_host", on_the_host)
    seen = []

    def run(batch, out):
        seen.append((batch.key_cache[expected.ids].clone(), tuple(batch.key_cache.shape), tuple(out.shape)))

    plan = _plan("tests.farm_subjects:slow")
    precompile._compile_case(Kernel("sees its batch", run, Capabilities()), plan, case)
    (written, shape, out_shape), = seen
    assert shape[0] == case.geometry.num_blocks and out_shape == (1, 4, 16)
    assert torch.equal(written.view(torch.int16), expected.caches["key_cache"].view(torch.int16))


def test_a_large_case_s_stand_in_keeps_each_block_count_s_specialisation():
    from nanfuzz.harness.launch.stand_in import stand_in_blocks

    for blocks in [*range(1, 200), 2 ** 20, 2 ** 23 - 1, 349527]:
        kept = stand_in_blocks(blocks)
        assert kept <= blocks and kept < 32 or kept == blocks <= 32
        assert (kept == 1) == (blocks == 1) and kept % 16 == blocks % 16


def _large_production_cases(count: int) -> list:
    from nanfuzz.strategies import paged_cases
    from nanfuzz.strategies.production import PRODUCTION_SIZE
    from nanfuzz.strategies.steady import drawn

    found = [case for case in drawn(paged_cases(Capabilities(), tier="production", production=PRODUCTION_SIZE), 24)
             if case.large and case.geometry.num_blocks > 32 and case.num_tokens <= 1024]
    assert len(found) >= count
    return found[:count]


def test_a_farm_task_launches_a_large_case_s_stand_in_with_every_argument_but_the_cache_s_block_count():
    # a compile-only launch reads no cache: gigabytes of blocks held through a compile of seconds only kept
    # the campaign's checks waiting; what picks a binary (shapes but the block count, strides, tables'
    # width, lengths, dtypes) stays
    import torch

    from nanfuzz.harness.launch import farm as precompile
    from nanfuzz.harness.launch.stand_in import stand_in_blocks

    seen = []

    def run(batch, out):
        seen.append({"q": tuple(batch.q.shape), "out": tuple(out.shape), "key": tuple(batch.key_cache.shape),
                     "key strides": batch.key_cache.stride(), "value": tuple(batch.value_cache.shape),
                     "table": batch.block_table.cpu().clone(), "lengths": batch.seq_lens.tolist(),
                     "starts": batch.query_start_loc.tolist()})

    kernel = Kernel("sees its batch", run, Capabilities())
    for case in _large_production_cases(3):
        g = case.geometry
        precompile._compile_case(kernel, _plan("tests.farm_subjects:slow"), case)
        launched = seen.pop()
        blocks = stand_in_blocks(g.num_blocks)
        slots = (g.block_size, g.num_kv_heads, g.head_size)
        assert launched["key"] == launched["value"] == (blocks, *slots)
        assert launched["key strides"] == (g.block_size * g.num_kv_heads * g.head_size, g.num_kv_heads * g.head_size,
                                           g.head_size, 1)
        assert launched["q"] == (case.num_tokens, g.num_q_heads, g.head_size)
        assert launched["out"] == (case.num_tokens, g.num_q_heads, g.v_head_size)
        assert launched["lengths"] == [s.seq_len for s in case.sequences]
        assert launched["starts"] == case.query_start_loc()
        table = torch.tensor([s.block_table for s in case.sequences], dtype=launched["table"].dtype)
        assert torch.equal(launched["table"], table % blocks)
        # what it reserves is the stand-in's: the caches of a few blocks, not the case's gigabytes
        assert precompile.compile_footprint(kernel, case) < case_bytes(case) // 4


class _FullDevice:
    """A governor of a device of 80 units whose memory others hold for the first ``busy`` asks."""

    class device:
        @staticmethod
        def total() -> int:
            return 80

    def __init__(self, busy: int):
        self.busy, self.asks = busy, 0

    def larger_than_device(self, need: int) -> bool:
        return need > 80

    def reserve(self, need: int, patience: float, headroom: int = 0) -> int:
        from nanfuzz.harness.judge.memory import TooLargeForDevice

        assert patience == 0.0  # a farm task never stands in line ahead of the campaign's checks
        assert headroom == max(20, need)  # and leaves a quarter of the device to them, or as much as it takes
        self.asks += 1
        if self.asks <= self.busy or need + headroom > 80:
            raise TooLargeForDevice("taken")
        return need


def test_a_farm_task_refused_for_memory_asks_again_while_its_process_s_patience_lasts(monkeypatch):
    from nanfuzz.harness.judge.memory import TooLargeForDevice
    from nanfuzz.harness.launch import farm

    monkeypatch.setattr(farm, "_MEMORY_POLL", 0.01)
    monkeypatch.setattr(farm, "_patience_left", [0.5])
    held_a_moment = _FullDevice(busy=3)
    farm._reserve_politely(held_a_moment, 10)   # built once the campaign's check gave its memory back
    assert held_a_moment.asks == 4
    too_large = _FullDevice(busy=0)
    with pytest.raises(TooLargeForDevice):       # more than the device has beside the checks' room: given up at once
        farm._reserve_politely(too_large, 70)
    assert too_large.asks == 1
    # a task of over half the device would leave a check of its like no room: given up at once, where a
    # quarter's room alone would have taken it
    over_half = _FullDevice(busy=0)
    with pytest.raises(TooLargeForDevice):
        farm._reserve_politely(over_half, 45)
    assert over_half.asks == 1
    assert farm._reserve_politely(_FullDevice(busy=0), 40) < 1.0  # half: room for one check of its like
    held_for_good = _FullDevice(busy=10 ** 9)
    with pytest.raises(TooLargeForDevice):       # the process's patience is spent: given up
        farm._reserve_politely(held_for_good, 10)
    assert farm._patience_left[0] <= 0
    spent = _FullDevice(busy=1)
    with pytest.raises(TooLargeForDevice):       # and later tasks no longer wait at all
        farm._reserve_politely(spent, 10)
    assert spent.asks == 1


class _WatchedFullDevice(_FullDevice):
    """``_FullDevice``, noting at each ask whether the task's ``stuck`` marker is there."""

    def __init__(self, busy: int, marker: Path):
        super().__init__(busy)
        self.marker, self.seen = marker, []

    def reserve(self, need: int, patience: float, headroom: int = 0) -> int:
        self.seen.append(self.marker.exists())
        return super().reserve(need, patience, headroom)


def test_a_farm_task_waiting_for_memory_says_so_while_it_waits(monkeypatch, tmp_path):
    # the campaign's cases put off for this task are checked meanwhile (``Skipped.stuck``)
    from nanfuzz.harness.judge.memory import TooLargeForDevice
    from nanfuzz.harness.launch import farm

    monkeypatch.setattr(farm, "_MEMORY_POLL", 0.01)
    monkeypatch.setattr(farm, "_patience_left", [0.5])
    marker = tmp_path / "task.stuck"
    held_a_moment = _WatchedFullDevice(busy=3, marker=marker)
    farm._reserve_politely(held_a_moment, 10, marker)
    assert held_a_moment.seen == [False, True, True, True] and not marker.exists()  # reserved: compiling now
    at_once = _WatchedFullDevice(busy=0, marker=marker)
    farm._reserve_politely(at_once, 10, marker)
    assert at_once.seen == [False] and not marker.exists()
    held_for_good = _WatchedFullDevice(busy=10 ** 9, marker=marker)
    with pytest.raises(TooLargeForDevice):
        farm._reserve_politely(held_for_good, 10, marker)
    assert marker.exists()  # given up: it stays
