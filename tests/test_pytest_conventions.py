"""The pytest side for users: nanfuzz.Finding, nanfuzz.check_repro, the plugin's markers, shards over xdist workers."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import nanfuzz

ROOT = Path(__file__).resolve().parents[1]
REPRO = ROOT / "tests" / "regressions" / "paged_decode-tail-past-seq-len.json"

USER_TESTS = '''
import pytest

import nanfuzz


def test_a_finding_is_an_assertion_error_with_its_outcome_and_repro(nanfuzz):
    with pytest.raises(nanfuzz_module.Finding) as found:
        nanfuzz.fuzz("mykernels.nanfuzz_adapter:broken_kernel", max_examples=30, seed=1)
    assert isinstance(found.value, AssertionError) and found.value.verdict == "NONFINITE"
    assert found.value.repro.endswith(".json")


@pytest.mark.nanfuzz(max_examples=2, seed=5)
@pytest.mark.nanfuzz_shards()
def test_spread_over_the_workers(nanfuzz, record_property):
    campaign = nanfuzz.fuzz("mykernels.nanfuzz_adapter:kernel")
    record_property("shard", f"{nanfuzz.shard}:{campaign.examples}:{campaign.seed}")
'''.replace("nanfuzz_module", "nanfuzz_package")


def test_the_fixture_raises_a_finding_and_a_campaign_spreads_over_the_xdist_workers(tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "tests" / "example_repo", repo, ignore=shutil.ignore_patterns("__pycache__"))
    (repo / "tests" / "test_attention.py").write_text("import nanfuzz as nanfuzz_package\n" + USER_TESTS)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NANFUZZ_", "PYTEST_"))}
    env["PYTHONPATH"] = str(repo)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "-p", "no:cacheprovider", "-q", "-rA",
                           "--junitxml", str(tmp_path / "junit.xml")], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "3 passed" in proc.stdout
    junit = (tmp_path / "junit.xml").read_text()
    assert "shard0of2" in junit and "shard1of2" in junit
    # each shard ran its share (one example of two) with a seed of its own
    assert 'value="(0, 2):1:10"' in junit and 'value="(1, 2):1:11"' in junit, junit


def test_check_repro_pins_a_case_until_it_is_fixed():
    with pytest.raises(nanfuzz.Finding) as found:
        nanfuzz.check_repro(REPRO, device="cpu")
    assert found.value.verdict == "NONFINITE" and found.value.repro == str(REPRO)
    assert nanfuzz.check_repro(REPRO.read_text(), kernel="paged_decode@masked", device="cpu").verdict.value == "PASS"
    with pytest.raises(nanfuzz.NanfuzzError, match="not a nanfuzz repro"):
        nanfuzz.check_repro("{}")


def test_the_plugin_registers_its_markers(pytestconfig):
    markers = pytestconfig.getini("markers")
    assert any(m.startswith("nanfuzz(") for m in markers) and any(m.startswith("nanfuzz_shards(") for m in markers)
