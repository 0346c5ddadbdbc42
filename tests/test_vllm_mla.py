"""vLLM's MLA decode (``vllm:triton_mla``) over the latent cache, from the released vllm wheel.

The kernel file is ``vllm/v1/attention/ops/triton_decode_attention.py`` of the release
tests/conftest.py pins (VLLM_VERSION); one cache ``[blocks, block_size, 1, rank + rope]``
is K, and its first ``rank`` entries are V.
"""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from nanfuzz.harness.adapters import vllm_loader, vllm_mla
from nanfuzz.harness.campaign.runner import fuzz
from nanfuzz.harness.judge.check import check
from nanfuzz.harness.kernels._common import INTERPRETED
from nanfuzz.harness.registry import resolve
from nanfuzz.harness.report.repro import load_repro
from nanfuzz.reference.case import Poison
from tests.cases import consecutive_case

DEVICE = "cpu" if INTERPRETED else "cuda"
MODULE = "vllm/v1/attention/ops/triton_decode_attention.py"
# the grouped stage-1 kernel's load of the latent K tile, which is also V under is_mla
LATENT_LOAD_MASK = "mask=(offs_n[None, :] < split_kv_end) & (mask_d[:, None]),"
# the per-head stage-1 kernel's scores, summed in the inputs' dtype
PER_HEAD_QK = "qk = tl.sum(q[None, :] * k, 1)"
# cases once on file whose rows the error model judges within a correct kernel's rounding
NEAR_BOUND = Path(__file__).parent / "near_bound"
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def latent_case(seqs=((1, 40), (1, 9)), *, rank=64, rope=16, **shape):
    return consecutive_case(seqs=list(seqs), q_heads=4, kv_heads=1, head_size=rank + rope, latent_rank=rank, **shape)


def test_the_loader_finds_the_decode_kernels(vllm_source):
    loaded = vllm_loader.load("triton_mla", vllm_source)
    module = loaded["triton_decode_attention"]
    assert callable(module.decode_attention_fwd) and module.__file__.endswith(MODULE)
    assert "vLLM 0.33.0" in loaded.source


@pytest.mark.parametrize("name", ["vllm:triton_mla", "vllm:triton_mla@page1"])
@pytest.mark.parametrize("poisoned", ["latent", "rope", "both"])
def test_the_kernel_masks_every_dead_slot_of_the_latent_cache(name, poisoned, vllm_source):
    """Tails of 8 and 7 slots, the null block and padding poisoned in the latent part, the rope part
    or both: 0.33.0's grouped kernel loads K (and so V) under the mask of each split's keys."""
    case = latent_case(poison=Poison(tensors={"latent": "v", "rope": "k", "both": "kv"}[poisoned]))
    outcome = check(resolve(name, vllm_src=str(vllm_source)), case, DEVICE)
    assert outcome.verdict.value == "PASS", outcome.summary
    assert sorted(outcome.paths) == ["_fwd_grouped_kernel_stage1", "_fwd_kernel_stage2"]
    assert ("padding" in outcome.layout) == name.endswith("@page1")  # req_to_token's rows run into padding


def test_deepseek_s_512_plus_64_takes_the_split_tiles(vllm_source):
    case = latent_case(seqs=((1, 20),), rank=512, rope=64)
    outcome = check(resolve("vllm:triton_mla", vllm_src=str(vllm_source)), case, DEVICE)
    assert outcome.verdict.value == "PASS", outcome.summary
    assert any("BLOCK_DPE=64" in spec for spec in outcome.paths["_fwd_grouped_kernel_stage1"])


def test_a_copy_that_loads_the_latent_tile_unmasked_is_caught(tmp_path, vllm_source):
    """A copy of 0.33.0 whose grouped kernel loads the latent K tile (V under is_mla) without its
    key mask: the tail's NaN reaches P @ V."""
    shutil.copytree(vllm_source, tmp_path / "tree")
    path = tmp_path / "tree" / MODULE
    text = path.read_text()
    assert text.count(LATENT_LOAD_MASK) == 1
    path.write_text(text.replace(LATENT_LOAD_MASK, "mask=mask_d[:, None],"))
    mutated = resolve("vllm:triton_mla", vllm_src=str(tmp_path / "tree"))
    outcome = check(mutated, latent_case(seqs=((1, 9),)), DEVICE)
    assert outcome.verdict.value == "NONFINITE", outcome.summary
    assert "tail" in outcome.summary


def test_a_short_campaign_passes_on_latent_cases_only(vllm_source, tmp_path):
    kernel = resolve("vllm:triton_mla", vllm_src=str(vllm_source))
    campaign = fuzz(kernel, device=DEVICE, max_examples=6, seed=2, use_database=False, state_dir=tmp_path)
    assert not campaign.failed, campaign.failure.summary
    assert campaign.examples >= 3
    assert campaign.statistics.counts["path:_fwd_grouped_kernel_stage1"] > 0


def test_the_capabilities_are_the_backend_s():
    caps = vllm_mla.CAPABILITIES
    assert caps.max_query_len == 1 and not caps.sliding_window and not caps.sinks
    assert (512, 64) in caps.mla and set(caps.dtypes) == {"float16", "bfloat16"}


def _grouped_only(case):
    return "one query head: the per-head stage 1 (on file)" if case.geometry.num_q_heads == 1 else None


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["vllm:triton_mla", "vllm:triton_mla@page1"])
def test_a_gpu_campaign_past_the_finding_on_file_passes(name, vllm_source, tmp_path):
    """Two query heads or more take the grouped stage 1 (tl.dot), which is right on GPU."""
    kernel = dataclasses.replace(resolve(name, vllm_src=str(vllm_source)), supports=_grouped_only)
    campaign = fuzz(kernel, device="cuda", max_examples=200, seed=1, use_database=False, state_dir=tmp_path)
    assert not campaign.failed, campaign.failure.summary


@pytest.mark.gpu
def test_the_per_head_stage_1_s_bf16_sums_stay_within_the_error_model(vllm_source, tmp_path):
    """With one query head, 0.33.0 takes _fwd_kernel_stage1, which sums ``q[None, :] * k`` in the
    cache's dtype (triton_decode_attention.py:151; tl.sum keeps bf16/fp16).  The case that met 3.48x
    under the per-row bound of small batches is within what the error model lets a bf16 kernel round
    (docs/error-model.md), as is the same kernel summing in float32, as SGLang's copy does; both take
    the per-head stage.  (Under the interpreter numpy sums half precision in float32.)"""
    record = load_repro(NEAR_BOUND / "vllm_triton_mla-per-head-stage-1-sums-qk-in-bf16.json")
    released = check(resolve("vllm:triton_mla", vllm_src=str(vllm_source)), record["case"], "cuda")
    assert released.verdict.value == "PASS", released.summary
    assert sorted(released.paths) == ["_fwd_kernel_stage1", "_fwd_kernel_stage2"]
    shutil.copytree(vllm_source, tmp_path / "tree")
    path = tmp_path / "tree" / MODULE
    text = path.read_text()
    assert text.count(PER_HEAD_QK) == 1
    path.write_text(text.replace(PER_HEAD_QK, "qk = tl.sum((q[None, :] * k).to(tl.float32), 1)"))
    fixed = check(resolve("vllm:triton_mla", vllm_src=str(tmp_path / "tree")), record["case"], "cuda")
    assert fixed.verdict.value == "PASS", fixed.summary
