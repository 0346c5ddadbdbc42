"""A Triton kernel imported before nanfuzz chose the mode is one clear error at every public entry.

``@triton.jit`` builds a GPU kernel or an interpreted one once, when its module
is imported; a GPU kernel launched on the CPU fails with "0 active drivers",
which a judge would report as the kernel's CRASH.  Each test runs a script in
a fresh process, in a copy of ``tests/example_repo``, that imports the
repository's adapter (and with it its ``@triton.jit`` kernel) before calling
nanfuzz, on a machine without a GPU as torch sees it.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Each public entry that judges a kernel, called with the adapter imported first; one line per entry.
CALLS = '''
import json
import sys

import mykernels.nanfuzz_adapter as adapter  # its @triton.jit kernel is built here, in the mode of the environment
import nanfuzz

repro = sys.argv[1]
record = json.load(open(repro))
case = nanfuzz.Case.from_json(json.dumps(record["case"]))
entries = {
    "check_repro": lambda: nanfuzz.check_repro(repro, kernel=adapter.kernel),
    "check_repro by name": lambda: nanfuzz.check_repro(record),
    "check": lambda: nanfuzz.check(adapter.kernel, case),
    "fuzz": lambda: nanfuzz.fuzz(adapter.kernel, max_examples=1, use_database=False),
    "replay": lambda: nanfuzz.replay(repro),
}
for name in sys.argv[2:]:
    try:
        result = entries[name]()
        verdict = getattr(result, "verdict", None) or getattr(getattr(result, "outcome", None), "verdict", None)
        print(f"{name}: verdict {getattr(verdict, 'value', verdict)}")
    except nanfuzz.NanfuzzError as exc:
        print(f"{name}: error {exc}")
    except nanfuzz.Finding as exc:
        print(f"{name}: finding {str(exc).splitlines()[0]}")
'''


@pytest.fixture
def repository(tmp_path) -> Path:
    """The example repository with a repro of its correct kernel (a decode case whose tail holds NaN)."""
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "tests" / "example_repo", repo, ignore=shutil.ignore_patterns("__pycache__"))
    record = json.loads((ROOT / "tests" / "regressions" / "paged_decode-tail-past-seq-len.json").read_text())
    record["kernel"] = "mykernels.nanfuzz_adapter:kernel"
    (repo / "repro.json").write_text(json.dumps(record))
    (repo / "calls.py").write_text(CALLS)
    return repo


def _call(repo: Path, *entries: str, interpret: str | None) -> list[str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "PYTHONPATH") and not k.startswith(("NANFUZZ_", "PYTEST_"))}
    env.update(CUDA_VISIBLE_DEVICES="", HIP_VISIBLE_DEVICES="", NANFUZZ_STATE_DIR=str(repo / ".nanfuzz"))
    if interpret is not None:
        env["TRITON_INTERPRET"] = interpret
    proc = subprocess.run([sys.executable, "calls.py", "repro.json", *entries], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return proc.stdout.splitlines()


def test_a_kernel_imported_before_the_interpreter_was_chosen_is_one_clear_error_at_every_entry(repository):
    entries = ("check_repro", "check_repro by name", "check", "fuzz", "replay")
    lines = _call(repository, *entries, interpret=None)
    assert [line.partition(":")[0] for line in lines] == list(entries), lines
    for line in lines:
        assert ": error nanfuzz: Triton kernels mykernels.paged_decode._decode_kernel were imported before nanfuzz " \
               "chose Triton's interpreter" in line, line
        assert "set TRITON_INTERPRET=1 before they are imported" in line and "CRASH" not in line


def test_a_kernel_imported_under_the_interpreter_is_judged(repository):
    assert _call(repository, "check_repro", interpret="1") == ["check_repro: verdict PASS"]
