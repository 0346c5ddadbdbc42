"""Repro scripts: every value in them is a literal, and they judge with nanfuzz's own check.

A script is run from the repository root, as a user runs one
(``python .nanfuzz/repros/X.py``): it resolves ``tests.torch_kernels:...``
from there.
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nanfuzz.harness.judge.check import Outcome, Verdict, check
from nanfuzz.harness.kernel import Kernel
from nanfuzz.harness.registry import resolve
from nanfuzz.harness.report.repro import load_repro, standalone_script, write_repro
from tests.cases import consecutive_case

ROOT = Path(__file__).resolve().parents[1]
REGRESSIONS = sorted((ROOT / "tests" / "regressions").glob("*.json"))

# Each would, pasted unescaped into a docstring or a string, end it early,
# run code, or break the script's syntax.
HOSTILE = [
    'ends the docstring """; import os; os._exit(3) """',
    "ends a string '; import os; os._exit(3); '",
    "backslash at the end \\",
    "a Windows path C:\\Users\\kernel\\new\\table.py and \\N{BULLET} \\x00",
    "two\nlines\r\nand a form feed\f",
    "non-ASCII: Ωμέγα, 中文, emoji \U0001f600, a lone surrogate \ud800",
    "{braces} %s %(name)s {0!r}",
    '\'\'\' and """ and \\"""',
]


def _case():
    return consecutive_case([(1, 5)], q_heads=1, kv_heads=1, head_size=32, block_size=8, dtype="float32")


def _statements(script: str) -> list[tuple[str, str]]:
    """The script's top-level statements: (kind, name) pairs."""
    out = []
    for node in ast.parse(script).body:
        if isinstance(node, ast.Assign):
            out.append(("assign", node.targets[0].id))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(("import", ",".join(a.name for a in node.names)))
        else:
            out.append((type(node).__name__, getattr(node, "name", "")))
    return out


def _constant(script: str, name: str):
    """The value the script assigns to ``name``, evaluated with no builtins."""
    for node in ast.parse(script).body:
        if isinstance(node, ast.Assign) and node.targets[0].id == name:
            return eval(compile(ast.Expression(node.value), "<constant>", "eval"), {"__builtins__": {}})
    raise AssertionError(f"no {name} in the script")


@pytest.mark.parametrize("text", HOSTILE)
def test_hostile_text_stays_data(text):
    kernel = Kernel(text, correct_run, resolve("tests.torch_kernels:correct").capabilities,
                    spec="tests.torch_kernels:correct")
    benign = standalone_script("tests.torch_kernels:correct", _case(), Outcome(Verdict.NONFINITE, "NONFINITE"))
    script = standalone_script(kernel, _case(), Outcome(Verdict.NONFINITE, text))
    compile(script, "repro.py", "exec")
    script.encode("ascii")  # every literal is written by ascii(): no encoding to get wrong
    assert _statements(script) == _statements(benign)  # nothing injected at the top level
    assert _constant(script, "SUMMARY") == text
    assert _constant(script, "KERNEL_NAME") == text
    assert _constant(script, "KERNEL") == "tests.torch_kernels:correct"


def correct_run(batch, out):
    raise AssertionError("never run here")


def test_hostile_names_make_safe_file_names(tmp_path):
    kernel = Kernel('../../x"""\n:@\\C:\\Users', correct_run, resolve("tests.torch_kernels:correct").capabilities,
                    spec="tests.torch_kernels:correct")
    paths = write_repro(kernel, _case(), Outcome(Verdict.LEAK, HOSTILE[0]), tmp_path / "repros", "cpu")
    assert all(p.parent == tmp_path / "repros" and p.exists() for p in paths)
    record = load_repro(paths[0])
    assert record["kernel"] == "tests.torch_kernels:correct" and record["kernel_name"] == kernel.name
    compile(paths[1].read_text(encoding="utf-8"), str(paths[1]), "exec")


def _run_script(path: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NANFUZZ_", "PYTEST_"))}
    env["PYTHONIOENCODING"] = "utf-8"
    run = subprocess.run([sys.executable, str(path), "--device", "cpu"], cwd=ROOT, env=env, capture_output=True,
                         timeout=300)
    # decoded by hand: text mode would turn a printed "\r\n" into "\n"
    return subprocess.CompletedProcess(run.args, run.returncode, run.stdout.decode("utf-8"), run.stderr.decode("utf-8"))


def test_a_passing_kernels_script_prints_the_hostile_summary_and_exits_0(tmp_path):
    marker = tmp_path / "injected"
    payload = (f'"""\nopen({str(marker)!r}, "w").close()\n"""'
               f"'\nopen({str(marker)!r}, 'w').close()\n'" + "".join(HOSTILE))
    kernel = resolve("tests.torch_kernels:correct")
    paths = write_repro(kernel, _case(), Outcome(Verdict.NONFINITE, payload), tmp_path, "cpu")
    run = _run_script(paths[1])
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert not marker.exists()
    assert "recorded: torch@correct: " + payload.replace("\ud800", "\\ud800") in run.stdout
    assert "PASS (recorded NONFINITE)" in run.stdout


def test_a_clobber_repro_script_exits_1(tmp_path):
    kernel = resolve("tests.torch_kernels:clobber")
    case = _case()
    outcome = check(kernel, case, "cpu")
    assert outcome.verdict is Verdict.CLOBBER, outcome.summary
    paths = write_repro(kernel, case, outcome, tmp_path, "cpu")
    run = _run_script(paths[1])
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    assert "FAIL CLOBBER (recorded CLOBBER)" in run.stderr
    assert "now: CLOBBER: the kernel wrote into output guard rows past the last token" in run.stdout


def test_a_repro_records_the_import_path_and_the_display_name(tmp_path):
    kernel = resolve("tests.torch_kernels:clobber")
    assert kernel.name != kernel.resolvable == "tests.torch_kernels:clobber"
    for given in (kernel,):
        record = json.loads(write_repro(given, _case(), Outcome(Verdict.CLOBBER, "CLOBBER"), tmp_path, "cpu")[0].read_text())
        assert record["kernel"] == "tests.torch_kernels:clobber"
        assert record["kernel_name"] == "torch@clobber"


BEFORE_KERNEL_NAME = [p for p in REGRESSIONS if "kernel_name" not in json.loads(p.read_text())][:2]


@pytest.mark.parametrize("path", BEFORE_KERNEL_NAME, ids=[p.stem for p in BEFORE_KERNEL_NAME])
def test_repros_written_before_kernel_name_still_load(path):
    record = load_repro(path)
    assert "kernel_name" not in json.loads(path.read_text())
    assert record["kernel_name"] == record["kernel"]
