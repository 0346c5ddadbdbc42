"""The paged_decode kernel family against the float64 oracle.

``masked`` must match the oracle on every geometry and survive poisoned dead
slots; the old variants must match on clean caches yet turn their own bug
class into NaN.
"""
from __future__ import annotations

import pytest
import torch

from nanfuzz.harness.kernels._common import INTERPRETED
from nanfuzz.harness.kernels.paged_decode import CAPABILITIES, KERNELS, paged_decode
from nanfuzz.reference.case import Case, Geometry, Poison, PoisonSite, Sequence
from nanfuzz.reference.materialize import materialize
from nanfuzz.reference.oracle import oracle

ON_GPU = torch.cuda.is_available() and not INTERPRETED
BF16 = pytest.param("bfloat16", marks=pytest.mark.skipif("bfloat16" not in CAPABILITIES.runnable_dtypes(not ON_GPU),
                                                         reason="bfloat16 does not run under Triton's interpreter"))

# |out| < 1 (a convex combination of V rows in [-1, 1)).  The kernel rounds
# each weight p to the cache dtype before p @ V (error <= u * |out|, u the
# unit roundoff) and rounds the output once more (<= u): 2u, doubled for margin.
ATOL = {
    "float16": 4 * 2.0 ** -11,   # u = 2**-11
    "bfloat16": 4 * 2.0 ** -8,   # u = 2**-8
    # IEEE fp32 dots and exp: a few hundred roundings of 2**-24 at most
    "float32": 1e-5,
}


@pytest.fixture(scope="module")
def device() -> str:
    return "cuda" if ON_GPU else "cpu"


def make_case(*, q_heads: int, kv_heads: int, head_size: int, block_size: int, seqs, dtype: str = "float16",
              window: int = 0, sinks: bool = False, causal: bool = True, poison: Poison = Poison()) -> Case:
    """Sequences ``(query_len, seq_len)`` with their own physical blocks, handed out in
    reverse so that logical and physical order differ; block 0 stays the null block
    and every table has one padding column pointing at it."""
    used = [-(-seq_len // block_size) for _, seq_len in seqs]
    width = max(used) + 1
    ids = list(range(sum(used), 0, -1))
    tables = []
    for n in used:
        mine, ids = ids[:n], ids[n:]
        tables.append(tuple(mine) + (0,) * (width - n))
    geometry = Geometry(num_q_heads=q_heads, num_kv_heads=kv_heads, head_size=head_size,
                        block_size=block_size, num_blocks=sum(used) + 1, dtype=dtype)
    sequences = tuple(Sequence(q, s, t) for (q, s), t in zip(seqs, tables))
    return Case(geometry, sequences, sliding_window=window, causal=causal, sinks=sinks, poison=poison).validate()


# Finite, so that a stray write of NaN (a program with no keys: 0 / 0) shows too.
CANARY = -3.5


def run(batch, variant: str, tile_size: int = 32) -> torch.Tensor:
    """Run into a NaN-filled buffer followed by one canary row."""
    q = batch.q
    buf = torch.full((q.shape[0] + 1, *q.shape[1:]), float("nan"), dtype=q.dtype, device=q.device)
    buf[-1] = CANARY
    out = buf[:-1]
    paged_decode(batch, out, variant=variant, tile_size=tile_size)
    assert (buf[-1] == CANARY).all(), "the kernel wrote past its last output row"
    return out


def assert_matches(out: torch.Tensor, batch) -> None:
    assert torch.isfinite(out).all(), "non-finite output"
    err = (out.double() - oracle(batch)).abs().max().item()
    assert err <= ATOL[batch.case.geometry.dtype], f"max error {err:.3g}"


# Each geometry covers what its name says.  Sequences without a query come
# last: their query_start_loc is num_tokens, so a stray write lands on the
# canary row (the interpreter runs programs in order, so a stray write to an
# earlier row would be overwritten by its owner and go unseen).
GEOMETRIES = {
    "gqa5-padding-seq": dict(q_heads=5, kv_heads=1, head_size=64, block_size=16, seqs=[(1, 37), (1, 5), (0, 0)]),
    "gqa3-head80-block48-window-sinks-no-query-seq": dict(q_heads=6, kv_heads=2, head_size=80, block_size=48,
                                                          seqs=[(1, 100), (1, 3), (0, 20)], window=20, sinks=True),
    "head96-block8-window-noncausal": dict(q_heads=2, kv_heads=2, head_size=96, block_size=8,
                                           seqs=[(1, 50), (1, 64)], window=9, causal=False),
    "gqa8-head128-block64-window-sinks": dict(q_heads=16, kv_heads=2, head_size=128, block_size=64,
                                              seqs=[(1, 130)], window=70, sinks=True),
    "head32-block32-one-key": dict(q_heads=4, kv_heads=4, head_size=32, block_size=32, seqs=[(1, 33), (1, 1)]),
}


@pytest.mark.parametrize("dtype", ["float16", "float32", BF16])
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_masked_matches_oracle_on_clean_caches(geometry, dtype, device):
    case = make_case(dtype=dtype, **GEOMETRIES[geometry])
    batch = materialize(case, device, poisoned=False)
    out = run(batch, "masked")
    assert_matches(out, batch)
    # finite garbage in dead slots must not change a single bit (no LEAK)
    other = run(materialize(case, device, garbage_seed=1, poisoned=False), "masked")
    assert torch.equal(out, other)


@pytest.mark.parametrize("tile_size", [16, 64])
@pytest.mark.parametrize("geometry", ["gqa3-head80-block48-window-sinks-no-query-seq", "head96-block8-window-noncausal"])
def test_masked_tile_size_is_independent_of_block_size(geometry, tile_size, device):
    batch = materialize(make_case(**GEOMETRIES[geometry]), device)
    assert_matches(run(batch, "masked", tile_size), batch)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("variant", ["unmasked", "tail-masked"])
@pytest.mark.parametrize("geometry", ["gqa3-head80-block48-window-sinks-no-query-seq", "head96-block8-window-noncausal"])
def test_old_variants_match_oracle_on_clean_caches(geometry, variant, dtype, device):
    batch = materialize(make_case(dtype=dtype, **GEOMETRIES[geometry]), device, poisoned=False)
    assert_matches(run(batch, variant), batch)


# -- one hand-built case per bug class: NaN in exactly those dead slots -------
BUG_GEOMETRY = dict(q_heads=4, kv_heads=2, head_size=64, block_size=16)


def tail_case() -> Case:
    """seq_len 21: slots 5..15 of the second block were never written."""
    case = make_case(**BUG_GEOMETRY, seqs=[(1, 21)])
    last = case.sequences[0].block_table[1]
    return _poison(case, [PoisonSite(last, offset) for offset in range(5, 16)])


def freed_block_case() -> Case:
    """seq_len 70, window 38: keys 0..31 (two whole blocks) expired and were freed."""
    case = make_case(**BUG_GEOMETRY, seqs=[(1, 70)], window=38)
    table = case.sequences[0].block_table
    return _poison(case, [PoisonSite(table[0]), PoisonSite(table[1])])


def straddling_block_case() -> Case:
    """seq_len 45, window 20: the second block holds expired keys 16..24 and live 25..31."""
    case = make_case(**BUG_GEOMETRY, seqs=[(1, 45)], window=20)
    block = case.sequences[0].block_table[1]
    return _poison(case, [PoisonSite(block, offset) for offset in range(0, 9)])


def _poison(case: Case, sites) -> Case:
    return case.replace(poison=Poison(value="nan", tensors="kv", sites=tuple(sites))).validate()


BUG_CASES = {"tail": tail_case, "freed-block": freed_block_case, "straddling-block": straddling_block_case}
CAUGHT_BY = {"unmasked": {"tail", "freed-block", "straddling-block"},
             "tail-masked": {"freed-block", "straddling-block"}}


@pytest.mark.parametrize("variant", ["unmasked", "tail-masked"])
@pytest.mark.parametrize("bug", list(BUG_CASES))
def test_old_variant_turns_its_bug_class_into_nan(bug, variant, device):
    batch = materialize(BUG_CASES[bug](), device)
    out = run(batch, variant)
    if bug in CAUGHT_BY[variant]:
        assert out.isnan().any(), f"{variant} should let the poisoned {bug} slots reach p @ V"
    else:
        assert_matches(out, batch)


@pytest.mark.parametrize("tile_size", [16, 32])
@pytest.mark.parametrize("bug", list(BUG_CASES))
def test_masked_survives_every_bug_class(bug, tile_size, device):
    batch = materialize(BUG_CASES[bug](), device)
    assert_matches(run(batch, "masked", tile_size), batch)


def test_registered_variants():
    assert {k.name: k.expect for k in KERNELS} == {
        "paged_decode@unmasked": "caught", "paged_decode@tail-masked": "caught", "paged_decode@masked": "pass"}
    for kernel in KERNELS:
        assert kernel.capabilities.decode_only


def test_compiled_specialisations_are_bounded():
    """Lengths, group sizes and strides are runtime values: a variant compiles at
    most one kernel per (dtype, padded head size 32/64/128, block size, window
    or not, sinks or not, cache: unquantized or one of 3 fp8) = 3 x 3 x 5 x 2 x 2 x 4
    = 720; the block size stays a constexpr for speed (see ``specialisation``)."""
    from hypothesis import HealthCheck, given, settings

    from nanfuzz.harness.kernels.paged_decode import CAPABILITIES, specialisation
    from nanfuzz.strategies import paged_cases

    keys = set()

    @settings(max_examples=300, database=None, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(paged_cases(CAPABILITIES))
    def collect(case):
        keys.add((case.geometry.dtype, case.kv_cache.dtype, tuple(sorted(specialisation(case, "masked").items()))))

    collect()
    assert len(keys) <= 3 * 3 * 5 * 2 * 2 * 4, sorted(keys)
    assert {dict(k[2])['HEAD_PAD'] for k in keys} == {32, 64, 128}
