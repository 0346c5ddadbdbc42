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


_CTRL_C_STORM = """
import os, signal, sys, threading, time
from nanfuzz.harness.launch.isolation import isolate
from nanfuzz.harness.launch.processes import fork_server_context, start

RUN = os.getpid()
interrupts = [0]


def child():
    isolate()


def received(signum, frame):
    if os.getpid() != RUN:  # the run's own handler, run in a child before its main took Ctrl-C
        raise KeyboardInterrupt
    interrupts[0] += 1


if __name__ == "__main__":
    plain = sys.argv[1] == "fork"
    context = __import__("multiprocessing").get_context("fork") if plain else fork_server_context()
    if not plain:
        start(context.Process(target=child))  # the fork server up before the storm
    signal.signal(signal.SIGINT, received)
    storming = [True]

    def storm():
        while storming[0]:
            os.killpg(0, signal.SIGINT)
            time.sleep(0.0002)

    threading.Thread(target=storm, daemon=True).start()
    statuses = []
    for _ in range(40):
        process = context.Process(target=child)
        start(process, not plain, plain_fork=plain)
        process.join()
        statuses.append(process.exitcode)
    storming[0] = False
    time.sleep(0.01)
    print("statuses", sorted(set(statuses)), "interrupts", interrupts[0], flush=True)
"""


def test_ctrl_c_to_the_group_as_processes_start_never_reaches_their_start_up(tmp_path):
    # Ctrl-C to the whole process group, every 0.2 ms, while 40 processes start one after another from
    # the fork server (jobs, farm processes, workers) and as plain forks (a job's workers): the run
    # takes each interrupt, and none reaches a child between its fork and its own first act, where it
    # would end the child with multiprocessing's traceback
    (tmp_path / "storm.py").write_text(_CTRL_C_STORM)
    for how in ("fork_server", "fork"):
        proc = subprocess.run([sys.executable, "storm.py", how], cwd=tmp_path, capture_output=True, text=True,
                              timeout=300, start_new_session=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert proc.returncode == 0 and "statuses [0]" in proc.stdout, (how, proc.stdout + proc.stderr[-3000:])
        assert "Traceback" not in proc.stderr, (how, proc.stderr[-3000:])
        assert int(proc.stdout.split("interrupts")[1]) > 0, "the storm reached the run"
