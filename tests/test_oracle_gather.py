"""Several arithmetics from one gather give each arithmetic's own result, bit for bit."""
import pytest
import torch

from nanfuzz.reference import oracle as oracle_module
from nanfuzz.reference.materialize import materialize
from nanfuzz.reference.oracle import attend_in, computed_in, oracle
from nanfuzz.reference.precision import FLOAT64, same_precision
from tests.test_materialize_digests import CASES


def _same(a, b):
    return a.shape == b.shape and torch.equal(a.view(torch.int64), b.view(torch.int64))


@pytest.mark.parametrize("chunk", [1 << 27, 1])   # one chunk, one sequence a chunk
@pytest.mark.parametrize("name", sorted(CASES))
def test_one_gather_gives_each_arithmetic_its_own_bits(name, chunk, monkeypatch):
    monkeypatch.setattr(oracle_module, "_CHUNK_ELEMENTS", chunk)
    case = CASES[name].validate()
    batch = materialize(case)
    same = same_precision(case.geometry.dtype, "tf32")
    alone = (oracle(batch), computed_in(batch, same))
    laps = []
    both = attend_in(batch, (FLOAT64, same), laps.append)
    reverse = attend_in(batch, (same, FLOAT64))
    assert _same(both[0], alone[0]) and _same(both[1], alone[1])
    assert _same(reverse[0], alone[1]) and _same(reverse[1], alone[0])
    chunks = laps.count(0)
    assert laps == [0, 1] * chunks and chunks >= 1


def test_a_chunk_of_prefills_holds_its_padded_queries_within_the_budget(monkeypatch):
    # forty short prefills behind one of 256 new tokens, a group of 32 query heads: padded to the
    # longest query, each prefill's queries outweigh its keys many times
    from nanfuzz.reference.case import Case, Geometry, Poison, Sequence

    seqs = [Sequence(256, 256, tuple(range(1, 17)))]
    seqs += [Sequence(2, 2, (17 + i,) + (0,) * 15) for i in range(40)]
    case = Case(Geometry(32, 1, 32, 16, 60, "float32"), tuple(seqs), poison=Poison("nan", "v", None)).validate()
    batch = materialize(case)
    whole = oracle(batch)
    budget = 1 << 20
    monkeypatch.setattr(oracle_module, "_CHUNK_ELEMENTS", budget)
    held = []
    gather = oracle_module._gather

    def measured(*args):
        live = gather(*args)
        held.append(live.q.numel() + live.k.numel() + live.v.numel() + live.allowed.numel() // 8)
        return live

    monkeypatch.setattr(oracle_module, "_gather", measured)
    chunked = oracle(batch)
    # padded to another longest query, a chunk's float64 products may be blocked otherwise by the
    # host's BLAS: the last bits of a sum, never a value
    assert chunked.shape == whole.shape and torch.equal(chunked.isnan(), whole.isnan())
    assert torch.allclose(chunked, whole, rtol=1e-12, atol=1e-15, equal_nan=True)
    assert len(held) > 1 and max(held) <= budget, held
