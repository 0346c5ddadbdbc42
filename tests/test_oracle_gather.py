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
