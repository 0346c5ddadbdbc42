"""The float64 oracle against a loop-by-loop definition and hand-computed cases."""
import math

import pytest
import torch
from hypothesis import given, settings

from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.case import Case, Geometry, Poison, PoisonSite, Sequence
from nanfuzz.reference.materialize import materialize
from nanfuzz.reference.oracle import oracle
from nanfuzz.strategies import Size, paged_cases
from tests.brute_force import brute_force

TINY = Size(max_sequences=3, max_blocks_per_sequence=3, max_query_len=6, max_kv_heads=2)
EVERYTHING = Capabilities(non_causal=True, sinks=True, head_sizes=(32,))


@settings(max_examples=40, deadline=None)
@given(paged_cases(EVERYTHING, interpreter=True, size=TINY))
def test_oracle_matches_brute_force(case):
    batch = materialize(case)
    expected = torch.tensor(brute_force(batch), dtype=torch.float64).reshape(case.num_tokens, case.geometry.num_q_heads, case.geometry.head_size)
    torch.testing.assert_close(oracle(batch), expected, rtol=1e-12, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(paged_cases(EVERYTHING, interpreter=True, size=TINY))
def test_oracle_is_bit_identical_under_any_poison(case):
    reference = oracle(materialize(case, poisoned=False))
    for value in ("nan", "inf", "bits", "garbage"):
        poisoned = case.replace(poison=Poison(value, "kv", None))
        assert torch.equal(oracle(materialize(poisoned)), reference)
    assert torch.equal(oracle(materialize(case, garbage_seed=7)), reference)


def _one_hot_case(seq_len, query_len, window, causal, head_size=32):
    blocks = -(-seq_len // 8)
    g = Geometry(1, 1, head_size, 8, blocks + 1, "float32")
    return Case(g, (Sequence(query_len, seq_len, tuple(range(1, blocks + 1))),), sliding_window=window, causal=causal)


def _batch_with_values(case, q_scale=0.0):
    """Zero scores (uniform softmax over the allowed keys) and V[k] = k: the output is the mean allowed key."""
    batch = materialize(case, poisoned=False)
    batch.q.mul_(q_scale)
    g = case.geometry
    seq = case.sequences[0]
    for k in range(seq.seq_len):
        batch.value_cache[seq.block_table[k // g.block_size], k % g.block_size] = float(k)
    return batch


@pytest.mark.parametrize("causal, window, expected", [
    # decode at position 9 of 10 keys
    (True, 0, [sum(range(10)) / 10]),
    (True, 1, [9.0]),                          # only the query's own key
    (True, 3, [(7 + 8 + 9) / 3]),              # W keys including its own position
    (False, 3, [(7 + 8 + 9) / 3]),             # non-causal: nothing after the last key
])
def test_hand_computed_decode_windows(causal, window, expected):
    case = _one_hot_case(10, 1, window, causal)
    out = oracle(_batch_with_values(case))
    assert out[:, 0, 0].tolist() == pytest.approx(expected)


def test_hand_computed_prefill_window_edges():
    # 6 keys, queries at positions 2..5 (context 2), window 2
    causal = oracle(_batch_with_values(_one_hot_case(6, 4, 2, True)))[:, 0, 0].tolist()
    assert causal == pytest.approx([(1 + 2) / 2, (2 + 3) / 2, (3 + 4) / 2, (4 + 5) / 2])
    # non-causal, window 2: |p - k| < 2, keys < 6
    both = oracle(_batch_with_values(_one_hot_case(6, 4, 2, False)))[:, 0, 0].tolist()
    assert both == pytest.approx([(1 + 2 + 3) / 3, (2 + 3 + 4) / 3, (3 + 4 + 5) / 3, (4 + 5) / 2])
    # non-causal, no window: every query sees all 6 keys
    full = oracle(_batch_with_values(_one_hot_case(6, 4, 0, False)))[:, 0, 0].tolist()
    assert full == pytest.approx([2.5] * 4)


def test_sinks_only_enlarge_the_denominator():
    case = _one_hot_case(4, 1, 0, True).replace(sinks=True)
    batch = _batch_with_values(case)
    batch.sinks.fill_(math.log(4.0))         # exp(sink) = 4 = the number of keys, at zero scores
    out = oracle(batch)[0, 0, 0].item()
    assert out == pytest.approx((0 + 1 + 2 + 3) / (4 + 4))


def test_gqa_head_mapping():
    g = Geometry(6, 2, 32, 8, 2, "float32")
    case = Case(g, (Sequence(1, 3, (1,)),))
    batch = materialize(case, poisoned=False)
    batch.q.zero_()
    batch.value_cache[1, :3, 0] = 1.0
    batch.value_cache[1, :3, 1] = -1.0
    out = oracle(batch)[0, :, 0].tolist()
    assert out == pytest.approx([1, 1, 1, -1, -1, -1])      # heads 0-2 read KV head 0, heads 3-5 KV head 1


def test_poison_never_reaches_the_oracle_even_in_shared_blocks():
    g = Geometry(2, 1, 32, 8, 6, "float16")
    # seq 1's expired first block points at seq 0's live block 1
    case = Case(g, (Sequence(1, 8, (1, 5, 5)), Sequence(1, 20, (1, 2, 3))), sliding_window=5,
                padding_block=5, poison=Poison("nan", "kv", None)).validate()
    out = oracle(materialize(case))
    assert torch.isfinite(out).all()
    assert torch.equal(out, oracle(materialize(case, poisoned=False)))
    single = case.replace(poison=Poison("inf", "v", (PoisonSite(2, 3),)))
    assert torch.equal(oracle(materialize(single)), out)


def test_padding_sequences_have_no_rows():
    g = Geometry(2, 1, 32, 8, 3, "float32")
    case = Case(g, (Sequence(0, 0, (0, 0)), Sequence(2, 9, (1, 2)), Sequence(0, 0, (0, 0))))
    assert oracle(materialize(case)).shape == (2, 2, 32)


def test_chunked_oracle_equals_one_pass(monkeypatch):
    from nanfuzz.reference import oracle as oracle_module

    g = Geometry(4, 2, 32, 8, 13, "float32")
    case = Case(g, (Sequence(3, 17, (1, 2, 3)), Sequence(1, 9, (4, 5, 0)), Sequence(0, 0, (0, 0, 0)),
                    Sequence(2, 20, (6, 7, 8)), Sequence(5, 5, (9, 0, 0)))).validate()
    batch = materialize(case)
    whole = oracle(batch)
    monkeypatch.setattr(oracle_module, "_CHUNK_ELEMENTS", 1)  # one sequence per chunk
    torch.testing.assert_close(oracle_module.oracle(batch), whole, rtol=1e-13, atol=1e-13)  # padding differs per chunk


def test_overlapping_oracles_keep_tf32_off_until_the_last_ends_and_then_put_the_process_s_setting_back():
    from nanfuzz.reference.oracle import _ieee_float32_matmuls

    matmul = torch.backends.cuda.matmul
    before = matmul.allow_tf32
    matmul.allow_tf32 = True
    try:
        first, second = _ieee_float32_matmuls(), _ieee_float32_matmuls()
        first.__enter__()
        second.__enter__()  # another thread's oracle, entered while the first runs
        first.__exit__(None, None, None)
        assert matmul.allow_tf32 is False  # the second still computes in full float32
        second.__exit__(None, None, None)
        assert matmul.allow_tf32 is True  # not the False the second found on its way in
    finally:
        matmul.allow_tf32 = before
