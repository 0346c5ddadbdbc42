"""Host threads: one per process while kernels run on the CPU, restored afterwards."""
import torch
from threadpoolctl import threadpool_info, threadpool_limits

from nanfuzz.harness.launch.backend import host_threads


def _pool_threads() -> set[int]:
    return {pool["num_threads"] for pool in threadpool_info()}


def test_cpu_runs_hold_every_pool_to_one_thread_and_restore_them():
    import numpy  # noqa: F401  (loads the BLAS pool the interpreter's tl.dot uses)

    session = torch.get_num_threads()
    try:
        with threadpool_limits(limits=2):
            torch.set_num_threads(2)
            before = _pool_threads()
            with host_threads("cpu"):
                assert torch.get_num_threads() == 1
                assert _pool_threads() == {1}
            assert torch.get_num_threads() == 2
            assert _pool_threads() == before
    finally:
        torch.set_num_threads(session)


def test_gpu_runs_leave_threads_alone():
    session = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with host_threads("cuda"):
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(session)


def test_nanfuzz_own_processes_hold_one_thread_on_a_gpu_too():
    session = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with host_threads("cuda", own_process=True):
            assert torch.get_num_threads() == 1 and _pool_threads() <= {1}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(session)
