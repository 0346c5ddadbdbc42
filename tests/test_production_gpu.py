"""Production sizes on a GPU: a huge cache whose block ids pass 2^31 elements, pooled caches that
keep nothing between cases, and the split-KV built-ins at lengths the small tier never draws."""
import pytest

from nanfuzz.harness.campaign.runner import fuzz
from nanfuzz.harness.judge.check import Verdict, check
from nanfuzz.harness.registry import builtin_kernels
from nanfuzz.reference.case import Case, Geometry, Poison, Sequence
from nanfuzz.reference.features import size_features
from tests import production_kernels

pytestmark = pytest.mark.gpu

# fp16, 16-slot blocks, 8 KV heads of 128: 16384 elements a block, so block 131072 starts at 2^31
THRESHOLD = (1 << 31) // (16 * 8 * 128)


def _huge_case(keys: int = 40, above: int = 5) -> Case:
    used = -(-keys // 16)
    table = tuple(range(THRESHOLD + above, THRESHOLD + above + used))
    geometry = Geometry(16, 8, 128, 16, THRESHOLD + above + used + 8, "float16")
    return Case(geometry, (Sequence(1, keys, table),), poison=Poison("nan", "kv", None), data_seed=3).validate()


def test_a_huge_cache_reaches_past_the_2_31_element_boundary():
    case = _huge_case()
    assert case.large and {"offsets>2^31", "cache>=8GiB"} <= size_features(case)
    assert check(production_kernels.correct, case, "cuda").verdict is Verdict.PASS
    wrapped = check(production_kernels.int32_offsets, case, "cuda")
    assert wrapped.verdict is not Verdict.PASS, wrapped.summary  # its int32 offsets wrap: it reads NaN


@pytest.mark.gpu_alone  # another process waiting for memory would make this one give its pool back
def test_pooled_caches_are_reused_and_stay_clean_across_cases():
    from nanfuzz.harness.judge.pool import process_pool

    for keys in (40, 3000, 17):
        assert check(production_kernels.correct, _huge_case(keys), "cuda").verdict is Verdict.PASS
    held = process_pool().held_bytes()
    assert held >= 2 * THRESHOLD * 16384 * 2  # one allocation of each cache, reused
    assert check(production_kernels.correct, _huge_case(64, above=2), "cuda").verdict is Verdict.PASS
    assert process_pool().held_bytes() == held


@pytest.mark.parametrize("variant, caught", [("drops-last-partition", True), ("masked", False)])
def test_split_decode_at_production_size(tmp_path, variant, caught):
    kernel = builtin_kernels()[f"split_decode@{variant}"]
    campaign = fuzz(kernel, device="cuda", max_examples=30, seed=2, use_database=False, state_dir=tmp_path,
                    pool_size=2, compile_jobs=0)
    assert campaign.failed is caught, campaign.failure and campaign.failure.summary
    assert "path:_partition_kernel" in campaign.statistics.counts or caught


def test_a_production_campaign_of_a_built_in_reaches_long_sequences(tmp_path):
    kernel = builtin_kernels()["paged_decode@masked"]
    campaign = fuzz(kernel, device="cuda", max_examples=30, seed=4, use_database=False, state_dir=tmp_path,
                    size="production", pool_size=2, compile_jobs=0)
    assert not campaign.failed, campaign.failure and campaign.failure.summary
    assert campaign.statistics.share("seq-len>=1024") > 0.2 and campaign.statistics.share("large") > 0


def test_hashing_on_the_gpu_gives_the_host_bits():
    import torch

    from nanfuzz.reference import values

    index = torch.cat([torch.randint(-2**62, 2**62, (100_000,)), torch.arange(5000), torch.tensor([2**63 - 1, -2**63])])
    for seed, stream in ((0, "cache_k"), (2**64 - 1, "q"), (123456789, "cache_v")):
        assert torch.equal(values.uniform(seed, stream, index.cuda()).cpu(), values.uniform(seed, stream, index))
        assert torch.equal(values.random_bits(seed, stream, index.cuda()).cpu(), values.random_bits(seed, stream, index))
