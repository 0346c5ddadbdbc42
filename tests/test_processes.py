"""The fork server starts before torch is imported, for the backend the environment points to;
a wrong guess restarts it, since Triton must know when it is imported whether it interprets."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from nanfuzz.harness.launch.processes import likely_backend

ROOT = Path(__file__).resolve().parents[1]


def test_the_backend_is_guessed_only_where_the_environment_tells(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert likely_backend("cpu") == "cpu" and likely_backend("cuda") == "cuda"
    assert likely_backend("tpu") is None  # choose_backend refuses it
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert likely_backend(None) == "cpu"
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert likely_backend(None) is None  # devices hidden: only torch can tell
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    if sys.platform.startswith("linux"):
        gpu_nodes = os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/kfd")
        assert likely_backend(None) == ("cuda" if gpu_nodes else "cpu")


def test_a_fork_server_started_for_the_wrong_backend_is_restarted(tmp_path):
    # the guess says GPU on a machine where the interpreter is chosen: without the restart every
    # job would import Triton's own helpers compiled for the GPU, and the masked kernel would crash
    script = (
        "import nanfuzz.harness.launch.processes as p\n"
        "p.likely_backend = lambda device: 'cuda'\n"
        "from nanfuzz.harness.cli import main\n"
        "raise SystemExit(main(['fuzz', '--kernel', 'paged_decode@masked', '--jobs', '2', '--max-examples', '12',\n"
        "                       '--no-shrink', '--seed', '0', '--device', 'cpu']))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["NANFUZZ_STATE_DIR"] = str(tmp_path / "state")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "PASS" in proc.stdout, proc.stdout + proc.stderr


def test_the_fork_server_starts_before_the_command_imports_torch():
    # the server's imports of torch and Triton take seconds on a GPU host: they overlap the command's
    # own only when nothing the command runs before starting it imports torch
    script = (
        "import sys\n"
        "from multiprocessing import forkserver\n"
        "def seen(*args):\n"
        "    print('torch imported' if 'torch' in sys.modules else 'torch not imported', flush=True)\n"
        "    raise SystemExit(0)\n"
        "forkserver.ensure_running = forkserver._forkserver.ensure_running = seen\n"
        "from nanfuzz.harness.cli import main\n"
        "main(['fuzz', '--kernel', 'paged_decode@masked', '--max-examples', '5', '--time-budget', '9',\n"
        "      '--summary-json', 'out.json', '--device', 'cpu'])\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "torch not imported", proc.stdout + proc.stderr
