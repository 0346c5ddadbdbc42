"""SIGTERM and SIGHUP stop a campaign as Ctrl-C does: every job stops, the smallest failure found
so far is written (exit 1), else the exit status is 128 + the signal, and no process the campaign
or its kernel started outlives it (the process table says so)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanfuzz.harness.campaign.runner import fuzz
from nanfuzz.harness.judge.check import Verdict
from tests.process_table import marked, marked_environment
from tests.test_check import WINDOWED
from tests.torch_kernels import torch_kernel

ROOT = Path(__file__).resolve().parents[1]
# How long a test waits for the campaign to reach the state it signals it in, and for its processes
# to be gone after it exits: bounds on a hang, not on speed.
_PATIENCE = 240.0


def _campaign(tmp_path: Path, kernel: str, jobs: int, *more: str, at_once: int = 1):
    """``nanfuzz fuzz`` of ``kernel`` (and the ``more`` kernels after it, one campaign each,
    ``at_once`` of them at a time)."""
    env, mark = marked_environment({**os.environ, "PYTHONPATH": str(ROOT)})
    env.pop("CI", None)
    kernels = [arg for name in (kernel, *more) for arg in ("--kernel", name)]
    proc = subprocess.Popen([sys.executable, "-m", "nanfuzz", "fuzz", *kernels, "--device", "cpu",
                             "--seed", "0", "--max-examples", "100000", "--jobs", str(jobs),
                             "--state-dir", str(tmp_path / "state"), "--kernels-at-once", str(at_once)],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    return proc, mark


def _lines(path: Path) -> set[str]:
    return set(path.read_text().splitlines()) if path.exists() else set()


def _when(proc, ready) -> None:
    """Wait until ``ready()`` (the campaign reached the state to signal it in), or fail."""
    deadline = time.monotonic() + _PATIENCE
    while not ready():
        if proc.poll() is not None:
            pytest.fail(f"the campaign ended first (exit {proc.returncode}): {proc.stderr.read()[-2000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("the campaign never reached the state to signal it in")
        time.sleep(0.05)


def _nothing_left(mark: str) -> None:
    deadline = time.monotonic() + _PATIENCE
    while marked(mark) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marked(mark) == [], "processes outlived their campaign"


def _stop(proc, signum: int, group: bool) -> tuple[str, str]:
    (os.killpg if group else os.kill)(proc.pid, signum)  # timeout(1) and CI signal the group, kill(1) the pid
    out, err = proc.communicate(timeout=_PATIENCE)
    assert "Traceback" not in err, err
    return out, err


@pytest.mark.parametrize("jobs, signum, group", [(1, signal.SIGTERM, True), (2, signal.SIGTERM, False),
                                                 (1, signal.SIGHUP, False), (2, signal.SIGINT, True)],
                         ids=["1-job-SIGTERM-group", "2-jobs-SIGTERM-pid", "1-job-SIGHUP-pid", "2-jobs-Ctrl-C-group"])
def test_a_stop_signal_during_the_search_ends_every_process_with_128_plus_the_signal(tmp_path, jobs, signum, group):
    proc, mark = _campaign(tmp_path, "tests.subjects:starts_a_child", jobs)
    _when(proc, lambda: len(_lines(tmp_path / "children.txt")) >= jobs)  # every job's kernel has a child running
    out, err = _stop(proc, signum, group)
    assert proc.returncode == 128 + signum, out + err
    assert err.strip().splitlines()[-1] == ("nanfuzz: interrupted" if signum == signal.SIGINT else
                                            f"nanfuzz: stopped by {signal.Signals(signum).name}")
    (row,) = [line for line in out.splitlines() if line.startswith("hostile@starts_a_child ")]
    assert row.split()[2] == "STOPPED" and row.split()[-1] == "stopped", out  # stopped, no pass
    _nothing_left(mark)
    assert not list((tmp_path / "state" / "journal").glob("*.json"))
    assert not (tmp_path / "state" / "repros").exists()


def test_a_stop_signal_in_the_first_of_several_kernels_starts_no_further_campaign(tmp_path):
    proc, mark = _campaign(tmp_path, "tests.subjects:starts_a_child", 1, "paged_decode@masked")
    _when(proc, lambda: len(_lines(tmp_path / "children.txt")) >= 1)
    out, err = _stop(proc, signal.SIGTERM, False)
    assert proc.returncode == 128 + signal.SIGTERM, out + err
    assert "2 kernel(s)" in out and "paged_decode@masked" not in out + err  # the second never began
    assert err.strip().splitlines()[-1] == "nanfuzz: stopped by SIGTERM"
    _nothing_left(mark)


@pytest.mark.parametrize("jobs, group", [(1, False), (2, True)], ids=["1-job-pid", "2-jobs-group"])
def test_sigterm_while_shrinking_writes_the_smallest_failure_so_far_and_ends_every_process(tmp_path, jobs, group):
    proc, mark = _campaign(tmp_path, "tests.subjects:starts_a_child_then_exits", jobs)
    # three failing cases met: at least one job has met two, so it is shrinking
    _when(proc, lambda: len(_lines(tmp_path / "failures.txt")) >= 3)
    out, err = _stop(proc, signal.SIGTERM, group)
    assert proc.returncode == 1, out + err
    assert "nanfuzz: stopped by SIGTERM; the failure found before it is reported above" in err
    (repro,) = (tmp_path / "state" / "repros").glob("*.json")
    record = json.loads(repro.read_text())
    assert record["verdict"] == "CRASH" and record["case"]["sliding_window"] > 0
    assert json.dumps(record["case"], separators=(",", ":")) in {json.dumps(json.loads(line), separators=(",", ":"))
                                                                 for line in _lines(tmp_path / "failures.txt")}
    _nothing_left(mark)


@pytest.mark.parametrize("group", [False, True], ids=["pid", "group"])
def test_sigterm_to_kernels_side_by_side_writes_the_failure_one_shrinks_and_stops_the_other(tmp_path, group):
    proc, mark = _campaign(tmp_path, "tests.subjects:starts_a_child", 1, "tests.subjects:starts_a_child_then_exits",
                           at_once=2)
    # the first campaign searches (its own kernel's child runs: under load the second could fail three
    # times before the first launched at all), the second shrinks its third failure or later
    _when(proc, lambda: len(_lines(tmp_path / "failures.txt")) >= 3 and _lines(tmp_path / "children.txt"))
    out, err = _stop(proc, signal.SIGTERM, group)
    assert proc.returncode == 1, out + err
    assert "nanfuzz: stopped by SIGTERM; the failure found before it is reported above" in err
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("hostile@starts_a_child")}
    assert rows["hostile@starts_a_child"][2] == "STOPPED", out
    assert rows["hostile@starts_a_child_then_exits"][2] == "CRASH", out
    (repro,) = (tmp_path / "state" / "repros").glob("*.json")
    assert json.loads(repro.read_text())["verdict"] == "CRASH"
    _nothing_left(mark)
    assert not list((tmp_path / "state" / "journal").glob("*.json"))


def test_a_job_killed_outright_leaves_no_process_of_its_kernel_behind(tmp_path):
    # a job that does not stop within its grace is killed; the worker it forked dies with it (or, forked
    # by the fork server, loses its job), and what that worker's kernel started is adopted by the command
    # and ended as it exits
    proc, mark = _campaign(tmp_path, "tests.subjects:starts_a_child", 2)
    _when(proc, lambda: len(_lines(tmp_path / "children.txt")) >= 2)
    child = int(sorted(_lines(tmp_path / "children.txt"))[0])
    worker = _parent(child)
    job = _parent(worker)
    assert job != proc.pid
    os.kill(job, signal.SIGKILL)
    out, err = _stop(proc, signal.SIGTERM, False)
    assert proc.returncode in (2, 128 + signal.SIGTERM), out + err
    _nothing_left(mark)


def test_the_command_killed_outright_leaves_no_process_of_its_kernel_behind(tmp_path):
    # kill -9 of the command: its worker dies with it (PR_SET_PDEATHSIG), and the worker's guard, which
    # outlives it by design, ends the worker's group, and with it what the kernel started
    proc, mark = _campaign(tmp_path, "tests.subjects:starts_a_child", 1)
    _when(proc, lambda: len(_lines(tmp_path / "children.txt")) >= 1)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=_PATIENCE)
    _nothing_left(mark)


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_a_journalled_case_of_any_verdict_is_judged_again_by_the_next_run(tmp_path, monkeypatch):
    # a campaign killed outright (kill -9) while it shrank a MISMATCH leaves that case in its journal
    from tests.test_fuzz import _leave_in_journal

    monkeypatch.chdir(tmp_path)
    kernel = torch_kernel("window-off-by-one")
    path = _leave_in_journal(kernel.name, WINDOWED)
    campaign = fuzz(kernel, device="cpu", max_examples=5, use_database=False)
    assert campaign.failed and campaign.failure.verdict is Verdict.MISMATCH and campaign.failing_case == WINDOWED
    assert campaign.recovered_crash and not path.exists()
