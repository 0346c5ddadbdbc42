"""The device memory governor: processes share a device's memory through one ledger, wait or
decline when it is short, and nanfuzz's own allocation failures are never the kernel's verdict."""
from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import signal
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from nanfuzz.harness.campaign.settings import Settings
from nanfuzz.harness.judge.check import Verdict, check
from nanfuzz.harness.judge.device_memory import DeviceMemory
from nanfuzz.harness.kernel import Kernel
from nanfuzz.harness.judge.memory import (GiB, MemoryPolicy, SimulatedDevice, TooLargeForDevice, device_key,
                                          governor)
from nanfuzz.harness.launch.subjects import worker_spec
from nanfuzz.harness.launch.worker import Declined, InProcess, Supervised
from nanfuzz.reference.errors import NanfuzzError
from tests import subjects
from tests.cases import consecutive_case

WINDOWED, PLAIN = consecutive_case([(1, 20)], window=4), consecutive_case([(1, 20)])
CPU = torch.device("cpu")


def _policy(folder, total=10, case=4, held=0, kept=0) -> MemoryPolicy:
    return MemoryPolicy(ledger_dir=str(folder),
                        simulated=SimulatedDevice(int(total * GiB), int(case * GiB), int(held * GiB), int(kept * GiB)))


class _Gpu(DeviceMemory):
    """A GPU of ``size`` bytes with no margin, holding ``holding`` between cases; its report of free
    memory is each test's own."""
    key, where = "gpu-test", "GPU"
    size = 16 * GiB
    holding = 0

    def total(self):
        return self.size

    def held(self):
        return self.holding

    def margin(self):
        return 0


def _hold(policy, folder, idle) -> None:
    """Another process: reserve a case, finish it (keeping what the simulated device says it holds
    between cases), and, while told to, give it back when someone waits; it ends once ``folder``
    holds a file named ``release`` (files, not locks a killed process could leave held)."""
    share = governor(policy, CPU)
    share.reserve(0, patience=0.0)
    if policy.simulated.held_bytes:
        share.settle()
    (folder / "reserved").touch()
    while not (folder / "release").exists():
        if idle:
            share.idle()
        time.sleep(0.05)
    os._exit(0)


class _Holders:
    def __init__(self, policy, folder):
        self.policy, self.folder = policy, folder
        self.processes = []

    def start(self, idle: bool = False):
        """A holding process, and what ends it."""
        folder = self.folder / f"holder-{len(self.processes)}"
        folder.mkdir()
        process = multiprocessing.get_context("fork").Process(target=_hold, args=(self.policy, folder, idle),
                                                             daemon=True)
        process.start()
        deadline = time.monotonic() + 60
        while not (folder / "reserved").exists():
            assert process.is_alive() and time.monotonic() < deadline, "the holder never got its memory"
            time.sleep(0.02)
        self.processes.append(process)
        return process, (folder / "release").touch

    def close(self):
        for process in self.processes:
            process.kill()
            process.join(10)


@pytest.fixture
def holders(tmp_path):
    made = []

    def make(policy):
        made.append(_Holders(policy, tmp_path))
        return made[-1]

    yield make
    for h in made:
        h.close()


def test_processes_sharing_a_device_get_what_fits_and_the_rest_waits_for_it(tmp_path, holders):
    policy = _policy(tmp_path)  # 10 GiB, 4 GiB a case: two cases at once
    others = holders(policy)
    others.start()
    _, release = others.start()
    share = governor(policy, CPU)
    with pytest.raises(TooLargeForDevice, match=r"needs about 4\.0 GiB .* 2\.0 GiB are not held or wanted"):
        share.reserve(0, patience=0.0)
    threading.Timer(0.5, release).start()  # one of the others finishes its case
    assert share.reserve(0, patience=30.0) == 4 * GiB
    assert share.waits == 2 and share.waited > 0.3
    share.settle()


def test_a_dead_process_s_reservation_is_void(tmp_path, holders):
    policy = _policy(tmp_path, case=6)
    process, _ = holders(policy).start()
    share = governor(policy, CPU)
    with pytest.raises(TooLargeForDevice):  # sensitivity: alive, it holds 6 of 10
        share.reserve(0, patience=0.0)
    os.kill(process.pid, signal.SIGKILL)  # it never gives its reservation back
    process.join(10)
    assert share.reserve(0, patience=0.0) == 6 * GiB
    share.settle()


def test_the_ledger_drops_a_process_it_watched_once_it_ends_unreaped_and_leaves_the_file_alone_while_unchanged(
        tmp_path):
    import subprocess

    from nanfuzz.harness.judge.ledger import Ledger, _started

    ledger = Ledger.open(tmp_path, "device")
    child = subprocess.Popen(["sleep", "0.5"])  # not waited for: it ends a zombie, which holds no memory
    with ledger.entries() as entries:
        entries[str(child.pid)] = {"started": _started(child.pid), "weight": GiB}
    with ledger.entries() as entries:  # alive: kept, and watched from now on
        assert str(child.pid) in entries
    written = ledger.path.stat().st_mtime_ns
    time.sleep(0.05)
    with ledger.entries() as entries:
        assert str(child.pid) in entries
    assert ledger.path.stat().st_mtime_ns == written  # nothing changed, nothing written
    deadline = time.monotonic() + 30
    while True:
        with ledger.entries() as entries:
            if str(child.pid) not in entries:
                break
        assert time.monotonic() < deadline, "an ended process kept its reservation"
        time.sleep(0.1)
    assert child.poll() is not None and not json.loads(ledger.path.read_text())
    child.wait()
    with ledger.entries() as entries:  # a start time no process has (written by something else): dropped
        entries[str(os.getpid())] = {"started": {"not": "a start time"}, "weight": GiB}
    with ledger.entries() as entries:
        assert not entries


@pytest.mark.parametrize("idle", [True, False])
def test_a_wait_for_memory_makes_an_idle_holder_give_back_what_it_keeps(tmp_path, holders, idle):
    policy = _policy(tmp_path, case=4, held=8)  # between cases a process keeps 8 of 10 GiB (the pool's caches)
    holders(policy).start(idle=idle)
    share = governor(policy, CPU)
    if idle:
        assert share.reserve(0, patience=30.0) == 4 * GiB
        share.settle()
    else:  # sensitivity: a holder that never looks keeps it
        with pytest.raises(TooLargeForDevice):
            share.reserve(0, patience=1.0)


def _small_cases(policy, folder, cases: int, pause: float) -> None:
    """Another process: judge ``cases`` small cases, ``pause`` seconds each, then say so in ``folder``."""
    share = governor(policy, CPU)
    for _ in range(cases):
        share.reserve(0, patience=60.0)
        time.sleep(pause)
        share.settle()
        (folder / "judged").touch()
    (folder / "done").touch()
    while True:
        time.sleep(1)


def _await(path) -> None:
    deadline = time.monotonic() + 60
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never came"
        time.sleep(0.02)


def _looks(monkeypatch) -> list:
    from nanfuzz.harness.judge.ledger import Ledger

    looks, real = [], Ledger.entries

    def counted(self):
        looks.append(time.monotonic())
        return real(self)

    monkeypatch.setattr(Ledger, "entries", counted)
    return looks


def test_small_cases_in_a_row_look_at_the_ledger_a_few_times_a_second_not_twice_a_case(tmp_path, monkeypatch):
    from nanfuzz.harness.judge import memory

    looks = _looks(monkeypatch)
    share = governor(_policy(tmp_path, total=10, case=0.25), CPU)
    started = time.monotonic()
    for _ in range(200):
        assert share.reserve(0, patience=0.0) == GiB // 4
        share.settle()
    seconds = time.monotonic() - started
    assert 1 <= len(looks) <= 2 * (2 + seconds / memory._LOOK_EVERY)
    entry = json.loads(next(tmp_path.glob("*.json")).read_text())[str(os.getpid())]
    assert entry["weight"] == GiB // 4  # between cases the entry keeps weighing the claim
    looks.clear()  # sensitivity: a case larger than the claim limit is looked at each time, and given back
    large = governor(_policy(tmp_path / "large", total=10, case=2), CPU)
    for _ in range(5):
        large.reserve(0, patience=0.0)
        large.settle()
    assert len(looks) == 10 and large.claim == 0


def test_a_process_waiting_for_memory_makes_a_busy_holder_give_its_claim_back(tmp_path, holders):
    policy = _policy(tmp_path, total=1.5, case=0.9)  # one case at a time: a claim of 0.9 GiB keeps the other out
    folder = tmp_path / "busy"
    folder.mkdir()
    busy = multiprocessing.get_context("fork").Process(target=_small_cases, args=(policy, folder, 10**6, 0.02),
                                                      daemon=True)
    busy.start()
    try:
        _await(folder / "judged")
        share = governor(policy, CPU)
        assert share.reserve(0, patience=30.0) == int(0.9 * GiB)  # granted though the other never idles
        share.settle()
        share.give_back()  # this process's claim too
    finally:
        busy.kill()
        busy.join(10)
    # sensitivity: a holder that judges no more cases keeps its claim, and the wait is declined
    folder = tmp_path / "stopped"
    folder.mkdir()
    stopped = multiprocessing.get_context("fork").Process(target=_small_cases, args=(policy, folder, 1, 0.0),
                                                         daemon=True)
    stopped.start()
    try:
        _await(folder / "done")
        with pytest.raises(TooLargeForDevice, match="not held or wanted"):
            governor(policy, CPU).reserve(0, patience=1.0)
    finally:
        stopped.kill()
        stopped.join(10)


def _wait_for_a_case(policy, folder) -> None:
    """Another process: wait (a minute at most) for a case, and say in ``folder`` whether it came."""
    try:
        governor(policy, CPU).reserve(0, patience=60.0)
        (folder / "granted").touch()
    except TooLargeForDevice:
        (folder / "declined").touch()
    while True:
        time.sleep(1)


def _ledger_wants(folder) -> list[int]:
    from nanfuzz.harness.judge.ledger import Ledger

    with Ledger.open(folder, "simulated").entries() as entries:
        return [e.get("wants", 0) for e in entries.values()]


@pytest.mark.parametrize("others_give_back", [False, True])
def test_a_case_that_fits_only_once_other_processes_end_keeps_no_one_waiting_behind_it(tmp_path, holders,
                                                                                        others_give_back):
    """On a 10 GiB device whose every process keeps a 1 GiB context, one waits for a 9.5 GiB case:
    beside another process's context it fits only once that process ends, so it stands ahead of no
    one, and a 1 GiB case is granted at once.  Sensitivity: an 8 GiB case, which fits once the other
    gives back the 2 GiB it keeps between cases, stands in line, and the 1 GiB case is refused."""
    holders(_policy(tmp_path, case=1, held=2, kept=1)).start()  # 3 GiB: its context and its pool's caches
    folder = tmp_path / "large"
    folder.mkdir()
    large = _policy(tmp_path, case=8 if others_give_back else 9.5, kept=1)
    waiter = multiprocessing.get_context("fork").Process(target=_wait_for_a_case, args=(large, folder), daemon=True)
    waiter.start()
    try:
        deadline = time.monotonic() + 60
        while len(_ledger_wants(tmp_path)) < 2:  # the waiter has written its entry
            assert waiter.is_alive() and time.monotonic() < deadline, "the waiter never wrote its entry"
            time.sleep(0.02)
        assert not (folder / "granted").exists()
        assert any(_ledger_wants(tmp_path)) == others_give_back
        share = governor(_policy(tmp_path, case=1, kept=1), CPU)
        if others_give_back:
            with pytest.raises(TooLargeForDevice, match="not held or wanted"):
                share.reserve(0, patience=0.0)
        else:
            assert share.reserve(0, patience=0.0) == GiB
            share.settle()
    finally:
        waiter.kill()
        waiter.join(10)


def test_a_case_larger_than_the_device_is_declined_without_waiting(tmp_path):
    share = governor(_policy(tmp_path, total=3, case=4), CPU)
    started = time.monotonic()
    with pytest.raises(TooLargeForDevice, match="more than the 3.0 GiB the device has"):
        share.reserve(0, patience=60.0)
    assert share.waits == 0 and time.monotonic() - started < 30


def test_a_device_is_named_by_its_uuid_under_any_index():
    h200 = dict(name="NVIDIA H200", total_memory=150 << 30)
    first = device_key(SimpleNamespace(uuid="GPU-5a1f0c3e-77aa-4c1d-9e2b-0123456789ab", **h200), 0)
    assert first == device_key(SimpleNamespace(uuid="GPU-5a1f0c3e-77aa-4c1d-9e2b-0123456789ab", **h200), 3)
    assert first != device_key(SimpleNamespace(uuid="GPU-00000000-0000-0000-0000-000000000001", **h200), 0)
    unnamed = SimpleNamespace(uuid="00000000-0000-0000-0000-000000000000", **h200)  # a driver that tells none
    assert device_key(unnamed, 0) != device_key(unnamed, 1)


# -- nanfuzz's own allocation failures, and the kernel's ------------------------------------

def _supervised(kernel):
    return Supervised(worker_spec(kernel, Settings(device="cpu")), launch_timeout=30.0)


def test_an_oom_in_the_oracle_is_retried_and_never_a_crash():
    subject = _supervised(subjects.oracle_runs_out_of_memory_once)  # every check's first oracle fails
    try:
        for case in (PLAIN, WINDOWED):
            outcome = subject.check(case)
            assert outcome.verdict is Verdict.PASS, outcome.summary
    finally:
        subject.close()


def test_an_oom_in_the_oracle_that_persists_is_declined_and_counted_never_a_crash(tmp_path):
    subject = _supervised(subjects.oracle_runs_out_of_memory_always)
    try:
        answer = subject.check(WINDOWED)
    finally:
        subject.close()
    assert isinstance(answer, Declined) and answer.judging_failed
    assert "nanfuzz ran out of host memory judging this case, twice" in answer.reason
    settings = Settings(device="cpu", state_dir=tmp_path, use_database=False, seed=1, max_examples=3)
    from nanfuzz.harness.campaign.runner import fuzz

    with pytest.raises(NanfuzzError, match=r"every case drawn \(\d+\) was declined for memory"):
        fuzz(subjects.oracle_runs_out_of_memory_always, settings)  # judged nothing: no pass


@pytest.mark.parametrize("stage", ["build_on_host", "attend_and_measure", "yardstick", "refill_dead_slots"],
                         ids=["materialising", "oracle", "reference", "garbage-batch"])
def test_an_oom_of_nanfuzz_s_own_in_the_campaign_s_process_is_retried(monkeypatch, stage):
    from nanfuzz.harness.judge import check as judge

    real, calls = getattr(judge, stage), []

    def once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 916.00 MiB")
        return real(*args, **kwargs)

    monkeypatch.setattr(judge, stage, once)
    subject = InProcess(subjects.runs_out_of_memory, "cpu")
    try:
        outcome = subject.check(PLAIN)
    finally:
        subject.close()
    assert outcome.verdict is Verdict.PASS and len(calls) == 2, outcome.summary


def test_an_oom_building_a_large_case_is_retried_and_never_a_crash(monkeypatch):
    """A large case whose build on the device fails: nanfuzz's own allocation, retried (once its
    check had failed before it built anything, its clean-up raised in place of the OOM: a harness
    AttributeError reported as the kernel's CRASH on an H200)."""
    from nanfuzz.harness.judge import large
    from nanfuzz.reference import case as case_module

    monkeypatch.setattr(case_module, "LARGE_ELEMENTS", 0)
    assert PLAIN.large
    real, calls = large.build_on_device, []

    def once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 916.00 MiB")
        return real(*args, **kwargs)

    monkeypatch.setattr(large, "build_on_device", once)
    outcome = check(subjects.runs_out_of_memory, PLAIN)
    assert outcome.verdict is Verdict.PASS and len(calls) == 2, outcome.summary


def test_a_kernel_that_runs_out_of_memory_in_its_launch_is_a_crash_that_says_so():
    assert check(subjects.runs_out_of_memory, PLAIN).verdict is Verdict.PASS
    outcome = check(subjects.runs_out_of_memory, WINDOWED)
    assert outcome.verdict is Verdict.CRASH
    assert "the kernel ran out of device memory during its launch" in outcome.summary
    assert outcome.evidence["out_of_memory_twice"]  # again, with this process's caches given back


def test_a_worker_waiting_for_memory_is_no_hang(tmp_path, holders, monkeypatch):
    from nanfuzz.harness.launch import worker

    policy = _policy(tmp_path / "ledger", case=6)
    subject = Supervised(worker_spec(subjects.slow_correct, Settings(device="cpu", memory=policy)), launch_timeout=30.0)
    try:
        assert subject.check(PLAIN).verdict is Verdict.PASS  # the worker is up, its imports done
        _, release = holders(policy).start()  # 6 of 10 GiB held: the next case waits
        monkeypatch.setattr(worker, "_HOST_WORK_TIMEOUT", 3.0)  # the supervisor's bound on a case's own work
        threading.Timer(8.0, release).start()
        outcome = subject.check(PLAIN)
        assert outcome.verdict is Verdict.PASS, outcome.summary
        assert outcome.memory_waited > 5.0
        assert outcome.memory_wait_causes == {"held by other nanfuzz processes": 1}
    finally:
        subject.close()


def test_a_worker_tells_memory_held_by_others_from_a_case_that_never_fits(tmp_path, holders):
    # a search puts off the first beside a compile farm, and declines the second
    policy = _policy(tmp_path / "ledger", case=6)
    subject = Supervised(worker_spec(subjects.slow_correct, Settings(device="cpu", memory=policy)), launch_timeout=30.0)
    try:
        assert subject.check(PLAIN).verdict is Verdict.PASS
        _, release = holders(policy).start()  # 6 of 10 GiB held for the whole wait
        answer = subject.check(PLAIN, patience=0.5)
        release()
    finally:
        subject.close()
    assert isinstance(answer, Declined) and answer.memory_taken and not answer.judging_failed
    too_large = _policy(tmp_path / "other", total=3, case=4)
    subject = Supervised(worker_spec(subjects.slow_correct, Settings(device="cpu", memory=too_large)), launch_timeout=30.0)
    try:
        answer = subject.check(PLAIN, patience=0.5)
    finally:
        subject.close()
    assert isinstance(answer, Declined) and not answer.memory_taken and "more than the 3.0 GiB" in answer.reason


def test_a_helper_process_opens_its_context_only_while_room_for_cases_stays(tmp_path):
    from nanfuzz.harness.judge.device_memory import CONTEXT_BYTES
    from nanfuzz.harness.judge.ledger import Ledger
    from nanfuzz.harness.judge.memory import Governor

    class Gpu(_Gpu):
        """A 16 GiB device whose report of free memory follows the contexts opened."""
        opened = []

        def __init__(self):
            self.mine = False

        def free(self):
            return 16 * GiB - len(Gpu.opened) * CONTEXT_BYTES

        def held(self):
            return CONTEXT_BYTES if self.mine else 0

    admitted = 0
    for _ in range(16):
        device = Gpu()
        share = Governor(device, Ledger.open(tmp_path, device.key))
        if not share.open_context(room=8 * GiB):
            break
        device.mine = True
        Gpu.opened.append(device)
        admitted += 1
    assert admitted == 8  # eight contexts, and the half of the device left for cases stays free
    assert not Governor(Gpu(), Ledger.open(tmp_path, "gpu-test")).open_context(room=8 * GiB)


def test_a_helper_process_opens_its_context_outside_the_ledger_s_lock(tmp_path):
    """Opening a context takes tenths of a second; held under the ledger's lock, every check's look at
    the ledger waited for it while sixteen compile processes opened theirs in turn."""
    import fcntl

    from nanfuzz.harness.judge.ledger import Ledger
    from nanfuzz.harness.judge.memory import Governor

    ledger = Ledger.open(tmp_path, "gpu-test")

    class Gpu(_Gpu):
        opened_while_locked = None

        def free(self):
            if Gpu.opened_while_locked is None:  # the first look opens the context
                fd = os.open(ledger.path, os.O_RDWR)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    Gpu.opened_while_locked = False
                except BlockingIOError:
                    Gpu.opened_while_locked = True
                finally:
                    os.close(fd)
            return self.size

    assert Governor(Gpu(), ledger).open_context(room=4 * GiB)
    assert Gpu.opened_while_locked is False

    class Full(Gpu):  # other processes' entries leave no room: the context is never opened
        def free(self):
            raise AssertionError("opened a context on a device the ledger says is full")

    with ledger.entries() as entries:
        entries["1"] = {"started": None, "weight": 14 * GiB, "allocated": 14 * GiB}  # pid 1 lives on
    assert not Governor(Full(), ledger).open_context(room=4 * GiB)


def test_a_reservation_with_headroom_leaves_it_free_for_others(tmp_path):
    """A compile process reserves a task's tensors only while a quarter of the device stays free beside
    them for the campaign's checks, and its entry weighs the tensors alone: a check may take that room."""
    from nanfuzz.harness.judge.ledger import Ledger, _started
    from nanfuzz.harness.judge.memory import Governor

    class Gpu(_Gpu):
        def free(self):
            return self.size  # what others hold is the ledger's to say

    class ParentsLedger(Ledger):  # this process's parent's entry: a second live process in the ledger
        me = str(os.getppid())
        started = _started(os.getppid())

    farm = Governor(Gpu(), Ledger.open(tmp_path, Gpu.key))
    campaign = Governor(Gpu(), ParentsLedger(Ledger.open(tmp_path, Gpu.key).path))
    assert farm.reserve(8 * GiB, patience=0.0, headroom=4 * GiB) == 8 * GiB
    with pytest.raises(TooLargeForDevice, match="are not held or wanted"):  # 8 + 5 leave 3 GiB: short of the room
        campaign.reserve(5 * GiB, patience=0.0, headroom=4 * GiB)
    assert campaign.reserve(8 * GiB, patience=0.0) == 8 * GiB  # the room was never reserved: a check takes it
    with pytest.raises(TooLargeForDevice, match=r"more than the 12\.0 GiB the device has beside the room"):
        farm.reserve(13 * GiB, patience=0.0, headroom=4 * GiB)


def test_a_device_runtime_error_that_is_out_of_memory_is_ours_and_others_are_not():
    from nanfuzz.harness.judge.memory import out_of_memory

    assert out_of_memory(RuntimeError("CUDA error: out of memory\nSearch for `cudaErrorMemoryAllocation'"))
    assert out_of_memory(RuntimeError("HIP error: out of memory"))
    assert not out_of_memory(RuntimeError("CUDA error: an illegal memory access was encountered"))


@pytest.mark.parametrize("error, free", [("CUDA error: out of memory", 0), ("an illegal memory access", None)])
def test_a_gpu_too_full_to_open_a_context_reports_nothing_free_and_other_errors_rise(monkeypatch, error, free):
    from nanfuzz.harness.judge.device_memory import CONTEXT_BYTES, GpuMemory

    def mem_get_info(index):
        raise RuntimeError(error)

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda index: {})
    device = object.__new__(GpuMemory)  # no GPU here: the fields __init__ would read from the driver
    device.index, device.opened = 0, False
    if free is None:
        with pytest.raises(RuntimeError, match="illegal memory access"):
            device.free()
    else:
        assert device.free() == free
    assert device.held() == 0 and not device.opened  # a look that failed opened no context
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (5 * GiB, 16 * GiB))
    assert device.free() == 5 * GiB and device.held() == CONTEXT_BYTES  # one that worked did


def test_a_message_gives_a_small_amount_in_mib_never_as_0_gib():
    from nanfuzz.harness.judge.memory import amount

    assert amount(4 * GiB) == "4.0 GiB"
    assert amount(40 * 2**20) == "40 MiB"
    assert amount(-5) == "0 MiB"


def test_a_reservation_that_never_waits_writes_no_want_for_others_to_queue_behind(tmp_path, holders, monkeypatch):
    # a want stands ahead of every later reservation; one that is withdrawn at once (a compile
    # process asking for room to open its context) only refuses others meanwhile
    policy = _policy(tmp_path)  # 10 GiB, 4 GiB a case: two cases at once, both held by others
    others = holders(policy)
    others.start()
    others.start()
    share = governor(policy, CPU)
    written = []
    write = share._write
    monkeypatch.setattr(share, "_write", lambda entries, weight, allocated, wants=0, since=0.0: (
        written.append(wants), write(entries, weight, allocated, wants, since)))
    with pytest.raises(TooLargeForDevice):
        share.reserve(0, patience=0.0)
    assert written and not any(written)


def test_a_wait_is_counted_by_what_stood_in_the_way(tmp_path, holders):
    # other nanfuzz processes' reservations, or the device's own report of free memory (what allocators
    # keep): a run's statistics say which its checks waited on
    from nanfuzz.harness.judge.ledger import Ledger
    from nanfuzz.harness.judge.memory import HELD_BY_OTHERS, NOT_FREE_ON_THE_DEVICE, Governor

    policy = _policy(tmp_path / "ledger", case=6)
    _, release = holders(policy).start()  # 6 of 10 GiB reserved by another process
    share = governor(policy, CPU)
    with pytest.raises(TooLargeForDevice):
        share.reserve(0, patience=0.2)
    release()
    assert share.wait_causes == {HELD_BY_OTHERS: 1}

    class Gpu(_Gpu):
        def free(self):
            return 1 * GiB  # a 16 GiB device whose memory others' allocators keep

    share = Governor(Gpu(), Ledger.open(tmp_path / "device", Gpu.key))
    with pytest.raises(TooLargeForDevice):
        share.reserve(2 * GiB, patience=0.2)
    assert share.reserve(512 << 20, patience=0.2) == 512 << 20
    assert share.wait_causes == {NOT_FREE_ON_THE_DEVICE: 1}


def test_a_wait_behind_another_process_s_earlier_want_is_told_from_memory_held(tmp_path):
    # a want standing ahead (another check waiting for its memory) is no reservation: a run whose
    # checks wait behind wants has a line of waiters, not memory held
    from nanfuzz.harness.judge.ledger import Ledger
    from nanfuzz.harness.judge.memory import HELD_BY_OTHERS, WANTED_FIRST_BY_OTHERS, Governor

    class Gpu(_Gpu):
        def free(self):
            return self.size

    def another_process(weight: int, wants: int) -> None:  # the parent of this test's process, alive
        with Ledger.open(tmp_path, Gpu.key).entries() as entries:
            entries[str(os.getppid())] = {"started": None, "weight": weight, "allocated": weight, "wants": wants,
                                          "since": 0.0, "kept": 0}

    another_process(weight=2 * GiB, wants=12 * GiB)  # holds 2 of 16 GiB, waits for 10 more
    share = Governor(Gpu(), Ledger.open(tmp_path, Gpu.key))
    with pytest.raises(TooLargeForDevice):
        share.reserve(8 * GiB, patience=0.05)  # fits beside what it holds, not behind what it waits for
    assert share.wait_causes == {WANTED_FIRST_BY_OTHERS: 1}
    another_process(weight=10 * GiB, wants=0)
    with pytest.raises(TooLargeForDevice):
        share.reserve(8 * GiB, patience=0.05)
    assert share.wait_causes == {WANTED_FIRST_BY_OTHERS: 1, HELD_BY_OTHERS: 1}


def test_a_reservation_already_allocated_is_not_set_aside_twice_beside_what_the_device_reports_free(tmp_path):
    """A process that has built its large case says so: another process then sees that case in the
    device's own report of free memory alone (set aside a second time, a 1 MiB case was refused on
    an H200 with 64 GiB free)."""
    from nanfuzz.harness.judge.ledger import Ledger
    from nanfuzz.harness.judge.memory import Governor

    allocated = multiprocessing.get_context("fork").Value("q", 0)

    class Gpu(_Gpu):
        """A 16 GiB device whose report of free memory follows what the holder allocated."""

        def free(self):
            return 16 * GiB - allocated.value

    def another_process_asks_for_1_gib(_=None):
        share = Governor(Gpu(), Ledger.open(tmp_path, Gpu.key))
        try:
            share.reserve(1 * GiB, patience=0.0)
        except TooLargeForDevice:
            os._exit(3)
        os._exit(0)

    def asked() -> int:
        child = multiprocessing.get_context("fork").Process(target=another_process_asks_for_1_gib)
        child.start()
        child.join(60)
        return child.exitcode

    holder = Gpu()
    share = Governor(holder, Ledger.open(tmp_path, Gpu.key))
    share.reserve(12 * GiB, patience=0.0)
    allocated.value = holder.holding = 12 * GiB  # the case's batches built
    assert asked() == 3  # 4 GiB free, and the 12 GiB not yet known to be among what is used
    share.built()
    assert asked() == 0
    share.settle()


def test_what_a_process_keeps_between_cases_is_given_back_before_a_case_is_called_larger_than_the_device(tmp_path):
    """A check's estimate counts the large-case pool this process keeps (its buffers are reused, or
    freed for the case's own): with 40 GiB kept, a case of 30 GiB on a 64 GiB device was declined
    as larger than the device, where given back it fits."""
    from nanfuzz.harness.judge.ledger import Ledger
    from nanfuzz.harness.judge.memory import Governor

    class Gpu(_Gpu):
        size, holding, given_back = 64 * GiB, 40 * GiB, 0

        def free(self):
            return self.size - self.holding

        def give_back(self):
            self.given_back += 1
            self.holding = 0

    device = Gpu()
    share = Governor(device, Ledger.open(tmp_path, Gpu.key))
    assert share.reserve(lambda: 30 * GiB + device.holding, patience=0.0) == 30 * GiB
    assert device.given_back == 1 and share.waits == 0
    share.settle()
    with pytest.raises(TooLargeForDevice, match="needs about 70.0 GiB of GPU memory, more than the 64.0 GiB"):
        share.reserve(lambda: 70 * GiB + device.holding, patience=0.0)  # larger however empty: declined


def test_a_declined_case_says_what_its_estimate_is_made_of(tmp_path, monkeypatch):
    """A decline names the parts of the case's estimate (the batch's copies, the oracle, the pool's
    caches...), so that a case declined as larger than the whole device tells which part grew."""
    from nanfuzz.harness.judge import large
    from nanfuzz.harness.judge.ledger import Ledger
    from nanfuzz.harness.judge.memory import Footprint, Governor
    from nanfuzz.harness.judge.runs import check_footprint
    from nanfuzz.reference import case as case_module

    class Gpu(_Gpu):
        size, holding = 64 * GiB, 0

        def free(self):
            return self.size

    share = Governor(Gpu(), Ledger.open(tmp_path, Gpu.key))
    with pytest.raises(TooLargeForDevice, match=r"needs about 70\.0 GiB of GPU memory \(pool caches 40\.0 GiB, "
                                                r"oracle 30\.0 GiB\), more than the 64\.0 GiB"):
        share.reserve(Footprint(pool_caches=40 * GiB, oracle=30 * GiB), patience=0.0)

    class Busy(Gpu):  # what other programs hold: a wait that ends in a decline
        def free(self):
            return 10 * GiB

    busy = Governor(Busy(), Ledger.open(tmp_path / "busy", Gpu.key))
    with pytest.raises(TooLargeForDevice, match=r"needs about 50\.0 GiB of GPU memory \(oracle 50\.0 GiB\) and "):
        busy.reserve(lambda: Footprint(oracle=50 * GiB), patience=0.0)

    small = check_footprint(PLAIN)
    assert set(small.parts) == {"case copies", "oracle", "kept large caches"} and sum(small.parts.values()) == small
    monkeypatch.setattr(case_module, "LARGE_ELEMENTS", 0)
    big = large.large_check_footprint(PLAIN)
    assert set(big.parts) == {"pool caches", "layout copy", "written blocks", "oracle"}
    assert sum(big.parts.values()) == big > 0
    assert pickle.loads(pickle.dumps(big)).parts == big.parts  # it may cross to another process


def test_a_layout_copy_is_reserved_only_for_a_kernel_that_makes_one(monkeypatch):
    import dataclasses

    from nanfuzz.harness.adapters.vllm import copies_token_head_caches
    from nanfuzz.harness.judge.check import LargeCaseCheck
    from nanfuzz.harness.registry import builtin_kernels
    from nanfuzz.reference import case as case_module
    from tests.quantized_subjects import LMDEPLOY_INT8

    monkeypatch.setattr(case_module, "LARGE_ELEMENTS", 0)  # PLAIN is a large case
    built_in = builtin_kernels()["paged_decode@masked"]
    users = dataclasses.replace(built_in, name="mine", copies_caches=True)  # an adapter's default: a copy
    footprints = {kernel.name: LargeCaseCheck(kernel, PLAIN, torch.device("cpu"), False, None)._footprint()
                  for kernel in (built_in, users)}
    assert "layout copy" not in footprints[built_in.name].parts  # the built-ins read the caches in place
    assert footprints["mine"].parts["layout copy"] == footprints["mine"] - footprints[built_in.name] > 0
    assert Kernel("plain", built_in.run, built_in.capabilities).copies_caches_of(PLAIN)  # the default
    token_head = dataclasses.replace(PLAIN, kv_cache=LMDEPLOY_INT8)
    assert copies_token_head_caches(token_head) and not copies_token_head_caches(PLAIN)  # TRITON_ATTN's packing


def test_a_wait_looks_again_soon_then_less_and_less_often(tmp_path, monkeypatch):
    # a shortfall beside small cases mostly ends within a look: the first looks again come within tens
    # of milliseconds, then twice as far apart each time, up to the usual pause
    from nanfuzz.harness.judge import memory
    from nanfuzz.harness.judge.ledger import Ledger

    looks = []

    class Gpu(_Gpu):
        def free(self):  # full for the first four looks, then free
            looks.append(None)
            return 0 if len(looks) <= 4 else self.size

    pauses = []
    monkeypatch.setattr(memory.random, "random", lambda: 0.0)
    monkeypatch.setattr(memory.time, "sleep", pauses.append)
    share = memory.Governor(Gpu(), Ledger.open(tmp_path, Gpu.key))
    assert share.reserve(1 * GiB, patience=60.0) == 1 * GiB
    assert pauses == [memory._FIRST_POLL * 2 ** n for n in range(4)] and pauses[-1] < memory._POLL
    pauses.clear()
    looks.clear()
    monkeypatch.setattr(Gpu, "free", lambda self: looks.append(None) or (0 if len(looks) <= 12 else self.size))
    memory.Governor(Gpu(), Ledger.open(tmp_path / "longer", Gpu.key)).reserve(1 * GiB, patience=60.0)
    assert max(pauses) == memory._POLL and pauses[-4:] == [memory._POLL] * 4
