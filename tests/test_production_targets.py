"""Production targets: which a kernel declares and why the others are out of reach, pools that hold
every compile-time situation the kernel allows, aimed cases that reach their targets, and failures
found in aimed cases that shrink as free ones do.  Cases are drawn, never run."""
import dataclasses

import pytest
from hypothesis import HealthCheck, find, settings

from nanfuzz.harness.adapters import aiter, vllm
from nanfuzz.harness.campaign.focus import Focus
from nanfuzz.harness.scaling import drawn
from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.features import batch_kind, size_features
from nanfuzz.strategies.aims import FAR_WINDOW, HUGE_OFFSETS, LARGEST_HEAD, SITUATIONS, WIDE_GROUP, Aim, Aims
from nanfuzz.strategies.cases import ROTATION_ENTRIES, campaign_pool, paged_cases
from nanfuzz.strategies.production import (INTERPRETER_PRODUCTION_SIZE, PRODUCTION_SIZE, entry_provides,
                                           pool_situations)
from nanfuzz.strategies.specialisations import entry_traits
from nanfuzz.strategies.targets import batch_kinds, production_targets

LIBRARIES = {"vllm:rocm_attn": vllm.ROCM_ATTN_CAPABILITIES, "vllm:triton_attn": vllm.TRITON_ATTN_CAPABILITIES,
             "aiter:pa_decode": aiter.PA_DECODE_CAPABILITIES, "aiter:unified_attention": aiter.UNIFIED_CAPABILITIES}
WINDOWED = Capabilities(non_causal=True, sinks=True, head_sizes=(64, 128, 256))


@pytest.mark.parametrize("name", LIBRARIES)
def test_every_pool_of_seeds_0_to_199_holds_each_compile_time_situation_the_kernel_allows(name):
    caps = LIBRARIES[name]
    wanted = pool_situations(caps, PRODUCTION_SIZE)
    assert {WIDE_GROUP, LARGEST_HEAD, HUGE_OFFSETS} <= set(wanted)
    for seed in range(200):
        pool = campaign_pool(caps, 16, seed, tier="mixed")
        lacking = [s for s in wanted if not any(entry_provides(e, s, caps, PRODUCTION_SIZE, "prefill") for e in pool)]
        assert not lacking, (seed, lacking)
        assert any(e.shape.num_q_heads // e.shape.num_kv_heads > 16 for e in pool), seed


def test_a_pool_adds_nothing_the_kernel_cannot_take():
    narrow = WINDOWED.restrict(max_q_heads=16, sliding_window=False)
    assert set(pool_situations(narrow, PRODUCTION_SIZE)) == {LARGEST_HEAD, HUGE_OFFSETS}
    for seed in range(20):
        pool = campaign_pool(narrow, 16, seed, tier="mixed")
        assert all(e.shape.num_q_heads <= 16 and not e.window for e in pool)
    assert campaign_pool(WINDOWED, 16, 3) == campaign_pool(WINDOWED, 16, 3, tier="small")  # the small tier: as before


def test_rounds_and_growth_add_a_few_new_shapes_and_keep_the_seeds_own():
    caps = vllm.TRITON_ATTN_CAPABILITIES  # more head sizes than a pool of 20 holds
    base = campaign_pool(caps, 16, 5, tier="mixed")
    first, second = (campaign_pool(caps, 16, 5, tier="mixed", pool_round=r) for r in (1, 2))
    grown = campaign_pool(caps, 16, 5, tier="mixed", pool_round=2, growth=2)
    assert first[:len(base)] == base and second[:len(base)] == base and grown[:len(second)] == second
    assert len(first) == len(second) == len(base) + ROTATION_ENTRIES
    assert len(grown) == len(second) + 2 * ROTATION_ENTRIES
    assert set(first[len(base):]).isdisjoint(second[len(base):])
    assert campaign_pool(caps, 16, 5, tier="mixed", pool_round=1) == first  # a round is a function of its number
    # the new entries bring traits the pool lacked
    known = set().union(*(entry_traits(e) for e in base))
    assert set().union(*(entry_traits(e) for e in first[len(base):])) - known


def test_targets_are_every_situation_in_every_batch_kind_with_why_the_others_are_out_of_reach():
    targets = production_targets(WINDOWED, PRODUCTION_SIZE)
    assert batch_kinds(WINDOWED) == ("decode", "prefill", "chunked-prefill", "mixed")
    assert len(targets.names()) == 4 * len(SITUATIONS)
    assert targets.out_of_reach() == {"prefill:seq-len>=32768": "a prefill's keys are its new tokens, at most "
                                                                "2048 here"}
    assert "decode:head-size=256" in targets.within_reach()

    decode_only = production_targets(WINDOWED.restrict(max_query_len=1, sliding_window=False, max_q_heads=16,
                                                       max_sequences=64), PRODUCTION_SIZE)
    assert {name.partition(":")[0] for name in decode_only.names()} == {"decode"}
    why = decode_only.out_of_reach()
    assert why["decode:gqa-group>16"] == "capabilities: at most 16 query heads per KV head"
    assert why["decode:far-window"] == "capabilities: no sliding window"
    assert why["decode:sequences>=128"] == "capabilities: at most 64 sequences"
    assert decode_only.within_reach() == ["decode:head-size=256", "decode:offsets>2^31", "decode:seq-len>=32768"]

    shared = production_targets(WINDOWED, PRODUCTION_SIZE.__class__(huge_cache_bytes=0))
    assert shared.out_of_reach()["mixed:offsets>2^31"].startswith("size: no cache past 2^31 elements")
    interpreted = production_targets(WINDOWED, INTERPRETER_PRODUCTION_SIZE).out_of_reach()
    assert interpreted["decode:seq-len>=32768"] == "size: sequences of at most 4096 keys"
    assert interpreted["decode:sequences>=128"] == "size: at most 8 sequences"
    assert interpreted["decode:gqa-group>16"] == "size: at most 8 query heads per KV head"  # the kernel takes 128


def test_a_case_meets_the_targets_of_its_own_batch_kind_only():
    targets = production_targets(WINDOWED, PRODUCTION_SIZE)
    features = {"batch:decode", "seq-len>=32768", "offsets>2^31", "far-window"}
    assert targets.met(features, 256) == ["decode:head-size=256", "decode:offsets>2^31", "decode:seq-len>=32768",
                                          "decode:far-window"]
    assert targets.met(features - {"batch:decode"} | {"batch:mixed"}, 64) == [
        "mixed:offsets>2^31", "mixed:seq-len>=32768", "mixed:far-window"]
    assert targets.met({"batch:prefill", "seq-len>=32768"}, 64) == []  # out of reach: never counted


def _aimed(draw_strategy_caps, aim: Aim, count: int, pool=None, size=PRODUCTION_SIZE):
    strategy = paged_cases(draw_strategy_caps, tier="production", production=size, pool=pool,
                           aims=Aims((aim,), urgent=True))
    return drawn(strategy, count)


# the size of a campaign of 14 jobs on one GPU: live keys for its share (harness.campaign.scope)
SHARED_14 = dataclasses.replace(PRODUCTION_SIZE, huge_cache_bytes=0, max_live_keys=PRODUCTION_SIZE.max_live_keys // 14)


@pytest.mark.parametrize("size", [PRODUCTION_SIZE, SHARED_14], ids=["alone", "shared-14"])
@pytest.mark.parametrize("kind", ["decode", "prefill", "chunked-prefill", "mixed"])
def test_an_aimed_case_reaches_its_batch_kind_and_situations(kind, size):
    caps = vllm.TRITON_ATTN_CAPABILITIES.restrict(non_causal=False)
    pool = campaign_pool(caps, 16, 2, tier="production")
    situations = frozenset(s for s in SITUATIONS if not (kind == "prefill" and s == "seq-len>=32768"))
    targets = production_targets(caps, size, pool)
    cases = _aimed(caps, Aim(kind, situations), 30, pool, size)
    of_kind = [c for c in cases if batch_kind(c) == kind]
    assert len(of_kind) >= len(cases) // 2  # the rest drawn freely, or with a bend shrunk off as generated
    reached = {name for c in of_kind for name in targets.met(size_features(c) | {f"batch:{kind}"},
                                                                c.geometry.head_size)}
    assert reached == {name for name in targets.within_reach() if name.startswith(kind + ":")}
    for case in cases:
        assert caps.unsupported(case) is None


def test_aimed_cases_keep_their_long_sequence_whatever_hypothesis_favours():
    """Hypothesis favours a draw's simplest value far beyond its weight and copies choices between a
    case's spans: with one weighted draw per bend and per floor, 142 of these 600 cases had their
    32k keys.  With three draws each, shrinking still goes step by step (the tests above)."""
    caps = vllm.TRITON_ATTN_CAPABILITIES.restrict(non_causal=False)
    pool = campaign_pool(caps, 16, 2, tier="production")
    long_ones = 0
    for kind in ("decode", "chunked-prefill", "mixed"):
        cases = _aimed(caps, Aim(kind, frozenset({"seq-len>=32768", "sequences>=128"})), 200, pool)
        long_ones += sum(1 for c in cases if batch_kind(c) == kind and "seq-len>=32768" in size_features(c))
    assert long_ones >= 200


def test_an_unaimed_draw_gives_every_kind_its_share_of_production_cases():
    caps = vllm.ROCM_ATTN_CAPABILITIES.restrict(sliding_window=False)
    kinds = {batch_kind(c) for c in drawn(paged_cases(caps, tier="production"), 60)}
    assert kinds == {"decode", "prefill", "chunked-prefill", "mixed"}


def test_a_failure_an_aimed_case_shows_sheds_every_bend_it_does_not_need():
    # every production case aimed at every situation, in a mixed batch
    caps = WINDOWED.restrict(non_causal=False)
    aims = Aims((Aim("mixed", frozenset(SITUATIONS)),), urgent=True)
    strategy = paged_cases(caps, tier="production", production=PRODUCTION_SIZE, aims=aims)
    quick = settings(database=None, max_examples=2000, derandomize=True, suppress_health_check=list(HealthCheck))
    minimal = find(strategy, lambda c: c.max_seq_len >= 3000, settings=quick)
    g = minimal.geometry
    assert 3000 <= minimal.max_seq_len <= 3032 and len(minimal.sequences) <= 2  # a floor cut 32 keys at a time
    assert (g.num_q_heads, g.num_kv_heads, g.head_size) == (1, 1, 64) and not minimal.sliding_window
    assert "offsets>2^31" not in size_features(minimal)
    many = find(strategy, lambda c: len(c.sequences) >= 130, settings=quick)
    assert len(many.sequences) == 130 and many.max_seq_len < 3000


def test_a_far_window_failure_shrinks_to_the_shortest_sequence_its_window_lies_far_below():
    caps = WINDOWED.restrict(non_causal=False)
    aims = Aims((Aim("decode", frozenset({FAR_WINDOW})),), urgent=True)
    strategy = paged_cases(caps, tier="production", production=PRODUCTION_SIZE, aims=aims)
    minimal = find(strategy, lambda c: "far-window" in size_features(c) and c.sliding_window >= 100,
                   settings=settings(database=None, max_examples=2000, derandomize=True,
                                     suppress_health_check=list(HealthCheck)))
    assert minimal.sliding_window == 128 and minimal.max_seq_len == 1024 and len(minimal.sequences) == 1
