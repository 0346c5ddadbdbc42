"""The GPU-runner gate (nanfuzz gate) run for real on the CPU, under Triton's interpreter.

Two gate runs, kept short: one with two xdist workers over a fixed kernel, an
old (buggy) kernel and a kernel that kills its worker, and one with the fixed
kernel alone.  They check what a CI job relies on: exit codes, the summary,
JUnit, one repro per distinct failure, work on both workers, one shared
example database, and a dead worker's case recovered as a CRASH.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXED, OLD, DYING = "paged_decode@masked", "paged_decode@unmasked", "dying_kernel:KERNEL"

# A user's own kernel (package.module:callable, importable from the directory
# the gate runs in) whose launch kills the worker process, as a GPU fault would.
# Its Kernel name is not its import path, as in many adapters.
DYING_KERNEL = '''\
import os

from nanfuzz.harness.kernel import Kernel
from nanfuzz.harness.registry import resolve


def _die(batch, out):
    os._exit(70)


KERNEL = Kernel("dying", _die, resolve("paged_decode@masked").capabilities)
'''


def run_gate(cwd: Path, *args: str, timeout: float = 300, **extra_env: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NANFUZZ_", "PYTEST_", "GITHUB_"))}
    env["PYTHONPATH"] = str(ROOT)
    env["GITHUB_STEP_SUMMARY"] = str(cwd / "step-summary.md")
    env.update(extra_env)
    return subprocess.run([sys.executable, "-m", "nanfuzz", "gate", "--device", "cpu", "--out", "out", "--state-dir", "state", *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _shards(summary, kernel):
    return [s for s in summary["shards"] if s["kernel"] == kernel]


def test_two_worker_gate_with_an_old_and_a_dying_kernel(tmp_path):
    """One gate run (start-up is most of its cost) checked from four sides."""
    (tmp_path / "dying_kernel.py").write_text(DYING_KERNEL)
    proc = run_gate(tmp_path, "--workers", "2", "--time-budget", "12", "--min-examples", "1", "--kernel", FIXED, "--kernel", OLD,
                    "--kernel", DYING)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = (tmp_path, proc, json.loads((tmp_path / "out" / "summary.json").read_text()))
    check_summary_junit_and_repro(run)
    check_both_workers_fuzz_every_kernel_and_share_the_database(run)
    check_each_failure_is_reported_once_and_none_is_lost(run)
    check_a_dead_worker_becomes_a_crash_with_its_case(run)


def check_summary_junit_and_repro(run):
    cwd, proc, summary = run
    text = (cwd / "out" / "summary.md").read_text()
    assert text.startswith("## nanfuzz gate: FAIL")
    assert "| kernel | shard | worker | examples | time | verdict |" in text
    assert (cwd / "step-summary.md").read_text() == text  # $GITHUB_STEP_SUMMARY gets the same Markdown
    old = next(f for f in summary["failures"] if f["kernel"] == OLD)
    assert old["verdict"] == "NONFINITE"
    repro = Path(old["repro"][0])
    assert repro.parent == cwd / "out" / "repros" and repro.exists()
    assert repro.with_suffix(".txt").read_text().strip() in text  # the picture
    assert f"replay {repro.relative_to(cwd)}" in text  # as the artifact lays it out

    from nanfuzz.harness.report.repro import load_repro

    assert load_repro(repro)["kernel"] == OLD

    suite = ET.parse(cwd / "out" / "junit.xml").getroot().find("testsuite")
    cases = {(c.get("classname"), c.get("name")): c for c in suite.iter("testcase")}
    assert set(cases) == {(f"nanfuzz.{k}", f"shard{i}") for k in (FIXED, OLD, DYING) for i in (0, 1)}
    repro_of = {f["number"]: f["repro"][0] for f in summary["failures"]}
    for shard in _shards(summary, FIXED):
        assert cases[(f"nanfuzz.{FIXED}", f"shard{shard['shard']}")].find("failure") is None
    for shard in _shards(summary, OLD):  # each shard names its own failure's repro
        failure = cases[(f"nanfuzz.{OLD}", f"shard{shard['shard']}")].find("failure")
        assert failure is not None and failure.get("type") == "NONFINITE"
        assert f"repro: {Path(repro_of[shard['failure']]).relative_to(cwd)}" in failure.text
    assert suite.get("failures") == "4" and suite.get("errors") == "0"


def check_both_workers_fuzz_every_kernel_and_share_the_database(run):
    cwd, _, summary = run
    state = (cwd / "state").resolve()
    for kernel in (FIXED, OLD):
        shards = _shards(summary, kernel)
        assert [s["shard"] for s in shards] == [0, 1]
        assert all(s["examples"] > 0 for s in shards), shards
        assert len({s["worker"] for s in shards}) == 2, shards
    records = [json.loads(p.read_text()) for p in (cwd / "out" / "internals" / "records").glob("*.json")]
    assert {r["examples_db"] for r in records if r["examples_db"]} == {str(state / "examples")}
    for slot in ("cpu0", "cpu1"):
        assert (state / "workers" / slot / "examples").resolve() == state / "examples"
    # the old kernel's failure went into the shared database, to be replayed first next time
    assert any(p.is_file() for p in (state / "examples").rglob("*"))


def check_each_failure_is_reported_once_and_none_is_lost(run):
    cwd, _, summary = run
    failing = [s for s in summary["shards"] if s["verdict"] != "PASS"]
    assert {s["kernel"] for s in failing} == {OLD, DYING} and len(failing) == 4
    assert all(s["failure"] is not None for s in failing)
    # one repro set per distinct failure; shards that shrank to the same case share it
    numbers = {s["failure"] for s in failing}
    assert sorted(numbers) == [f["number"] for f in summary["failures"]]
    repro_files = sorted(p.name for p in (cwd / "out" / "repros").iterdir())
    expected = sorted(Path(f["repro"][0]).stem + ext for f in summary["failures"] for ext in (".json", ".py", ".txt"))
    assert repro_files == expected
    for failure in summary["failures"]:
        assert len(failure["shards"]) == sum(1 for s in failing if s["failure"] == failure["number"])
    # every failing shard wrote exactly one repro set of its own before the gate gathered them
    records = [json.loads(p.read_text()) for p in (cwd / "out" / "internals" / "records").glob("*.json")]
    assert all(len(r["repro"]) == 3 for r in records if r["verdict"] != "PASS")
    text = (cwd / "out" / "summary.md").read_text()
    for failure in summary["failures"]:
        assert text.count(f"### Failure {failure['number']}:") == 1
        assert text.count(f"Repro: `{Path(failure['repro'][0]).relative_to(cwd)}`") == 1


def check_a_dead_worker_becomes_a_crash_with_its_case(run):
    cwd, proc, summary = run
    # the kernel kills the supervised worker process, not the xdist worker: each shard reports the
    # CRASH itself, with the shrunk case, and carries on to its end
    assert "crashed while running" not in proc.stdout and "INTERNALERROR" not in proc.stdout
    dying = _shards(summary, DYING)
    assert [s["verdict"] for s in dying] == ["CRASH", "CRASH"]
    crash = next(f for f in summary["failures"] if f["kernel"] == DYING)
    record = json.loads(Path(crash["repro"][0]).read_text())
    assert record["verdict"] == "CRASH" and "worker process exited with status" in record["summary"]
    assert record["environment"]["device_name"] == "cpu (Triton interpreter)"
    # every shard's journal went with its campaign: the next run has nothing left over to replay
    assert not list((cwd / "state" / "workers").glob("*/journal/*.json"))


def test_fixed_kernel_alone_passes(tmp_path):
    # a floor of one example: how many fit in 10 s depends on how busy the machine is
    proc = run_gate(tmp_path, "--workers", "1", "--time-budget", "10", "--max-examples", "2", "--min-examples", "1",
                    "--kernel", FIXED)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["passed"] and summary["failures"] == []
    assert [(s["kernel"], s["verdict"]) for s in summary["shards"]] == [(FIXED, "PASS")]
    assert 1 <= summary["shards"][0]["examples"] <= 2
    assert (tmp_path / "out" / "summary.md").read_text().startswith("## nanfuzz gate: PASS")
    suite = ET.parse(tmp_path / "out" / "junit.xml").getroot().find("testsuite")
    assert suite.get("tests") == "1" and suite.get("failures") == "0"
    assert not any((tmp_path / "out" / "repros").iterdir())


def test_a_pytest_run_that_runs_no_test_is_an_error_not_a_pass(tmp_path):
    proc = run_gate(tmp_path, "--workers", "1", "--time-budget", "10", "--kernel", FIXED,
                    PYTEST_ADDOPTS="-k no_such_test")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.strip().startswith("nanfuzz gate: pytest ran no gate test (exit 5)")
    assert not (tmp_path / "out" / "summary.md").exists()


@pytest.mark.parametrize("args, message", [
    (["--time-budget", "-3"], "--time-budget=-3 is too small; give at least 5 seconds"),
    (["--time-budget", "nan"], "--time-budget=nan must be a finite number of seconds"),
    (["--grace", "inf"], "--grace=inf must be a finite number of seconds"),
    (["--workers", "two"], "argument --workers: invalid int value: 'two'"),
    (["--kernel", "paged_decode@nope"], "unknown kernel 'paged_decode@nope'"),
])
def test_usage_errors_exit_2_with_one_line(tmp_path, args, message):
    proc = run_gate(tmp_path, *args, timeout=120)
    assert proc.returncode == 2
    err = proc.stderr.strip()
    assert err.startswith("nanfuzz gate: ") and message in err and "\n" not in err, err


def test_gpu_ids_come_from_the_runner_s_visibility_variables():
    from nanfuzz.harness.gate import devices
    assert devices.visible_ids({}, 4, rocm=True) == ["0", "1", "2", "3"]
    assert devices.visible_ids({"HIP_VISIBLE_DEVICES": "4,5,6,7"}, 4, rocm=True) == ["4", "5", "6", "7"]
    assert devices.visible_ids({"CUDA_VISIBLE_DEVICES": "GPU-a1, GPU-b2"}, 2, rocm=True) == ["GPU-a1", "GPU-b2"]
    assert devices.visible_ids({"HIP_VISIBLE_DEVICES": "4,5"}, 2, rocm=False) == ["0", "1"]  # CUDA ignores HIP's
    assert devices.visible_ids({"CUDA_VISIBLE_DEVICES": "1,2,3"}, 2, rocm=False) == ["1", "2"]
    assert [s.name for s in devices.detect("auto", 3, env={"TRITON_INTERPRET": "1"}).slots] == ["cpu0", "cpu1", "cpu2"]


def test_several_workers_share_a_gpu_when_asked():
    from nanfuzz.harness.gate import devices
    workers = devices.gpu_workers(["4", "5"], None, "ROCm 7.0", per_gpu=2)
    assert [s.name for s in workers.slots] == ["gpu0-0", "gpu0-1", "gpu1-0", "gpu1-1"]
    assert [s.env["HIP_VISIBLE_DEVICES"] for s in workers.slots] == ["4", "4", "5", "5"]
    assert "2 per GPU" in workers.description
    with pytest.raises(devices.NanfuzzError, match="workers-per-gpu"):
        devices.detect("cuda", None, env={}, per_gpu=0)


def test_each_gpu_worker_is_pinned_to_its_gpu_through_its_environment(tmp_path):
    import execnet

    from nanfuzz.harness.gate import devices, plan as gate_plan, run as gate
    workers = devices.gpu_workers(["4", "5"], None, "ROCm 7.0")
    plan = gate_plan.Plan(device="cuda", profile="pr-gate", kernels=[FIXED], slots=["gpu0", "gpu1"], deadline=0.0,
                     max_examples=None, state_dir=str(tmp_path / "state"), work_dir=str(tmp_path / "work"))
    command = gate.pytest_command(plan, workers, tmp_path / "junit.xml", restarts=2)
    assert command[command.index("--dist") + 1] == "each"
    specs = [execnet.XSpec(command[i + 1]) for i, arg in enumerate(command) if arg == "--tx"]
    assert [s.popen for s in specs] == [True, True]
    assert [s.env for s in specs] == [
        {"NANFUZZ_GATE_SLOT": f"gpu{i}", "NANFUZZ_STATE_DIR": str(tmp_path / "state" / "workers" / f"gpu{i}"),
         "HIP_VISIBLE_DEVICES": gpu, "CUDA_VISIBLE_DEVICES": gpu, "NANFUZZ_CAMPAIGNS_PER_DEVICE": "1",
         # each worker's compile farm gets its share of the cores
         "NANFUZZ_COMPILE_JOBS": str(max(1, len(os.sched_getaffinity(0)) // 2))}
        for i, gpu in enumerate(["4", "5"])]


def test_the_gate_loads_its_pytest_plugin_itself_where_nanfuzz_is_a_checkout_on_the_path(tmp_path, monkeypatch):
    """Without an install's entry point, pytest would refuse --nanfuzz-device."""
    from nanfuzz.harness.gate import devices, plan as gate_plan, run as gate

    monkeypatch.delenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    workers = devices.gpu_workers(["0"], None, "CUDA 13.0")
    plan = gate_plan.Plan(device="cuda", profile="pr-gate", kernels=[FIXED], slots=["gpu0"], deadline=0.0,
                          max_examples=None, state_dir=str(tmp_path / "state"), work_dir=str(tmp_path / "work"))
    monkeypatch.setattr(gate, "plugin_installed", lambda: False)
    command = gate.pytest_command(plan, workers, tmp_path / "junit.xml", restarts=2)
    assert command[3:5] == ["-p", "nanfuzz.harness.plugin"] and "--nanfuzz-device" in command
    monkeypatch.setattr(gate, "plugin_installed", lambda: True)
    assert "nanfuzz.harness.plugin" not in gate.pytest_command(plan, workers, tmp_path / "junit.xml", restarts=2)
