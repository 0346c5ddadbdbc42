"""A user's repository, end to end: tests/example_repo/ copied and used from its root.

It holds a package ``mykernels`` (a small Triton paged-decode kernel, and an
adapter module with ``kernel`` and a ``broken_kernel`` whose V loads are
unmasked) and a pytest test using the ``nanfuzz`` fixture.  Everything runs
as a user would run it: the installed ``nanfuzz`` command and ``python``,
from the repository root, with nothing of nanfuzz's own tree on the path.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent / "example_repo"
NANFUZZ = Path(sys.executable).with_name("nanfuzz")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NANFUZZ_", "PYTEST_", "PYTHONPATH"))}
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _run(args: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    run = subprocess.run([str(a) for a in args], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    run.log = f"$ {' '.join(map(str, args))}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    return run


@pytest.mark.skipif(not NANFUZZ.exists(), reason="the nanfuzz command is not installed beside this python")
def test_a_users_repository_from_its_root(tmp_path):
    root = tmp_path / "repo"
    shutil.copytree(EXAMPLE, root, ignore=shutil.ignore_patterns("__pycache__", ".nanfuzz"))

    good = _run([NANFUZZ, "fuzz", "--kernel", "mykernels.nanfuzz_adapter:kernel", "--max-examples", "20",
                 "--device", "cpu"], root)
    assert good.returncode == 0, good.log

    bad = _run([NANFUZZ, "fuzz", "--kernel", "mykernels.nanfuzz_adapter:broken_kernel", "--max-examples", "20",
                "--device", "cpu"], root)
    assert bad.returncode == 1, bad.log
    assert "NONFINITE" in bad.stdout, bad.log
    repro = Path(re.search(r"^repro: (\S+\.json)$", bad.stdout, re.M).group(1))
    assert not repro.is_absolute() and (root / repro).exists()
    record = json.loads((root / repro).read_text())
    assert record["kernel"] == "mykernels.nanfuzz_adapter:broken_kernel"  # the import path, not the display name
    assert record["kernel_name"] == "my paged decode, V unmasked"

    replay = _run([NANFUZZ, "replay", repro, "--device", "cpu"], root)
    assert replay.returncode == 1, replay.log
    assert "output bits identical to the recording" in replay.stdout, replay.log
    fixed = _run([NANFUZZ, "replay", repro, "--kernel", "mykernels.nanfuzz_adapter:kernel", "--device", "cpu"], root)
    assert fixed.returncode == 0, fixed.log

    script = _run([sys.executable, repro.with_suffix(".py")], root)
    assert script.returncode == 1, script.log
    assert "FAIL NONFINITE (recorded NONFINITE)" in script.stderr, script.log

    tests = _run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-q"], root)
    assert tests.returncode == 0, tests.log
    assert "1 passed" in tests.stdout, tests.log

    # the repro names where the adapter was found, so a replay from any folder of the repository finds it
    assert record["kernel_module"]["file"] == "mykernels/nanfuzz_adapter.py"
    inside = _run([NANFUZZ, "replay", root / repro, "--device", "cpu"], root / "mykernels")
    assert inside.returncode == 1 and "NONFINITE" in inside.stdout, inside.log
    lonely = tmp_path / "elsewhere"
    lonely.mkdir()
    shutil.copy(root / repro, lonely / repro.name)
    root.rename(tmp_path / "moved")  # neither this folder, nor the repro's, nor the recorded repository holds it
    lost = _run([NANFUZZ, "replay", repro.name, "--device", "cpu"], lonely)
    assert lost.returncode == 2 and "to PYTHONPATH" in lost.stderr and "mykernels/nanfuzz_adapter.py" in lost.stderr, \
        lost.log
