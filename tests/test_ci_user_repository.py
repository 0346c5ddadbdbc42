"""The workflow template run end to end on the CPU, in a scratch repository holding tests/example_repo/.

Every step's commands run as the workflow has them, under bash, in the order
of its jobs: the plan, nanfuzz installed as pinned (a wheel built with
``pip wheel`` and kept in the repository, as ci/README.md says), the repository installed
with the default command, ``nanfuzz gate`` on its adapters (the correct
kernel and the one with unmasked V loads), the repository's own pytest
selection, and the merge.  The environment is a fresh virtual environment
that sees this one's torch, Triton, Hypothesis and pytest but not its
nanfuzz, so what runs is what pip installed.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from nanfuzz import __version__
from tests.test_ci_workflow import PINNED, _run_script

ROOT = Path(__file__).resolve().parents[1]
KERNELS = "mykernels.nanfuzz_adapter:kernel mykernels.nanfuzz_adapter:broken_kernel"


def _venv_without_nanfuzz(tmp_path: Path) -> Path:
    """A virtual environment whose packages are this one's, less nanfuzz: it installs its own."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    shared = tmp_path / "shared-site-packages"
    shared.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith(("nanfuzz", "__editable__", "_nanfuzz")) and not entry.name.endswith(".pth"):
            (shared / entry.name).symlink_to(entry)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "shared.pth").write_text(f"{shared}\n")  # a plain path: no other .pth runs from it
    return venv


def _wheel(tmp_path: Path, wheel_dir: Path) -> Path:
    """nanfuzz built into a wheel from a copy of this checkout, as the docs say (``pip wheel --no-deps``),
    into ``wheel_dir``."""
    source = tmp_path / "nanfuzz-src"
    for name in ("nanfuzz", "reference", "strategies", "harness"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copyfile(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(wheel_dir),
                    str(source)], check=True, capture_output=True)
    return next(wheel_dir.glob("nanfuzz-*.whl"))


@pytest.mark.skipif(shutil.which("bash") is None, reason="the workflow's steps are bash")
def test_the_workflow_s_steps_gate_a_user_repository_on_the_cpu(tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "tests" / "example_repo", repo, ignore=shutil.ignore_patterns("__pycache__"))
    venv = _venv_without_nanfuzz(tmp_path)
    wheel = _wheel(tmp_path, repo / "ci")
    github = {name: tmp_path / name.lower() for name in ("GITHUB_OUTPUT", "GITHUB_ENV", "GITHUB_STEP_SUMMARY")}
    for path in github.values():
        path.write_text("")
    base = {k: v for k, v in os.environ.items() if not k.startswith(("NANFUZZ_", "PYTEST_", "GITHUB_", "VIRTUAL_ENV"))}
    base.update({"PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}", "VIRTUAL_ENV": str(venv),
                 # pip installs the wheel kept in the repository, and builds the repository with what is installed
                 "PIP_NO_INDEX": "1", "PIP_NO_BUILD_ISOLATION": "0",
                 "PIP_DISABLE_PIP_VERSION_CHECK": "1", "GITHUB_WORKSPACE": str(repo),
                 **{k: str(v) for k, v in github.items()}})

    def step(name: str, cwd: Path = repo, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", _run_script(name)],
                              cwd=cwd, env={**base, **env}, capture_output=True, text=True, timeout=600)

    requirement = str(wheel.relative_to(repo))
    assert requirement == f"ci/nanfuzz-{__version__}-py3-none-any.whl"  # the form ci/README.md gives
    plan = step("Plan the gate", EVENT="pull_request", INPUT_PROFILE="", INPUT_BUDGET="", PR_BUDGET="12",
                NIGHTLY_BUDGET="7200", SETUP_MINUTES="20", RUNNERS="1", **{**PINNED, "REQUIREMENT": requirement})
    assert plan.returncode == 0, plan.stdout + plan.stderr
    outputs = dict(line.split("=", 1) for line in github["GITHUB_OUTPUT"].read_text().splitlines())
    assert outputs["run"] == "true" and outputs["budget"] == "12"

    installed = step("Install nanfuzz", REQUIREMENT=requirement, EXAMPLE_DB="")
    assert installed.returncode == 0, installed.stdout + installed.stderr
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import nanfuzz; print(nanfuzz.__file__)"],
                           capture_output=True, text=True, env=base, cwd=tmp_path)
    assert where.stdout.startswith(str(venv)), where.stdout + where.stderr  # pip's nanfuzz, not this checkout's
    assert step("Install the repository under test", INSTALL="python -m pip install -e .").returncode == 0

    gate = step("Run the gate", GATE_OUT="nanfuzz-gate", GATE_STATE=".nanfuzz", PROFILE=outputs["profile"],
                BUDGET=outputs["budget"], GRACE=outputs["grace"], INPUT_KERNELS="", KERNELS=KERNELS, VLLM_SRC="",
                AITER_SRC="", PER_GPU="1", DEVICE="cpu", MIN_EXAMPLES="1", EVENT="pull_request", SHARD="1",
                RUNNERS=outputs["runners"], EXAMPLE_DB="")
    assert gate.returncode == 1, gate.stdout[-3000:] + gate.stderr[-3000:]
    summary = json.loads((repo / "nanfuzz-gate" / "summary.json").read_text())
    verdicts = {(s["kernel"], s["verdict"]) for s in summary["shards"]}
    assert verdicts == {("mykernels.nanfuzz_adapter:kernel", "PASS"),
                        ("mykernels.nanfuzz_adapter:broken_kernel", "NONFINITE")}, verdicts
    assert github["GITHUB_STEP_SUMMARY"].read_text().startswith("## nanfuzz gate: FAIL")

    own_tests = step("Run the repository's own tests", SELECTION="tests -q -p no:cacheprovider --nanfuzz-examples 3")
    assert own_tests.returncode == 0 and "1 passed" in own_tests.stdout, own_tests.stdout[-3000:] + own_tests.stderr

    runners = tmp_path / "runners"
    shutil.copytree(repo / "nanfuzz-gate", runners / "nanfuzz-gate-1")
    merged = step("Merge the runners' reports", cwd=tmp_path)
    assert merged.returncode == 1, merged.stdout[-2000:] + merged.stderr
    assert (tmp_path / "nanfuzz-fleet" / "summary.md").read_text().startswith("## nanfuzz fleet: FAIL")

    # the finding, exported for the kernel's author: the script calls the user's adapter from the repository root
    repro = Path(summary["failures"][0]["repro"][0])
    script = repo / "standalone.py"
    export = subprocess.run(["nanfuzz", "export", str(repro), "-o", str(script)], cwd=repo, env=base,
                            capture_output=True, text=True)
    assert export.returncode == 0, export.stderr
    bug = subprocess.run(["python", script.name], cwd=repo, env=base, capture_output=True, text=True, timeout=600)
    assert bug.returncode == 1 and "NONFINITE:" in bug.stdout, bug.stdout + bug.stderr[-2000:]
    script.write_text(script.read_text().replace("'broken_kernel'", "'kernel'"))
    fixed = subprocess.run(["python", script.name], cwd=repo, env=base, capture_output=True, text=True, timeout=600)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr[-2000:]


def test_every_package_folder_installs():
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {"nanfuzz." + ".".join(p.parent.relative_to(ROOT).parts) for top in ("reference", "strategies", "harness")
               for p in (ROOT / top).rglob("__init__.py")}
    assert folders <= listed, sorted(folders - listed)
