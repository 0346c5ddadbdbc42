""".ci/run: the README's test command and its exit status; a run that collected no test (5) fails."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / ".ci" / "run"


def _readme_test_command() -> str:
    block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.DOTALL).group(1)
    return next(line for line in block.splitlines() if "pytest" in line)


def test_ci_runs_the_readme_s_test_command_verbatim():
    command = _readme_test_command()
    assert command.startswith("python3 -m venv .venv && ") and command.endswith("python -m pytest -n 2")
    assert command in RUN.read_text().splitlines()


def _run_with_pytest_exiting(tmp_path, status: int) -> subprocess.CompletedProcess:
    """.ci/run in a copy of the repository's shape, with python3, pip and python replaced by stubs."""
    if shutil.which("bash") is None:
        pytest.skip("no bash on this machine")
    (tmp_path / ".ci").mkdir()
    shutil.copy(RUN, tmp_path / ".ci" / "run")
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    scripts = {
        "python3": 'mkdir -p .venv/bin && : > .venv/bin/activate\n',
        "pip": "exit 0\n",
        "python": f'echo "$@" > "{tmp_path}/pytest-args"\nexit {status}\n',
    }
    for name, body in scripts.items():
        (stubs / name).write_text("#!/usr/bin/env bash\n" + body)
        (stubs / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(["bash", str(tmp_path / ".ci" / "run")], env=env, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=60)
    assert (tmp_path / "pytest-args").read_text().split() == ["-m", "pytest", "-n", "2"]
    return proc


@pytest.mark.parametrize("status", [0, 1, 2])
def test_pytest_s_exit_status_is_the_run_s(tmp_path, status):
    proc = _run_with_pytest_exiting(tmp_path, status)
    assert proc.returncode == status, proc.stderr


def test_a_run_that_collects_no_test_fails(tmp_path):
    proc = _run_with_pytest_exiting(tmp_path, 5)
    assert proc.returncode == 1 and "no test" in proc.stderr
