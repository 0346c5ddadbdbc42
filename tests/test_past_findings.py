"""The subjects "past the findings" (tests/past_findings.py), which the GPU's tallies of correct library
kernels count on: each declines the case of every finding on file it stands past (or, for the tails
its campaigns leave unpoisoned, that finding's poison lies in a tail alone), and takes most of what
its campaign draws (a subject that declines every batch passes without running anything)."""
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from nanfuzz.harness.adapters.lmdeploy import block_pointers_removed
from nanfuzz.harness.campaign.scope import campaign_capabilities, campaign_pool_of, campaign_strategy
from nanfuzz.harness.campaign.settings import Settings
from nanfuzz.harness.report.repro import load_repro
from nanfuzz.harness.scaling import drawn
from nanfuzz.reference.features import poisoned_mask
from nanfuzz.reference.errors import NanfuzzError
from nanfuzz.reference.semantics import Dead, reasons

HERE = Path(__file__).parent
# subject: the repros on file it must decline
DECLINED = {
    "pa_decode_float16": ["aiter_pa_decode-v1-block-offset-past-2-31-crash", "aiter_pa_decode-v1-gqa-block-48-crash",
                          "aiter_pa_decode-v2-block-48-padding-lanes-mismatch"],
    "pa_prefill_without_windows": ["aiter_pa_prefill-block-offset-past-2-31-crash",
                                   "aiter_pa_prefill-window-expired-slots-of-a-live-block"],
    "chunked_pa_prefill_prefills_without_windows": ["aiter_chunked_pa_prefill-decode-tail-finite-garbage-overflows",
                                                    "aiter_chunked_pa_prefill-decode-tail-past-seq-len",
                                                    "aiter_chunked_pa_prefill-prefill-window-expired-slots"],
    "unified_attention_without_windows": ["aiter_unified_attention-3d-head-80-crash",
                                          "aiter_unified_attention-decode-block-48-crash",
                                          "aiter_unified_attention-prefill-float32-head-256-shared-memory-crash",
                                          "aiter_unified_attention-window-expired-slots-of-a-live-block",
                                          "aiter_unified_attention-window-null-block-in-the-first-tile"],
    "triton_attn_int4_without_windows": ["vllm_triton_attn_int4-nan-v-scale-below-window"],
    "rocm_segmented_attn_without_windows": ["vllm_rocm_segmented_attn-window-first-tile-loads-expired-v"],
    "triton_mla_two_heads": ["../near_bound/vllm_triton_mla-per-head-stage-1-sums-qk-in-bf16"],
    "fa_contiguous_one_tile": ["fa_amd_kvcache-contiguous-tail-in-a-later-tile", "fa_amd_kvcache-contiguous-window-ignored"],
    "lmdeploy_decode_without_windows": ["lmdeploy_decode-window-expired-slots-of-a-live-block"],
    "lmdeploy_prefill_without_windows": ["lmdeploy_prefill-window-expired-slots-of-a-live-block"],
}
# subject: the repros on file its campaigns stand past by leaving tails unpoisoned (``--poison`` without tail)
TAILS_LEFT_FINITE = {
    "unified_attention_without_windows": ["aiter_unified_attention-3d-tail-past-seq-len",
                                          "aiter_unified_attention-decode-tail-past-seq-len",
                                          "aiter_unified_attention-prefill-block-64-tail-past-seq-len"],
    "lmdeploy_decode_without_windows": ["lmdeploy_decode-tail-past-seq-len", "lmdeploy_decode-fp8-tail-past-seq-len"],
}


@pytest.fixture(scope="module")
def past(vllm_source, aiter_source, fa_amd_source, lmdeploy_source):
    patch = pytest.MonkeyPatch()
    patch.setenv("NANFUZZ_VLLM_SRC", str(vllm_source))
    patch.setenv("NANFUZZ_AITER_SRC", str(aiter_source))
    patch.setenv("NANFUZZ_FA_SRC", str(fa_amd_source))
    patch.setenv("NANFUZZ_LMDEPLOY_SRC", str(lmdeploy_source))
    yield _fresh_module("past_findings_of_every_library")
    patch.undo()


def _fresh_module(name: str):
    """tests/past_findings.py as a module of its own, whose subjects read the environment as it is now
    (a module imported before keeps the subjects it built)."""
    spec = importlib.util.spec_from_file_location(name, HERE / "past_findings.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _subject(past, name: str):
    """The subject ``name``; lmdeploy's prefill only where Triton still has block pointers."""
    if name == "lmdeploy_prefill_without_windows" and block_pointers_removed():
        pytest.skip("lmdeploy's prefill cannot load on this Triton (no tl.make_block_ptr)")
    return getattr(past, name)


def declines(subject, case) -> str | None:
    return subject.capabilities.unsupported(case) or (subject.supports(case) if subject.supports else None)


@pytest.mark.parametrize("name", DECLINED)
def test_a_subject_declines_the_findings_it_stands_past(past, name):
    subject = _subject(past, name)
    for stem in DECLINED[name]:
        case = load_repro(HERE / "regressions" / f"{stem}.json")["case"]
        assert declines(subject, case), f"{name} takes {stem}"


@pytest.mark.parametrize("name", TAILS_LEFT_FINITE)
def test_the_tail_findings_a_subject_stands_past_poison_tails_alone(past, name):
    for stem in TAILS_LEFT_FINITE[name]:
        case = load_repro(HERE / "regressions" / f"{stem}.json")["case"]
        poisoned = poisoned_mask(case)
        assert poisoned.any() and np.all(reasons(case)[poisoned] == Dead.TAIL), stem


@pytest.mark.parametrize("name", ["pa_decode_float16", "pa_prefill_without_windows", "unified_attention_without_windows",
                                  "chunked_pa_prefill_prefills_without_windows", "fa_contiguous_one_tile",
                                  "lmdeploy_decode_without_windows", "lmdeploy_block_decode_unquantized",
                                  "lmdeploy_prefill_without_windows"])
def test_a_subject_takes_most_of_what_its_campaign_draws(past, name, tmp_path):
    subject = _subject(past, name)
    settings = Settings(device="cpu", state_dir=tmp_path, size="production")
    caps, _ = campaign_capabilities(subject, settings)
    pool, _ = campaign_pool_of(caps, settings, tier="production")
    cases = drawn(campaign_strategy(caps, settings, pool, "production"), 40)
    declined = [why for why in (declines(subject, case) for case in cases) if why]
    assert len(declined) <= len(cases) // 2, declined[:3]


def test_a_subject_needs_its_own_library_alone(aiter_source, monkeypatch, tmp_path):
    """A campaign of AITER's subject runs where vLLM's and FlashAttention's trees are not to be had."""
    monkeypatch.setenv("NANFUZZ_AITER_SRC", str(aiter_source))
    for variable in ("NANFUZZ_VLLM_SRC", "NANFUZZ_FA_SRC", "NANFUZZ_LMDEPLOY_SRC"):
        monkeypatch.setenv(variable, str(tmp_path / "no-such-tree"))
    module = _fresh_module("past_findings_of_aiter_alone")
    assert module.pa_decode_float16.name.startswith("aiter:pa_decode")
    with pytest.raises(NanfuzzError, match="is not a directory"):
        module.fa_contiguous_one_tile
