"""vLLM's TRITON_ATTN for different K and V head sizes (``vllm:triton_attn_diffkv``), from the released wheel.

The kernel file is ``vllm/v1/attention/ops/triton_unified_attention_diffkv.py`` of the release
tests/conftest.py pins; the backend packs K and V into one cache ``[blocks, block_size, kv_heads,
head_qk + head_v]`` and hands the kernel its two slices.
"""
from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from nanfuzz.harness.adapters import vllm_diffkv, vllm_loader
from nanfuzz.harness.campaign.runner import fuzz
from nanfuzz.harness.judge.check import check
from nanfuzz.harness.kernels._common import INTERPRETED
from nanfuzz.harness.registry import resolve
from nanfuzz.reference.case import KVCache, Poison
from nanfuzz.reference.materialize import materialize
from nanfuzz.reference.redzones import CACHE_BLOCKS_AFTER, CACHE_BLOCKS_BEFORE
from tests.cases import consecutive_case

DEVICE = "cpu" if INTERPRETED else "cuda"
MODULE = "vllm/v1/attention/ops/triton_unified_attention_diffkv.py"
# the 2D/3D kernel's zeroing of V rows below every query's window in the tile
V_WINDOW_ZEROING = "        if SLIDING_WINDOW:\n            qpos_lo = q_block_local_idx * BLOCK_Q\n"
# the V tile's load: from the value view of the packed cache
V_LOAD = "            value_cache_ptr + v_offset,"
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def diffkv_case(seqs=((1, 40), (3, 19)), *, k=64, v=32, **options):
    return consecutive_case(seqs=list(seqs), head_size=k, head_size_v=v, **options)


def test_the_loader_finds_the_diffkv_kernels(vllm_source):
    loaded = vllm_loader.load("triton_attn_diffkv", vllm_source)
    module = loaded["triton_unified_attention_diffkv"]
    assert callable(module.unified_attention_diffkv) and module.__file__.endswith(MODULE)
    assert "vLLM 0.33.0" in loaded.source


def test_the_packed_cache_holds_k_then_v_of_every_slot_inside_the_caches_margins():
    case = diffkv_case(poison=Poison("nan", "kv"))
    batch = materialize(case)
    packed = vllm_diffkv.packed_cache(batch)
    assert packed.shape == (*batch.key_cache.shape[:3], 64 + 32)
    assert torch.equal(packed[..., :64].view(torch.int16), batch.key_cache.view(torch.int16))
    assert torch.equal(packed[..., 64:].view(torch.int16), batch.value_cache.view(torch.int16))
    before, after = CACHE_BLOCKS_BEFORE, CACHE_BLOCKS_AFTER
    whole = packed.as_strided((packed.shape[0] + before + after, *packed.shape[1:]), packed.stride(),
                              packed.storage_offset() - before * packed.stride(0))
    assert torch.isnan(whole[:before]).all() and torch.isnan(whole[-after:]).all()  # the caches' margins
    fp8 = materialize(dataclasses.replace(case, kv_cache=KVCache("fp8_e4m3fn", "tensor", 0.5, 2.0)))
    codes = vllm_diffkv.packed_cache(fp8)
    assert codes.dtype == torch.uint8 and torch.equal(codes[..., 64:], fp8.value_cache.view(torch.uint8))


@pytest.mark.parametrize("name, heads", [("vllm:triton_attn_diffkv@2d", (64, 32)),
                                         ("vllm:triton_attn_diffkv@3d", (32, 64)),
                                         ("vllm:triton_attn_diffkv@3d", (96, 48))])
def test_every_dead_slot_stays_out_of_the_output(name, heads, vllm_source):
    """Tails, the null block, padding and an expired block under a window of 5, NaN in K and V:
    0.33.0 masks K by tile, scores by the allowed set, and zeroes V below each query block's window."""
    k, v = heads
    case = diffkv_case(((1, 40), (1, 19)), k=k, v=v, window=5, sinks=True, poison=Poison("nan", "kv"))
    outcome = check(resolve(name, vllm_src=str(vllm_source)), case, DEVICE)
    assert outcome.verdict.value == "PASS", outcome.summary
    specialisation = outcome.paths["kernel_unified_attention_diffkv"]
    assert any(f"HEAD_SIZE_QK={k}," in s and f"HEAD_SIZE_V={v}," in s for s in specialisation), specialisation
    assert ("kernel_reduce_segments_diffkv" in outcome.paths) == name.endswith("@3d")  # decode takes 3D when offered


def test_the_3d_path_and_its_merge_run_on_v_s_width(vllm_source):
    case = diffkv_case(((1, 70), (1, 19), (0, 9)), k=96, v=48, poison=Poison("inf", "v"))
    outcome = check(resolve("vllm:triton_attn_diffkv@3d", vllm_src=str(vllm_source)), case, DEVICE)
    assert outcome.verdict.value == "PASS", outcome.summary
    assert any("HEAD_SIZE_V_PADDED=64" in s for s in outcome.paths["kernel_reduce_segments_diffkv"])


def test_fp8_caches_go_in_as_the_backend_views_them(vllm_source):
    fp8 = KVCache("fp8_e4m3fn", "tensor", 0.25, 0.5)
    case = diffkv_case(window=9, poison=Poison("nan", "v")).replace(kv_cache=fp8).validate()
    outcome = check(resolve("vllm:triton_attn_diffkv", vllm_src=str(vllm_source)), case, DEVICE)
    assert outcome.verdict.value == "PASS", outcome.summary
    assert all("USE_KV_SCALES=True" in s for s in outcome.paths["kernel_unified_attention_diffkv"])


def _mutated(tmp_path, vllm_source, old: str, new: str):
    shutil.copytree(vllm_source, tmp_path / "tree")
    path = tmp_path / "tree" / MODULE
    text = path.read_text()
    assert text.count(old) == 1
    path.write_text(text.replace(old, new))
    return resolve("vllm:triton_attn_diffkv", vllm_src=str(tmp_path / "tree"))


def test_a_copy_that_keeps_v_below_the_window_is_caught(tmp_path, vllm_source):
    """Without its V zeroing, the expired keys of the first tile reach P @ V as 0 * NaN."""
    mutated = _mutated(tmp_path, vllm_source, V_WINDOW_ZEROING,
                       V_WINDOW_ZEROING.replace("if SLIDING_WINDOW:", "if False:"))
    outcome = check(mutated, diffkv_case(((1, 40),), window=5, poison=Poison("nan", "v")), DEVICE)
    assert outcome.verdict.value == "NONFINITE" and "out-of-window" in outcome.summary, outcome.summary


def test_a_copy_that_reads_v_from_the_key_slice_is_caught(tmp_path, vllm_source):
    mutated = _mutated(tmp_path, vllm_source, V_LOAD, V_LOAD.replace("value_cache_ptr", "key_cache_ptr"))
    outcome = check(mutated, diffkv_case(poison=Poison("max", "k")), DEVICE)
    assert outcome.verdict.value == "MISMATCH", outcome.summary


def test_a_short_campaign_passes_and_draws_both_head_sizes(vllm_source, tmp_path):
    kernel = resolve("vllm:triton_attn_diffkv", vllm_src=str(vllm_source))
    campaign = fuzz(kernel, device=DEVICE, max_examples=6, seed=2, use_database=False, state_dir=tmp_path)
    assert not campaign.failed, campaign.failure.summary
    assert campaign.examples >= 3 and campaign.statistics.counts["path:kernel_unified_attention_diffkv"] > 0


def test_the_capabilities_are_the_backend_s(vllm_source):
    caps = resolve("vllm:triton_attn_diffkv", vllm_src=str(vllm_source)).capabilities
    assert caps.causal and not caps.non_causal and caps.sliding_window and caps.sinks
    assert (192, 128) in caps.diff_kv and caps.kv_cache_dtypes[0] == "auto" and not caps.token_head_dtypes


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["vllm:triton_attn_diffkv", "vllm:triton_attn_diffkv@3d"])
def test_a_gpu_campaign_passes(name, vllm_source, tmp_path):
    kernel = resolve(name, vllm_src=str(vllm_source))
    campaign = fuzz(kernel, device="cuda", max_examples=300, seed=1, use_database=False, state_dir=tmp_path)
    assert not campaign.failed, campaign.failure.summary
