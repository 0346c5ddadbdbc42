"""First-use work moved out of a fresh worker's first check (harness.launch.warm_start): Triton's
installation hash in the fork server, the oracle's first float64 attention in a thread."""
from __future__ import annotations

import pytest

from nanfuzz.harness.launch import warm_start
from nanfuzz.harness.registry import resolve


def test_triton_is_hashed_once_ahead_unless_interpreting(monkeypatch):
    from triton.runtime.cache import triton_key

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    triton_key.cache_clear()
    warm_start.hash_triton()
    assert triton_key.cache_info().currsize == 1  # a later compile in this process (or a fork) hashes nothing

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    triton_key.cache_clear()
    warm_start.hash_triton()
    assert triton_key.cache_info().currsize == 0  # the interpreter never compiles


def test_the_oracle_warms_on_a_decode_and_a_prefill_sequence_of_the_kernel_s_dtype(nanfuzz_device, monkeypatch):
    from nanfuzz.reference import batch

    def shared_staging(*args, **kwargs):
        raise AssertionError("the warm-up ran beside a check must not fill the checks' pinned staging buffer")

    monkeypatch.setattr(batch, "move_together", shared_staging)  # what ``PagedBatch.in_one_buffer`` stages through
    kernel = resolve("paged_decode@masked")
    errors = warm_start.attend_tiny_case(kernel, nanfuzz_device)
    assert errors.kernel.shape == (1 + 3, 2)  # four tokens, two query heads
    assert float(errors.kernel.max()) == 0.0  # the oracle against itself
    thread = warm_start.warm_oracle(kernel, nanfuzz_device)
    thread.join(60)
    assert not thread.is_alive()


@pytest.mark.gpu
def test_processes_forked_for_the_gpu_inherit_triton_s_hash():
    from nanfuzz.harness.launch.processes import fork_server_context

    context = fork_server_context()
    if context.get_start_method() != "forkserver":
        pytest.skip("no fork server on this platform")
    queue = context.Queue()
    process = context.Process(target=_report_hash_cached, args=(queue,))
    process.start()
    assert queue.get(timeout=120) == 1
    process.join(30)


def _report_hash_cached(queue) -> None:
    from triton.runtime.cache import triton_key

    queue.put(triton_key.cache_info().currsize)
