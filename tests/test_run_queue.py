"""A campaign's search thread's wait for a core (``processes.run_queue_seconds``): it grows while
other processes keep the thread's only core busy, and hardly at all while the thread sleeps."""
import multiprocessing
import os
import time

import pytest

from nanfuzz.harness.launch.processes import run_queue_seconds

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/schedstat") or not hasattr(os, "sched_setaffinity"),
                                reason="Linux' schedstat and CPU affinity")


def _spin(core: int, seconds: float) -> None:
    os.sched_setaffinity(0, {core})
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def _own_work(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_the_wait_for_a_core_grows_on_a_shared_core_and_not_while_asleep():
    core = min(os.sched_getaffinity(0))
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        before = run_queue_seconds()
        time.sleep(0.3)
        asleep = run_queue_seconds() - before
        spinners = [multiprocessing.get_context("fork").Process(target=_spin, args=(core, 3.0)) for _ in range(3)]
        for process in spinners:
            process.start()
        time.sleep(0.2)  # they are on the core
        before = run_queue_seconds()
        _own_work(0.2)  # about a quarter of the core: three quarters of the time waiting for it
        shared = run_queue_seconds() - before
        for process in spinners:
            process.terminate()
            process.join()
    finally:
        os.sched_setaffinity(0, allowed)
    assert asleep < 0.05
    assert shared > 0.35, shared  # more than its own 0.2 s of CPU: the others held the core
