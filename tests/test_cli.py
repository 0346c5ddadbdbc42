"""The command line: exit codes 0/1/2 and one-line errors, never a traceback."""
import json
import subprocess
import sys

import pytest

from nanfuzz.harness.cli import main
from nanfuzz.harness.judge.check import Outcome, Verdict
from nanfuzz.harness.report.repro import write_repro
from nanfuzz.reference.case import Case, Geometry, Sequence


@pytest.fixture(autouse=True)
def private_state(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def _one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("nanfuzz: ") and "\n" not in err and "Traceback" not in err, err
    return err


def test_unknown_kernel(capsys):
    err = _one_line_error(capsys, ["fuzz", "--kernel", "paged_decode@foo", "--device", "cpu"])
    assert "unknown kernel 'paged_decode@foo'; known:" in err and "paged_decode@masked" in err


@pytest.mark.parametrize("argv, message", [
    (["fuzz", "--kernel", "paged_decode@masked", "--jobs", "0"], "--jobs=0 must be >= 1"),
    (["fuzz", "--kernel", "paged_decode@masked", "--pool", "-1"], "--pool=-1 must be >= 0"),
    (["fuzz", "--kernel", "paged_decode@masked", "--jobs", "4", "--max-examples", "2"], "cannot be shared by 4 jobs"),
    (["bench", "--kernel", "paged_decode@masked", "--jobs", "0"], "--jobs=0 must be >= 1"),
])
def test_bad_job_and_pool_options(capsys, argv, message):
    assert message in _one_line_error(capsys, [*argv, "--device", "cpu"])


def test_unimportable_user_kernel(capsys):
    assert "cannot import module 'no_such_pkg.mod'" in _one_line_error(capsys, ["fuzz", "--kernel", "no_such_pkg.mod:run"])


def test_bad_and_foreign_json(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert "not JSON" in _one_line_error(capsys, ["replay", str(bad), "--device", "cpu"])
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps({"hello": 1}))
    assert "not a nanfuzz repro" in _one_line_error(capsys, ["replay", str(foreign), "--device", "cpu"])
    assert "cannot read repro" in _one_line_error(capsys, ["replay", str(tmp_path / "missing.json")])


def test_case_the_kernel_does_not_support(tmp_path, capsys):
    prefill = Case(Geometry(1, 1, 32, 16, 2, "float16"), (Sequence(4, 4, (1,)),)).validate()
    paths = write_repro("prefix_prefill@masked", prefill, Outcome(Verdict.PASS, "PASS"), tmp_path, "cpu")
    err = _one_line_error(capsys, ["replay", str(paths[0]), "--kernel", "paged_decode@masked", "--device", "cpu"])
    assert "does not support this case: query_len 4 (at most 1)" in err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_without_gpu(capsys):
    assert "no GPU is visible" in _one_line_error(capsys, ["list", "--device", "cuda"])


def test_conflicting_focus(capsys):
    err = _one_line_error(capsys, ["fuzz", "--kernel", "paged_decode@masked", "--decode-only", "--prefill-only", "--device", "cpu"])
    assert "exclude each other" in err


def test_fuzz_replay_round_trip_exit_codes(tmp_path, capsys):
    repros = tmp_path / "repros"
    assert main(["fuzz", "--kernel", "paged_decode@unmasked", "--max-examples", "30", "--seed", "1",
                 "--repro-dir", str(repros), "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "NONFINITE" in out and "logical" in out            # the picture is in the failure message
    files = sorted(p.suffix for p in repros.iterdir())
    assert files == [".json", ".py", ".txt"]
    repro = next(repros.glob("*.json"))
    assert main(["replay", str(repro), "--device", "cpu"]) == 1
    assert "output bits identical" in capsys.readouterr().out
    assert main(["replay", str(repro), "--kernel", "paged_decode@masked", "--device", "cpu"]) == 0
    script = next(repros.glob("*.py"))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env={
        **__import__("os").environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode != 0 and "NaN/Inf where the oracle is finite" in run.stderr


def test_list(capsys):
    assert main(["list", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "paged_decode@masked" in out and "vllm:rocm_attn" in out


def test_python_dash_m_nanfuzz_is_the_command_and_knows_its_version():
    from nanfuzz import __version__

    version = subprocess.run([sys.executable, "-m", "nanfuzz", "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout.strip() == f"nanfuzz {__version__}"
    listing = subprocess.run([sys.executable, "-m", "nanfuzz", "list", "--device", "cpu"], capture_output=True,
                             text=True, timeout=300)
    assert listing.returncode == 0 and "paged_decode@masked" in listing.stdout, listing.stderr


def test_a_usage_error_from_argparse_is_one_line_and_exit_2():
    proc = subprocess.run([sys.executable, "-m", "nanfuzz", "fuzz", "--no-such-flag"], capture_output=True, text=True)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "unrecognized arguments: --no-such-flag" in proc.stderr


def test_fuzz_takes_several_kernels_and_fails_if_any_fails(capsys):
    argv = ["fuzz", "--kernel", "paged_decode@masked", "--kernel", "paged_decode@unmasked", "--max-examples", "20",
            "--seed", "1", "--device", "cpu", "--no-shrink"]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "2 kernel(s)" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("paged_decode@") and ":" not in line]
    assert [(row[0], row[2]) for row in rows] == [("paged_decode@masked", "PASS"), ("paged_decode@unmasked", "NONFINITE")]
