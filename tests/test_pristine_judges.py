"""Judges read pristine inputs: a write into any input is a CLOBBER naming the tensor and where,
ranked above MISMATCH, and what an adapter rebinds on its batch object is never judged."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from nanfuzz.harness.judge.check import Verdict, check
from nanfuzz.harness.kernel import Kernel
from nanfuzz.reference.case import KVCache
from nanfuzz.reference.oracle import oracle
from tests.test_check import WINDOWED
from tests.torch_kernels import CAPS, attention

QUANTIZED_CAPS = replace(CAPS, kv_cache_dtypes=("auto", "fp8_e4m3fn"), token_head_dtypes=("int8",))
# WINDOWED: sequence 0 decodes at position 19 with a window of 6 over blocks (1, 2, 3) of 8 slots,
# so keys 14..19 are live: block 2 slots 6-7 and block 3 slots 0-3; block 6 is in no table.
PER_TENSOR = WINDOWED.replace(kv_cache=KVCache("fp8_e4m3fn", "tensor", 0.5, 0.25)).validate()
TOKEN_HEAD = WINDOWED.replace(kv_cache=KVCache("int8", "token-head"),
                              poison=replace(WINDOWED.poison, value="max")).validate()
WITH_SINKS = WINDOWED.replace(sinks=True).validate()


def _writes_into(name: str, index: tuple):
    """A kernel whose output is exactly the oracle's, and which then flips one bit of
    ``batch.<name>[index]``: its one defect is the write."""
    def run(batch, out):
        out.copy_(oracle(batch))
        getattr(batch, name)[index].view(torch.uint8).view(-1)[0] ^= 1
        return out
    return Kernel(name=f"writes@{name}", run=run, capabilities=QUANTIZED_CAPS)


@pytest.mark.parametrize("case, name, index, where", [
    (WINDOWED, "key_cache", (3, 0), "key_cache at block 3 slot 0 (live)"),
    (WINDOWED, "value_cache", (2, 7), "value_cache at block 2 slot 7 (live)"),
    (WINDOWED, "value_cache", (6, 4), "value_cache at block 6 slot 4 (dead)"),
    (WINDOWED, "q", (1,), "q at row 1"),
    (WINDOWED, "k", (0,), "k at row 0"),
    (WINDOWED, "v", (3,), "v at row 3"),
    (WINDOWED, "block_table", (1, slice(0, 1)), "block_table at entry [1][0]"),
    (WINDOWED, "seq_lens", (slice(1, 2),), "seq_lens at entry 1"),
    (WINDOWED, "query_start_loc", (slice(2, 3),), "query_start_loc at entry 2"),
    (WITH_SINKS, "sinks", (slice(3, 4),), "sinks at entry 3"),
    (PER_TENSOR, "k_scale", (slice(0, 1),), "k_scale at entry 0"),
    (PER_TENSOR, "v_scale", (slice(0, 1),), "v_scale at entry 0"),
    (TOKEN_HEAD, "k_scale_cache", (3, 1), "k_scale_cache at block 3 slot 1 (live)"),
    (TOKEN_HEAD, "v_scale_cache", (2, 6), "v_scale_cache at block 2 slot 6 (live)"),
], ids=lambda x: x if isinstance(x, str) and " " not in x else None)
def test_a_write_into_any_input_is_a_clobber_naming_the_tensor_and_where(case, name, index, where, nanfuzz_device):
    outcome = check(_writes_into(name, index), case, nanfuzz_device)
    assert outcome.verdict is Verdict.CLOBBER, outcome.summary
    assert outcome.evidence["written"] == [where], outcome.summary
    assert where in outcome.summary and name in outcome.evidence["written_at"]


def test_the_same_kernel_without_its_write_passes(nanfuzz_device):
    def exact(batch, out):
        return out.copy_(oracle(batch))

    for case in (WINDOWED, WITH_SINKS, PER_TENSOR, TOKEN_HEAD):
        outcome = check(Kernel(name="exact", run=exact, capabilities=QUANTIZED_CAPS), case, nanfuzz_device)
        assert outcome.verdict is Verdict.PASS, outcome.summary


def _zeroes_a_live_value_then_attends(batch, out):
    batch.value_cache[3, 1].zero_()  # a live slot: every later step of the model would read zeros there
    return attention(batch, out)


def test_writing_a_live_slot_it_then_reads_is_a_clobber_not_a_mismatch(nanfuzz_device):
    # its output is off the oracle (MISMATCH's evidence), but the cache it corrupted is what matters
    kernel = Kernel(name="torch@zeroes-live-v", run=_zeroes_a_live_value_then_attends, capabilities=CAPS)
    outcome = check(kernel, WINDOWED, nanfuzz_device)
    assert outcome.verdict is Verdict.CLOBBER, outcome.summary
    assert outcome.evidence["written"] == ["value_cache at block 3 slot 1 (live)"]
    assert list(Verdict).index(Verdict.CLOBBER) < list(Verdict).index(Verdict.MISMATCH)


def _hides_a_doubled_scale(batch, out):
    """Wrong (scores at twice the scale), and rebinds q so that judges reading the batch would agree."""
    batch.q = batch.q * 2
    return attention(batch, out)


def _converts_layouts_by_rebinding(batch, out):
    """Correct: converts the caches to a head-major layout of its own and rebinds them, as an
    adapter for a kernel with another layout may, then attends from that layout."""
    batch.key_cache = batch.key_cache.permute(0, 2, 1, 3).contiguous()  # [blocks, kv heads, slots, head]
    batch.value_cache = batch.value_cache.permute(0, 2, 1, 3).contiguous()
    batch.q = batch.q.float()
    canonical = replace(batch, key_cache=batch.key_cache.permute(0, 2, 1, 3),
                        value_cache=batch.value_cache.permute(0, 2, 1, 3))
    return attention(canonical, out)


@pytest.mark.parametrize("run, verdict", [(_hides_a_doubled_scale, Verdict.MISMATCH),
                                          (_converts_layouts_by_rebinding, Verdict.PASS)])
def test_what_an_adapter_rebinds_on_its_batch_is_never_judged(run, verdict, nanfuzz_device):
    outcome = check(Kernel(name="torch@rebinds", run=run, capabilities=CAPS), WINDOWED, nanfuzz_device)
    assert outcome.verdict is verdict, outcome.summary
    if verdict is Verdict.PASS:  # judged against the canonical caches, not NaN read from another layout
        assert math.isfinite(outcome.evidence["max_error_ratio"]), outcome.evidence
