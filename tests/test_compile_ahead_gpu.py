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


_STAND_IN_KERNELS = {"paged_decode@masked": {}, "split_decode@masked": {}, "prefix_prefill@masked": {},
                     "unified@masked": {}, "vllm:rocm_attn": {"no_window": True},
                     "vllm:triton_attn": {"causal_only": True, "kv_cache_dtype": "auto"}}
_SAME_BINARIES = """
import json, os, sys
from pathlib import Path

import torch
from triton.runtime.jit import JITFunction

from nanfuzz.harness.campaign.focus import Focus
from nanfuzz.harness.campaign.scope import campaign_capabilities, campaign_pool_of, campaign_strategy
from nanfuzz.harness.campaign.settings import Settings
from nanfuzz.harness.launch import farm
from nanfuzz.harness.registry import resolve
from nanfuzz.harness.scaling import drawn

name, focus, state = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
kernel = resolve(name, vllm_src=os.environ.get("NANFUZZ_VLLM_SRC"))
settings = Settings(device="cuda", state_dir=Path(state), size="production", campaigns_per_device=2,
                    focus=Focus(**focus))
caps, _ = campaign_capabilities(kernel, settings)
pool, _ = campaign_pool_of(caps, settings, tier="production")
cases = [case for case in drawn(campaign_strategy(caps, settings, pool, "production"), 16)
         if case.large and case.geometry.num_blocks > 32 and not kernel.declines(case)][:3]
device = torch.device("cuda")

def launch(batch, case):
    g = case.geometry
    kernel(batch, torch.empty(case.num_tokens, g.num_q_heads, g.v_head_size, dtype=batch.q.dtype, device=device))
    torch.cuda.synchronize()

def binaries():
    return {path.parent.name for path in Path(os.environ["TRITON_CACHE_DIR"]).rglob("*")
            if path.suffix in (".cubin", ".hsaco")}

run = JITFunction.run
farm._compile_only()
for case in cases:
    launch(farm.compile_batch(case, device), case)
JITFunction.run = run
built = binaries()
for case in cases:
    launch(farm._built_on_device(case, device), case)
print(json.dumps({"cases": len(cases), "built": len(built), "new": sorted(binaries() - built)}))
"""


@pytest.mark.parametrize("name", sorted(_STAND_IN_KERNELS))
def test_a_large_case_s_stand_in_compiles_every_binary_its_check_launches(name, tmp_path):
    """A farm process compiles a large case as its stand-in (caches of a few blocks); the case itself,
    launched after in an empty Triton cache of its own, compiles nothing more."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    if name.startswith("vllm:") and not os.environ.get("NANFUZZ_VLLM_SRC"):
        pytest.skip("needs NANFUZZ_VLLM_SRC, a vLLM 0.33.0 tree")
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    proc = subprocess.run([sys.executable, "-c", _SAME_BINARIES, name, json.dumps(_STAND_IN_KERNELS[name]),
                           str(tmp_path / "state")], cwd=Path(__file__).resolve().parents[1], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    print(name, found)
    assert found["cases"] >= 2 and found["built"] >= 1
    assert found["new"] == []
