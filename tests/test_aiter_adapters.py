"""AMD AITER's Triton attention kernels behind the ``aiter:*`` names.

The kernels come from the released amd-aiter wheel that tests/conftest.py pins
(AITER_VERSION): fetched once with ``pip download --no-deps`` into
``$NANFUZZ_CACHE/aiter-<version>`` and reused; a failed fetch fails the tests.
Every verdict below was read off AITER's code (see the comments): PASS where a
path masks what it must not read, the bug's verdict where it does not.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from nanfuzz.harness.adapters import aiter as aiter_adapters
from nanfuzz.harness.adapters import aiter_loader, launches
from nanfuzz.harness.campaign.settings import Settings
from nanfuzz.harness.judge.check import check
from nanfuzz.harness.cli import main
from nanfuzz.harness.kernels._common import INTERPRETED
from nanfuzz.harness.launch.subjects import check_once
from nanfuzz.harness.registry import resolve
from nanfuzz.harness.report.repro import load_repro
from nanfuzz.reference.case import Poison
from nanfuzz.reference.errors import NanfuzzError
from nanfuzz.reference.materialize import materialize
from tests.cases import consecutive_case
from tests.launch_spy import LaunchSpy

DEVICE = "cpu" if INTERPRETED else "cuda"
SOURCE: list = []  # the fetched kernel tree, for the helpers below
REGRESSIONS = Path(__file__).parent / "regressions"
KERNELS = "aiter/ops/triton/_triton_kernels/pa_decode.py"
PREFILL_KERNELS = "aiter/ops/triton/_triton_kernels/pa_prefill.py"
# Every pa_decode kernel's block offset: the block number (int32, from the int32 table) times the
# block stride (an int32 argument below 2^31), which Triton multiplies in int32.
BLOCK_OFFSET = "kv_blk_nums * stride_k_b + kv_offs"


@pytest.fixture(autouse=True)
def _aiter(aiter_source):  # tests/conftest.py fetches the kernel tree
    SOURCE[:] = [str(aiter_source)]
    return aiter_source


def kernel(name: str):
    return resolve(name, aiter_src=SOURCE[0])


def verdict(name: str, **shape) -> str:
    return check(kernel(name), consecutive_case(**shape), DEVICE).verdict.value


def run(name: str, case, *, poisoned: bool = True) -> torch.Tensor:
    batch = materialize(case, DEVICE, poisoned=poisoned)
    g = case.geometry
    out = torch.full((case.num_tokens, g.num_q_heads, g.head_size), float("nan"), dtype=batch.q.dtype, device=DEVICE)
    return kernel(name)(batch, out)


# Sequences (query_len, seq_len) on 16-slot blocks, 4 query heads over 2 KV heads, head 64, fp16.
SHAPES = {
    "decode": dict(seqs=[(1, 40), (1, 17), (1, 5)]),             # tails of 8, 15 and 11 dead slots
    "decode-full-blocks": dict(seqs=[(1, 32), (1, 16)]),         # no tail
    "prefill": dict(seqs=[(20, 20), (9, 9)]),
    "prefill-block-64": dict(seqs=[(20, 20), (9, 9)], block_size=64),  # prefill tiles are 64 slots too
    "mixed": dict(seqs=[(7, 50), (1, 33), (12, 12)]),
    "idle-sequence": dict(seqs=[(3, 30), (0, 21), (1, 9)]),
    "gqa5-d80": dict(seqs=[(7, 60), (1, 33)], q_heads=5, kv_heads=1, head_size=80),
    "window": dict(seqs=[(7, 50), (1, 33), (12, 12)], window=10),
    "fp32": dict(seqs=[(7, 50), (1, 33)], dtype="float32"),
    "sinks": dict(seqs=[(7, 50), (1, 33)], sinks=True),
    "decode-gqa5-d80": dict(seqs=[(1, 60), (1, 33)], q_heads=5, kv_heads=1, head_size=80),
}

EXPECTED = {
    # A 2D tile that is exactly one block (decode tiles always; prefill tiles of 64
    # on 64-slot blocks) is loaded without a mask, so the tail past seq_len reaches
    # P @ V; other prefill tiles are masked at the longest prefix.  The first tile
    # of a window holds expired keys, loaded unmasked too.
    "aiter:unified_attention": {
        "decode": "NONFINITE", "decode-full-blocks": "PASS", "prefill": "PASS", "prefill-block-64": "NONFINITE",
        "mixed": "PASS", "idle-sequence": "PASS", "gqa5-d80": "PASS", "window": "NONFINITE", "fp32": "PASS",
        "sinks": "PASS"},
    # v1 and v2 mask K and V loads at seq_len (GQA here: see test_pa_decode_mha below).
    "aiter:pa_decode": {"decode": "PASS", "decode-full-blocks": "PASS", "decode-gqa5-d80": "PASS"},
    "aiter:pa_decode@v2": {"decode": "PASS", "decode-gqa5-d80": "PASS"},
    "aiter:pa_decode@v1-per-token": {"decode": "PASS"},
    "aiter:pa_decode@v2-per-token": {"decode": "PASS"},
    # the context loop masks at the context length, but loads keys below the window
    "aiter:pa_prefill": {"decode": "PASS", "mixed": "PASS", "gqa5-d80": "PASS", "window": "NONFINITE", "fp32": "PASS"},
    # its decode kernel (vLLM's kernel_paged_attention_2d before the fix) loads whole
    # blocks, tail included; every batch with a decode sequence and a partial block shows it.
    # Without a tail it passes: its scores are tl.sum(K * Q) of fp16 products, each rounded to
    # fp16 (the interpreter sums them in float32), a rounding of each score's terms that the error
    # model allows as it allows q scaled in its dtype (docs/error-model.md).
    "aiter:chunked_pa_prefill": {
        "decode": "NONFINITE", "decode-full-blocks": "PASS", "prefill": "PASS", "mixed": "NONFINITE",
        "window": "NONFINITE"},
}
RUNS = [(name, shape) for name, shapes in EXPECTED.items() for shape in shapes]


@pytest.mark.parametrize("name,shape", RUNS, ids=[f"{n}-{s}" for n, s in RUNS])
def test_verdicts_follow_aiter_s_masking(name, shape):
    assert verdict(name, **SHAPES[shape]) == EXPECTED[name][shape]


def test_unified_3d_path_reads_the_tail_and_its_merge_names_an_undefined_variable():
    """The 3D path's tiles are whole blocks without a mask (NaN from the tail), and
    reduce_segments uses ``offs_d`` it never defines once the head size is not a power of two."""
    assert verdict("aiter:unified_attention@3d", seqs=[(1, 40)], q_heads=2, kv_heads=1) == "NONFINITE"
    outcome = check(kernel("aiter:unified_attention@3d"),
                    consecutive_case(seqs=[(1, 17)], q_heads=2, kv_heads=1, head_size=80), DEVICE)
    assert outcome.verdict.value == "CRASH" and "offs_d" in outcome.summary


def test_a_non_power_of_two_block_crashes_unified_decode_and_pa_decode_v1():
    """Both make a tl.arange of the block size (TILE_SIZE = block_size in unified's decode
    tiles; KV_BLK_SZ_POW2 = kv_blk_sz in pa_decode v1's GQA launcher), which must be a power of two."""
    shape = dict(seqs=[(1, 60), (1, 33)], block_size=48)
    for name in ("aiter:unified_attention", "aiter:pa_decode@v1"):
        outcome = check(kernel(name), consecutive_case(**shape), DEVICE)
        assert outcome.verdict.value == "CRASH" and "power of 2" in outcome.summary, (name, outcome.summary)


def test_pa_decode_v2_counts_the_padding_lanes_of_a_non_power_of_two_block():
    """v2 pads a 48-slot block to 64 lanes but masks scores only at seq_len: lanes 48-63
    score 0 against K = 0 and join the softmax, so every output is off."""
    assert verdict("aiter:pa_decode@v2", seqs=[(1, 60), (1, 33)], block_size=48) == "MISMATCH"


def _rejects_slicing_a_scalar() -> bool:
    """Does this Triton refuse ``x[:, None]`` on a 0-d value (triton-lang/triton#10429)?"""
    @triton.jit
    def probe(out):
        x = tl.sum(tl.arange(0, 16), axis=0)
        tl.store(out + tl.arange(0, 1), x[:, None].reshape(1))

    try:
        probe[(1,)](torch.zeros(1, dtype=torch.int32, device=DEVICE))
    except Exception:  # noqa: BLE001 - the compiler's refusal, whatever its type
        return True
    return False


def test_pa_decode_mha_runs_where_triton_accepts_its_scalar_slices():
    """The MHA kernels rescale with ``alpha[:, None]`` on a 0-d alpha; newer Triton refuses that."""
    outcome = check(kernel("aiter:pa_decode"), consecutive_case(seqs=[(1, 50), (1, 33)], q_heads=2, kv_heads=2), DEVICE)
    if _rejects_slicing_a_scalar():
        assert outcome.verdict.value == "CRASH" and "too many indices" in outcome.summary
    else:
        assert outcome.verdict.value == "PASS", outcome.summary


# -- paths and launches ------------------------------------------------------------


def spy(monkeypatch, group: str, module: str, *names: str) -> dict[str, LaunchSpy]:
    loaded = aiter_loader.load(group, SOURCE[0])[module]
    spies = {name: LaunchSpy(getattr(loaded, name)) for name in names}
    for name, one in spies.items():
        monkeypatch.setattr(loaded, name, one)
    return spies


def test_unified_paths(monkeypatch):
    spies = spy(monkeypatch, "unified_attention", "unified_attention",
                "kernel_unified_attention_2d", "kernel_unified_attention_3d", "reduce_segments")
    case = consecutive_case(seqs=[(1, 32), (2, 16)], q_heads=2, kv_heads=1)
    for name, launched in (("aiter:unified_attention", "2d"), ("aiter:unified_attention@2d", "2d"),
                           ("aiter:unified_attention@3d", "3d")):
        run(name, case, poisoned=False)
        assert [n for n, s in spies.items() if s.grids] == (
            ["kernel_unified_attention_2d"] if launched == "2d" else ["kernel_unified_attention_3d", "reduce_segments"])
        for one in spies.values():
            one.grids.clear()
    # the pin holds only during the call
    assert aiter_loader.load("unified_attention", SOURCE[0])["unified_attention"].use_2d_kernel.__name__ == "use_2d_kernel"
    assert not kernel("aiter:unified_attention@3d").capabilities.sliding_window  # AITER never windows in 3D


def test_pa_decode_paths(monkeypatch):
    entries = ("paged_attn_decode_v1", "paged_attn_decode_v2", "paged_attn_decode_v1_per_token_quant",
               "paged_attn_decode_v2_per_token_quant")
    module = aiter_loader.load("pa_decode", SOURCE[0])["pa_decode"]
    calls: list[str] = []
    for entry in entries:
        original = getattr(module, entry)
        monkeypatch.setattr(module, entry, lambda *a, _f=original, _n=entry, **k: (calls.append(_n), _f(*a, **k))[1])
    case = consecutive_case(seqs=[(1, 20), (0, 9), (1, 5)])  # the idle sequence stays out of the launch
    for name, entry in (("aiter:pa_decode", "paged_attn_decode_v1"), ("aiter:pa_decode@v2", "paged_attn_decode_v2"),
                        ("aiter:pa_decode@v1-per-token", "paged_attn_decode_v1_per_token_quant"),
                        ("aiter:pa_decode@v2-per-token", "paged_attn_decode_v2_per_token_quant")):
        assert torch.isfinite(run(name, case)).all()
        assert calls.pop() == entry and not calls


def test_layout_conversion_copies_every_block():
    batch = materialize(consecutive_case(seqs=[(1, 40)], poison=Poison("nan", "v")), DEVICE)  # every dead slot
    value_cache = aiter_adapters.pa_decode_cache(batch.value_cache)
    assert value_cache.shape == (batch.value_cache.shape[0], 2, 16, 64)
    assert torch.equal(value_cache.permute(0, 2, 1, 3).view(torch.int16), batch.value_cache.view(torch.int16))
    assert torch.isnan(value_cache[3, :, 8:]).all()  # the poisoned tail survives the copy


def test_amd_only_launch_options_are_left_out_elsewhere():
    assert {"waves_per_eu", "matrix_instr_nonkdim", "kpack"} <= launches.amd_only_options()
    assert not {"num_warps", "num_stages"} & launches.amd_only_options()

    class Kernel:
        arg_names = ["x", "kpack"]  # a kernel parameter of that name is the kernel's, not an option

        def __getitem__(self, grid):
            return lambda *args, **kwargs: kwargs

    launch = launches.WithoutAmdOptions(Kernel())[(1,)]
    assert launch(x=1, kpack=2, waves_per_eu=2, num_warps=4) == {"x": 1, "kpack": 2, "num_warps": 4}


@pytest.mark.gpu
def test_aiter_kernels_run_on_this_gpu():
    """On NVIDIA the launches leave waves_per_eu out (Triton's NVIDIA backend refuses it); on ROCm they keep it."""
    for name in ("aiter:unified_attention", "aiter:pa_decode", "aiter:pa_prefill", "aiter:chunked_pa_prefill"):
        wrapped = launches.portable_launches(aiter_loader.launchers(aiter_loader.load(name[6:], SOURCE[0])))
        assert bool(wrapped) != launches.compiles_for_amd(), name
        case = consecutive_case(seqs=[(1, 32), (1, 16)])  # full blocks: no tail for the kernels that load it
        assert check(kernel(name), case, DEVICE).verdict.value == "PASS", name


def in_a_worker(resolved, case):
    """``resolved``'s outcome on ``case`` from a worker process: an illegal address ends its context, not this one's."""
    return check_once(resolved, Settings(device="cuda"), case)


def crashes_released_and_passes_patched(tmp_path, repro: str, kernels_file: str, patch):
    """The repro ``repro`` CRASHes on the released kernel and passes once ``patch`` rewrites the text
    of ``kernels_file`` in a copy of the tree; the patched kernel's outcome."""
    record = load_repro(REGRESSIONS / repro)
    released = in_a_worker(kernel(record["kernel"]), record["case"])
    assert released.verdict.value == "CRASH", released.summary
    shutil.copytree(SOURCE[0], tmp_path / "tree")
    path = tmp_path / "tree" / kernels_file
    path.write_text(patch(path.read_text()))
    fixed = in_a_worker(resolve(record["kernel"], aiter_src=str(tmp_path / "tree")), record["case"])
    assert fixed.verdict.value == "PASS", fixed.summary
    return fixed


@pytest.mark.gpu
def test_pa_decode_s_block_offset_in_int64_passes_the_crash_on_file(tmp_path):
    """The CRASH on file: physical block 419431 of a 160-wide head on 32-slot blocks starts at element
    419431 * 5120 = 2,147,486,720, past 2^31.  AITER sends the case to v1 (one partition) and its GQA
    kernel (3 query heads a KV head), whose ``kv_blk_nums * stride_k_b`` (_triton_kernels/pa_decode.py:222)
    is an int32 product: it wraps to -2,147,480,576, 4 GiB below the cache.  With the block number in
    int64 in every kernel, the same case passes."""
    def in_int64(text: str) -> str:
        assert text.count(BLOCK_OFFSET) == 8  # v1 and v2, with and without tl.dot, and their per-token copies
        return text.replace(BLOCK_OFFSET, "kv_blk_nums.to(tl.int64) * stride_k_b + kv_offs")

    fixed = crashes_released_and_passes_patched(tmp_path, "aiter_pa_decode-v1-block-offset-past-2-31-crash.json",
                                                KERNELS, in_int64)
    assert sorted(fixed.paths) == ["_paged_attn_decode_v1_w_dot_kernel"]


@pytest.mark.gpu
def test_pa_prefill_s_context_block_offset_in_int64_passes_the_crash_on_file(tmp_path):
    """The CRASH on file: one chunked prefill whose only context key sits in block 174799 of a 192-wide
    head on 64-slot blocks, element 174799 * 12288 = 2,147,930,112, past 2^31.  The context loop's
    ``bn * stride_k_cache_bs`` (_triton_kernels/pa_prefill.py:127, V :135) multiplies the int32 block number
    by an int32 stride.  With the block number in int64 the same case passes."""
    def in_int64(text: str) -> str:
        for wrapped, widened in (("bn[None, :] * stride_k_cache_bs", "bn[None, :].to(tl.int64) * stride_k_cache_bs"),
                                 ("bn[:, None] * stride_v_cache_bs", "bn[:, None].to(tl.int64) * stride_v_cache_bs")):
            assert text.count(wrapped) == 2  # the plain kernel and the ALiBi one
            text = text.replace(wrapped, widened)
        return text

    crashes_released_and_passes_patched(tmp_path, "aiter_pa_prefill-block-offset-past-2-31-crash.json",
                                        PREFILL_KERNELS, in_int64)


# -- the command line --------------------------------------------------------------

def test_a_campaign_finds_shrinks_and_replays_with_the_aiter_source(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    source = ["--aiter-src", SOURCE[0], "--device", DEVICE]
    assert main(["list", *source]) == 0
    listing = capsys.readouterr().out
    assert "aiter:pa_decode@v2-per-token" in listing and "decode causal fp32-products tf32 heads" in listing
    # float32: in fp16 its decode scores' precision (see EXPECTED) may be what is found first
    assert main(["fuzz", "--kernel", "aiter:chunked_pa_prefill", "--max-examples", "40", "--seed", "1",
                 "--dtype", "float32", *source]) == 1
    out = capsys.readouterr().out
    assert "NONFINITE" in out and f"--aiter-src {SOURCE[0]}" in out  # the replay line names the tree
    (repro,) = (tmp_path / ".nanfuzz" / "repros").glob("*.json")
    case = json.loads(repro.read_text())["case"]
    assert len(case["sequences"]) == 1 and case["sequences"][0]["query_len"] == 1  # shrunk to one decode query
    assert main(["replay", str(repro), *source]) == 1
    monkeypatch.setenv("NANFUZZ_AITER_SRC", SOURCE[0])  # the environment variable does what --aiter-src does
    assert main(["replay", str(repro), "--device", DEVICE]) == 1


def test_the_gate_fuzzes_an_aiter_kernel_and_its_replay_names_the_tree(tmp_path):
    from tests.test_ci_gate import run_gate

    proc = run_gate(tmp_path, "--workers", "1", "--time-budget", "30", "--max-examples", "40", "--device", DEVICE,
                    "--kernel", "aiter:chunked_pa_prefill", "--aiter-src", SOURCE[0])
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "aiter:chunked_pa_prefill" in summary and "NONFINITE" in summary
    assert f"--aiter-src {SOURCE[0]}" in summary  # the replay command loads the same tree


# -- loading ------------------------------------------------------------------------

def _no_aiter_modules() -> bool:
    return not [name for name in sys.modules if name == "aiter" or name.startswith("aiter.")]


def test_stand_ins_do_not_stay_in_sys_modules():
    run("aiter:pa_prefill", consecutive_case(seqs=[(2, 20)]), poisoned=False)
    assert _no_aiter_modules()


def one_line_error(group: str, source) -> str:
    with pytest.raises(NanfuzzError) as info:
        aiter_loader.load(group, source)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_bogus_source_is_one_clear_line(tmp_path):
    message = one_line_error("pa_decode", tmp_path / "nowhere")
    assert str(tmp_path / "nowhere") in message and "not a directory" in message and "--aiter-src" in message
    with pytest.raises(NanfuzzError, match="not a directory"):
        resolve("aiter:pa_prefill", aiter_src=str(tmp_path / "nowhere"))  # at resolution, before any case runs
    message = one_line_error("unified_attention", tmp_path)
    assert "aiter/ops/triton" in message and "an AITER source checkout or an unpacked amd-aiter wheel" in message


def test_missing_module_and_function_are_named(tmp_path, aiter_source):
    tree = tmp_path / "aiter"
    shutil.copytree(aiter_source / "aiter", tree)
    ops = tree / "ops" / "triton"
    (ops / "_triton_kernels" / "chunked_pa_prefill.py").unlink()
    message = one_line_error("chunked_pa_prefill", tmp_path)
    assert "lacks aiter/ops/triton/_triton_kernels/chunked_pa_prefill.py" in message and str(tree) in message
    decode = ops / "pa_decode.py"
    decode.write_text(decode.read_text().replace("def paged_attn_decode_v2(", "def renamed("))
    message = one_line_error("pa_decode", tmp_path)
    assert "has no paged_attn_decode_v2()" in message and str(decode) in message


def test_later_trees_keep_the_modules_in_attention_subfolders(tmp_path, aiter_source):
    """Later AITER moved the attention modules to ops/triton/attention/ and _triton_kernels/attention/."""
    ops = tmp_path / "aiter" / "ops" / "triton"
    for folder in (ops / "attention", ops / "_triton_kernels" / "attention"):
        folder.mkdir(parents=True)
    moved = ("pa_prefill", "chunked_pa_prefill")
    for name in moved:
        for old, new in ((aiter_source / "aiter/ops/triton" / f"{name}.py", ops / "attention" / f"{name}.py"),
                         (aiter_source / "aiter/ops/triton/_triton_kernels" / f"{name}.py",
                          ops / "_triton_kernels" / "attention" / f"{name}.py")):
            text = old.read_text()
            for module in moved:
                text = text.replace(f"aiter.ops.triton._triton_kernels.{module} ",
                                    f"aiter.ops.triton._triton_kernels.attention.{module} ")
                text = text.replace(f"aiter.ops.triton.{module} ", f"aiter.ops.triton.attention.{module} ")
            new.write_text(text)
    loaded = aiter_loader.load("chunked_pa_prefill", tmp_path)
    assert loaded["chunked_pa_prefill"].__name__ == "aiter.ops.triton.attention.chunked_pa_prefill"
    case = consecutive_case(seqs=[(5, 20), (1, 32)], dtype="float32")  # fp16: MISMATCH, see EXPECTED
    assert check(resolve("aiter:chunked_pa_prefill", aiter_src=str(tmp_path)), case, DEVICE).verdict.value == "PASS"


def test_installed_package_without_runtime_is_found(monkeypatch, aiter_source):
    monkeypatch.syspath_prepend(str(aiter_source))
    aiter_loader.loader._cache.clear()
    try:
        loaded = aiter_loader.load("pa_prefill")
        assert not loaded.native and "runtime not importable" in loaded.source
        assert _no_aiter_modules()
    finally:
        aiter_loader.loader._cache.clear()


def test_unknown_aiter_kernel_names_the_known_ones():
    with pytest.raises(NanfuzzError, match=r"aiter:unified_attention, aiter:pa_decode.*aiter:pa_decode@v2-per-token"):
        resolve("aiter:unified_attention@4d")
    with pytest.raises(NanfuzzError, match="aiter:chunked_pa_prefill"):
        resolve("aiter:flash_attn")
