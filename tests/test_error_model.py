"""The MISMATCH error model (harness/judge/tolerance.py) held to account at production size on the CPU.

Correct kernels that compute the way Triton kernels do (tests/tiled_attention.py: tiled online
softmax in float32, P rounded per tile, split-KV merges, fp8 dequantized in the input dtype) must
pass rows of 128k keys and batches of dozens of sequences, and a row must be judged the same
however many rows share its batch; kernels of the same arithmetic with one planted bug must still
be caught.  Rows are judged as the check judges them, from the host-built batch.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from nanfuzz.harness.judge import tolerance
from nanfuzz.harness.judge.tolerance import RowErrors
from nanfuzz.reference.case import KVCache, Poison
from tests import tiled_attention
from tests.cases import consecutive_case
from tests.quantized_subjects import LMDEPLOY_INT4, VLLM_INT4, raw_code_kernel

def judged(kernel, case, rows=None) -> RowErrors:
    return tiled_attention.judged(kernel, case, rows)[0]


def production_cases(kernel, count: int, at: int = 0) -> list:
    return tiled_attention.drawn_cases(kernel, count, at)


def _worst(errors: RowErrors) -> str:
    ratio = errors.ratio.nan_to_num(float("inf"))
    return f"worst row {ratio.max().item():.3g}x, bound {errors.bound:g}x"


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiled loop is thousands of small steps: threads only contend
    with tiled_attention.heap_kept():
        yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("kernel", tiled_attention.CORRECT, ids=lambda k: k.name)
def test_a_correct_tiled_kernel_passes_production_batches(kernel):
    for case in production_cases(kernel, 8):
        errors = judged(kernel, case)
        assert not errors.off().any(), f"{len(case.sequences)} sequences of up to {case.max_seq_len} keys, " \
                                       f"{case.geometry.dtype} {case.kv_cache.label()}: {_worst(errors)}"


@pytest.mark.parametrize("dtype,kv_cache", [("float32", "fp8_e5m2"), ("float16", "auto"), ("bfloat16", "fp8_e4m3fn")])
def test_a_correct_tiled_kernel_passes_rows_of_128k_keys(dtype, kv_cache):
    # the shape of a false MISMATCH the bare reference ratio gave an H200: float32 queries over
    # an fp8_e5m2 cache, a decode of thousands of 48-slot blocks
    case = consecutive_case([(1, 1 << 17)], q_heads=2, kv_heads=1, head_size=32, block_size=48, dtype=dtype, seed=3)
    if kv_cache != "auto":
        case = dataclasses.replace(case, kv_cache=KVCache(kv_cache, "tensor", 0.75, 1.25)).validate()
    for kernel in (tiled_attention.tile16, tiled_attention.tile64_split8):
        errors = judged(kernel, case)
        assert not errors.off().any(), f"{kernel.name}: {_worst(errors)}"


def test_a_row_is_judged_the_same_alone_and_among_a_hundred_others():
    # the first sequence's blocks, query and data are the same in both batches
    alone = consecutive_case([(1, 3000)], head_size=64, block_size=16, dtype="float16", seed=5)
    crowded = consecutive_case([(1, 3000)] + [(2, 200)] * 100, head_size=64, block_size=16, dtype="float16", seed=5)
    kernel = tiled_attention.tile16
    first, output = tiled_attention.judged(kernel, alone)
    among = judged(kernel, crowded, rows={0: output[0]})  # the same output row (float32 sums may differ)
    # the same judgement up to the float32 statistics' summation order, which the batch's shape may change
    torch.testing.assert_close(first.denominator[0], among.denominator[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(first.ratio[0], among.ratio[0], rtol=1e-5, atol=0)


@pytest.mark.parametrize("kernel", tiled_attention.PLANTED, ids=lambda k: k.name)
def test_a_planted_error_is_caught_in_production_batches(kernel):
    assert any(judged(kernel, case).off().any() for case in production_cases(kernel, 8)), \
        f"{kernel.name} passed 8 production batches"


@pytest.mark.parametrize("dtype,plant", [("float16", "row"), ("float32", "row"), ("float16", "scale"),
                                         ("float32", "scale")])
def test_a_planted_error_is_caught_on_a_long_row(dtype, plant):
    # 1% on a float16 row and 0.1% on a float32 row, a 1% softmax scale: above the rounding of 20,000 keys
    case = consecutive_case([(1, 20_000)], q_heads=2, kv_heads=1, head_size=32, block_size=64, dtype=dtype, seed=2)
    kernel = tiled_attention.tiled_kernel(tiled_attention.Tiling(tile=64, splits=4), plant=plant)
    assert judged(kernel, case).off()[0, 0], plant


def test_a_planted_bfloat16_row_error_is_caught_on_a_row_of_one_key():
    case = consecutive_case([(1, 1), (1, 40)], head_size=64, dtype="bfloat16", seed=4)
    errors = judged(tiled_attention.planted_row, case)
    assert errors.off()[0, 0] and not errors.off()[1:].any() and not errors.off()[0, 1:].any()


# -- P against uncentred codes ------------------------------------------------------------

def _zero_point_case(kv: KVCache, keys: int):
    return consecutive_case([(1, keys)] * 2, q_heads=8, kv_heads=2, head_size=64, block_size=16, dtype="float32",
                            seed=1).replace(kv_cache=kv, poison=Poison("max")).validate()


@pytest.mark.parametrize("kv", [VLLM_INT4, LMDEPLOY_INT4], ids=["vllm-int4", "lmdeploy-int4"])
def test_tf32_products_of_raw_codes_pass_long_rows_by_the_zero_points_share(kv, monkeypatch):
    # vLLM's INT4 attention with float32 queries on an H200: 27.5x on rows of thousands of keys, each
    # truncated P x scale against codes that all carry the zero point, one sign of rounding in every term
    case = _zero_point_case(kv, 8192)
    errors = judged(raw_code_kernel(), case)
    assert not errors.off().any(), _worst(errors)
    monkeypatch.setattr(tolerance, "OFFSET_SHARE", 0.0)
    without = judged(raw_code_kernel(), case)
    assert without.off().any(), f"without the zero points' share: {_worst(without)}"


@pytest.mark.parametrize("kv", [VLLM_INT4, LMDEPLOY_INT4], ids=["vllm-int4", "lmdeploy-int4"])
def test_a_zero_point_one_code_short_is_caught_on_every_long_row(kv):
    errors = judged(raw_code_kernel("zero-point"), _zero_point_case(kv, 8192))
    assert errors.off().all(), f"caught {int(errors.off().sum())} of {errors.off().numel()} rows"


def test_a_dropped_key_of_uncentred_codes_is_caught_on_short_rows():
    # on long rows a key's weight is below what truncation does to the zero points' share
    errors = judged(raw_code_kernel("drop-key"), _zero_point_case(LMDEPLOY_INT4, 64))
    assert errors.off().any(), _worst(errors)
