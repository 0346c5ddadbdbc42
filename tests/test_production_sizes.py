"""Production sizes: every size is drawn, tiers shrink toward small, and a large case is built on
its device with the bits the host build gives, in caches that keep nothing from one case to the next."""
import json

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, find, settings

import nanfuzz.reference.case as case_module
from nanfuzz.harness.campaign.runner import fuzz
from nanfuzz.harness.judge.check import Verdict, check
from nanfuzz.harness.judge.pool import process_pool
from nanfuzz.harness.scaling import drawn
from nanfuzz.reference import values
from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.case import Case, Geometry, Poison, PoisonSite, Sequence
from nanfuzz.reference.device_build import background, build_on_device, written_blocks
from nanfuzz.reference.features import size_features
from nanfuzz.reference.materialize import build_on_host
from nanfuzz.strategies import paged_cases
from nanfuzz.strategies.cases import INTERPRETER_LONG
from nanfuzz.strategies.production import EDGE_GRANULARITIES, PRODUCTION_SIZE
from nanfuzz.strategies.steady import steady_draws
from tests import production_kernels
from tests.torch_kernels import BUGS, torch_kernel

WIDE = Capabilities(non_causal=True, sinks=True, head_sizes=(64, 128, 256), kv_cache_dtypes=("auto", "fp8_e4m3fn"))


@pytest.fixture(scope="module")
def production_cases():
    return drawn(paged_cases(WIDE, tier="production", production=PRODUCTION_SIZE), 150)


@pytest.mark.parametrize("size", ["seq-len>=32768", "sequences>=128", "q-heads>=64", "gqa-group>16",
                                  "head-size>=192", "query-len>=1024", "expired>=1024", "offsets>2^31",
                                  "cache>=8GiB", "large"])
def test_every_production_size_is_drawn(production_cases, size):
    assert any(size in size_features(case) for case in production_cases), size


def test_production_cases_reach_the_longest_sequence_and_the_most_heads_and_sequences(production_cases):
    assert max(c.max_seq_len for c in production_cases) > 40000
    assert max(len(c.sequences) for c in production_cases) > 150
    assert max(c.geometry.num_q_heads for c in production_cases) > 64
    assert max(c.max_query_len for c in production_cases) >= 1024


def test_windows_straddle_partition_boundaries(production_cases):
    edges = set()
    for case in production_cases:
        for seq in case.sequences:
            lo = seq.live_range(case.sliding_window)[0]
            if case.sliding_window and seq.query_len and lo:
                edges.update(g for g in EDGE_GRANULARITIES if g >= 512 and lo % g in (0, 1, g - 1))
    assert {512, 1024, 2048} <= edges


def test_huge_caches_place_live_blocks_past_the_2_31_element_boundary(production_cases):
    huge = [c for c in production_cases if "offsets>2^31" in size_features(c)]
    assert huge
    for case in huge:
        g = case.geometry
        per_block = g.block_size * g.num_kv_heads * g.head_size
        live_ids = written_blocks(case)
        assert live_ids.max() * per_block >= 1 << 31  # a block some query reads lies past it
        assert len(case.to_json()) < 4 << 20  # the table and lengths, never the cache


def test_production_cases_respect_the_kernels_limits():
    caps = WIDE.restrict(max_seq_len=5000, max_group=4, max_sequences=3, max_blocks=3000, max_q_heads=32)
    for case in drawn(paged_cases(caps, tier="production"), 60):
        assert caps.unsupported(case) is None
        assert case.max_seq_len <= 5000 and len(case.sequences) <= 3 and case.geometry.queries_per_kv <= 4


def test_production_failures_shrink_toward_small():
    with steady_draws():
        minimal = find(paged_cases(WIDE, tier="mixed"), lambda c: c.max_seq_len >= 3000,
                       settings=settings(database=None, max_examples=2000, derandomize=True,
                                         suppress_health_check=list(HealthCheck)))
    g = minimal.geometry
    # a free draw's 3000 keys, or an aimed floor cut 32 keys at a time
    assert 3000 <= minimal.max_seq_len <= 3032 and len(minimal.sequences) == 1
    # (a window that keeps every key live may stay: the condition does not care, nor does a bug it stands for)
    assert (g.num_q_heads, g.num_kv_heads, g.head_size) == (1, 1, 64)
    assert not minimal.sliding_window or minimal.sliding_window >= minimal.max_seq_len // 3
    assert g.num_blocks <= -(-3000 // g.block_size) + 3  # fresh blocks from 1, no huge cache


def test_a_failure_small_cases_also_show_shrinks_into_the_small_tier():
    with steady_draws():
        minimal = find(paged_cases(WIDE, tier="mixed"), lambda c: len(c.sequences) >= 3,
                       settings=settings(database=None, max_examples=2000, derandomize=True,
                                         suppress_health_check=list(HealthCheck)))
    assert len(minimal.sequences) == 3 and not minimal.large and minimal.max_seq_len <= 8 * 64


def test_hashing_on_a_device_gives_the_host_bits():
    index = torch.cat([torch.randint(-2**62, 2**62, (5000,)), torch.arange(100), torch.tensor([2**63 - 1, -2**63])])
    for seed in (0, 1, 2**64 - 1):
        assert torch.equal(values._bits_tensor(seed, "cache_k", index), values.random_bits(seed, "cache_k", index))


# -- large cases: built on the device, in pooled caches ---------------------------------

G = Geometry(4, 2, 32, 8, 9, "float32")
# seq 0: decode at position 19, window 6 -> keys 14..19 live; seq 1: chunked prefill; block 8 unreferenced
WINDOWED = Case(G, (Sequence(1, 20, (1, 2, 3)), Sequence(3, 11, (4, 5, 7))), sliding_window=6,
                padding_block=7, poison=Poison("nan", "kv", None), data_seed=5).validate()
MIXED_POISON = WINDOWED.replace(poison=Poison("inf", "v", (PoisonSite(3, 5), PoisonSite(8))))


@pytest.fixture
def every_case_large(monkeypatch):
    monkeypatch.setattr(case_module, "LARGE_ELEMENTS", 0)


def _pool_is_background(case) -> bool:
    pool = process_pool()
    for name, buffer in pool._buffers.items():
        if buffer.bytes is None or buffer.pattern is None:
            continue
        value, width = buffer.pattern
        words = buffer.bytes[:buffer.extent].view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[width])
        if not bool((words == (value - (1 << (8 * width)) if value >= 1 << (8 * width - 1) else value)).all()):
            return False
    return True


@pytest.mark.parametrize("case", [WINDOWED, MIXED_POISON], ids=["all-nan", "sites-inf"])
def test_a_large_case_holds_the_host_builds_bits_in_the_blocks_it_writes(every_case_large, case):
    host = build_on_host(case)
    device = build_on_device(case, "cpu")
    ids = device.ids
    for name in ("key_cache", "value_cache"):
        assert torch.equal(host.allocations[name].view[ids].view(torch.int32), device.caches[name].view(torch.int32))
    for name in ("q", "k", "v", "seq_lens", "query_start_loc", "block_table"):
        a, b = host.allocations[name].base, device.small[name].base
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), name  # NaN margins included
    if case.poison.sites:  # the named blocks are written, block 8 holding no live key among them
        assert set(ids.tolist()) >= {3, 8}
    else:  # block 8 holds no live key: never written, NaN in every run
        assert 8 not in ids.tolist()


@pytest.mark.parametrize("bug", BUGS)
def test_large_cases_give_the_small_cases_verdicts(every_case_large, bug, monkeypatch):
    large = check(torch_kernel(bug), WINDOWED, "cpu")
    monkeypatch.setattr(case_module, "LARGE_ELEMENTS", 1 << 40)
    small = check(torch_kernel(bug), WINDOWED, "cpu")
    assert large.verdict is small.verdict, (large.summary, small.summary)
    assert large.output_sha256 == small.output_sha256


def test_pooled_caches_keep_nothing_from_one_case_to_the_next(every_case_large):
    assert check(torch_kernel(), WINDOWED, "cpu").verdict is Verdict.PASS
    assert _pool_is_background(WINDOWED)
    other = WINDOWED.replace(sequences=(Sequence(2, 9, (6, 2, 7)),), sliding_window=0, data_seed=9).validate()
    assert check(torch_kernel(), other, "cpu").verdict is Verdict.PASS
    assert _pool_is_background(other)


def _scribbles_in_an_unused_block(batch, out):
    from tests.torch_kernels import attention

    attention(batch, out)
    batch.key_cache[8].fill_(1.5)  # block 8 holds no live key of the case
    return out


def test_a_kernel_that_writes_past_its_blocks_is_clobber_and_the_next_case_starts_clean(every_case_large):
    from nanfuzz.harness.kernel import Kernel
    from tests.torch_kernels import CAPS

    scribbler = Kernel("torch@scribbles", _scribbles_in_an_unused_block, CAPS)
    outcome = check(scribbler, WINDOWED, "cpu")
    assert outcome.verdict is Verdict.CLOBBER and "key_cache outside the blocks" in outcome.summary
    assert check(torch_kernel(), WINDOWED, "cpu").verdict is Verdict.PASS
    assert _pool_is_background(WINDOWED)


def test_a_large_case_replays_bit_for_bit_from_its_json(every_case_large):
    again = Case.from_json(WINDOWED.to_json())
    assert again == WINDOWED
    first, second = check(torch_kernel(), WINDOWED, "cpu"), check(torch_kernel(), again, "cpu")
    assert first.output_sha256 == second.output_sha256


def test_a_big_table_is_written_without_its_padding_and_read_back():
    seqs = tuple(Sequence(1, 16 * 300, tuple(range(1 + 300 * i, 301 + 300 * i)) + (0,) * 700) for i in range(20))
    case = Case(Geometry(1, 1, 32, 16, 6001, "float16"), seqs, poison=Poison("nan", "v", None)).validate()
    record = case.to_dict()
    assert record["table_width"] == 1000 and all(len(s["block_table"]) == 300 for s in record["sequences"])
    assert Case.from_dict(json.loads(json.dumps(record))) == case
    assert case.large is False or case.large is True  # either way it round-trips


# -- campaigns at production size with a plain-torch subject ---------------------------------

def test_a_production_campaign_passes_a_correct_kernel_and_says_what_it_reached(tmp_path):
    campaign = fuzz(production_kernels.correct, device="cpu", max_examples=40, seed=3, use_database=False,
                    state_dir=tmp_path)
    assert not campaign.failed, campaign.failure and campaign.failure.summary
    assert campaign.examples == 40 and "seq-len>=1024" in campaign.statistics.to_dict()["groups"]["sizes"]


def test_a_bug_only_long_sequences_meet_is_caught_and_shrunk_to_one_short_production_sequence(tmp_path):
    campaign = fuzz(production_kernels.drops_long_tail, device="cpu", max_examples=60, seed=1, use_database=False,
                    state_dir=tmp_path)
    assert campaign.failed and campaign.failure.verdict in (Verdict.MISMATCH, Verdict.NONFINITE)
    case = campaign.failing_case
    assert len([s for s in case.sequences if s.query_len]) == 1
    assert 1024 < case.max_seq_len < 2048 and case.geometry.num_kv_heads == 1


def test_the_interpreters_small_tier_meets_the_same_bug_only_in_its_long_batches(tmp_path):
    campaign = fuzz(production_kernels.drops_long_tail, device="cpu", max_examples=100, seed=1, use_database=False,
                    state_dir=tmp_path, size="small")
    assert campaign.failed
    # met in a long batch, shrunk to the fewest sequences one has, then cut down to its first, just past 1024 keys
    case = campaign.failing_case
    assert len(case.sequences) == 1 and 1024 < case.max_seq_len < 1100
    assert any(f"of {INTERPRETER_LONG.min_sequences} fails alone" in note for note in campaign.notes), campaign.notes


def test_background_is_the_encodings_nan():
    case = WINDOWED.replace(kv_cache=case_module.KVCache("fp8_e4m3fnuz", "tensor", 1.0, 1.0))
    assert background(case, "key_cache") == (0x80, 1) and background(WINDOWED, "value_cache") == (0x7FC00000, 4)
    assert np.isnan(np.array([0x7FC00000], dtype=np.uint32).view(np.float32))[0]


def test_only_a_campaign_alone_on_its_device_draws_huge_caches():
    from nanfuzz.harness.campaign.scope import campaign_production_size
    from nanfuzz.harness.campaign.settings import Settings
    from nanfuzz.harness.gate.devices import gpu_workers

    assert campaign_production_size(Settings(device="cuda")).huge_cache_bytes > 0
    assert campaign_production_size(Settings(device="cuda", jobs=2)).huge_cache_bytes == 0
    shared = gpu_workers(["0"], None, "CUDA 12", per_gpu=3).slots[0].env
    assert campaign_production_size(Settings.from_environment(shared, device="cuda")).huge_cache_bytes == 0
    alone = gpu_workers(["0"], None, "CUDA 12").slots[0].env
    assert campaign_production_size(Settings.from_environment(alone, device="cuda")).huge_cache_bytes > 0


def test_a_campaign_sharing_its_device_draws_live_keys_for_its_share_alone():
    from nanfuzz.harness.campaign.scope import SHARED_LEAST_LIVE_KEYS, campaign_production_size, campaign_strategy
    from nanfuzz.harness.campaign.settings import Settings

    alone = Settings(device="cuda", size="production")
    assert campaign_production_size(alone) == PRODUCTION_SIZE
    side_by_side, jobs = alone.replace(campaigns_per_device=9), alone.replace(jobs=14)
    assert campaign_production_size(side_by_side).max_live_keys == PRODUCTION_SIZE.max_live_keys // 9
    assert campaign_production_size(jobs).max_live_keys == PRODUCTION_SIZE.max_live_keys // 14
    # a job's own settings (one job, the device shared fourteen ways) draw the same as its campaign's
    assert campaign_production_size(jobs.replace(jobs=1, campaigns_per_device=14)) == campaign_production_size(jobs)
    many = alone.replace(campaigns_per_device=64)
    assert campaign_production_size(many).max_live_keys == SHARED_LEAST_LIVE_KEYS
    interpreter = Settings(device="cpu", size="production", jobs=4)
    assert campaign_production_size(interpreter).max_live_keys == campaign_production_size(
        interpreter.replace(jobs=1)).max_live_keys  # its budget is below the least already
    budget = PRODUCTION_SIZE.max_live_keys // 9
    lives = [sum(hi - lo for lo, hi in (q.live_range(case.sliding_window) for q in case.sequences))
             for case in drawn(campaign_strategy(Capabilities(), side_by_side, None, "production"), 40)]
    assert max(lives) <= budget and max(lives) > budget // 2, (max(lives), budget)
