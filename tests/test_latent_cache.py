"""The latent (MLA) cache mode: one cache of rows kv_lora_rank + rope_dim, K the whole row, V its
first kv_lora_rank entries, one KV head for every query head; the oracle, the same-precision
reference, poison, redzones and the device build follow it."""
import json

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings

import nanfuzz.reference.case as case_module
from nanfuzz.harness.judge.check import Verdict, check
from nanfuzz.harness.report.picture import picture
from nanfuzz.harness.report.statistics import Statistics
from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.case import Case, Geometry, Poison, PoisonSite, Sequence
from nanfuzz.reference.device_build import build_on_device
from nanfuzz.reference.errors import CaseError, NanfuzzError
from nanfuzz.reference.materialize import build_on_host, materialize, refill_dead_slots
from nanfuzz.reference.oracle import oracle
from nanfuzz.strategies import paged_cases
from tests import latent_kernels
from tests.brute_force import brute_force
from tests.latent_kernels import MLA_CAPS

LATENT = Geometry(8, 1, 80, 16, 6, "float32", latent_rank=64)
# seq 0: decode at 19, window 7 (keys 13..19); seq 1: a decode whose padding entry points at block 0;
# seq 2: a chunked prefill; block 5 unreferenced
CASE = Case(LATENT, (Sequence(1, 20, (1, 2)), Sequence(1, 5, (3, 0)), Sequence(3, 19, (4, 2))), sliding_window=7,
            poison=Poison("nan", "v"), data_seed=3).validate()


def kernel(bug=None):
    return getattr(latent_kernels, "mla_" + (bug or "correct").replace("-", "_"))


def test_a_latent_case_round_trips_and_a_record_without_it_reads_as_before():
    again = Case.from_json(CASE.to_json())
    assert again == CASE and again.geometry.v_head_size == 64 and again.geometry.rope_dim == 16
    plain = CASE.replace(geometry=Geometry(8, 1, 80, 16, 6, "float32"))
    record = plain.to_dict()
    assert "latent_rank" not in record["geometry"]  # as every repro read before latent caches
    assert Case.from_dict(json.loads(json.dumps(record))) == plain


@pytest.mark.parametrize("geometry,why", [
    (Geometry(8, 2, 80, 16, 6, "float32", latent_rank=64), "one KV head"),
    (Geometry(8, 1, 80, 16, 6, "float32", latent_rank=80), "latent_rank=80 must lie in 1..head_size-1"),
    (Geometry(8, 1, 80, 16, 6, "float32", latent_rank=-1), "latent_rank=-1"),
])
def test_a_latent_geometry_that_cannot_be_is_one_line(geometry, why):
    with pytest.raises(CaseError, match=why):
        CASE.replace(geometry=geometry).validate()


def test_the_value_cache_is_a_view_of_the_latent_part_of_the_one_cache():
    batch = materialize(CASE)
    assert batch.key_cache.shape == (6, 16, 1, 80) and batch.value_cache.shape == (6, 16, 1, 64)
    assert batch.value_cache.data_ptr() == batch.key_cache.data_ptr()  # the same memory
    assert "value_cache" not in batch.inputs() and "value_cache" not in batch.allocations
    assert torch.equal(batch.v, batch.k[..., :64])
    copy = batch.clone()
    assert copy.value_cache.data_ptr() == copy.key_cache.data_ptr() != batch.key_cache.data_ptr()


@pytest.mark.parametrize("tensors,poisoned", [("v", slice(0, 64)), ("k", slice(64, 80)), ("kv", slice(0, 80))])
def test_poison_goes_into_the_latent_part_the_rope_part_or_both(tensors, poisoned):
    batch = materialize(CASE.replace(poison=Poison("nan", tensors)))
    tail = batch.key_cache[1, 4:]  # seq 0's expired keys 4..12 of block 1... and its live slots 13..15
    dead = tail[:9, 0]
    assert torch.isnan(dead[:, poisoned]).all()
    rest = torch.ones(80, dtype=torch.bool)
    rest[poisoned] = False
    assert torch.isfinite(dead[:, rest]).all()  # the other part holds finite garbage
    assert torch.isfinite(tail[9:]).all()  # live


def test_the_oracle_reads_k_from_the_whole_row_and_v_from_the_latent_part():
    batch = materialize(CASE)
    expected = torch.tensor(brute_force(batch), dtype=torch.float64)
    assert torch.allclose(oracle(batch), expected, rtol=1e-12, atol=1e-12)
    assert oracle(batch).shape == (5, 8, 64)


def test_leak_runs_refill_the_one_cache_as_a_fresh_build_does():
    refilled, fresh = refill_dead_slots(build_on_host(CASE), 1), build_on_host(CASE, garbage_seed=1, poisoned=False)
    for name, tensor in fresh.allocations.items():
        assert torch.equal(refilled.allocations[name].base.view(torch.int32), tensor.base.view(torch.int32)), name


@pytest.mark.parametrize("bug,verdict", [(None, "PASS"), ("mask-multiply", "NONFINITE"), ("no-rope", "MISMATCH"),
                                         ("v-from-rope", "MISMATCH"), ("writes-cache", "CLOBBER")])
def test_verdicts_on_a_latent_cache(bug, verdict):
    outcome = check(kernel(bug), CASE, "cpu")
    assert outcome.verdict.value == verdict, outcome.summary


def test_rope_part_poison_reaches_only_a_kernel_that_reads_it_unmasked():
    """NaN in the rope part enters the scores alone, which a score mask removes; NaN in the latent part
    is V too, and a kernel that multiplies masked V by p = 0 shows it."""
    rope = CASE.replace(poison=Poison("nan", "k"))
    assert check(kernel("mask-multiply"), rope, "cpu").verdict is Verdict.PASS
    assert check(kernel("mask-multiply"), CASE, "cpu").verdict is Verdict.NONFINITE


@pytest.mark.parametrize("bug", [None, "no-rope", "writes-cache"])
def test_a_large_latent_case_has_the_host_builds_bits_and_verdicts(bug, monkeypatch):
    case = CASE.replace(poison=Poison("nan", "k", (PoisonSite(1, 2), PoisonSite(5)))).validate()
    small = check(kernel(bug), case, "cpu")
    monkeypatch.setattr(case_module, "LARGE_ELEMENTS", 0)
    assert case.large
    host, device = build_on_host(case), build_on_device(case, "cpu")
    assert set(device.caches) == {"key_cache"}  # the one cache
    assert torch.equal(host.allocations["key_cache"].view[device.ids].view(torch.int32),
                       device.caches["key_cache"].view(torch.int32))
    for name in ("q", "k", "v"):
        assert torch.equal(host.allocations[name].base.view(torch.int32), device.small[name].base.view(torch.int32))
    large = check(kernel(bug), case, "cpu")
    assert large.verdict is small.verdict and large.output_sha256 == small.output_sha256, large.summary


def test_mla_capabilities_draw_latent_cases_only_and_other_kernels_refuse_them():
    seen = set()

    @settings(max_examples=40, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(paged_cases(MLA_CAPS, interpreter=True))
    def drawn(case):
        g = case.geometry
        assert g.num_kv_heads == 1 and (g.latent_rank, g.rope_dim) in MLA_CAPS.mla
        seen.add(g.head_size)

    drawn()
    assert seen == {48, 80, 576}
    assert "MLA latent cache" in Capabilities().unsupported(CASE)
    assert "not an MLA latent cache" in MLA_CAPS.unsupported(CASE.replace(geometry=Geometry(8, 1, 80, 16, 6, "float32")))
    assert "latent rank 48 + rope 32" in MLA_CAPS.unsupported(
        CASE.replace(geometry=Geometry(8, 1, 80, 16, 6, "float32", latent_rank=48)))
    assert MLA_CAPS.head_sizes == (48, 80, 576) and "mla 32+16,64+16,512+64" in MLA_CAPS.describe()
    with pytest.raises(NanfuzzError, match="one row width"):
        Capabilities(mla=((64, 16), (48, 32)))


def test_the_picture_and_the_statistics_name_the_latent_cache():
    text = picture(CASE)
    assert "latent cache 64 + rope 16 (V: the first 64)" in text and "nan in the latent part (V)" in text
    stats = Statistics()
    stats.add(CASE)
    assert stats.counts["mla:64+16"] == 1
