"""A fleet of gate runners on one real Redis server, and the merged report (nanfuzz gate merge).

Two gate processes stand for two runners (``--shard 1/2`` and ``--shard 2/2``),
one after the other on one example database: the second replays the first's
failure as its first example, and the merged report counts that failure once
with both runners listed.  The subject is the plain-torch kernel with the
window off-by-one bug, whose simplest case passes.
"""
from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.redis_server import redis_server  # noqa: F401 (a fixture)
from tests.test_ci_gate import run_gate

ROOT = Path(__file__).resolve().parents[1]
KERNEL = "tests.torch_kernels:window_off_by_one"


def run_merge(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nanfuzz", "gate", "merge", *args], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "GITHUB_STEP_SUMMARY": str(cwd / "step-summary.md")})


def _record(cwd: Path, out: str) -> dict:
    (path,) = (cwd / out / "internals" / "records").glob("*.json")
    return json.loads(path.read_text())


def test_two_runners_on_one_server_replay_each_other_and_count_a_failure_once(tmp_path, redis_server):
    server = redis_server()
    for shard, name in (("1/2", "alpha"), ("2/2", "beta")):
        proc = run_gate(tmp_path, "--workers", "1", "--time-budget", "60", "--max-examples", "200", "--kernel", KERNEL,
                        "--example-db", server.url, "--shard", shard, "--runner-name", name,
                        "--out", name, "--state-dir", f"state-{name}")
        assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert f"runner {name}, shard {shard}" in proc.stdout and f"example database: {server.url}" in proc.stdout
    first, second = _record(tmp_path, "alpha"), _record(tmp_path, "beta")
    assert first["examples_to_first_failure"] > 1  # the first runner searched for it
    assert second["examples_to_first_failure"] == 1  # the second replayed it first, from the server
    assert Path(first["repro"][0]).name == Path(second["repro"][0]).name  # the same shrunk case

    proc = run_merge(tmp_path, "--out", "fleet", "alpha", "beta")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    merged = json.loads((tmp_path / "fleet" / "summary.json").read_text())
    assert [r["label"] for r in merged["runners"]] == ["alpha", "beta"]
    (failure,) = merged["failures"]
    # the kernel drops the window's oldest key: a one-key window keeps no key (NONFINITE), a wider one
    # loses a live key (MISMATCH); which one the shrink stops at depends on the search
    assert failure["runners"] == ["alpha", "beta"] and failure["verdict"] in ("NONFINITE", "MISMATCH")
    assert sorted(p.name for p in (tmp_path / "fleet" / "repros").iterdir()) == sorted(
        Path(failure["repro"][0]).stem + ext for ext in (".json", ".py", ".txt"))
    assert [s["failure"] for s in merged["shards"]] == [1, 1] and merged["problems"] == []
    text = (tmp_path / "fleet" / "summary.md").read_text()
    assert text.startswith("## nanfuzz fleet: FAIL (1 failure(s) in 1 of 1 kernel(s), 2 runner(s))")
    assert text.count("### Failure ") == 1 and "Found by 2 runner(s): runner `alpha`" in text
    assert f"nanfuzz replay fleet/repros/{Path(failure['repro'][0]).name} --kernel {KERNEL}" in text
    assert (tmp_path / "step-summary.md").read_text().endswith(text)
    suite = ET.parse(tmp_path / "fleet" / "junit.xml").getroot().find("testsuite")
    names = sorted(case.get("name") for case in suite.iter("testcase"))
    assert names == ["alpha/shard0", "beta/shard0"] and suite.get("failures") == "2"

    # a runner whose output never arrived makes the fleet's report incomplete, whatever the others say
    alone = run_merge(tmp_path, "--out", "fleet-alone", "alpha")
    assert alone.returncode == 1  # alpha's finding stands; the missing runner alone would be 3
    assert "no output from runner shard 2/2" in (tmp_path / "fleet-alone" / "summary.md").read_text()


def test_a_server_that_stops_mid_gate_is_one_note_and_the_finding_is_kept(tmp_path, redis_server):
    from tests.fleet_subjects import STOP_PID_VAR

    server = redis_server()
    proc = run_gate(tmp_path, "--workers", "1", "--time-budget", "60", "--max-examples", "200",
                    "--kernel", "tests.fleet_subjects:stops_the_server", "--example-db", server.url,
                    **{STOP_PID_VAR: str(server.pid)})
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert server.process.poll() is not None
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert {s["verdict"] for s in summary["shards"]} == {"NONFINITE"}
    assert all(Path(f["repro"][0]).exists() for f in summary["failures"])
    lost = [note for note in summary["notes"] if "stopped answering" in note]
    assert len(lost) == 1 and f"example database {server.url} stopped answering" in lost[0], summary["notes"]
    assert (tmp_path / "out" / "summary.md").read_text().count("stopped answering") == 1
    # the runner's local folder kept the finding, as a case the next run replays first
    from hypothesis.database import DirectoryBasedExampleDatabase

    from nanfuzz.harness.campaign import known_failures
    from nanfuzz.harness.report.repro import load_repro

    local = DirectoryBasedExampleDatabase(str(tmp_path / "state" / "examples"))
    kept = [case for _, case in known_failures.known(local, known_failures.key("fleet@stops-the-server", "cpu", ""))]
    assert load_repro(summary["failures"][0]["repro"][0])["case"] in kept


def test_an_unreachable_server_stops_the_gate_before_anything_runs(tmp_path, redis_server):
    server = redis_server()
    server.stop()
    proc = run_gate(tmp_path, "--workers", "1", "--time-budget", "10", "--kernel", KERNEL, "--example-db", server.url,
                    timeout=120)
    assert proc.returncode == 2
    err = proc.stderr.strip()
    assert err.startswith(f"nanfuzz gate: example database {server.url} does not answer (") and "\n" not in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, message", [
    (["--shard", "3/2"], "argument --shard: '3/2' is not I/N with 1 <= I <= N"),
    (["--example-db", "readonly:"], "names no store after 'readonly:'"),
])
def test_gate_usage_errors(tmp_path, args, message):
    proc = run_gate(tmp_path, "--kernel", KERNEL, *args, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


def test_runners_search_different_ground():
    from nanfuzz.harness.gate import plan as plan_module, run as gate
    kernels = ["a", "b", "c", "d", "e"]
    # more kernels than runners: each kernel on one runner
    dealt = [gate.deal(kernels, shard, 2) for shard in (1, 2)]
    assert dealt == [["a", "c", "e"], ["b", "d"]]
    # more runners than kernels: every runner works, the kernels are shared out evenly
    assert [gate.deal(["a", "b"], shard, 5) for shard in range(1, 6)] == [["a"], ["b"], ["a"], ["b"], ["a"]]
    assert gate.deal(kernels, 1, 1) == kernels
    # every slot of every runner fuzzes its own specialisation pool
    seeds = set()
    for shard in (1, 2, 3):
        plan = plan_module.Plan(device="cuda", profile="nightly", kernels=["a"], slots=["gpu0", "gpu1", "gpu2"],
                                deadline=0.0, max_examples=None, state_dir="s", work_dir="w", shard=shard, shards=3)
        seeds |= {plan.pool_seed(slot) for slot in plan.slots}
    assert seeds == set(range(9))


def test_merge_without_any_summary_is_a_usage_error(tmp_path):
    (tmp_path / "empty").mkdir()
    proc = run_merge(tmp_path, "empty")
    assert proc.returncode == 2 and proc.stderr.startswith("nanfuzz merge: no summary.json in empty")
