"""Case model: validity rules, JSON round trip, deterministic materialisation."""
import json
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.case import Case, Geometry, Poison, PoisonSite, Sequence
from nanfuzz.reference.errors import CaseError
from nanfuzz.reference.device_build import build_on_device
from nanfuzz.reference.materialize import live_mask, materialize
from nanfuzz.reference.semantics import Dead, allowed, allowed_mask, poison_dead_slots_only, slot_reasons
from nanfuzz.strategies import paged_cases

EVERYTHING = Capabilities(non_causal=True, sinks=True)


@settings(max_examples=150, deadline=None)
@given(paged_cases(EVERYTHING))
def test_generated_cases_are_valid_and_round_trip_exactly(case):
    assert case.validate() is case
    text = case.to_json()
    again = Case.from_json(text)
    assert again == case and again.to_json() == text
    assert len(text) < 4096  # small: no tensors inside


@settings(max_examples=30, deadline=None)
@given(paged_cases(EVERYTHING, interpreter=True))
def test_materialisation_is_deterministic_and_poison_only_touches_dead_slots(case):
    a, b = materialize(case), materialize(case)
    for name, tensor in a.inputs().items():
        other = b.inputs()[name]
        view = torch.int16 if tensor.element_size() == 2 else torch.int32
        assert torch.equal(tensor.view(view) if tensor.is_floating_point() else tensor,
                           other.view(view) if other.is_floating_point() else other), name
    clean = materialize(case, poisoned=False, garbage_seed=3)
    live = live_mask(case, "cpu")
    assert torch.equal(a.key_cache[live], clean.key_cache[live])
    assert torch.equal(a.value_cache[live], clean.value_cache[live])
    assert torch.equal(a.q, clean.q) and torch.equal(a.k, clean.k) and torch.equal(a.v, clean.v)
    assert torch.isfinite(clean.key_cache.float()).all() and torch.isfinite(clean.value_cache.float()).all()


def test_new_token_kv_equal_the_cache_slots():
    g = Geometry(2, 2, 32, 8, 4, "float16")
    case = Case(g, (Sequence(3, 11, (2, 1, 0)),)).validate()
    batch = materialize(case)
    for i, key in enumerate(range(8, 11)):
        assert torch.equal(batch.k[i], batch.key_cache[1, key % 8])
        assert torch.equal(batch.v[i], batch.value_cache[1, key % 8])


def test_live_values_do_not_depend_on_the_batch_around_them():
    g = Geometry(1, 1, 32, 8, 3, "float32")
    small = Case(g, (Sequence(1, 5, (1,)),))
    bigger = Case(g.__class__(1, 1, 32, 8, 6, "float32"), (Sequence(1, 5, (1, 0)), Sequence(1, 16, (4, 5))))
    a, b = materialize(small.validate()), materialize(bigger.validate())
    assert torch.equal(a.key_cache[1, :5], b.key_cache[1, :5])


def test_dead_slot_classes():
    g = Geometry(1, 1, 32, 4, 7, "float16")
    # keys 0-3 -> null block, 4-7 -> block 1, 8-11 -> block 2; live keys [7, 10)
    case = Case(g, (Sequence(1, 10, (0, 1, 2, 6)),), sliding_window=3, padding_block=6).validate()
    reasons = slot_reasons(case)
    assert reasons[2][2] & Dead.TAIL and reasons[2][3] & Dead.TAIL        # keys 10, 11
    assert reasons[1][0] & Dead.OUT_OF_WINDOW                             # key 4, expired
    assert reasons[0][0] & Dead.NULL_BLOCK and reasons[0][0] & Dead.OUT_OF_WINDOW
    assert reasons[6][0] & Dead.PADDING
    assert reasons[3][0] & Dead.UNREFERENCED
    assert not reasons[2][0] and not reasons[2][1]                        # keys 8, 9 live
    assert not reasons[1][3] and reasons[1][2] & Dead.OUT_OF_WINDOW        # key 7 live, key 6: 9 - 6 >= 3


def test_a_sequence_cut_out_of_its_batch_keeps_its_queries_values():
    g = Geometry(4, 2, 32, 8, 8, "float16")
    batch = Case(g, (Sequence(2, 5, (1, 0)), Sequence(3, 11, (2, 3)), Sequence(1, 9, (4, 5)))).validate()
    starts = batch.query_start_loc()
    whole = materialize(batch).q
    for index in (1, 2):
        alone = replace(batch, sequences=(batch.sequences[index],), query_keys=(index,)).validate()
        assert torch.equal(materialize(alone).q, whole[starts[index]:starts[index + 1]])
        renumbered = replace(alone, query_keys=None)  # under the index it has alone: other values
        assert not torch.equal(materialize(renumbered).q, whole[starts[index]:starts[index + 1]])
        assert Case.from_json(alone.to_json()) == alone
        assert "query_keys" not in renumbered.to_dict()  # a case without keys reads as it always did


def test_a_large_case_hashes_its_queries_under_their_keys_as_the_host_does():
    g = Geometry(4, 2, 32, 8, 8, "float16")
    case = Case(g, (Sequence(3, 11, (2, 3)), Sequence(1, 9, (4, 5))), query_keys=(7, 2)).validate()
    host, device = materialize(case), build_on_device(case, "cpu")
    assert torch.equal(host.allocations["q"].base.view(torch.int16), device.small["q"].base.view(torch.int16))


def test_a_changed_case_keeps_only_the_poison_sites_still_dead():
    g = Geometry(1, 1, 32, 4, 4, "float16")
    # two sequences: keys 0-4 on blocks 1, 2 (block 2 holds key 4), keys 0-1 on block 3
    case = Case(g, (Sequence(1, 5, (1, 2)), Sequence(1, 2, (3, 0))),
                poison=Poison("nan", "v", (PoisonSite(2, 1), PoisonSite(3, 2)))).validate()
    alone = replace(case, sequences=(Sequence(1, 2, (3,)),))  # the first sequence gone: blocks 1, 2 dead
    kept = poison_dead_slots_only(alone)
    assert kept.poison.sites == (PoisonSite(2, 1), PoisonSite(3, 2))
    grown = replace(case, sequences=(Sequence(1, 7, (1, 2)), Sequence(1, 4, (3, 0))))  # both sites live now
    assert poison_dead_slots_only(grown).poison.sites is None  # then every dead slot
    whole = replace(case, poison=Poison("nan", "v", (PoisonSite(1), PoisonSite(2))))
    assert poison_dead_slots_only(replace(whole, sequences=(Sequence(1, 4, (1, 0)), Sequence(1, 2, (3, 0))))) \
        .poison.sites == (PoisonSite(2),)  # a whole block's site goes where any of its slots is live


@pytest.mark.parametrize("change, message", [
    (dict(sequences=(Sequence(2, 1, (1,)),)), "query_len=2 must lie in 0..seq_len=1"),
    (dict(sequences=(Sequence(1, 9, (1,)),)), "needs 2 blocks"),
    (dict(sequences=(Sequence(1, 4, (0,)),)), "null block"),
    (dict(sequences=(Sequence(1, 4, (9,)),)), "outside 0..2"),
    (dict(poison=Poison("nan", "v", (PoisonSite(1, 0),))), "is live"),
    (dict(poison=Poison("nan", "w", None)), "poison tensors"),
    (dict(padding_block=1, sequences=(Sequence(1, 4, (1, 1)),)), "holds live keys"),
    (dict(query_keys=(0, 1)), "query_keys has 2 entries for 1 sequences"),
    (dict(query_keys=(-1,)), "must lie in 0.."),
])
def test_invalid_cases_name_the_rule(change, message):
    g = Geometry(1, 1, 32, 8, 3, "float16")
    with pytest.raises(CaseError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        Case(g, (Sequence(1, 4, (1,)),)).replace(**change).validate()


@pytest.mark.parametrize("text", ["[]", "{", '{"geometry": {}}', '{"geometry": 3}'])
def test_malformed_json_is_one_clear_error(text):
    with pytest.raises(CaseError) as info:
        Case.from_json(text)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("keys, message", [("[1, true]", "must be a list of integers"), ('"3"', "must be a list of integers"),
                                           ("[4096]", "must lie in 0..4095"), ("[2]", None)])
def test_a_case_s_query_keys_in_json_are_checked(keys, message):
    record = Case(Geometry(1, 1, 32, 8, 3, "float16"), (Sequence(1, 4, (1,)),)).to_dict()
    text = json.dumps(record)[:-1] + f', "query_keys": {keys}}}'
    if message is None:
        assert Case.from_json(text).query_keys == (2,)
        return
    with pytest.raises(CaseError, match=message.replace(".", r"\.")):
        Case.from_json(text)


@given(seq_len=st.integers(0, 12), window=st.integers(0, 6), causal=st.booleans())
def test_the_tensor_allowed_set_is_the_scalar_definition(seq_len, window, causal):
    positions, keys = torch.arange(-1, 14)[:, None], torch.arange(-1, 14)[None, :]
    mask = allowed_mask(positions, keys, seq_len, window, causal)
    assert mask.tolist() == [[allowed(p, k, seq_len, window, causal) for k in range(-1, 14)] for p in range(-1, 14)]
