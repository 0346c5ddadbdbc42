"""vLLM 0.33.0's INT4 per-token-head attention (``vllm:triton_attn_int4``) and TurboQuant decode
(``vllm:turboquant``) over the caches the case model describes, from the released wheel."""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from nanfuzz.harness.adapters import vllm as vllm_adapters
from nanfuzz.harness.adapters import vllm_loader, vllm_turboquant
from nanfuzz.harness.campaign.runner import fuzz
from nanfuzz.harness.judge.check import check
from nanfuzz.harness.kernels._common import INTERPRETED
from nanfuzz.harness.registry import resolve
from nanfuzz.harness.report.repro import load_repro
from nanfuzz.reference.case import Poison, PoisonSite
from tests.cases import consecutive_case

DEVICE = "cpu" if INTERPRETED else "cuda"
INT4 = "vllm/v1/attention/ops/int4_per_token_head.py"
# where the INT4 kernel zeroes out-of-window V codes, and not the V scales it multiplies P by
WINDOWED_V = "            V_s1 = tl.where(sw_mask[:, None], V_s1, 0.0)\n"
REGRESSIONS = Path(__file__).parent / "regressions"
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def test_the_loader_finds_both_kernels_and_their_helpers(vllm_source):
    assert callable(vllm_loader.load("triton_attn_int4", vllm_source)["int4_per_token_head"].unified_attention_int4)
    loaded = vllm_loader.load("turboquant", vllm_source)
    assert callable(loaded["triton_turboquant_decode"].triton_turboquant_decode_attention)


def test_each_declares_the_cache_it_reads_and_what_it_leaves_out(vllm_source):
    int4 = resolve("vllm:triton_attn_int4", vllm_src=str(vllm_source))
    assert int4.capabilities.cache_formats == (vllm_adapters.INT4_CACHE,) and not int4.capabilities.non_causal
    assert "uint4/token-head/code-zero/float32-zp4/hadamard" in int4.capabilities.describe()
    assert "rotations in bf16" in int4.capabilities.describe()
    tq = resolve("vllm:turboquant", vllm_src=str(vllm_source))
    assert set(tq.capabilities.cache_formats) == set(vllm_turboquant.CACHES.values())
    assert tq.capabilities.decode_only and not tq.capabilities.sliding_window and not tq.capabilities.sinks
    assert any("MSE-key presets" in note for note in tq.notes)


@pytest.mark.parametrize("name, seqs", [("vllm:triton_attn_int4@2d", [(1, 40), (9, 20), (0, 7)]),
                                        ("vllm:triton_attn_int4@3d", [(1, 40), (1, 17)])])
def test_int4_masks_every_dead_slot_but_those_below_a_window(name, seqs, vllm_source):
    """Tails, padding entries at the null block and a spare block, poisoned in codes, scales and zero
    points (NaN in the scales' bits): read under the tile mask, they stay out of the output."""
    case = consecutive_case(seqs, q_heads=4, kv_heads=2, head_size=96, sinks=True)
    case = case.replace(kv_cache=vllm_adapters.INT4_CACHE, poison=Poison("max", "kv", None, "data+scales+zeros"))
    kernel = resolve(name, vllm_src=str(vllm_source))
    outcome = check(kernel, case.validate(), DEVICE)
    assert outcome.verdict.value == "PASS", outcome.summary
    assert ("reduce_segments" in outcome.paths) == name.endswith("@3d")
    nan_scales = case.replace(poison=Poison("nan", "kv", None, "scales")).validate()
    assert check(kernel, nan_scales, DEVICE).verdict.value == "PASS"


def test_int4_with_the_v_scales_masked_by_the_window_passes_the_case_on_file(tmp_path, vllm_source):
    """The NONFINITE on file: int4_per_token_head.py zeroes out-of-window V codes (lines 599-602) but
    multiplies P by every loaded V scale (606-609), so 0 x NaN reaches the output.  Zeroing those
    scales where it zeroes the codes makes the same case pass."""
    record = load_repro(REGRESSIONS / "vllm_triton_attn_int4-nan-v-scale-below-window.json")
    released = check(resolve("vllm:triton_attn_int4", vllm_src=str(vllm_source)), record["case"], DEVICE)
    assert released.verdict.value == "NONFINITE" and "poison in V scales" in released.summary
    shutil.copytree(vllm_source, tmp_path / "tree")
    path = tmp_path / "tree" / INT4
    text = path.read_text()
    assert text.count(WINDOWED_V) == 1
    path.write_text(text.replace(WINDOWED_V, WINDOWED_V + "            v_token_head_scales = tl.where("
                                                           "sw_mask, v_token_head_scales, 0.0)\n"))
    fixed = check(resolve("vllm:triton_attn_int4", vllm_src=str(tmp_path / "tree")), record["case"], DEVICE)
    assert fixed.verdict.value == "PASS", fixed.summary


def test_turboquant_masks_the_tail_of_3_bit_values(vllm_source):
    """One decode of 20 keys over 16-slot blocks: its tail and padding poisoned with NaN in V's scales and
    zero points, then a NaN in K's fp8 codes of one tail slot."""
    case = consecutive_case([(1, 20)], q_heads=2, kv_heads=1, head_size=32)
    case = case.replace(kv_cache=vllm_turboquant.CACHES[3], poison=Poison("nan", "v", None, "scales+zeros")).validate()
    kernel = resolve("vllm:turboquant", vllm_src=str(vllm_source))
    outcome = check(kernel, case, DEVICE)
    assert outcome.verdict.value == "PASS", outcome.summary
    assert sorted(outcome.paths) == ["_fwd_kernel_stage2", "_tq_decode_stage1"]
    assert check(kernel, case.replace(poison=Poison("nan", "k", (PoisonSite(2, 4),))), DEVICE).verdict.value == "PASS"


@pytest.mark.gpu
def test_a_gpu_campaign_past_the_int4_finding_passes(vllm_source, tmp_path):
    kernel = resolve("vllm:triton_attn_int4", vllm_src=str(vllm_source))
    kernel = dataclasses.replace(kernel, capabilities=kernel.capabilities.restrict(sliding_window=False))
    campaign = fuzz(kernel, device="cuda", max_examples=500, seed=1, use_database=False, state_dir=tmp_path)
    assert not campaign.failed, campaign.failure.summary


@pytest.mark.gpu
def test_a_gpu_campaign_of_turboquant_passes(vllm_source, tmp_path):
    campaign = fuzz(resolve("vllm:turboquant", vllm_src=str(vllm_source)), device="cuda", max_examples=500, seed=1,
                    use_database=False, state_dir=tmp_path)
    assert not campaign.failed, campaign.failure.summary
    assert {f"kv:{kv.label()}" for kv in vllm_turboquant.CACHES.values()} <= set(campaign.statistics.counts)
