"""V head size different from K's (``Geometry.head_size_v``): separate K and V caches of their own
widths; the strategies, materialisation (host and device), redzones, the oracle, the judges, the
repro JSON, the picture and shrinking follow it."""
import dataclasses
import json

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings

import nanfuzz.reference.case as case_module
from nanfuzz.harness.campaign.runner import fuzz
from nanfuzz.harness.judge.check import Verdict, check
from nanfuzz.harness.report.picture import picture
from nanfuzz.harness.report.repro import load_repro, write_repro
from nanfuzz.harness.report.statistics import Statistics
from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.case import Case, Poison, PoisonSite
from nanfuzz.reference.device_build import build_on_device
from nanfuzz.reference.errors import CaseError, NanfuzzError
from nanfuzz.reference.materialize import build_on_host, materialize, refill_dead_slots
from nanfuzz.reference.oracle import oracle
from nanfuzz.strategies import paged_cases
from tests import diff_kv_kernels
from tests.brute_force import brute_force
from tests.cases import consecutive_case
from tests.diff_kv_kernels import DIFF_KV_CAPS

# seq 0: a decode at 19 under a window of 7; seq 1: a chunked prefill; every dead slot holds NaN in V
CASE = consecutive_case([(1, 20), (3, 19)], head_size=64, head_size_v=32, dtype="float32", window=7,
                        poison=Poison("nan", "v"), seed=5)


def kernel(bug=None):
    return getattr(diff_kv_kernels, "diff_kv_" + (bug or "correct").replace("-", "_"))


def test_a_diff_kv_case_round_trips_and_a_record_without_it_reads_as_before():
    again = Case.from_json(CASE.to_json())
    assert again == CASE and again.geometry.v_head_size == 32 and CASE.to_dict()["geometry"]["head_size_v"] == 32
    plain = CASE.replace(geometry=dataclasses.replace(CASE.geometry, head_size_v=0))
    record = plain.to_dict()
    assert "head_size_v" not in record["geometry"]  # as every repro read before V had a head size of its own
    assert Case.from_dict(json.loads(json.dumps(record))) == plain


@pytest.mark.parametrize("head_size_v,why", [
    (64, "head_size_v=64 equals head_size; leave it out"),
    (-1, "head_size_v=-1 must lie in 1..1024"),
    (2048, "head_size_v=2048 must lie in 1..1024"),
])
def test_a_v_head_size_that_cannot_be_is_one_line(head_size_v, why):
    with pytest.raises(CaseError, match=why):
        CASE.replace(geometry=dataclasses.replace(CASE.geometry, head_size_v=head_size_v)).validate()
    latent = dataclasses.replace(CASE.geometry, num_kv_heads=1, latent_rank=48)
    with pytest.raises(CaseError, match="head_size_v and latent_rank exclude each other"):
        CASE.replace(geometry=latent).validate()


def test_an_older_repro_still_loads_and_a_new_one_says_its_version(tmp_path):
    [path, *_] = write_repro(kernel(), CASE, check(kernel(), CASE, "cpu"), tmp_path, "cpu")
    record = json.loads(path.read_text())
    assert record["schema_version"] == case_module.SCHEMA_VERSION == 2 and load_repro(path)["case"] == CASE
    old = CASE.replace(geometry=dataclasses.replace(CASE.geometry, head_size_v=0))
    path.write_text(json.dumps({**record, "schema_version": 1, "case": old.to_dict()}))
    assert load_repro(path)["case"] == old
    path.write_text(json.dumps({**record, "schema_version": 3}))
    with pytest.raises(NanfuzzError, match="repro schema version 3; this nanfuzz reads 1, 2"):
        load_repro(path)


def test_the_caches_the_new_tokens_and_the_oracle_have_v_s_width():
    batch = materialize(CASE)
    assert batch.key_cache.shape[-1] == 64 and batch.value_cache.shape[-1] == 32
    assert batch.q.shape[-1] == batch.k.shape[-1] == 64 and batch.v.shape[-1] == 32
    expected = torch.tensor(brute_force(batch), dtype=torch.float64)
    assert oracle(batch).shape == (4, 4, 32)
    assert torch.allclose(oracle(batch), expected, rtol=1e-12, atol=1e-12)
    # the margins around the value cache are whole V-wide blocks of NaN
    base = batch.allocations["value_cache"].base
    assert base.shape[1:] == (16, 2, 32) and torch.isnan(base[0]).all() and torch.isnan(base[-1]).all()


def test_leak_runs_refill_both_caches_as_a_fresh_build_does():
    refilled, fresh = refill_dead_slots(build_on_host(CASE), 1), build_on_host(CASE, garbage_seed=1, poisoned=False)
    for name, tensor in fresh.allocations.items():
        assert torch.equal(refilled.allocations[name].base.view(torch.int32), tensor.base.view(torch.int32)), name


@pytest.mark.parametrize("bug,verdicts", [(None, {"PASS"}), ("mask-multiply", {"NONFINITE"}),
                                          ("v-at-k-stride", {"NONFINITE", "MISMATCH"})])
@pytest.mark.parametrize("heads", DIFF_KV_CAPS.diff_kv)
def test_verdicts_with_a_narrower_and_a_wider_v(bug, verdicts, heads):
    k, v = heads
    case = CASE.replace(geometry=dataclasses.replace(CASE.geometry, head_size=k, head_size_v=v)).validate()
    outcome = check(kernel(bug), case, "cpu")
    assert outcome.verdict.value in verdicts, outcome.summary


def test_a_kernel_that_reads_v_with_k_s_stride_is_off_even_where_every_slot_it_reads_is_finite():
    # K narrower than V: the rows it reads stay inside the value cache, whose dead slots hold finite garbage
    wide_v = dataclasses.replace(CASE.geometry, head_size=32, head_size_v=48)
    clean = CASE.replace(geometry=wide_v, poison=Poison("max", "k")).validate()
    outcome = check(kernel("v-at-k-stride"), clean, "cpu")
    assert outcome.verdict in (Verdict.MISMATCH, Verdict.LEAK), outcome.summary


@pytest.mark.parametrize("bug", [None, "head-map"])
def test_a_large_diff_kv_case_has_the_host_builds_bits_and_verdicts(bug, monkeypatch):
    case = CASE.replace(poison=Poison("nan", "kv", (PoisonSite(1, 2), PoisonSite(5)))).validate()
    small = check(kernel(bug), case, "cpu")
    monkeypatch.setattr(case_module, "LARGE_ELEMENTS", 0)
    assert case.large
    host, device = build_on_host(case), build_on_device(case, "cpu")
    for name in ("key_cache", "value_cache"):
        assert torch.equal(host.allocations[name].view[device.ids].view(torch.int32),
                           device.caches[name].view(torch.int32)), name
    for name in ("q", "k", "v"):
        assert torch.equal(host.allocations[name].base.view(torch.int32), device.small[name].base.view(torch.int32))
    large = check(kernel(bug), case, "cpu")
    assert large.verdict is small.verdict and large.output_sha256 == small.output_sha256, large.summary


def test_capabilities_draw_the_declared_pairs_and_other_kernels_refuse_them():
    seen = set()

    @settings(max_examples=150, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(paged_cases(DIFF_KV_CAPS, interpreter=True))
    def drawn(case):
        g = case.geometry
        assert not g.diff_kv or (g.head_size, g.head_size_v) in DIFF_KV_CAPS.diff_kv
        seen.add((g.head_size, g.v_head_size))

    drawn()
    assert {(64, 32), (32, 48)} <= seen and any(k == v for k, v in seen)
    assert "head sizes K 64 / V 32 (supported: V as wide as K)" in Capabilities().unsupported(CASE)
    assert "head sizes K 64 / V 32 (supported: 32/48)" in Capabilities(diff_kv=((32, 48),)).unsupported(CASE)
    assert DIFF_KV_CAPS.unsupported(CASE) is None and "k/v-heads 32/48,64/32" in DIFF_KV_CAPS.describe()
    for bad in (((64, 64),), ((64, 0),), ((64,),)):
        with pytest.raises(NanfuzzError, match="must be \\(K head size, V head size\\) pairs"):
            Capabilities(diff_kv=bad)
    with pytest.raises(NanfuzzError, match="give one of them"):
        Capabilities(diff_kv=((64, 32),), mla=((64, 16),))


def test_a_failure_that_needs_no_v_head_size_of_its_own_shrinks_to_v_as_wide_as_k(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    campaign = fuzz(kernel("mask-multiply"), device="cpu", max_examples=100, seed=3, use_database=False)
    assert campaign.failure.verdict is Verdict.NONFINITE
    g = campaign.failing_case.geometry
    assert not g.diff_kv and g.head_size == min(DIFF_KV_CAPS.head_sizes), g


def test_a_failure_that_needs_it_shrinks_to_the_simplest_pair_and_a_correct_kernel_passes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    campaign = fuzz(kernel("v-at-k-stride"), device="cpu", max_examples=100, seed=3, use_database=False)
    assert campaign.failed, "reading V with K's stride went unseen"
    g = campaign.failing_case.geometry
    assert (g.head_size, g.head_size_v) == DIFF_KV_CAPS.diff_kv[0], g
    assert not fuzz(kernel(), device="cpu", max_examples=60, seed=3, use_database=False).failed


def test_the_picture_and_the_statistics_name_both_head_sizes():
    assert "head K 64 / V 32" in picture(CASE)
    stats = Statistics()
    stats.add(CASE)
    assert stats.counts["v-head-size!=k"] == 1 and stats.counts["head:64/32"] == 1


@pytest.mark.parametrize("bug,verdict", [(None, "PASS"), ("mask-multiply", "NONFINITE")])
def test_an_exported_script_s_runtime_builds_and_judges_v_s_own_width(bug, verdict):
    from nanfuzz.harness.report.export import runtime
    from nanfuzz.harness.report.export.script import case_literal
    from nanfuzz.reference.features import poisoned_slots

    assert "head_size_v=32" in case_literal(CASE)
    poison = dict(value="nan", tensors="v", parts="data", slots=poisoned_slots(CASE))
    batch = runtime.build_batch(CASE, poison, "cpu")
    assert batch.value_cache.shape[-1] == 32 and batch.v.shape[-1] == 32 and batch.key_cache.shape[-1] == 64
    found = runtime.judge(lambda b, out: diff_kv_kernels.diff_kv_attention(b, out, bug=bug), CASE, poison, "cpu",
                          precision="ieee")
    assert found.verdict() == verdict and found.output.shape == (4, 4, 32), found.report()
