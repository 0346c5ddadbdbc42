"""The fast paths of the fuzz loop agree with their slow, key-by-key definitions."""
import torch
from hypothesis import HealthCheck, given, settings

from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.case import NULL_BLOCK
from nanfuzz.reference.materialize import materialize, refill_dead_slots
from nanfuzz.reference.semantics import Dead, allowed, dead_slots, slot_liveness, slot_reasons
from nanfuzz.strategies import paged_cases

EVERYTHING = Capabilities(non_causal=True, sinks=True)
FEW = settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))


def _liveness_by_keys(case):
    """A slot is live when some query of a sequence whose table maps a key to it may read that key."""
    g = case.geometry
    live = [[False] * g.block_size for _ in range(g.num_blocks)]
    for seq in case.sequences:
        for key in range(seq.seq_len):
            if any(allowed(seq.context_len + i, key, seq.seq_len, case.sliding_window, case.causal)
                   for i in range(seq.query_len)):
                live[seq.block_table[key // g.block_size]][key % g.block_size] = True
    return live


def _reasons_by_keys(case):
    """Every dead-slot class, decided slot by slot."""
    g = case.geometry
    live = _liveness_by_keys(case)
    reasons = [[Dead(0)] * g.block_size for _ in range(g.num_blocks)]
    referenced = set()
    padded = any(len(s.block_table) > -(-s.seq_len // g.block_size) for s in case.sequences)
    for seq in case.sequences:
        reads = [k for k in range(seq.seq_len) if any(
            allowed(seq.context_len + i, k, seq.seq_len, case.sliding_window, case.causal) for i in range(seq.query_len))]
        for j in range(-(-seq.seq_len // g.block_size)):
            block = seq.block_table[j]
            referenced.add(block)
            for offset in range(g.block_size):
                key = j * g.block_size + offset
                if key >= seq.seq_len:
                    reasons[block][offset] |= Dead.TAIL
                elif seq.query_len == 0:
                    reasons[block][offset] |= Dead.NO_QUERY
                elif key not in reads:
                    reasons[block][offset] |= Dead.OUT_OF_WINDOW
    for block in range(g.num_blocks):
        for offset in range(g.block_size):
            if live[block][offset]:
                reasons[block][offset] = Dead(0)
                continue
            if block == NULL_BLOCK:
                reasons[block][offset] |= Dead.NULL_BLOCK
            if block == case.padding_block and padded:
                reasons[block][offset] |= Dead.PADDING
            if block not in referenced:
                reasons[block][offset] |= Dead.UNREFERENCED
    return reasons


@FEW
@given(paged_cases(EVERYTHING))
def test_liveness_and_reasons_match_the_key_by_key_definition(case):
    assert slot_liveness(case) == _liveness_by_keys(case)
    reasons = slot_reasons(case)
    assert reasons == _reasons_by_keys(case)
    assert all(type(why) is Dead for row in reasons for why in row)
    dead = dead_slots(case)
    assert sorted(dead) == sorted((b, o) for b, row in enumerate(reasons) for o, why in enumerate(row) if why)
    reached = [bool(reasons[b][o] & (Dead.TAIL | Dead.OUT_OF_WINDOW)) for b, o in dead]
    assert reached == sorted(reached, reverse=True)  # table-reached slots first, each part in slot order


def test_memoised_answers_are_fresh_lists():
    from nanfuzz.reference.case import Case, Geometry, Sequence

    case = Case(Geometry(1, 1, 32, 4, 3, "float16"), (Sequence(1, 6, (1, 2)),)).validate()
    slot_liveness(case)[1][0] = "changed"
    slot_reasons(case)[0][0] = "changed"
    dead_slots(case).clear()
    assert slot_liveness(case)[1][0] is True and slot_reasons(case)[0][0] & Dead.NULL_BLOCK and dead_slots(case)


@FEW
@given(paged_cases(EVERYTHING, interpreter=True))
def test_refilled_batch_is_the_clean_materialisation(case):
    expected = materialize(case, garbage_seed=1, poisoned=False)
    refilled = refill_dead_slots(materialize(case), garbage_seed=1)
    for name, tensor in expected.inputs().items():
        other = refilled.inputs()[name]
        assert other.dtype == tensor.dtype and other.shape == tensor.shape, name
        view = torch.int16 if tensor.element_size() == 2 else torch.int32
        assert torch.equal(tensor.view(view) if tensor.is_floating_point() else tensor,
                           other.view(view) if other.is_floating_point() else other), name
