"""vLLM's ROCm segmented attention (``vllm:rocm_segmented_attn``), from the released wheel.

The kernel file is ``vllm/v1/attention/ops/segmented_attention.py`` of the release tests/conftest.py
pins, called through its dispatcher ``segmented_attention()`` as the ROCM_SEGMENTED_ATTN backend
calls it.  Its finding: the first tile of a sliding window starts at the window's first key rounded
down to the tile (``segmented_attention.py:145-148``), and the tile's K and V are loaded under the
sequence's bounds alone (``:205``, ``:263``; ``:240`` and ``:249`` in the split-PV tiles); the window
masks only the scores (``:222-225``), so the expired keys' V reaches ``P @ V`` (``:278``) as 0 x NaN.
"""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch

from nanfuzz.harness.adapters import vllm_loader, vllm_segmented
from nanfuzz.harness.campaign.runner import fuzz
from nanfuzz.harness.judge.check import check
from nanfuzz.harness.kernels._common import INTERPRETED
from nanfuzz.harness.registry import resolve
from nanfuzz.harness.report.repro import load_repro
from nanfuzz.reference.case import KVCache, Poison
from nanfuzz.reference.materialize import materialize
from tests.cases import consecutive_case

DEVICE = "cpu" if INTERPRETED else "cuda"
MODULE = "vllm/v1/attention/ops/segmented_attention.py"
# the stage kernel's key bounds of one tile, which its K and V loads are masked by
TILE_BOUNDS = "            if tail:\n                valid = ns < end\n"
# the same, with the first key of the tile's first query row's window as a lower bound
TILE_BOUNDS_IN_WINDOW = TILE_BOUNDS + ("            if WINDOW >= 0:\n"
                                       "                valid = valid & (ns >= prefix + (mb * BM) // G - WINDOW)\n")
REGRESSIONS = Path(__file__).parent / "regressions"
FINDING = REGRESSIONS / "vllm_rocm_segmented_attn-window-first-tile-loads-expired-v.json"
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def segmented_case(seqs=((1, 40), (3, 19)), **options):
    return consecutive_case(seqs=list(seqs), head_size=options.pop("head_size", 64), **options)


def test_the_loader_finds_the_segmented_kernels(vllm_source):
    loaded = vllm_loader.load("rocm_segmented_attn", vllm_source)
    module = loaded["segmented_attention"]
    assert callable(module.segmented_attention) and module.__file__.endswith(MODULE)
    assert "vLLM 0.33.0" in loaded.source


@pytest.mark.parametrize("shape", [
    dict(seqs=((1, 40), (0, 9), (3, 19))),                                # decode, an idle sequence, a chunked prefill
    dict(seqs=((1, 300),), q_heads=2, kv_heads=1),                        # one KV head: its keys split, then merged
    dict(seqs=((12, 12), (5, 33)), causal=False, sinks=True),             # non-causal, sinks
    dict(seqs=((2, 70),), head_size=128, q_heads=8, kv_heads=1, block_size=48),
])
def test_every_dead_slot_stays_out_of_the_output_without_a_window(shape, vllm_source):
    case = segmented_case(poison=Poison("nan", "kv"), **shape)
    outcome = check(resolve(vllm_segmented.NAME, vllm_src=str(vllm_source)), case, DEVICE)
    assert outcome.verdict.value == "PASS", outcome.summary
    assert "_segmented_attention_stage" in outcome.paths


def test_a_batch_whose_keys_split_takes_the_merge(vllm_source):
    case = segmented_case(((1, 300),), q_heads=2, kv_heads=1, poison=Poison("nan", "v"))
    outcome = check(resolve(vllm_segmented.NAME, vllm_src=str(vllm_source)), case, DEVICE)
    assert outcome.verdict.value == "PASS", outcome.summary
    assert any("SPLITS=2" in s for s in outcome.paths["_segmented_attention_stage"])
    assert "_segmented_attention_reduce" in outcome.paths


def test_fp8_caches_go_in_as_the_backend_views_them(vllm_source):
    fp8 = KVCache("fp8_e4m3fn", "tensor", 0.25, 0.5)
    case = segmented_case(poison=Poison("nan", "v")).replace(kv_cache=fp8).validate()
    outcome = check(resolve(vllm_segmented.NAME, vllm_src=str(vllm_source)), case, DEVICE)
    assert outcome.verdict.value == "PASS", outcome.summary
    assert all("FP8=True" in s for s in outcome.paths["_segmented_attention_stage"])


def test_the_table_s_rows_sit_a_power_of_two_apart_with_the_trap_past_each():
    case = segmented_case(((1, 40), (3, 19)))
    batch = materialize(case)
    table = vllm_segmented.bucketed_table(batch)
    assert table.shape == (2, 4) and torch.equal(table, batch.block_table)
    assert table.stride(0) == 8  # 4 entries and the 2 redzone columns, rounded up
    assert (table.as_strided((2, 8), (8, 1))[:, 4:] == case.geometry.num_blocks).all()


def test_the_window_finding_and_the_one_line_fix(tmp_path, vllm_source):
    """The released kernel loads the expired keys of a window's first tile: NONFINITE, out-of-window
    alone reachable.  A copy whose tile bounds start at the window passes the same case."""
    record = load_repro(FINDING)
    released = check(resolve(vllm_segmented.NAME, vllm_src=str(vllm_source)), record["case"], DEVICE)
    assert released.verdict.value == record["verdict"] == "NONFINITE", released.summary
    assert "out-of-window" in released.summary
    shutil.copytree(vllm_source, tmp_path / "tree")
    path = tmp_path / "tree" / MODULE
    text = path.read_text()
    assert text.count(TILE_BOUNDS) == 1
    path.write_text(text.replace(TILE_BOUNDS, TILE_BOUNDS_IN_WINDOW))
    fixed = check(resolve(vllm_segmented.NAME, vllm_src=str(tmp_path / "tree")), record["case"], DEVICE)
    assert fixed.verdict.value == "PASS", fixed.summary


def test_a_window_whose_first_tile_holds_no_expired_slot_passes(vllm_source):
    # a decode at key 70 under a window of 7: its first tile starts at 64, the window at 64
    case = segmented_case(((1, 71),), window=7, poison=Poison("nan", "v"))
    outcome = check(resolve(vllm_segmented.NAME, vllm_src=str(vllm_source)), case, DEVICE)
    assert outcome.verdict.value == "PASS", outcome.summary


def test_a_short_campaign_without_windows_passes(vllm_source, tmp_path):
    kernel = resolve(vllm_segmented.NAME, vllm_src=str(vllm_source))
    campaign = fuzz(dataclasses.replace(kernel, capabilities=kernel.capabilities.restrict(sliding_window=False)),
                    device=DEVICE, max_examples=6, seed=2, use_database=False, state_dir=tmp_path)
    assert not campaign.failed, campaign.failure.summary
    assert campaign.examples >= 3 and campaign.statistics.counts["path:_segmented_attention_stage"] > 0


def test_the_capabilities_are_the_backend_s_and_the_list_says_what_is_left_out(vllm_source):
    kernel = resolve(vllm_segmented.NAME, vllm_src=str(vllm_source))
    caps = kernel.capabilities
    assert caps.head_sizes == (64, 128, 256) and caps.max_group == 16 and caps.max_query_len == 8192
    assert caps.non_causal and not caps.non_causal_window and set(caps.dtypes) == {"float16", "bfloat16"}
    notes = " ".join(kernel.notes)
    assert "autotuned" in notes and "non-causal" in notes and "waves_per_eu" in notes


@pytest.mark.parametrize("group", ["rocm_segmented_attn", "triton_attn_diffkv"])
def test_the_fetched_cache_keeps_every_file_the_group_loads(group):
    from nanfuzz.harness.adapters.vllm_fetch import VLLM

    for module in vllm_loader.GROUPS[group]:
        assert VLLM.kept("vllm/" + vllm_loader.VLLM.relpath(module.name)), module.name


def test_the_dispatcher_sending_a_case_elsewhere_is_no_silent_pass(vllm_source):
    # head size 96 is no head size of the segmented kernels: the dispatcher would run unified_attention
    kernel = resolve(vllm_segmented.NAME, vllm_src=str(vllm_source))
    wider = dataclasses.replace(kernel, capabilities=kernel.capabilities.restrict(head_sizes=(96,)))
    outcome = check(wider, segmented_case(head_size=96), DEVICE)
    assert outcome.verdict.value == "CRASH" and "sent this case to unified_attention" in outcome.summary


def test_the_interpreter_leaves_is_cuda_as_it_found_it():
    tensor = torch.zeros(1)
    with vllm_segmented._tensors_on_a_gpu():
        assert tensor.is_cuda
    assert not tensor.is_cuda


@pytest.mark.gpu
def test_a_gpu_campaign_past_the_finding_passes(vllm_source, tmp_path):
    """Without windows (the finding's geometry), and with windows on the one-line fix."""
    kernel = resolve(vllm_segmented.NAME, vllm_src=str(vllm_source))
    windowless = dataclasses.replace(kernel, capabilities=kernel.capabilities.restrict(sliding_window=False))
    campaign = fuzz(windowless, device="cuda", max_examples=300, seed=1, use_database=False, state_dir=tmp_path)
    assert not campaign.failed, campaign.failure.summary
    shutil.copytree(vllm_source, tmp_path / "tree")
    path = tmp_path / "tree" / MODULE
    path.write_text(path.read_text().replace(TILE_BOUNDS, TILE_BOUNDS_IN_WINDOW))
    fixed = resolve(vllm_segmented.NAME, vllm_src=str(tmp_path / "tree"))
    campaign = fuzz(fixed, device="cuda", max_examples=300, seed=1, use_database=False, state_dir=tmp_path / "fixed")
    assert not campaign.failed, campaign.failure.summary
