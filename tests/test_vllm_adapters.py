"""vLLM's real attention kernels behind ``vllm:rocm_attn`` and ``vllm:triton_attn``.

The kernels come from the released vllm==0.33.0 wheel: fetched once with
``pip download --no-deps`` into ``$NANFUZZ_CACHE/vllm-0.33.0`` (default
``~/.cache/nanfuzz/vllm-0.33.0``) and reused.  The tests skip only when no
package index can be reached; any other fetch failure fails them.
"""
from __future__ import annotations

import shutil
import sys

import pytest
import torch

from nanfuzz.harness.adapters import vllm as vllm_adapters
from nanfuzz.harness.adapters import vllm_loader
from nanfuzz.harness.kernels._common import INTERPRETED
from nanfuzz.harness.judge.check import Verdict, check
from nanfuzz.harness.registry import resolve
from nanfuzz.reference.case import Case, KVCache, Poison, PoisonSite
from nanfuzz.reference.errors import NanfuzzError
from nanfuzz.reference.materialize import materialize
from nanfuzz.reference.oracle import oracle
from tests.cases import consecutive_case
from tests.launch_spy import LaunchSpy

VLLM_VERSION = "0.33.0"
DEVICE = "cpu" if INTERPRETED else "cuda"

# Largest |kernel - float64 oracle| on live data (|q| < 3, |k|, |v| < 1):
# fp16 output and the fp16 cast of P before P @ V each round at 2**-11
# relative, a few units of that over a row; fp32 is exact-ish under the
# interpreter (true fp32 dots) but uses TF32 (10-bit mantissa) on a GPU.
TOLERANCE = {"float16": 2e-3, "float32": 1e-5 if INTERPRETED else 2e-3}

# The interpreter evaluates exp(-inf - -inf) on masked lanes before the
# kernels discard them; numpy's warning about it is noise.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


SOURCE: list = []  # the fetched kernel tree, for the helpers below


@pytest.fixture(autouse=True)
def _vllm(vllm_source):  # tests/conftest.py fetches the kernel tree
    SOURCE[:] = [str(vllm_source)]
    return vllm_source


def make_case(seqs, **options) -> Case:
    """Sequences ``(query_len, seq_len)`` on consecutive blocks from 1; padding points at block 0."""
    return consecutive_case(seqs, **options)


def run(name: str, case: Case, *, poisoned: bool = False) -> torch.Tensor:
    batch = materialize(case, DEVICE, poisoned=poisoned)
    g = case.geometry
    out = torch.full((case.num_tokens, g.num_q_heads, g.head_size), float("nan"), dtype=batch.q.dtype, device=DEVICE)
    return resolve(name, vllm_src=SOURCE[0])(batch, out)


def max_error(name: str, case: Case) -> float:
    out = run(name, case)
    return (out.double() - oracle(materialize(case, DEVICE, poisoned=False))).abs().max().item()


@pytest.fixture
def unified_spy(monkeypatch):
    """Records launches of unified_attention's main kernel and of its 3D merge."""
    module = vllm_loader.load("triton_attn", SOURCE[0])["triton_unified_attention"]
    spies = {name: LaunchSpy(getattr(module, name)) for name in ("kernel_unified_attention", "reduce_segments")}
    for name, spy in spies.items():
        monkeypatch.setattr(module, name, spy)
    return spies


CASES = {
    "decode": dict(seqs=[(1, 40), (1, 17), (1, 5)]),
    "prefill": dict(seqs=[(20, 20), (9, 9)]),
    "mixed": dict(seqs=[(7, 50), (1, 33), (12, 12)]),
    "idle-sequence": dict(seqs=[(3, 30), (0, 21), (1, 9)]),
    "gqa-d80-b48": dict(seqs=[(7, 60), (1, 33)], q_heads=8, kv_heads=2, head_size=80, block_size=48),
    "window": dict(seqs=[(7, 50), (1, 33), (12, 12)], window=10),
    "non-causal": dict(seqs=[(7, 50), (1, 33), (12, 12)], causal=False),
    "sinks-window": dict(seqs=[(7, 50), (1, 33)], sinks=True, window=5),
    "fp32": dict(seqs=[(7, 50), (1, 33)], dtype="float32"),
}


@pytest.mark.parametrize("shape", CASES)
def test_rocm_attn_matches_oracle(shape):
    case = make_case(**CASES[shape])
    assert max_error("vllm:rocm_attn", case) <= TOLERANCE[case.geometry.dtype]


def takes_3d(shape: str) -> bool:
    """vLLM's rule once split-K scratch is offered: causal, queries at most 8 long."""
    return CASES[shape].get("causal", True) and max(q for q, _ in CASES[shape]["seqs"]) <= 8


# Split-K (3D) scratch is offered for odd data seeds: seed 0 runs 2D, seed 1 3D.
TRITON_RUNS = [(shape, 0) for shape in CASES] + [(shape, 1) for shape in CASES if takes_3d(shape)]


@pytest.mark.parametrize("shape,seed", TRITON_RUNS)
def test_triton_attn_matches_oracle(shape, seed, unified_spy):
    case = make_case(**CASES[shape], seed=seed)
    assert max_error("vllm:triton_attn", case) <= TOLERANCE[case.geometry.dtype]
    (grid,) = unified_spy["kernel_unified_attention"].grids
    assert len(grid) == (3 if seed == 1 else 2)
    assert len(unified_spy["reduce_segments"].grids) == seed


def test_triton_attn_pinned_paths(unified_spy):
    case = make_case(seqs=[(1, 40), (2, 70)], seed=0)
    for name, segments in (("vllm:triton_attn@3d", vllm_adapters.SOFTMAX_SEGMENTS), ("vllm:triton_attn@2d", None)):
        assert max_error(name, case) <= TOLERANCE["float16"]
        grid = unified_spy["kernel_unified_attention"].grids.pop()
        assert (grid[2] if len(grid) == 3 else None) == segments


# -- the bug class ------------------------------------------------------------------

def windowed_case(query_len: int, window: int, **kw) -> Case:
    """One sequence of 40 keys in blocks 1-3; with a window of 8, block 1 (keys 0-15) is freed."""
    freed = PoisonSite(block=1) if window else None
    return make_case(seqs=[(query_len, 40)], window=window,
                     poison=Poison("nan", "v", None if freed is None else (freed,)), **kw)


@pytest.mark.parametrize("query_len", [1, 8], ids=["decode", "prefill"])
def test_rocm_attn_reads_nan_v_below_the_window(query_len):
    """vLLM 0.33.0's ROCM_ATTN kernels mask out-of-window scores but load the V rows."""
    out = run("vllm:rocm_attn", windowed_case(query_len, window=8), poisoned=True)
    assert torch.isnan(out).any()
    clean = run("vllm:rocm_attn", windowed_case(query_len, window=0), poisoned=True)
    assert torch.isfinite(clean).all()  # tail and padding NaN stay out: the last tile is masked


@pytest.mark.parametrize("path", vllm_adapters.UNIFIED_PATHS)
def test_triton_attn_zeroes_v_below_the_window(path):
    out = run(f"vllm:triton_attn@{path}", windowed_case(1, window=8), poisoned=True)
    assert torch.isfinite(out).all()


def row_errors(name: str, case: Case) -> torch.Tensor:
    out = run(name, case)
    return (out.double() - oracle(materialize(case, DEVICE, poisoned=False))).abs().amax(dim=(1, 2))


# Non-causal with a window: the specification's window is symmetric, |p - k| < W,
# as unified_attention's score mask is; a 12-token chunk with W = 4.
NON_CAUSAL_WINDOW = dict(seqs=[(12, 12)], window=4, causal=False, q_heads=2, kv_heads=2)


def test_triton_attn_non_causal_window_drops_later_keys():
    """unified_attention zeroes V beyond the window of a query block's *first*
    query, so every later query of the block (here one block of 16) loses
    in-window keys ahead of it."""
    error = row_errors("vllm:triton_attn", make_case(**NON_CAUSAL_WINDOW))
    assert error[0] <= TOLERANCE["float16"]
    assert (error[1:] > 0.05).all()


def test_rocm_attn_non_causal_window_keeps_far_later_keys():
    """context_attention_fwd windows only keys before the query (p - k < W), so
    non-causal queries also read chunk keys W or more positions ahead."""
    error = row_errors("vllm:rocm_attn", make_case(**NON_CAUSAL_WINDOW))
    assert (error[:8] > 0.05).all()  # queries 0-7 have keys >= p + 4 in the chunk
    assert (error[8:] <= TOLERANCE["float16"]).all()


def test_layout_conversion_copies_every_block():
    batch = materialize(windowed_case(1, window=8), DEVICE)  # NaN V in freed block 1
    blocks, block_size, heads, head_size = batch.key_cache.shape
    x = 16 // batch.key_cache.element_size()
    key_cache = vllm_adapters.rocm_key_cache(batch.key_cache)
    value_cache = vllm_adapters.rocm_value_cache(batch.value_cache)
    assert key_cache.shape == (blocks, heads, head_size // x, block_size, x)
    assert value_cache.shape == (blocks, heads, head_size, block_size)
    back_k = key_cache.permute(0, 3, 1, 2, 4).reshape(batch.key_cache.shape)
    back_v = value_cache.permute(0, 3, 1, 2)
    # bit for bit, poison included
    assert torch.equal(back_k.view(torch.int16), batch.key_cache.view(torch.int16))
    assert torch.equal(back_v.view(torch.int16), batch.value_cache.view(torch.int16))
    assert torch.isnan(value_cache[1]).all()


# -- loading ------------------------------------------------------------------------

def test_stand_ins_do_not_stay_in_sys_modules():
    run("vllm:rocm_attn", make_case(seqs=[(2, 20)]))
    assert not [name for name in sys.modules if name == "vllm" or name.startswith("vllm.")]


def one_line_error(group: str, source) -> str:
    with pytest.raises(NanfuzzError) as info:
        vllm_loader.load(group, source)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_bogus_source_is_one_clear_line(tmp_path, monkeypatch):
    message = one_line_error("rocm_attn", tmp_path / "nowhere")
    assert str(tmp_path / "nowhere") in message and "not a directory" in message and "--vllm-src" in message
    with pytest.raises(NanfuzzError, match="not a directory"):
        resolve("vllm:triton_attn", vllm_src=str(tmp_path / "nowhere"))  # at resolution, before any case runs
    message = one_line_error("triton_attn", tmp_path)
    assert "vllm/v1/attention/ops" in message and "unpacked vllm wheel" in message


def test_missing_module_and_function_are_named(tmp_path, monkeypatch, vllm_source):
    tree = tmp_path / "vllm"
    shutil.copytree(vllm_source / "vllm", tree)
    ops = tree / "v1" / "attention" / "ops"
    (ops / "triton_unified_attention.py").unlink()
    message = one_line_error("triton_attn", tmp_path)
    assert "lacks vllm/v1/attention/ops/triton_unified_attention.py" in message and str(tree) in message
    chunked = ops / "chunked_prefill_paged_decode.py"
    chunked.write_text(chunked.read_text().replace("def chunked_prefill_paged_decode(", "def renamed_entry("))
    message = one_line_error("rocm_attn", tmp_path)
    assert "has no chunked_prefill_paged_decode()" in message and str(chunked) in message


def test_installed_package_without_runtime_is_found(monkeypatch, vllm_source):
    monkeypatch.syspath_prepend(str(vllm_source))
    vllm_loader._cache.clear()
    loaded = vllm_loader.load("rocm_attn")
    assert not loaded.native and "runtime not importable" in loaded.source
    assert not [name for name in sys.modules if name == "vllm" or name.startswith("vllm.")]
    vllm_loader._cache.clear()


def test_unknown_vllm_kernel_names_the_known_ones():
    with pytest.raises(NanfuzzError, match="vllm:rocm_attn, vllm:triton_attn"):
        resolve("vllm:flash_attn")


# -- quantized caches ----------------------------------------------------------------

def quantized(kv: KVCache, **case) -> Case:
    return make_case(**case).replace(kv_cache=kv, poison=Poison("max" if kv.dtype == "int8" else "nan")).validate()


def test_each_backend_takes_the_caches_its_backend_passes():
    rocm = resolve("vllm:rocm_attn", vllm_src=SOURCE[0]).capabilities
    triton = resolve("vllm:triton_attn", vllm_src=SOURCE[0]).capabilities
    fp8 = vllm_adapters.platform_fp8(vllm_loader.load("rocm_attn", SOURCE[0]), "chunked_prefill_paged_decode")
    assert fp8 == ("fp8_e4m3fnuz" if torch.version.hip and "gfx94" in _arch() else "fp8_e4m3fn")
    assert rocm.kv_cache_dtypes == ("auto", fp8, "fp8_e5m2") and rocm.token_head_dtypes == ()
    assert triton.kv_cache_dtypes == ("auto", fp8) and triton.token_head_dtypes == (fp8, "int8")


def _arch() -> str:
    return getattr(torch.cuda.get_device_properties(0), "gcnArchName", "") if torch.cuda.is_available() else ""


def _platform_fp8() -> str:
    return resolve("vllm:triton_attn", vllm_src=SOURCE[0]).capabilities.kv_cache_dtypes[1]


QUANTIZED_SHAPES = {"mixed": dict(seqs=[(7, 50), (1, 33), (3, 12)]), "decode": dict(seqs=[(1, 40), (2, 70)])}


@pytest.mark.parametrize("shape", QUANTIZED_SHAPES)
@pytest.mark.parametrize("dtype", ["platform", "fp8_e5m2"])
def test_rocm_attn_with_fp8_caches_matches_oracle(dtype, shape):
    kv = KVCache(_platform_fp8() if dtype == "platform" else dtype, "tensor", 0.25, 0.0078125)
    case = quantized(kv, **QUANTIZED_SHAPES[shape])
    assert max_error("vllm:rocm_attn", case) <= TOLERANCE["float16"]
    assert check(resolve("vllm:rocm_attn", vllm_src=SOURCE[0]), case, DEVICE).verdict is Verdict.PASS


@pytest.mark.parametrize("path", vllm_adapters.UNIFIED_PATHS)
@pytest.mark.parametrize("mode", ["per-tensor", "fp8/token-head", "int8/token-head"])
def test_triton_attn_with_quantized_caches_matches_oracle(mode, path, unified_spy):
    kv = {"per-tensor": KVCache(_platform_fp8(), "tensor", 0.25, 2.0),
          "fp8/token-head": KVCache(_platform_fp8(), "token-head"),
          "int8/token-head": KVCache("int8", "token-head")}[mode]
    case = quantized(kv, **QUANTIZED_SHAPES["decode"])
    name = f"vllm:triton_attn@{path}"
    assert max_error(name, case) <= TOLERANCE["float16"]
    assert check(resolve(name, vllm_src=SOURCE[0]), case, DEVICE).verdict is Verdict.PASS
    assert len(unified_spy["kernel_unified_attention"].grids[-1]) == (3 if path == "3d" else 2)


def test_rocm_attn_reads_nan_fp8_codes_below_the_window():
    case = windowed_case(1, window=8).replace(kv_cache=KVCache(_platform_fp8())).validate()
    assert torch.isnan(run("vllm:rocm_attn", case, poisoned=True)).any()


@pytest.mark.parametrize("dtype", ["platform", "int8"])
def test_triton_attn_per_token_head_reads_a_nan_v_scale_below_the_window(dtype):
    """Decode at position 1 with a one-key window: key 0 is out of the window but in the tile.
    V there is zeroed, yet P (0) times its NaN scale is NaN and reaches P @ V."""
    kv = KVCache(_platform_fp8() if dtype == "platform" else dtype, "token-head")
    case = make_case(seqs=[(1, 2)], q_heads=1, kv_heads=1, head_size=32, window=1).replace(
        kv_cache=kv, poison=Poison("nan", "v", (PoisonSite(1, 0),), "scales")).validate()
    assert check(resolve("vllm:triton_attn", vllm_src=SOURCE[0]), case, DEVICE).verdict is Verdict.NONFINITE
    finite_scales = case.replace(poison=Poison("garbage", "v", (PoisonSite(1, 0),), "scales"))
    assert check(resolve("vllm:triton_attn", vllm_src=SOURCE[0]), finite_scales, DEVICE).verdict is Verdict.PASS


def test_the_packed_per_token_head_cache_holds_every_code_and_scale():
    kv = KVCache(_platform_fp8(), "token-head")
    batch = materialize(quantized(kv, **QUANTIZED_SHAPES["mixed"]).replace(
        poison=Poison("nan", "kv", None, "data+scales")), DEVICE)
    packed = vllm_adapters.packed_token_head_caches(batch)
    g = batch.case.geometry
    key_cache, value_cache, k_scales, v_scales = vllm_adapters.token_head_views(packed, g.head_size,
                                                                                 batch.key_cache.dtype)
    assert key_cache.shape[-1] == g.head_size + vllm_adapters.SCALE_ELEMENTS
    for view, original in ((key_cache, batch.key_cache), (value_cache, batch.value_cache)):
        assert torch.equal(view[..., :g.head_size].contiguous().view(torch.uint8), original.view(torch.uint8))
    for view, original in ((k_scales, batch.k_scale_cache), (v_scales, batch.v_scale_cache)):
        assert torch.equal(view.contiguous().view(torch.int32), original.contiguous().view(torch.int32))
