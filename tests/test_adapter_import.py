"""A user's adapter module is imported first in a process of its own, within the launch timeout:
any way that import ends other than with a Kernel is one line naming the module and exit 2."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from nanfuzz.harness.campaign.settings import DEFAULT_LAUNCH_TIMEOUT
from nanfuzz.harness.cli import main
from nanfuzz.harness.gate.run import choose_kernels
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


@pytest.mark.parametrize("module, words", [("exits_zero", "SystemExit: 0"), ("segfaults", "SIGSEGV")])
def test_in_pytest_an_adapter_that_ends_its_import_is_an_error_of_its_test_not_the_end_of_the_session(tmp_path, module,
                                                                                           words):
    # imported in the session's own process, the first would end pytest with exit 0 and the second kill it
    (tmp_path / "test_kernel.py").write_text("def test_kernel(nanfuzz_kernel):\n    assert nanfuzz_kernel\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("CI", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                           "--nanfuzz-kernel", f"tests.hostile_imports.{module}:kernel", "--nanfuzz-device", "cpu",
                           "test_kernel.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == pytest.ExitCode.TESTS_FAILED, proc.stdout + proc.stderr
    assert "1 error" in proc.stdout and words in proc.stdout and f"tests.hostile_imports.{module}" in proc.stdout, \
        proc.stdout + proc.stderr


HANGS = "tests.hostile_imports.hangs:kernel"


@pytest.mark.parametrize("argv", [
    ["fuzz", "--kernel", HANGS, "--no-isolation"],
    ["replay", "REPRO", "--no-isolation"],
    ["export", "REPRO"],
    ["bench", "--kernel", HANGS, "--no-isolation", "--examples", "1", "--seeds", "0"],
], ids=["fuzz-no-isolation", "replay-no-isolation", "export", "bench-no-isolation"])
def test_an_import_that_hangs_ends_every_command_within_the_launch_timeout(argv, tmp_path, capsys):
    record = json.loads((ROOT / "tests" / "regressions" / "paged_decode-tail-past-seq-len.json").read_text())
    repro = tmp_path / "hangs.json"
    repro.write_text(json.dumps({**record, "kernel": HANGS, "kernel_name": HANGS}))
    argv = [str(repro) if arg == "REPRO" else arg for arg in argv]

    def hung(signum, frame):
        raise AssertionError(f"nanfuzz {argv[0]} still importing the module after a minute")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    try:
        assert main([*argv, "--device", "cpu", "--launch-timeout", "2"]) == 2
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    err = capsys.readouterr().err.strip()
    assert "importing module 'tests.hostile_imports.hangs' did not finish within 2 s" in err and "\n" not in err


def test_the_gate_imports_a_user_s_kernel_first_within_the_launch_timeout(monkeypatch):
    monkeypatch.setitem(DEFAULT_LAUNCH_TIMEOUT, "cpu", 2.0)
    with pytest.raises(NanfuzzError, match="did not finish within 2 s \\(the default launch timeout\\)"):
        choose_kernels([HANGS], "cpu")
    assert choose_kernels(["tests.torch_kernels:correct"], "cpu") == ["tests.torch_kernels:correct"]
