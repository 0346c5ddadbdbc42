"""``nanfuzz export`` of a user's own adapter, run where nanfuzz is not installed.

A copy of ``tests/example_repo`` (a Triton decode kernel and its adapter,
whose ``broken_kernel`` loads V unmasked) holds a repro of the broken kernel,
exported by this checkout's nanfuzz.  The exported files then run in fresh
virtual environments that see this one's torch, Triton, numpy and pytest but
not nanfuzz (``tests/venvs.py``), or not numpy either, with the repository
as the current folder, or another folder, where its package does not import.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_export import _imports_nanfuzz
from tests.venvs import venv_without

ROOT = Path(__file__).resolve().parents[1]
BROKEN, FIXED = "'broken_kernel'", "'kernel'"  # the attribute the exported files import, as their text has it
ADAPTER = "'mykernels.nanfuzz_adapter'"

# An unrelated test of the user's suite, run after the exported one: what it sees of the session.
UNRELATED = '''
import json
import os
import sys


def test_unrelated():
    seen = {"TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET"), "mykernels": "mykernels" in sys.modules}
    with open("unrelated.json", "w") as out:
        json.dump(seen, out)
'''

# Adapters that go wrong in each way a kernel's loading or launch can, beside the repository's own.
HOSTILE = {
    "exits_on_import": "import sys\n\nsys.exit(1)\n",
    "imports_what_the_stand_in_lacks": "from nanfuzz import Kernel, fuzz\n",
    "raises_at_launch": ("from mykernels.nanfuzz_adapter import CAPABILITIES\nfrom nanfuzz import Kernel\n\n\n"
                         "def run(batch, out):\n    raise RuntimeError('planted launch failure')\n\n\n"
                         "kernel = Kernel('raises', run, CAPABILITIES)\n"),
    "imports_a_missing_module_at_launch": (
        "from mykernels.nanfuzz_adapter import CAPABILITIES\nfrom nanfuzz import Kernel\n\n\n"
        "def run(batch, out):\n    import mykernels_extension  # noqa: F401 - a compiled part that is not built\n\n\n"
        "kernel = Kernel('lazy import', run, CAPABILITIES)\n"),
    "dies_at_launch": ("import os\nimport signal\n\nfrom mykernels.nanfuzz_adapter import CAPABILITIES\n"
                       "from nanfuzz import Kernel\n\n\n"
                       "def run(batch, out):\n    os.kill(os.getpid(), signal.SIGKILL)\n\n\n"
                       "kernel = Kernel('dies', run, CAPABILITIES)\n"),
    "hangs_at_launch": ("import time\n\nfrom mykernels.nanfuzz_adapter import CAPABILITIES\nfrom nanfuzz import Kernel\n\n\n"
                        "def run(batch, out):\n    time.sleep(3600)\n\n\n"
                        "kernel = Kernel('hangs', run, CAPABILITIES)\n"),
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    """The repository with ``standalone.py`` and ``test_broken.py`` exported from a repro of its
    broken kernel, and ``test_fixed.py``, the same for its correct kernel."""
    repo = tmp_path_factory.mktemp("user") / "repo"
    shutil.copytree(ROOT / "tests" / "example_repo", repo, ignore=shutil.ignore_patterns("__pycache__"))
    record = json.loads((ROOT / "tests" / "regressions" / "paged_decode-tail-past-seq-len.json").read_text())
    record["kernel"] = "mykernels.nanfuzz_adapter:broken_kernel"
    (repo / "repro.json").write_text(json.dumps(record))
    code = ("import sys\nfrom nanfuzz.harness.cli import main\n"
            "sys.exit(main(['export', 'repro.json', '-o', 'standalone.py']) or "
            "main(['export', 'repro.json', '--pytest', '-o', 'test_broken.py']))")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NANFUZZ_", "PYTEST_")) and k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    test_file = (repo / "test_broken.py").read_text()
    assert test_file.count(BROKEN) == 1 and (repo / "standalone.py").read_text().count(BROKEN) == 1
    (repo / "test_fixed.py").write_text(test_file.replace(BROKEN, FIXED))
    return repo


@pytest.fixture(scope="module")
def without_nanfuzz(tmp_path_factory) -> Path:
    return venv_without(tmp_path_factory.mktemp("venv"))


def _run(python: Path, cwd: Path, *argv: str, gpu: bool = False) -> subprocess.CompletedProcess:
    """``python *argv`` in ``cwd``: under Triton's interpreter (a GPU runner's devices hidden), or ``gpu``."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "PYTHONPATH", "VIRTUAL_ENV") and not k.startswith(("NANFUZZ_", "PYTEST_"))}
    if not gpu:
        env.update(CUDA_VISIBLE_DEVICES="", HIP_VISIBLE_DEVICES="")
    return subprocess.run([str(python), *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def _pytest(python: Path, cwd: Path, *files: str, gpu: bool = False) -> subprocess.CompletedProcess:
    return _run(python, cwd, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", *files, gpu=gpu)


def test_the_exported_files_fail_on_the_bug_and_pass_on_the_fix_without_nanfuzz(exported, without_nanfuzz):
    for name in ("standalone.py", "test_broken.py"):
        assert not _imports_nanfuzz((exported / name).read_text()), name  # the adapter alone may, of the two
    bug = _run(without_nanfuzz, exported, "standalone.py")
    assert bug.returncode == 1 and "NONFINITE: 1/1 output rows" in bug.stdout, bug.stdout + bug.stderr[-3000:]

    fixed_script = exported / "fixed.py"
    fixed_script.write_text((exported / "standalone.py").read_text().replace(BROKEN, FIXED))
    fixed = _run(without_nanfuzz, exported, fixed_script.name)
    last = fixed.stdout.splitlines()[-1]
    assert fixed.returncode == 0 and last.startswith("PASS: the output is finite"), fixed.stdout + fixed.stderr[-3000:]
    assert "no dead slot read" not in last and "loads are not traced" in last  # it claims only what it checked

    broken = _pytest(without_nanfuzz, exported, "test_broken.py")
    assert broken.returncode == 1, broken.stdout[-3000:] + broken.stderr[-3000:]
    failed = [line for line in broken.stdout.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 1 and failed[0].startswith(
        "FAILED test_broken.py::test_output_is_finite_where_the_reference_is"), broken.stdout[-3000:]
    assert broken.stdout.splitlines()[-1].startswith("1 failed, 4 passed"), broken.stdout[-3000:]

    (exported / "test_zz_unrelated.py").write_text(UNRELATED)
    fixed_suite = _pytest(without_nanfuzz, exported, "test_fixed.py", "test_zz_unrelated.py")
    assert fixed_suite.returncode == 0, fixed_suite.stdout[-3000:] + fixed_suite.stderr[-3000:]
    assert fixed_suite.stdout.splitlines()[-1].startswith("6 passed"), fixed_suite.stdout[-3000:]
    # the exported tests changed nothing a later test of the session sees
    assert json.loads((exported / "unrelated.json").read_text()) == {"TRITON_INTERPRET": None, "mykernels": False}


@pytest.mark.gpu
def test_on_a_gpu_the_exported_files_fail_on_the_bug_and_pass_on_the_fix_without_nanfuzz(exported, without_nanfuzz):
    bug = _run(without_nanfuzz, exported, "standalone.py", gpu=True)
    assert bug.returncode == 1 and "running on cuda" in bug.stdout and "NONFINITE:" in bug.stdout, \
        bug.stdout + bug.stderr[-3000:]
    fixed_script = exported / "fixed_on_the_gpu.py"
    fixed_script.write_text((exported / "standalone.py").read_text().replace(BROKEN, FIXED))
    fixed = _run(without_nanfuzz, exported, fixed_script.name, gpu=True)
    assert fixed.returncode == 0 and fixed.stdout.splitlines()[-1].startswith("PASS"), fixed.stdout + fixed.stderr
    broken = _pytest(without_nanfuzz, exported, "test_broken.py", gpu=True)
    assert broken.returncode == 1, broken.stdout[-3000:]
    assert "FAILED test_broken.py::test_output_is_finite_where_the_reference_is" in broken.stdout, broken.stdout
    passing = _pytest(without_nanfuzz, exported, "test_fixed.py", gpu=True)
    assert passing.returncode == 0 and passing.stdout.splitlines()[-1].startswith("5 passed"), passing.stdout


def _one_line(proc: subprocess.CompletedProcess, *words: str, loaded: bool = False) -> str:
    """The one line a run that cannot load the kernel (or, ``loaded``, run it) prints, which must hold
    ``words``; a kernel that loaded was announced first."""
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and all(w in lines[0] for w in words), proc.stdout + proc.stderr
    assert len(proc.stdout.splitlines()) == (1 if loaded else 0), proc.stdout
    return lines[0]


def _session_stopped(proc: subprocess.CompletedProcess, *words: str) -> None:
    """A pytest session that could not load the kernel: exit status 2, the line once, no test failed."""
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if all(w in line for w in words)]
    assert lines and "failed" not in proc.stdout.splitlines()[-1], proc.stdout[-3000:]


def test_without_numpy_the_exported_files_say_so_in_one_line(exported, tmp_path):
    python = venv_without(tmp_path, "numpy")
    _one_line(_run(python, exported, "standalone.py"), "cannot load the kernel: no module named 'numpy'",
              "pip install numpy")
    _session_stopped(_pytest(python, exported, "test_broken.py"), "cannot load the kernel: no module named 'numpy'")


def test_where_the_adapter_s_package_does_not_import_the_exported_files_say_so_in_one_line(exported, without_nanfuzz,
                                                                                             tmp_path):
    for name in ("standalone.py", "test_broken.py"):
        shutil.copyfile(exported / name, tmp_path / name)
    _one_line(_run(without_nanfuzz, tmp_path, "standalone.py"),
              "cannot load the kernel: no module named 'mykernels'")
    _session_stopped(_pytest(without_nanfuzz, tmp_path, "test_broken.py"),
                     "cannot load the kernel: no module named 'mykernels'")


def _hostile(exported: Path, adapter: str, exported_name: str) -> Path:
    """``exported_name`` with the adapter ``adapter`` (``HOSTILE``) in the correct kernel's place."""
    (exported / "mykernels" / f"{adapter}.py").write_text(HOSTILE[adapter])
    target = exported / exported_name.replace("broken", adapter).replace("standalone", f"{adapter}_standalone")
    target.write_text((exported / exported_name).read_text().replace(ADAPTER, f"'mykernels.{adapter}'")
                      .replace(BROKEN, FIXED))
    return target


@pytest.mark.parametrize("adapter, status, shown", [
    ("exits_on_import", 2, "cannot load the kernel: SystemExit: 1"),
    ("imports_what_the_stand_in_lacks", 2, "cannot import name 'fuzz' from 'nanfuzz'"),
    ("raises_at_launch", 1, "FAIL CRASH: the kernel raised"),
    ("imports_a_missing_module_at_launch", 2, "cannot load the kernel: no module named 'mykernels_extension'"),
], ids=["exits_on_import", "imports_what_the_stand_in_lacks", "raises_at_launch", "imports_a_missing_module_at_launch"])
def test_a_kernel_that_cannot_load_is_no_finding_and_one_that_raises_is(exported, without_nanfuzz, adapter, status,
                                                                         shown):
    script = _hostile(exported, adapter, "standalone.py")
    proc = _run(without_nanfuzz, exported, script.name)
    if status == 2:
        line = _one_line(proc, shown, loaded=adapter.endswith("at_launch"))
        assert adapter != "imports_what_the_stand_in_lacks" or "install nanfuzz" in line
    else:
        assert proc.returncode == 1 and shown in proc.stdout and "RuntimeError: planted launch failure" in proc.stdout, \
            proc.stdout[-2000:] + proc.stderr[-2000:]


def test_in_the_pytest_file_a_kernel_that_kills_its_process_or_hangs_errors_every_test(exported, without_nanfuzz):
    dies = _hostile(exported, "dies_at_launch", "test_broken.py")
    hangs = _hostile(exported, "hangs_at_launch", "test_broken.py")
    text = hangs.read_text()
    assert text.count("hang_seconds=300 if") == 1
    hangs.write_text(text.replace("hang_seconds=300 if", "hang_seconds=3 if"))  # a launch may take 3 s here
    suite = _pytest(without_nanfuzz, exported, dies.name, hangs.name)
    assert suite.returncode == 1 and suite.stdout.splitlines()[-1].startswith("10 errors"), suite.stdout[-3000:]
    assert "CRASH: the process running the case died (signal 9) before its verdicts" in suite.stdout
    assert "HANG: a launch did not return in time" in suite.stdout, suite.stdout[-3000:]
    assert 'mykernels/hangs_at_launch.py", line 8 in run' in suite.stdout  # the sleep: where the launch was
