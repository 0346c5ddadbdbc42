"""FlashAttention's AMD Triton backend behind ``fa_amd:kvcache``, called as flash_attn_with_kvcache calls it.

The backend comes from the flash-attn source distribution tests/conftest.py pins (FA_VERSION),
``flash_attn/flash_attn_triton_amd/``, fetched once into ``$NANFUZZ_CACHE/flash-attn-<version>``;
no CUDA extension is built.  Its ``fwd_kvcache`` runs the split-K decode kernel of
``fwd_decode.py`` for every query length; what that release gets wrong is on file in
tests/regressions/ (fa_amd_*.json).
"""
from __future__ import annotations

import sys

import pytest

from nanfuzz.harness.adapters import fa_amd, fa_loader
from nanfuzz.harness.campaign.runner import fuzz
from nanfuzz.harness.cli import main
from nanfuzz.harness.judge.check import check
from nanfuzz.harness.kernel import Kernel
from nanfuzz.harness.kernels._common import INTERPRETED
from nanfuzz.harness.registry import resolve
from nanfuzz.reference.case import Poison
from nanfuzz.reference.errors import NanfuzzError
from tests.cases import consecutive_case

DEVICE = "cpu" if INTERPRETED else "cuda"
BACKWARD = {"bwd_prefill", "bwd_prefill_split", "bwd_prefill_fused", "bwd_prefill_onekernel", "bwd_ref"}
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def kernel(name: str, fa_amd_source) -> Kernel:
    return resolve(name, fa_src=str(fa_amd_source))


def test_the_backend_loads_without_flash_attn_s_extension(fa_amd_source):
    loaded = fa_loader.load("kvcache", fa_amd_source)
    assert callable(loaded["interface_fa"].fwd_kvcache) and callable(loaded["fwd_decode"]._fwd_kernel_splitK)
    assert "FlashAttention 2.8.3.post2" in loaded.source
    assert set(loaded.left_out) <= BACKWARD  # only backward modules may stand in
    assert not [name for name in sys.modules if name == "flash_attn" or name.startswith("flash_attn.")]


def test_a_placeholder_says_why_when_called(fa_amd_source):
    loaded = fa_loader.load("kvcache", fa_amd_source)
    for name, why in loaded.left_out.items():
        with pytest.raises(NanfuzzError, match="did not import"):
            loaded[name].anything()
        assert why


def test_list_says_where_it_runs_and_what_is_left_out(fa_amd_source, capsys):
    assert main(["list", "--fa-src", str(fa_amd_source), "--device", DEVICE]) == 0
    out = capsys.readouterr().out
    assert "fa_amd:kvcache " in out and "fa_amd:kvcache@contiguous" in out
    assert "blocks 256" in out and "uniform-query-len" in out
    assert "varlen_fwd: no kernel" in out


# One tile of 64 keys per split, no window: what 2.8.3.post2's decode kernel gets right.
CORRECT = {
    "decode-gqa": dict(seqs=[(1, 40), (1, 17)], q_heads=2, kv_heads=1),
    "prefill-uniform": dict(seqs=[(3, 40), (3, 3)], q_heads=2, kv_heads=2, seed=1),
    "non-causal": dict(seqs=[(2, 30), (2, 9)], q_heads=2, kv_heads=1, causal=False, seed=2),
    "head-80": dict(seqs=[(1, 33)], q_heads=1, kv_heads=1, head_size=80, seed=3),
}


@pytest.mark.parametrize("shape", CORRECT)
def test_the_contiguous_call_matches_the_oracle_within_one_tile(shape, fa_amd_source):
    outcome = check(kernel("fa_amd:kvcache@contiguous", fa_amd_source), consecutive_case(**CORRECT[shape]), DEVICE)
    assert outcome.verdict.value == "PASS", outcome.summary
    assert sorted(outcome.paths) == ["_fwd_kernel_splitK", "_splitK_reduce"]


def test_the_contiguous_cache_is_each_row_s_blocks_in_table_order():
    import torch

    cache = torch.arange(4 * 2 * 1 * 1, dtype=torch.float32).view(4, 2, 1, 1)
    table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    assert fa_amd.contiguous_cache(cache, table).flatten().tolist() == [4, 5, 0, 1, 2, 3, 6, 7]


def test_the_contiguous_cache_sits_in_nan_margins_past_each_row_and_past_the_last(fa_amd_source):
    """A kernel reading past a row of the gathered cache reads NaN, as past any tensor nanfuzz hands it:
    2.8.3.post2's later tiles of one 65-key sequence read past its 80-slot row (no dead slot is
    poisoned, so nothing else holds NaN), and with finite margins the same case passes."""
    import torch

    cache = torch.arange(4 * 2 * 1 * 1, dtype=torch.float32).view(4, 2, 1, 1)
    view = fa_amd.contiguous_cache(cache, torch.tensor([[2, 0], [1, 3]], dtype=torch.int32))
    base = view._base
    assert base.shape[:2] == (3, 6) and view.data_ptr() == base.data_ptr()
    assert torch.isnan(base[:2, 4:]).all() and torch.isnan(base[2]).all()

    case = consecutive_case(seqs=[(2, 2), (2, 65)], q_heads=1, kv_heads=1, head_size=32, spare_entries=0,
                            poison=Poison(sites=()))
    real = kernel("fa_amd:kvcache@contiguous", fa_amd_source)
    outcome = check(real, case, DEVICE)
    assert outcome.verdict.value == "NONFINITE", outcome.summary
    assert "past the end of a tensor" in outcome.summary

    def finite_margins(cache, table, gathered=fa_amd.contiguous_cache):
        view = gathered(cache, table)
        view._base.nan_to_num_(0.0)
        return view
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fa_amd, "contiguous_cache", finite_margins)
        assert check(real, case, DEVICE).verdict.value == "PASS"


def test_the_paged_call_reads_the_block_of_its_batch_index_not_its_table(fa_amd_source):
    """2.8.3.post2's fwd_kvcache never hands block_table to the kernel, which addresses the cache as
    [batch, seqlen]: sequence 0 reads block 0, the null block, whatever its table says."""
    case = consecutive_case(seqs=[(1, 10)], q_heads=1, kv_heads=1, block_size=256, spare_entries=0)
    outcome = check(kernel("fa_amd:kvcache", fa_amd_source), case, DEVICE)
    assert outcome.failed
    if outcome.reads:  # traced under the interpreter
        assert set(outcome.reads["addressed"]["value_cache"]) == {"null-block", "unreferenced"}


def test_a_campaign_is_silent_where_the_kernel_is_right_and_catches_it_where_not(fa_amd_source, tmp_path):
    """Within what the kernel gets right (one 64-key tile, no window) a campaign passes; the
    declared capabilities (windows, longer sequences) meet the findings on file within a few examples."""
    real = kernel("fa_amd:kvcache@contiguous", fa_amd_source)
    within = Kernel("fa_amd-within-one-tile", real.run,
                    real.capabilities.restrict(sliding_window=False, max_seq_len=48, max_sequences=3))
    quiet = fuzz(within, device=DEVICE, max_examples=5, seed=1, use_database=False, state_dir=tmp_path / "a")
    assert not quiet.failed, quiet.failure.summary
    caught = fuzz(real, device=DEVICE, max_examples=20, seed=1, use_database=False, state_dir=tmp_path / "b",
                  shrink=False)
    assert caught.failed and caught.examples_to_first_failure <= 20
    assert caught.failure.verdict.value in ("NONFINITE", "LEAK", "MISMATCH")


def test_bogus_sources_and_names_are_one_line(tmp_path, fa_amd_source):
    with pytest.raises(NanfuzzError, match="not a directory"):
        resolve("fa_amd:kvcache", fa_src=str(tmp_path / "nowhere"))
    with pytest.raises(NanfuzzError, match="flash_attn"):
        resolve("fa_amd:kvcache", fa_src=str(tmp_path))
    with pytest.raises(NanfuzzError, match=r"^fa_amd:kvcache needs FlashAttention's kernels: .* an unpacked "
                                           r"flash-attn source distribution"):
        resolve("fa_amd:kvcache")  # no flash_attn installed here, no tree given
    with pytest.raises(NanfuzzError, match=r"unknown FlashAttention kernel 'fa_amd:varlen'; known: fa_amd:kvcache"):
        resolve("fa_amd:varlen", fa_src=str(fa_amd_source))


def test_a_bad_source_on_the_command_line_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["fuzz", "--kernel", "fa_amd:kvcache", "--fa-src", str(tmp_path / "nowhere"), "--device",
                 DEVICE]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("nanfuzz:")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["fa_amd:kvcache", "fa_amd:kvcache@contiguous"])
def test_a_gpu_campaign_meets_the_findings_on_file(name, fa_amd_source, tmp_path):
    campaign = fuzz(kernel(name, fa_amd_source), device="cuda", max_examples=200, seed=1, use_database=False,
                    state_dir=tmp_path)
    assert campaign.failed  # 2.8.3.post2: tests/regressions/fa_amd_*.json
    assert campaign.failure.verdict.value in ("NONFINITE", "LEAK", "MISMATCH")


@pytest.mark.gpu
def test_a_gpu_campaign_within_one_tile_passes(fa_amd_source, tmp_path):
    real = kernel("fa_amd:kvcache@contiguous", fa_amd_source)
    within = Kernel("fa_amd-within-one-tile", real.run,
                    real.capabilities.restrict(sliding_window=False, max_seq_len=64), source=real.source)
    campaign = fuzz(within, device="cuda", max_examples=200, seed=1, use_database=False, state_dir=tmp_path)
    assert not campaign.failed, campaign.failure.summary
