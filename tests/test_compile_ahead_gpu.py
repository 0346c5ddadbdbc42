"""On a GPU: a campaign's farm builds its first cases, drawn while the farm's processes start, and
the self-check's one farm builds each campaign's first cases in turn, then one case per entry."""
from __future__ import annotations

import pytest

from nanfuzz.harness.campaign.compile_ahead import compile_ahead
from nanfuzz.harness.campaign.runner import fuzz
from nanfuzz.harness.campaign.settings import Settings
from nanfuzz.harness.judge.memory import MemoryPolicy
from nanfuzz.harness.registry import resolve

pytestmark = pytest.mark.gpu


def _own_ledger(tmp_path) -> MemoryPolicy:
    """A ledger of the test's own: the other GPU tests of a parallel session reserve the device's
    memory for production cases, and a farm never waits for memory (it gives a task up); here only
    what the device reports free counts."""
    (tmp_path / "ledger").mkdir(exist_ok=True)
    return MemoryPolicy(ledger_dir=str(tmp_path / "ledger"))


def test_a_campaign_s_farm_builds_the_first_cases_it_drew_meanwhile(tmp_path):
    settings = Settings(device="cuda", state_dir=tmp_path, use_database=False, seed=3, max_examples=40, size="small",
                        memory=_own_ledger(tmp_path))
    campaign = fuzz(resolve("paged_decode@masked"), settings)
    assert not campaign.failed, campaign.failure
    farm = campaign.farm
    print("farm:", farm, "| startup:", campaign.startup_seconds(), "| first example:", campaign.time_to_first_example)
    if farm is None or not farm["processes"]:
        pytest.skip("a warm Triton cache: no farm started (run with an empty TRITON_CACHE_DIR)")
    assert farm["upcoming"] > 0 and farm["compiled"] > 0
    # a farm never waits for memory: on a GPU that other programs fill it gives a task up, and for no other reason
    assert farm["given_up"] == 0 or farm["first_error"].startswith("TooLargeForDevice")
    # a short campaign may end before its farm (a busy GPU): what it left is counted, not lost
    assert farm["compiled"] + farm["unbuilt"] == farm["tasks"] - farm["already_built"]
    steps = campaign.startup_seconds()
    assert 0 <= steps["farm_started_s"] and 0 < steps["worker_loaded_s"] <= steps["worker_ready_s"]


def test_the_self_check_farm_builds_each_campaign_s_first_cases_in_turn(tmp_path):
    kernels = [resolve("paged_decode@unmasked"), resolve("paged_decode@masked")]
    base = Settings(device="cuda", state_dir=tmp_path, use_database=False, size="small", max_examples=60,
                    memory=_own_ledger(tmp_path))
    ahead = compile_ahead([(k, base) for k in kernels], base, lambda k: 16 if k.expect == "caught" else 32,
                          samples=lambda tier: 1)
    try:
        campaigns = [fuzz(k, base, farm=ahead.handle(i), search_seed=ahead.seeds[i]) for i, k in enumerate(kernels)]
    finally:
        ahead.close()
    assert [c.seed for c in campaigns] == ahead.seeds
    assert campaigns[0].failed and not campaigns[1].failed
    summary = ahead.farm.summary() if ahead.farm is not None else None
    print("farm:", summary, "| first examples:", [c.time_to_first_example for c in campaigns])
    if summary is None or not summary["processes"]:
        pytest.skip("a warm Triton cache: no farm started (run with an empty TRITON_CACHE_DIR)")
    assert summary["given_up"] == 0 or summary["first_error"].startswith("TooLargeForDevice")
    # the first cases of both campaigns (in two copies each where claims work) and one case per entry
    assert summary["upcoming"] in (16 + 32, 2 * (16 + 32))
    assert summary["tasks"] == summary["upcoming"] + 2 * 16
