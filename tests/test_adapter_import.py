"""A user's adapter module is imported first in a process of its own, within the launch timeout:
any way that import ends other than with a Kernel is one line naming the module and exit 2."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nanfuzz.harness.cli import main
from nanfuzz.harness.launch.import_probe import import_first
from nanfuzz.reference.errors import NanfuzzError

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("module, words", [
    ("exits_zero", "(SystemExit: 0)"),
    ("exits_with_message", "(SystemExit: this adapter needs a GPU)"),
    ("interrupts", "(KeyboardInterrupt)"),
    ("segfaults", "killed its process (SIGSEGV)"),
    ("kills_its_group", "killed its process (SIGKILL)"),  # its own group: this process lives on
    ("hangs", "did not finish within 2 s"),
])
def test_an_import_that_ends_in_anything_but_a_kernel_is_one_line_naming_the_module(module, words):
    name = f"tests.hostile_imports.{module}:kernel"
    with pytest.raises(NanfuzzError) as raised:
        import_first(name, "cpu", timeout=2.0)
    message = str(raised.value)
    assert words in message and f"module 'tests.hostile_imports.{module}'" in message and "\n" not in message


def test_a_module_that_gives_a_kernel_passes_and_a_missing_one_is_named():
    import_first("tests.torch_kernels:correct", "cpu", timeout=60.0)
    with pytest.raises(NanfuzzError, match="has no attribute 'nothing_here'"):
        import_first("tests.torch_kernels:nothing_here", "cpu", timeout=60.0)


def test_without_isolation_an_import_that_exits_is_still_exit_2_not_a_verdict(capsys):
    argv = ["fuzz", "--kernel", "tests.hostile_imports.exits_zero:kernel", "--device", "cpu", "--no-isolation"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("nanfuzz: ") and "SystemExit: 0" in err and "\n" not in err


@pytest.mark.parametrize("module", ["exits_zero", "exits_with_message"])
def test_the_command_exits_2_whatever_status_the_adapter_exits_with(module, tmp_path):
    # 0 would read as "no failure", 1 as "a finding": neither may come from an import
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "nanfuzz", "fuzz", "--kernel", f"tests.hostile_imports.{module}:kernel",
                           "--device", "cpu"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("nanfuzz: ") and f"tests.hostile_imports.{module}" in line
