"""lmdeploy's Triton attention behind the ``lmdeploy:*`` names, called as its attention backend does.

The kernels come from the released lmdeploy wheel tests/conftest.py pins (LMDEPLOY_VERSION): the
files of ``lmdeploy/pytorch/kernels/cuda/`` the PyTorch engine's decode and prefill run, fetched
once into ``$NANFUZZ_CACHE/lmdeploy-<version>``.  Under the interpreter the checks here stand in
for a GPU of 4 compute units: lmdeploy splits each request's keys to fill its GPU (on an MI355X,
16 to 256 programs per request and KV head), and on 4 units the split count sits at its floor of
4, the same code in a few programs.  The findings are on file in tests/regressions (lmdeploy_*);
each root-cause test here patches the responsible line in a copy of the release and passes.
"""
from __future__ import annotations

import dataclasses
import shutil
import sys

import pytest

from nanfuzz import H200, DeviceProperties
from nanfuzz.harness.adapters import lmdeploy as lmdeploy_adapters
from nanfuzz.harness.adapters import lmdeploy_loader, lmdeploy_standins
from nanfuzz.harness.campaign.focus import Focus
from nanfuzz.harness.cli import main
from nanfuzz.harness.device import standing_in_for
from nanfuzz.harness.judge import encodings
from nanfuzz.harness.judge.check import check
from nanfuzz.harness.kernels._common import INTERPRETED
from nanfuzz.harness.registry import resolve
from nanfuzz.reference.case import KVCache, Poison, PoisonSite
from nanfuzz.reference.errors import NanfuzzError
from tests.cases import consecutive_case

DEVICE = "cpu" if INTERPRETED else "cuda"
FOUR_UNITS = DeviceProperties("a GPU of 4 compute units", "amd", "gfx950", compute_units=4, major=9, minor=5,
                              warp_size=64)
PAGED = "lmdeploy/pytorch/kernels/cuda/pagedattention.py"
PREFILL = "lmdeploy/pytorch/kernels/cuda/flashattention.py"
# P @ V in both decode kernels (pagedattention.py:205 and :548): V is loaded without a key mask,
# each dead key's score is masked alone (to -inf, so its p is 0)
P_TIMES_V = "acc += tl.dot(p, v)"
# the same with V's rows that no query weighs set to zero first: a dead key's V never meets P
P_TIMES_LIVE_V = "acc += tl.dot(p, tl.where((tl.max(p, 0) > 0)[:, None], v, 0.0).to(v.dtype))"
# The prefill's V tile (flashattention.py:132), and the same with the keys below the tile's earliest
# window start (dead for every query of the tile) set to zero
PREFILL_V = "v = _load_kv(v_ptrs, boundary_check=v_bound)"
PREFILL_WINDOWED_V = ("v = tl.where(((start_n + offs_n) >= tl.min(kv_min_loc, 0))[:, None], "
                      "_load_kv(v_ptrs, boundary_check=v_bound), 0.0).to(k.dtype)")
BLOCK_POINTERS = not lmdeploy_adapters.block_pointers_removed()
needs_block_pointers = pytest.mark.skipif(not BLOCK_POINTERS, reason="lmdeploy's prefill tiles K and V with "
                                          "tl.make_block_ptr, which this Triton removed (3.9)")
SOURCE: list = []


@pytest.fixture(autouse=True)
def _lmdeploy(lmdeploy_source):  # tests/conftest.py fetches the kernel files
    SOURCE[:] = [str(lmdeploy_source)]
    return lmdeploy_source


def kernel(name: str, source: str | None = None):
    """The kernel as resolved; under the interpreter, on 4 compute units (see the module's notes)."""
    resolved = resolve(name, lmdeploy_src=source or SOURCE[0])
    return dataclasses.replace(resolved, stands_in_for=FOUR_UNITS) if INTERPRETED else resolved


def fp8(case):
    """``case`` over an e5m2 cache, or a skip where this device (this Triton's interpreter) cannot decode it."""
    why = encodings.skipped(DEVICE).get("fp8_e5m2")
    if why:
        pytest.skip(f"fp8_e5m2 caches: {why}")
    return case.replace(kv_cache=KVCache("fp8_e5m2")).validate()


def patched_tree(tmp_path, module: str, old: str, new: str) -> str:
    """A copy of the release with ``old`` replaced by ``new`` in ``module`` (each occurrence)."""
    shutil.copytree(SOURCE[0], tmp_path / "tree")
    path = tmp_path / "tree" / module
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new))
    return str(tmp_path / "tree")


# -- what the kernels get right -------------------------------------------------------

# Every sequence a whole number of blocks (no tail), windows starting on a block's first key.
DECODES = {
    "gqa-sinks": dict(seqs=[(1, 32), (0, 9), (1, 16)], q_heads=4, kv_heads=1, sinks=True),
    "head-80": dict(seqs=[(1, 32)], q_heads=2, kv_heads=2, head_size=80, seed=1),
    "window-on-a-block-edge": dict(seqs=[(1, 48)], q_heads=2, kv_heads=1, window=32, seed=2),
}


@pytest.mark.parametrize("shape", DECODES)
def test_the_decode_passes_where_no_dead_slot_shares_a_block_with_a_live_key(shape):
    outcome = check(kernel("lmdeploy:decode"), consecutive_case(**DECODES[shape]), DEVICE)
    assert outcome.verdict.value == "PASS", outcome.summary
    assert sorted(outcome.paths) == ["_fwd_grouped_split_kernel", "_reduce_split_kernel"]


def test_the_block_decode_reads_every_key_of_its_block():
    block = consecutive_case(seqs=[(4, 32), (4, 16)], q_heads=2, kv_heads=1, causal=False)
    outcome = check(kernel("lmdeploy:decode@block"), block, DEVICE)
    assert outcome.verdict.value == "PASS", outcome.summary
    assert any("seq_len=4" in spec for spec in outcome.paths["_fwd_grouped_split_kernel"])


def test_the_fp8_decode_passes_there_too():
    outcome = check(kernel("lmdeploy:decode"), fp8(consecutive_case(seqs=[(1, 32), (1, 16)], q_heads=2, kv_heads=1)),
                    DEVICE)
    assert outcome.verdict.value == "PASS" and "_fwd_grouped_split_quant_kernel" in outcome.paths, outcome.summary


@pytest.mark.skipif(not INTERPRETED, reason="the stood-in device of a CPU run")
def test_the_split_count_and_pdl_follow_the_stood_in_gpu():
    """lmdeploy's own sizing reads the stood-in GPU through torch: 256 splits of one request's keys
    on an MI355X, 128 on an H200 (its SM count's power of two); PDL on NVIDIA's sm_90 only."""
    loaded = lmdeploy_loader.load("decode", SOURCE[0])
    module = loaded["pagedattention"]
    for device, splits in ((None, 256), (H200, 128)):
        with standing_in_for(device):
            overrides = lmdeploy_standins.interpreter_overrides(loaded, ("pagedattention",))
        with standing_in_for(device), loaded.active(overrides):
            assert module._get_split_k(None, 1, 1, 4) == splits and module.is_cuda() == (device is H200)
    pdl = DeviceProperties("a small sm_90", "nvidia", "sm_90", compute_units=4, major=9, minor=0, warp_size=32)
    outcome = check(dataclasses.replace(kernel("lmdeploy:decode"), stands_in_for=pdl),
                    consecutive_case(**DECODES["gqa-sinks"]), DEVICE)
    assert outcome.verdict.value == "PASS", outcome.summary  # gdc_wait and gdc_launch_dependents run
    assert all("USE_PDL=True" in spec for specs in outcome.paths.values() for spec in specs)


def test_a_control_with_only_unreachable_slots_poisoned_passes():
    """The null block, the padding entry's block and a block no table holds hold NaN in K and V; the
    tail the kernel loads holds finite garbage, which p = 0 weighs to nothing: no false alarm."""
    case = consecutive_case(seqs=[(1, 20), (1, 9)], q_heads=2, kv_heads=1, window=6,
                            poison=Poison(tensors="kv", sites=(PoisonSite(0), PoisonSite(4))))
    outcome = check(kernel("lmdeploy:decode"), case, DEVICE)
    assert outcome.verdict.value == "PASS", outcome.summary


# -- the findings, and their root causes ------------------------------------------------

def test_the_decode_weighs_the_tail_s_v_by_zero(tmp_path):
    """pagedattention.py:165 loads the last block's V whole; :178-186 mask the tail's scores alone,
    so p = 0 meets the tail's NaN at :205 (0 * NaN).  With V rows no query weighs zeroed, it passes."""
    case = consecutive_case(seqs=[(1, 20)], q_heads=2, kv_heads=1)
    outcome = check(kernel("lmdeploy:decode"), case, DEVICE)
    assert outcome.verdict.value == "NONFINITE" and "tail" in outcome.summary, outcome.summary
    fixed = kernel("lmdeploy:decode", patched_tree(tmp_path, PAGED, P_TIMES_V, P_TIMES_LIVE_V))
    assert check(fixed, case, DEVICE).verdict.value == "PASS"


def test_the_decode_weighs_the_expired_keys_of_the_window_s_first_block_by_zero(tmp_path):
    """pagedattention.py:147 starts the window's loop on a block's first key: its expired keys are
    loaded, masked in the scores only (:180-181), and their V meets P at :205."""
    case = consecutive_case(seqs=[(1, 48)], q_heads=2, kv_heads=1, window=20)  # keys 28..47: block 1 half expired
    outcome = check(kernel("lmdeploy:decode"), case, DEVICE)
    assert outcome.verdict.value == "NONFINITE" and "out-of-window" in outcome.summary, outcome.summary
    fixed = kernel("lmdeploy:decode", patched_tree(tmp_path, PAGED, P_TIMES_V, P_TIMES_LIVE_V))
    assert check(fixed, case, DEVICE).verdict.value == "PASS"


def test_the_fp8_decode_weighs_the_tail_s_v_by_zero(tmp_path):
    """The fp8 kernel too: _fwd_grouped_split_quant_kernel loads V unmasked (:491), P @ V at :548."""
    case = fp8(consecutive_case(seqs=[(1, 20)], q_heads=2, kv_heads=1))
    outcome = check(kernel("lmdeploy:decode"), case, DEVICE)
    assert outcome.verdict.value == "NONFINITE" and "tail" in outcome.summary, outcome.summary
    fixed = kernel("lmdeploy:decode", patched_tree(tmp_path, PAGED, P_TIMES_V, P_TIMES_LIVE_V))
    assert check(fixed, case, DEVICE).verdict.value == "PASS"


def test_the_block_decode_of_a_quantized_cache_reads_the_wrong_queries():
    """_fwd_grouped_split_quant_kernel (pagedattention.py:267) has no seq_len: with a dLLM's block of
    new tokens per request it reads request b's query at token b (:363), writes its partials at token
    b (:560) and leaves the other tokens' scratch (``q.new_empty``, :910) unwritten, under the grid
    :888-891 size for the block.  What the merge then reads is whatever that memory held, so the
    verdict is NONFINITE, NONDETERMINISTIC, LEAK (the clean and poisoned runs met different garbage)
    or MISMATCH by the allocator's mood, which a repro on
    file could not keep: this test is its regression.  The same batch over an unquantized cache
    passes (test_the_block_decode_reads_every_key_of_its_block)."""
    case = consecutive_case(seqs=[(4, 32), (4, 16)], q_heads=2, kv_heads=1, causal=False)
    outcome = check(kernel("lmdeploy:decode@block"), fp8(case), DEVICE)
    assert outcome.verdict.value in ("NONFINITE", "NONDETERMINISTIC", "LEAK", "MISMATCH"), outcome.summary
    assert "_fwd_grouped_split_quant_kernel" in outcome.paths


@pytest.mark.skipif(not INTERPRETED, reason="a GPU of 4 compute units is a stand-in of a CPU run")
def test_the_split_count_is_a_negative_shift_where_head_tiles_outnumber_the_gpu_s_programs():
    """pagedattention.py:675-676: SPLIT_K = cdiv(cta_per_device // head_grid, ...) is 0 where a request's
    head tiles outnumber the programs lmdeploy expects the GPU to run at once, and ``1 << (0).bit_length()
    - 1`` raises.  6 query heads times a block of 11 tokens are 5 tiles of 16, one more than 4 compute
    units run; an MI355X runs 256, which no case within the declared 128 query heads and 32-token
    blocks outnumbers, so only a smaller GPU meets it (the tests here stand in for one)."""
    case = consecutive_case(seqs=[(11, 11)], q_heads=6, kv_heads=1, causal=False)
    outcome = check(kernel("lmdeploy:decode@block"), case, DEVICE)
    assert outcome.verdict.value == "CRASH" and "negative shift count" in outcome.summary, outcome.summary
    assert "pagedattention.py\", line 676, in _get_split_k" in outcome.evidence["traceback"]


@needs_block_pointers
def test_the_prefill_takes_in_the_expired_keys_of_its_first_tile(tmp_path):
    """flashattention.py:230-232 start a query tile's loop at the block of its first query's window,
    and flatten_kv_cache has copied every key, freed blocks included; V is loaded whole (:132) and
    the keys below a query's window are masked in the scores alone, to -1e30 (:100), which weighs
    them 1 in a row with no live key yet: the freed blocks' NaN enters the sum at :134 and stays
    there (NaN * 0 at the rescale).  With the V of keys below the tile's earliest window start set
    to zero, it passes."""
    case = consecutive_case(seqs=[(7, 40)], q_heads=2, kv_heads=1, window=6)
    outcome = check(kernel("lmdeploy:prefill"), case, DEVICE)
    assert outcome.verdict.value == "NONFINITE" and "out-of-window" in outcome.summary, outcome.summary
    fixed = kernel("lmdeploy:prefill", patched_tree(tmp_path, PREFILL, PREFILL_V, PREFILL_WINDOWED_V))
    assert check(fixed, case, DEVICE).verdict.value == "PASS"


@needs_block_pointers
def test_the_prefill_passes_chunked_and_non_causal_batches():
    for shape in (dict(seqs=[(7, 30), (12, 12), (1, 17)], q_heads=2, kv_heads=1, sinks=True),
                  dict(seqs=[(7, 32), (16, 16)], q_heads=2, kv_heads=2, causal=False, seed=1)):
        outcome = check(kernel("lmdeploy:prefill"), consecutive_case(**shape), DEVICE)
        assert outcome.verdict.value == "PASS", outcome.summary
        assert sorted(outcome.paths) == ["_flash_prefill_fwd_kernel", "_flatten_kv_cache"]


@pytest.mark.skipif(BLOCK_POINTERS, reason="this Triton has block pointers")
def test_the_prefill_on_a_triton_without_block_pointers_is_one_line_and_no_default_of_the_gate(monkeypatch, capsys):
    from nanfuzz.harness.gate.run import choose_kernels

    with pytest.raises(NanfuzzError, match=r"lmdeploy:prefill cannot run on Triton .*tl.make_block_ptr, which "
                                           r"Triton 3.9 removed \(lmdeploy 0.18.0 requires triton>=3.4,<=3.7.1\)"):
        resolve("lmdeploy:prefill", lmdeploy_src=SOURCE[0])
    monkeypatch.setenv("NANFUZZ_LMDEPLOY_SRC", SOURCE[0])
    chosen = choose_kernels([], DEVICE)
    assert "lmdeploy:decode@block" in chosen and "lmdeploy:prefill" not in chosen
    assert "nanfuzz gate: left out lmdeploy:prefill: lmdeploy:prefill cannot run on Triton" in capsys.readouterr().err
    with pytest.raises(NanfuzzError, match="lmdeploy:prefill cannot run on Triton"):
        choose_kernels(["lmdeploy:prefill"], DEVICE)



# -- loading, listing, usage errors -----------------------------------------------------

def test_the_loader_runs_the_release_s_own_files_beside_two_stand_ins():
    loaded = lmdeploy_loader.load("decode", SOURCE[0])
    assert loaded["pagedattention"].__file__.endswith(PAGED) and "lmdeploy 0.18.0" in loaded.source
    assert loaded["utils"].__file__.endswith("kernels/cuda/utils.py")  # lmdeploy's device tables, not ours
    check(kernel("lmdeploy:decode"), consecutive_case(seqs=[(1, 16)], q_heads=1, kv_heads=1), DEVICE)
    assert not [name for name in sys.modules if name == "lmdeploy" or name.startswith("lmdeploy.")]


def test_nanfuzz_list_says_what_each_entry_point_leaves_out(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["list", "--lmdeploy-src", SOURCE[0], "--device", DEVICE]) == 0
    listing = " ".join(capsys.readouterr().out.split())
    assert "lmdeploy:decode@block" in listing and "uniform-query-len" in listing and "window>=2" in listing
    assert "int4/int8 caches with zero points (QuantPolicy.INT4/INT8, per-token scale and zero point): not yet" in listing
    assert "kv auto,fp8_e4m3fn,fp8_e5m2 per-tensor" in listing and "TurboQuant caches" in listing


def test_bogus_sources_and_names_are_one_line(tmp_path):
    with pytest.raises(NanfuzzError, match="not a directory"):
        resolve("lmdeploy:decode", lmdeploy_src=str(tmp_path / "nowhere"))
    with pytest.raises(NanfuzzError, match=r"lmdeploy/pytorch/kernels/cuda/ folder; point it at an lmdeploy source"):
        resolve("lmdeploy:decode", lmdeploy_src=str(tmp_path))
    with pytest.raises(NanfuzzError, match=r"unknown lmdeploy kernel 'lmdeploy:extend'; known: lmdeploy:decode, "):
        resolve("lmdeploy:extend", lmdeploy_src=SOURCE[0])


def _no_window_edge_inside_a_block(case):
    """The decode's window finding on file left out: a window whose first key is not a block's first."""
    block = case.geometry.block_size
    edge = case.sliding_window and any(s.query_len and (s.seq_len - case.sliding_window) % block
                                       for s in case.sequences)
    return "a window edge inside a block (on file)" if edge else None


# Every dead-slot class but the tail: the decode's tail finding on file (V of a block loaded whole) left out
# without declining the ragged sequences that nearly every batch of a GPU campaign holds.
PAST_THE_TAIL = ("out-of-window", "null-block", "padding", "unreferenced")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["lmdeploy:decode", "lmdeploy:decode@block", "lmdeploy:prefill"])
def test_a_gpu_campaign_past_the_findings_passes(name, tmp_path):
    """On the GPU, beyond the findings on file: no NaN in a tail, no window edge inside a block, and for
    the block decode an unquantized cache; the prefill with every dead slot poisoned and no window."""
    from nanfuzz.harness.campaign.runner import fuzz

    if name == "lmdeploy:prefill" and not BLOCK_POINTERS:
        pytest.skip("this Triton removed block pointers")
    caps = kernel(name).capabilities
    if name.endswith("@block"):
        caps = caps.restrict(kv_cache_dtypes=("auto",))
    if name == "lmdeploy:prefill":
        # its window finding on file left out: a query tile starts at the tile of keys where its first
        # query's window starts, so a window whose start is not a tile's first key loads expired keys
        # (a live block's, or a freed block's where the tile spans several pages)
        caps = caps.restrict(sliding_window=False)
    decode = name != "lmdeploy:prefill"
    chosen = dataclasses.replace(kernel(name), supports=_no_window_edge_inside_a_block if decode else None,
                                 capabilities=caps)
    poison = PAST_THE_TAIL if decode else None
    campaign = fuzz(chosen, device="cuda", max_examples=300, seed=1, use_database=False, state_dir=tmp_path,
                    focus=Focus(poison_classes=poison))
    assert not campaign.failed, campaign.failure.summary
