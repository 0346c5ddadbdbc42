"""The prefix_prefill family: the fixed variant matches the oracle, the old one is caught."""
from __future__ import annotations

import inspect

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings

from nanfuzz.harness.kernels import prefix_prefill as pp
from nanfuzz.harness.kernels._common import INTERPRETED, dot_rows
from nanfuzz.reference.case import Case, Poison, PoisonSite
from nanfuzz.reference.materialize import materialize
from nanfuzz.reference.oracle import oracle
from nanfuzz.strategies import GPU_SIZE, paged_cases
from tests.cases import consecutive_case

UNMASKED, MASKED = pp.KERNELS

# Largest |kernel - oracle| on outputs in [-1, 1] (V is uniform there).
ATOL = {
    # fp32 scores (|score| <= 3 * 128 / sqrt(128) ~ 34) and sums of up to a few
    # hundred terms: ~100 unit roundoffs (2**-24) of fp32 plus headroom.
    "float32": 2e-5,
    # P is rounded to the dtype before P @ V (relative 2**-11 per weight, so at
    # most 2**-11 on a convex mix of |v| <= 1), then the output is rounded
    # (at most 2**-12 below 1): 2**-11 + 2**-12 < 2**-10.
    "float16": 2.0**-10,
    # the same two roundings with bf16's 8-bit mantissa: 2**-8 + 2**-9 < 2**-7.
    "bfloat16": 2.0**-7,
}


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"


def make_case(seqs, *, dtype="float32", **options) -> Case:
    """Sequences ``(query_len, seq_len)`` on fresh blocks 1, 2, ...; padding points at block 0."""
    return consecutive_case(seqs, dtype=dtype, **options)


def run(kernel, case: Case, device: str, *, poisoned: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's output and the oracle's, for one materialisation of ``case``."""
    reason = kernel.capabilities.unsupported(case, interpreter=INTERPRETED)
    if reason:
        pytest.skip(f"{kernel.name} does not take {reason}")
    batch = materialize(case, device, poisoned=poisoned)
    out = torch.full_like(batch.q, float("nan"))
    return kernel(batch, out), oracle(batch)


def assert_matches(out: torch.Tensor, expected: torch.Tensor, dtype: str) -> None:
    assert out.isfinite().all(), "non-finite output where the oracle is finite"
    error = (out.double() - expected).abs().max().item() if out.numel() else 0.0
    assert error <= ATOL[dtype], f"max error {error:.3g} > {ATOL[dtype]:.3g}"


# decode, prefill from zero, chunked prefill over several context tiles, a
# padding sequence (query_len 0), and a chunk whose context (12 keys) ends
# mid-tile and whose later query tiles read no context key under a short window
MIXED = [(1, 37), (23, 23), (19, 90), (0, 30), (30, 42)]
MODES = {
    "causal": dict(causal=True),
    "causal-window": dict(causal=True, window=21),
    "non-causal": dict(causal=False),
    "non-causal-window": dict(causal=False, window=13),
}
GEOMETRIES = {
    "hq5-hkv1-head80-block48": dict(q_heads=5, kv_heads=1, head_size=80, block_size=48),
    "hq6-hkv2-head96-block16": dict(q_heads=6, kv_heads=2, head_size=96, block_size=16),
}


# every mode once with each geometry would double the interpreter time for
# little: each geometry meets a windowed and an unwindowed, a causal and a
# non-causal mode
MODE_GEOMETRY = [("causal", "hq5-hkv1-head80-block48"), ("causal-window", "hq6-hkv2-head96-block16"),
                 ("non-causal", "hq6-hkv2-head96-block16"), ("non-causal-window", "hq5-hkv1-head80-block48")]


@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16"])
@pytest.mark.parametrize("mode, geometry", MODE_GEOMETRY)
def test_masked_matches_oracle(device, dtype, mode, geometry):
    case = make_case(MIXED, dtype=dtype, poison=Poison("nan", "kv"), **MODES[mode], **GEOMETRIES[geometry])
    out, expected = run(MASKED, case, device, poisoned=False)
    assert_matches(out, expected, dtype)
    if dtype == "float32":  # once per mode: every dead slot NaN in K and V, the same answer
        out, expected = run(MASKED, case, device, poisoned=True)
        assert_matches(out, expected, dtype)


@pytest.mark.parametrize("block_size, head_size", [(8, 32), (16, 64), (32, 128), (64, 80), (48, 96)])
def test_block_and_head_sizes(device, block_size, head_size):
    case = make_case([(1, 37), (19, 90), (0, 30)], block_size=block_size, head_size=head_size, window=30)
    for kernel in (MASKED, UNMASKED):
        out, expected = run(kernel, case, device, poisoned=False)
        assert_matches(out, expected, "float32")


@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16"])
def test_sinks(device, dtype):
    case = make_case(MIXED, dtype=dtype, q_heads=8, kv_heads=2, sinks=True, causal=False, window=13)
    out, expected = run(MASKED, case, device, poisoned=True)
    assert_matches(out, expected, dtype)


@pytest.mark.parametrize("mode", ["causal-window", "non-causal"])
def test_unmasked_matches_oracle_on_clean_caches(device, mode):
    case = make_case(MIXED, dtype="float16", q_heads=5, kv_heads=1, head_size=80, block_size=48, **MODES[mode])
    out, expected = run(UNMASKED, case, device, poisoned=False)
    assert_matches(out, expected, "float16")


def test_writes_only_its_rows_and_no_input(device):
    case = make_case(MIXED, window=21, poison=Poison("nan", "kv"))
    batch = materialize(case, device)
    before = {name: t.clone() for name, t in batch.inputs().items()}
    canary = torch.full((case.num_tokens + 3,) + tuple(batch.q.shape[1:]), float("nan"),
                        dtype=batch.q.dtype, device=device)
    MASKED(batch, canary[:case.num_tokens])
    assert canary[:case.num_tokens].isfinite().all()
    assert canary[case.num_tokens:].isnan().all(), "wrote past the last token"
    for name, t in batch.inputs().items():
        assert torch.equal(t.nan_to_num(), before[name].nan_to_num()), f"wrote into {name}"

    padding_only = make_case([(0, 20), (0, 5)])
    batch = materialize(padding_only, device)
    assert MASKED(batch, torch.empty_like(batch.q)).shape[0] == 0


# -- the bug class: one dead slot holds NaN, the old variant reads it ------------

def _nan_at(*sites: PoisonSite, tensors: str = "v") -> Poison:
    return Poison("nan", tensors, sites)


def freed_block_below_window() -> Case:
    # keys 0..47 lie below every query's window (lowest allowed key 57);
    # block 2 (keys 16..31) was freed and reused, and holds NaN in K and V
    return make_case([(2, 82)], window=24, poison=_nan_at(PoisonSite(2), tensors="kv"))


def expired_part_of_live_block() -> Case:
    # lowest allowed key 41 sits mid-block: key 40 (block 3, slot 8) expired
    return make_case([(4, 64)], window=20, poison=_nan_at(PoisonSite(3, 8)))


def tail_inside_last_context_tile() -> Case:
    # decode at seq_len 20: the context tile covers keys 0..31 (0..127 under
    # the interpreter), keys 20..31 are the never-written tail of block 2
    assert pp.BLOCK_N == 32 and pp.BLOCK_N_INTERPRETED > 32, "the case is laid out for tiles of 32 keys or more"
    return make_case([(1, 20)], poison=_nan_at(PoisonSite(2, 4)))


def padding_entry_inside_last_context_tile() -> Case:
    # blocks of 8: the tile over keys 0..31 reaches table entry 2, padding
    # that points at the null block 0, which a warm-up run filled with NaN
    return make_case([(1, 10)], block_size=8, spare_entries=2, poison=_nan_at(PoisonSite(0)))


BUG_CASES = [freed_block_below_window, expired_part_of_live_block,
             tail_inside_last_context_tile, padding_entry_inside_last_context_tile]


@pytest.mark.parametrize("make", BUG_CASES, ids=lambda f: f.__name__)
def test_unmasked_reads_the_poisoned_slot(device, make):
    out, expected = run(UNMASKED, make(), device, poisoned=True)
    assert expected.isfinite().all()
    assert out.isnan().any(), "the old variant should have let NaN reach p @ V"


@pytest.mark.parametrize("make", BUG_CASES, ids=lambda f: f.__name__)
def test_masked_never_reads_the_poisoned_slot(device, make):
    out, expected = run(MASKED, make(), device, poisoned=True)
    assert_matches(out, expected, "float32")


# -- compiles: a campaign reuses a handful of specialisations --------------------

def _parameters() -> dict[str, inspect.Parameter]:
    kernel = pp._prefix_prefill_fwd
    return dict(inspect.signature(getattr(kernel, "fn", kernel)).parameters)


def _do_not_specialize() -> list:
    kernel = pp._prefix_prefill_fwd
    if hasattr(kernel, "do_not_specialize"):  # compiled
        return list(kernel.do_not_specialize)
    return list(kernel.kwargs.get("do_not_specialize", []))  # interpreted


def test_no_integer_argument_is_specialised():
    # pointers are Capitalised, constexprs annotated; every other argument but
    # the float scale is an integer whose ==1 / %16 Triton would key a compile on
    params = _parameters()
    integers = {name for name, p in params.items()
                if not name[0].isupper() and "constexpr" not in str(p.annotation) and name != "scale"}
    assert integers and set(_do_not_specialize()) == integers


def test_specialisations_per_variant_are_bounded():
    # A compile is keyed by the tensors' dtype, the constexprs and the launch
    # options (num_warps is fixed); no integer is part of it (test above).
    # Left as constexprs: the variant switch, BLOCK_M (fixed: groups of up to
    # max_q_heads = 16 fit it), BLOCK_N (fixed) and the padded head size.  So
    # per variant: 3 dtypes x 3 padded heads (32; 64; 80, 96, 128 -> 128) x 4
    # caches (unquantized, 3 fp8 encodings: a pointer type and KV_QUANT each) = 36,
    # where 300 cases with a new compile each used to give over a hundred.
    params = _parameters()
    constexprs = {name for name, p in params.items() if "constexpr" in str(p.annotation)}
    caps = pp.CAPABILITIES
    pads = {dot_rows(h) for h in caps.head_sizes}
    assert len(caps.dtypes) == 3 and len(pads) == 3 and GPU_SIZE.bound(caps).max_q_heads <= pp.BLOCK_M
    seen, batches = set(), 0

    @settings(max_examples=300, derandomize=True, database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(paged_cases(caps, interpreter=False))
    def collect(case):
        nonlocal batches
        values = pp.specialisation(case, "masked")
        # the specialisation names every constexpr the launcher sets
        assert set(values) == constexprs
        if batches < 10:  # materialising all 300 would take minutes
            # the launch meets the dtype the key names
            assert str(materialize(case, "cpu", poisoned=False).q.dtype).removeprefix("torch.") == case.geometry.dtype
            batches += 1
        seen.add((case.geometry.dtype, case.kv_cache.dtype, *sorted(values.items())))

    collect()
    assert len(seen) <= len(caps.dtypes) * len(pads) * len(caps.kv_cache_dtypes) == 36, sorted(seen)
