"""SGLang's Triton attention kernels behind the ``sglang:*`` names, called as its triton_backend.py does.

The kernels come from the released sglang wheel tests/conftest.py pins (SGLANG_VERSION): its
three attention files, fetched once into ``$NANFUZZ_CACHE/sglang-<version>``.  Token-index
layouts are built from the block table; the index buffer runs past the batch's keys with
slots of the padding block, dead and poisoned, as a CUDA-graph buffer holds stale entries.
"""
from __future__ import annotations

import functools
import shutil
import sys
import types

import pytest
import torch

from nanfuzz.harness.adapters import sglang as sglang_adapters
from nanfuzz.harness.adapters import sglang_loader
from nanfuzz.harness.cli import main
from nanfuzz.harness.judge.check import check
from nanfuzz.harness.kernel import Kernel
from nanfuzz.harness.kernels._common import INTERPRETED
from nanfuzz.harness.registry import resolve
from nanfuzz.reference.case import Poison
from nanfuzz.reference.errors import NanfuzzError
from nanfuzz.reference.layouts import token_indices
from tests.cases import consecutive_case

DEVICE = "cpu" if INTERPRETED else "cuda"
SOURCE: list = []


@pytest.fixture(autouse=True)
def _sglang(sglang_source):  # tests/conftest.py fetches the kernel files
    SOURCE[:] = [str(sglang_source)]
    return sglang_source


def kernel(name: str) -> Kernel:
    return resolve(name, sglang_src=SOURCE[0])


def verdict(name: str, **shape) -> str:
    outcome = check(kernel(name), consecutive_case(**shape), DEVICE)
    return outcome.verdict.value


# Small heads: the extend kernel's 128-row tiles (its gfx950 choice) cost seconds under the interpreter.
DECODES = {
    "mha": dict(seqs=[(1, 40), (1, 17), (1, 5)], q_heads=2, kv_heads=2),        # tails of 8, 15 and 11
    "gqa-window-sinks": dict(seqs=[(1, 50), (0, 9), (1, 33)], q_heads=4, kv_heads=1, window=10, sinks=True, seed=1),
    "head-80-fp32": dict(seqs=[(1, 60), (1, 3)], q_heads=2, kv_heads=1, head_size=80, dtype="float32", seed=2),
}
EXTENDS = {
    "chunked-and-prefill": dict(seqs=[(7, 30), (12, 12), (1, 21)], q_heads=2, kv_heads=1),
    "non-causal-window": dict(seqs=[(6, 40), (0, 5), (9, 9)], q_heads=2, kv_heads=2, window=5, causal=False, seed=1),
    "window-sinks": dict(seqs=[(5, 37)], q_heads=2, kv_heads=1, window=9, sinks=True, seed=2),
}
RUNS = ([(name, shape, DECODES) for name in ("sglang:decode", "sglang:decode@page1", "sglang:decode@paged")
         for shape in DECODES]
        + [(name, shape, EXTENDS) for name in ("sglang:extend", "sglang:extend@paged", "sglang:extend@custom-mask")
           for shape in EXTENDS])


@pytest.mark.gpu
@pytest.mark.parametrize("name", sglang_adapters.KERNEL_NAMES)
def test_a_gpu_campaign_passes(name, tmp_path):
    from nanfuzz.harness.campaign.runner import fuzz

    campaign = fuzz(kernel(name), device="cuda", max_examples=200, seed=1, use_database=False, state_dir=tmp_path)
    assert not campaign.failed, campaign.failure.summary


@pytest.mark.parametrize("name,shape,shapes", RUNS, ids=[f"{n}-{s}" for n, s, _ in RUNS])
def test_the_kernels_mask_what_their_index_lists_hold(name, shape, shapes):
    """0.5.23's decode and extend kernels load K and V under the mask of the keys a request lists
    (and a window's tiles), so NaN in every dead slot stays out; every path passes."""
    assert verdict(name, **shapes[shape]) == "PASS"


def test_mla_decode_reads_the_latent_cache():
    case = consecutive_case(seqs=[(1, 40), (1, 9)], q_heads=4, kv_heads=1, head_size=288, latent_rank=256)
    outcome = check(kernel("sglang:decode@mla"), case, DEVICE)
    assert outcome.verdict.value == "PASS", outcome.summary
    assert "_fwd_grouped_kernel_stage1" in outcome.paths


def test_paths_splits_and_page_sizes(monkeypatch):
    """MHA and GQA take different stage-1 kernels; the page size reaches PAGE_SIZE; every request
    gets its own split count and stale scratch."""
    mha = check(kernel("sglang:decode@paged"), consecutive_case(seqs=[(1, 20)], q_heads=2, kv_heads=2), DEVICE)
    gqa = check(kernel("sglang:decode@page1"), consecutive_case(seqs=[(1, 20)], q_heads=2, kv_heads=1), DEVICE)
    assert "_fwd_kernel_stage1" in mha.paths and "_fwd_grouped_kernel_stage1" in gqa.paths
    assert any("PAGE_SIZE=16" in s for s in mha.paths["_fwd_kernel_stage1"])
    assert any("PAGE_SIZE=1" in s for s in gqa.paths["_fwd_grouped_kernel_stage1"])
    case = consecutive_case(seqs=[(1, 20), (1, 5), (1, 9)], seed=4)
    assert sglang_adapters.page_size(case, None) == 1 and sglang_adapters.page_size(case.replace(data_seed=5), None) == 16
    splits = sglang_adapters.split_counts(case, 3, "cpu")
    assert splits.dtype == torch.int32 and ((1 <= splits) & (splits <= sglang_adapters.MAX_KV_SPLITS)).all()


def _index_buffer_overrun(batch, out):
    """The real decode kernel handed kv_indptr whose last request runs one entry past its keys,
    into the buffer's stale entries."""
    real = token_indices

    def overrun(*args, **kwargs):
        index = real(*args, **kwargs)
        index.kv_indptr[-1] += 1
        return index

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sglang_adapters, "token_indices", overrun)
        return sglang_adapters.run_decode(batch, out, page="page1", source=SOURCE[0])


def _expired_keys_listed(batch, out):
    """The real decode kernel handed every key of the sequence, window or not (keys="all")."""
    real = token_indices
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sglang_adapters, "token_indices", lambda *a, **k: real(*a, **{**k, "keys": "all"}))
        return sglang_adapters.run_decode(batch, out, page="page1", source=SOURCE[0])


def test_a_layout_that_reaches_its_dead_entries_is_caught_and_the_statistics_say_what_it_reaches():
    caps = sglang_adapters.DECODE_CAPABILITIES
    case = consecutive_case(seqs=[(1, 20), (1, 9)], q_heads=2, kv_heads=2)
    correct = check(kernel("sglang:decode@page1"), case, DEVICE)
    assert correct.verdict.value == "PASS" and set(correct.layout) == {"indexed", "null-block", "padding", "unreferenced"}
    overrun = check(Kernel("sglang-overrun", _index_buffer_overrun, caps), case, DEVICE)
    assert overrun.verdict.value == "NONFINITE" and "sequences 1" in overrun.summary
    windowed = consecutive_case(seqs=[(1, 40)], q_heads=2, kv_heads=2, window=8)
    assert check(kernel("sglang:decode@page1"), windowed, DEVICE).verdict.value == "PASS"
    listed = check(Kernel("sglang-all-keys", _expired_keys_listed, caps), windowed, DEVICE)
    assert listed.verdict.value == "NONFINITE" and "out-of-window" in listed.layout


def _extend_with_expired_prefix(batch, out):
    """The real extend kernel handed each request's whole context, window or not (the prefix of the
    case without its window): it masks the scores of expired keys but loads their V with the tile."""
    real = token_indices

    def whole_context(batch, **options):
        windowless = types.SimpleNamespace(case=batch.case.replace(sliding_window=0), block_table=batch.block_table)
        return real(windowless, **options)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sglang_adapters, "token_indices", whole_context)
        return sglang_adapters.run_extend(batch, out, page="page1", source=SOURCE[0])


def test_an_extend_layout_that_lists_expired_keys_is_caught():
    case = consecutive_case(seqs=[(2, 40)], q_heads=1, kv_heads=1, window=6)
    assert check(kernel("sglang:extend@page1"), case, DEVICE).verdict.value == "PASS"
    listed = check(Kernel("sglang-extend-all-keys", _extend_with_expired_prefix, sglang_adapters.EXTEND_CAPABILITIES),
                   case, DEVICE)
    assert listed.verdict.value == "NONFINITE" and "out-of-window" in listed.summary, listed.summary


def test_the_custom_mask_is_the_allowed_set():
    case = consecutive_case(seqs=[(3, 5), (0, 2), (2, 2)], window=2, causal=False)
    mask, indptr = sglang_adapters.custom_mask(case, "cpu")
    assert indptr.tolist() == [0, 15, 19]
    assert mask[:15].view(3, 5).tolist() == [[0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [0, 0, 0, 1, 1]]


def test_a_campaign_passes_and_says_which_dead_slots_its_index_buffers_reach(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    source = ["--sglang-src", SOURCE[0], "--device", DEVICE]
    assert main(["list", *source]) == 0
    listing = capsys.readouterr().out
    assert "sglang:extend@custom-mask" in listing and "window>=2" in listing and "mla 512+64,256+32" in listing
    assert "Lean (persistent, work-stealing) decode" in listing and "dense fp8 prefill" in listing
    assert main(["fuzz", "--kernel", "sglang:decode", "--max-examples", "12", "--seed", "3", "--show-statistics",
                 *source]) == 0
    out = capsys.readouterr().out
    assert "dead slots its index buffers point at" in out and "layout:padding" in out
    assert main(["fuzz", "--kernel", "sglang:extend", "--max-examples", "4", "--seed", "3", *source]) == 0


# -- loading ------------------------------------------------------------------------

def test_stand_ins_do_not_stay_in_sys_modules():
    check(kernel("sglang:extend"), consecutive_case(seqs=[(2, 20)], q_heads=1, kv_heads=1), DEVICE)
    assert not [name for name in sys.modules if name == "sglang" or name.startswith("sglang.")]


def test_bogus_sources_and_names_are_one_line(tmp_path):
    with pytest.raises(NanfuzzError, match="not a directory"):
        resolve("sglang:decode", sglang_src=str(tmp_path / "nowhere"))
    with pytest.raises(NanfuzzError, match=r"sglang/kernels/ops/attention.*an SGLang source checkout"):
        resolve("sglang:decode", sglang_src=str(tmp_path))
    with pytest.raises(NanfuzzError, match=r"unknown SGLang kernel 'sglang:prefill'; known: sglang:decode, "):
        resolve("sglang:prefill", sglang_src=SOURCE[0])


def test_earlier_releases_keep_the_files_under_srt(tmp_path, sglang_source):
    """Releases before 0.5.2x keep the kernels in sglang/srt/layers/attention/triton_ops/."""
    earlier = tmp_path / "sglang" / "srt" / "layers" / "attention" / "triton_ops"
    earlier.mkdir(parents=True)
    for name in ("decode_attention", "score_mod"):
        text = (sglang_source / "sglang/kernels/ops/attention" / f"{name}.py").read_text()
        (earlier / f"{name}.py").write_text(text.replace("sglang.kernels.ops.attention.", f"{sglang_loader.EARLIER}."))
    loaded = sglang_loader.load("decode", tmp_path)
    assert loaded["decode_attention"].__name__ == f"{sglang_loader.EARLIER}.decode_attention"
    found = resolve("sglang:decode@page1", sglang_src=str(tmp_path))
    assert check(found, consecutive_case(seqs=[(1, 20)], q_heads=2, kv_heads=2), DEVICE).verdict.value == "PASS"


def test_an_entry_point_without_sinks_or_a_page_size_is_declared_as_it_is(tmp_path, sglang_source):
    """An earlier decode_attention_fwd without ``sinks`` and ``page_size``: the kernel takes no sinks,
    ``@paged`` is refused in one line, and the rest runs on page size 1."""
    tree = tmp_path / "sglang"
    shutil.copytree(sglang_source / "sglang", tree)
    path = tree / "kernels/ops/attention/decode_attention.py"
    path.write_text(path.read_text() + EARLIER_ENTRY)
    assert not resolve("sglang:decode", sglang_src=str(tmp_path)).capabilities.sinks
    with pytest.raises(NanfuzzError, match="takes no page_size"):
        resolve("sglang:decode@paged", sglang_src=str(tmp_path))
    case = consecutive_case(seqs=[(1, 20)], q_heads=2, kv_heads=2, seed=1)  # odd: a page of a block, if it could
    assert check(resolve("sglang:decode", sglang_src=str(tmp_path)), case, DEVICE).verdict.value == "PASS"


EARLIER_ENTRY = """

_current = decode_attention_fwd


def decode_attention_fwd(q, k_buffer, v_buffer, o, kv_indptr, kv_indices, attn_logits, attn_lse, num_kv_splits,
                         max_kv_splits, sm_scale, logit_cap=0.0):
    return _current(q, k_buffer, v_buffer, o, kv_indptr, kv_indices, attn_logits, attn_lse, num_kv_splits,
                    max_kv_splits, sm_scale, 1.0, 1.0, logit_cap=logit_cap)
"""
