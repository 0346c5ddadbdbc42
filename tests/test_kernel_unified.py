"""The unified kernel family against the float64 oracle, on clean and poisoned caches."""
from __future__ import annotations

import inspect

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from nanfuzz.harness.kernels._common import INTERPRETED
from nanfuzz.harness.kernels.unified import (CAPABILITIES, DO_NOT_SPECIALIZE, KERNELS, TILE_SIZE, VARIANTS,
                                            _unified_attention, specialisation)
from nanfuzz.reference.case import Case, Geometry, Poison, PoisonSite, Sequence
from nanfuzz.reference.materialize import materialize
from nanfuzz.reference.oracle import oracle
from nanfuzz.reference.semantics import Dead, slot_reasons
from nanfuzz.strategies import paged_cases

KERNEL = {k.name: k for k in KERNELS}
MASKED, OVERSHOOT = "unified@masked", "unified@overshoot"

NULL, TRAP = 0, 1  # block 0 is the null block; block 1 is where table padding points

# Max |out - oracle|.  V and the output lie in [-1, 1] and the scores are
# exact enough in fp32 that two roundings dominate: P rounded to the cache
# dtype before P @ V (at most one unit roundoff u of the weighted mean) and
# the output's own rounding (u/2).  fp16 u = 2**-11, bf16 u = 2**-8; the
# bound is 4u, over twice the sum.  fp32 keeps P in fp32 with an IEEE dot,
# so only exp() and summation error remain (~1e-6 measured); 2e-5 is 10x that.
ATOL = {"float16": 4 * 2.0**-11, "bfloat16": 4 * 2.0**-8, "float32": 2e-5}


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"


def make_case(seqs, *, num_q_heads=2, num_kv_heads=1, head_size=32, block_size=16, dtype="float32",
              window=0, causal=True, sinks=False, poison=Poison("nan", "kv"), free_to_null=False,
              data_seed=0) -> Case:
    """A case of ``(query_len, seq_len)`` sequences, each on fresh blocks from block 2 up.

    Every table has one padding entry (pointing at TRAP).  With
    ``free_to_null`` the entries of blocks wholly below a sequence's window
    point at the null block, as a KV manager leaves them after freeing.
    """
    width = max(-(-seq_len // block_size) for _, seq_len in seqs) + 1
    next_block = 2
    tables = []
    for query_len, seq_len in seqs:
        used = -(-seq_len // block_size)
        first_live = max(0, seq_len - query_len - window + 1) if window else 0
        table = []
        for j in range(used):
            if free_to_null and query_len and (j + 1) * block_size <= first_live:
                table.append(NULL)
            else:
                table.append(next_block)
                next_block += 1
        tables.append(tuple(table + [TRAP] * (width - used)))
    geometry = Geometry(num_q_heads, num_kv_heads, head_size, block_size, next_block, dtype)
    sequences = tuple(Sequence(q, s, t) for (q, s), t in zip(seqs, tables))
    return Case(geometry, sequences, window, causal, sinks, TRAP, poison, data_seed).validate()


def run(kernel: str, case: Case, device: str, *, poisoned: bool):
    """Run ``kernel``; fail if it wrote past the last token's row."""
    if case.geometry.dtype not in CAPABILITIES.runnable_dtypes(interpreter=device == "cpu"):
        pytest.skip(f"{case.geometry.dtype} does not run under Triton's interpreter")
    g = case.geometry
    batch = materialize(case, device, poisoned=poisoned)
    rows = case.num_tokens
    canary = torch.full((rows + 2, g.num_q_heads, g.head_size), float("nan"), dtype=batch.q.dtype, device=device)
    out = KERNEL[kernel](batch, canary[:rows])
    assert torch.isnan(canary[rows:]).all(), "the kernel wrote past the last token's row"
    return batch, out


def assert_matches_oracle(batch, out) -> None:
    expected = oracle(batch)
    assert torch.isfinite(out).all(), f"non-finite output in token rows {sorted(set(torch.nonzero(~torch.isfinite(out))[:, 0].tolist()))}"
    error = (out.double() - expected).abs().max().item()
    assert error <= ATOL[batch.case.geometry.dtype], f"max |out - oracle| = {error:.3g}"


# decode, prefill from 0, chunked prefill with context, padding (query_len 0)
MIXED = [(1, 37), (20, 20), (5, 70), (0, 12)]
CONFIGS = {
    "causal-gqa6/2-head96-block48-sinks": dict(
        seqs=MIXED, num_q_heads=6, num_kv_heads=2, head_size=96, block_size=48, sinks=True),
    "noncausal-window13-gqa5/1-head80": dict(
        seqs=[(1, 40), (17, 17), (0, 30), (9, 61)], num_q_heads=5, head_size=80, block_size=16,
        causal=False, window=13),
    "causal-window21-gqa5/1-head128-block8-sinks": dict(
        seqs=[(1, 90), (0, 9), (70, 70), (33, 100)], num_q_heads=5, head_size=128, block_size=8,
        window=21, sinks=True, free_to_null=True),
    "noncausal-gqa6/2-head64-block64-sinks": dict(
        seqs=[(1, 75), (40, 40), (0, 5), (12, 130)], num_q_heads=6, num_kv_heads=2, head_size=64,
        block_size=64, causal=False, sinks=True),
}


@pytest.mark.parametrize("dtype", ["float16", "float32", "bfloat16"])
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("kernel", [MASKED, OVERSHOOT])
def test_matches_oracle_on_clean_caches(kernel, config, dtype, device):
    case = make_case(**CONFIGS[config], dtype=dtype)
    assert_matches_oracle(*run(kernel, case, device, poisoned=False))


@pytest.mark.parametrize("config", CONFIGS)
def test_masked_matches_oracle_on_poisoned_caches(config, device):
    case = make_case(**CONFIGS[config], dtype="float16")
    assert_matches_oracle(*run(MASKED, case, device, poisoned=True))


@pytest.mark.parametrize("config", [c for c in CONFIGS if c.startswith("causal")])
def test_overshoot_is_correct_when_causal(config, device):
    case = make_case(**CONFIGS[config], dtype="float16")
    assert_matches_oracle(*run(OVERSHOOT, case, device, poisoned=True))


def _tail_case() -> Case:
    # seq_len 20 is no multiple of the tile: the last tile holds the tail 20..31
    case = make_case([(20, 20)], causal=False, poison=Poison("nan", "v"))
    last = case.sequences[0].block_table[1]
    return case.replace(poison=Poison("nan", "v", tuple(PoisonSite(last, o) for o in range(4, 16))))


def _padding_case() -> Case:
    # the last query (19) plus the window (6) reaches key 24, in the padding entry
    case = make_case([(4, 20)], block_size=8, causal=False, window=6)
    return case.replace(poison=Poison("nan", "v", (PoisonSite(TRAP),)))


@pytest.mark.parametrize("make", [_tail_case, _padding_case], ids=["tail", "table-padding"])
def test_overshoot_reads_past_seq_len_and_masked_does_not(make, device):
    case = make()
    assert case.sequences[0].seq_len % TILE_SIZE, "the bug needs a tile that straddles seq_len"
    _, out = run(OVERSHOOT, case, device, poisoned=True)
    assert torch.isnan(out).all(dim=(1, 2)).any(), "overshoot did not pull the NaN into p @ V"
    assert_matches_oracle(*run(MASKED, case, device, poisoned=True))


def _window_case(causal: bool, free_to_null: bool) -> Case:
    # context 67, window 22: keys 0..45 expired.  Blocks 0 and 1 are freed;
    # block 2 (keys 32..47) holds expired 32..45 and live 46, 47, and so
    # does the tile 32..63.  The prefill's query blocks each have their own
    # lower edge.
    return make_case([(3, 70), (40, 100)], num_q_heads=4, num_kv_heads=2, head_size=64, window=22,
                     causal=causal, free_to_null=free_to_null, dtype="float16")


def _holds_expired_and_live(case: Case) -> bool:
    reasons = slot_reasons(case)
    return any(
        any(why & Dead.OUT_OF_WINDOW for why in row) and any(not why for why in row)
        for row in reasons
    )


@pytest.mark.parametrize("free_to_null", [False, True], ids=["freed-blocks", "freed-to-null"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_masked_ignores_nan_below_the_window(causal, free_to_null, device):
    case = _window_case(causal, free_to_null)
    assert _holds_expired_and_live(case)
    assert_matches_oracle(*run(MASKED, case, device, poisoned=True))
    if causal:
        assert_matches_oracle(*run(OVERSHOOT, case, device, poisoned=True))


# Distinct compiles over fuzzed GPU-sized cases, per variant: 3 dtypes x 3
# padded head sizes (32; 64; 80, 96, 128 -> 128) x 2 row counts (decode-only
# batches, batches with prefill) x 8 caches (unquantized, 3 fp8 per-tensor, 4
# per-token-head).  Everything else a case varies is a runtime argument, so
# the bound holds however many cases a campaign draws.
MAX_SPECIALISATIONS = 3 * 3 * 2 * 8


def test_specialisations_stay_bounded():
    cases = []

    @settings(max_examples=300, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(paged_cases(CAPABILITIES, interpreter=False))
    def collect(case):
        cases.append(case)

    collect()
    assert {c.geometry.dtype for c in cases} == {"float16", "bfloat16", "float32"}
    for variant, switches in VARIANTS.items():
        seen = {(c.geometry.dtype, c.kv_cache.label(), *sorted(specialisation(c, variant).items())) for c in cases}
        assert len(seen) <= MAX_SPECIALISATIONS, f"{len(seen)} specialisations over {len(cases)} cases"
        assert all(switches.items() <= set(s[2:]) for s in seen)


def test_no_integer_argument_is_specialised():
    """Triton keys a compile on whether an integer is 1 or divisible by 16 unless told not to."""
    fn = getattr(_unified_attention, "fn", _unified_attention)
    params = inspect.signature(fn).parameters.values()
    runtime = {p.name for p in params if "constexpr" not in str(p.annotation)}
    pointers = {name for name in runtime if name[0].isupper()}
    assert runtime - pointers - {"scale"} == set(DO_NOT_SPECIALIZE)
