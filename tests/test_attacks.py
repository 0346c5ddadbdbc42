"""Kernels that attack their campaign: one that signals its process group, one that kills the
fork server its worker came from, one that leaves processes behind.  Each is a verdict of the
case that did it, or nothing at all; none reaches the campaign."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from nanfuzz.harness.campaign.runner import fuzz
from nanfuzz.harness.campaign.settings import Settings
from nanfuzz.harness.judge.check import Verdict
from nanfuzz.harness.launch.subjects import worker_spec
from nanfuzz.harness.launch.worker import Supervised
from tests import subjects
from tests.cases import consecutive_case
from tests.process_table import ended, running

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process table in /proc")

WINDOWED, PLAIN = consecutive_case([(1, 20)], window=4), consecutive_case([(1, 20)])


@pytest.fixture
def settings(tmp_path):
    return Settings(device="cpu", state_dir=tmp_path / "state", repro_dir=tmp_path / "repros", use_database=False,
                    seed=0, max_examples=100, launch_timeout=2.0)


@pytest.mark.parametrize("subject", [subjects.kills_its_process_group, subjects.kills_its_group_by_pid_zero],
                         ids=["killpg-0", "kill-0"])
def test_a_kernel_that_kills_its_process_group_is_a_crash_shrunk_like_any_death(settings, subject):
    # the worker leads a group of its own: were it the campaign's, this test's process would die here
    campaign = fuzz(subject, settings)
    assert campaign.failed and campaign.failure.verdict is Verdict.CRASH, campaign.failure
    assert "killed by SIGKILL during a launch" in campaign.failure.summary
    assert len(campaign.failing_case.sequences) == 1 and campaign.failing_case.sliding_window > 0
    assert campaign.failure.evidence["repeated"] == "3/3"


def _fork_server_pid():
    from multiprocessing import forkserver

    return forkserver._forkserver._forkserver_pid


def test_a_kernel_that_kills_the_fork_server_is_a_crash_of_that_case_and_a_new_server_carries_on():
    subject = Supervised(worker_spec(subjects.kills_the_fork_server, Settings(device="cpu")), launch_timeout=5.0)
    try:
        assert subject.check(PLAIN).verdict is Verdict.PASS
        server = _fork_server_pid()
        crashed = subject.check(WINDOWED)  # the kernel kills the server: its worker dies with it, now
        assert crashed.verdict is Verdict.CRASH, crashed.summary
        assert "the fork server it was forked from died (killed by SIGKILL)" in crashed.summary
        assert subject.check(PLAIN).verdict is Verdict.PASS  # a fresh worker, from a fresh server
        assert _fork_server_pid() != server and ended(server) and subject.restarts == 1
    finally:
        subject.close()


def test_a_campaign_against_a_fork_server_killer_reports_the_crash(settings):
    campaign = fuzz(subjects.kills_the_fork_server, settings.replace(shrink=False, replays=1))
    assert campaign.failed and campaign.failure.verdict is Verdict.CRASH, campaign.failure
    assert campaign.failing_case.sliding_window > 0 and campaign.failure.evidence["repeated"] == "1/1"


def test_a_kernel_that_kills_the_process_of_its_job_is_a_crash_of_that_case_not_a_lost_campaign(settings):
    """With --jobs a worker is forked from its job, so this kernel takes the job down with it: the
    campaign replays the case the job left in its journal, and reports its CRASH with a repro."""
    from nanfuzz.harness.campaign.jobs import fuzz_parallel

    campaign = fuzz_parallel(subjects.kills_the_fork_server, settings.replace(jobs=2, max_examples=60))
    assert campaign.failed and campaign.failure.verdict is Verdict.CRASH, campaign.failure
    assert campaign.failing_case.sliding_window > 0 and campaign.recovered_crash


def test_a_job_reported_ended_with_255_is_waited_for_while_it_still_runs():
    """multiprocessing reads 255 for a job whose fork server died before it: such a job may be running."""
    from types import SimpleNamespace

    from nanfuzz.harness.campaign.jobs import _gone

    reaped = subprocess.Popen(["true"])
    reaped.wait()
    assert not _gone(SimpleNamespace(exitcode=255, pid=os.getpid()))  # this process runs
    assert _gone(SimpleNamespace(exitcode=255, pid=reaped.pid))
    assert _gone(SimpleNamespace(exitcode=1, pid=os.getpid()))


def _children(folder: Path) -> list[int]:
    path = folder / "exiting-children.txt"  # where starts_a_child_then_exits notes them
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def test_processes_a_kernel_starts_end_with_its_worker(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where the kernel notes its children
    subject = Supervised(worker_spec(subjects.starts_a_child_then_exits, Settings(device="cpu")), launch_timeout=5.0)
    try:
        assert subject.check(PLAIN).verdict is Verdict.PASS
        (first,) = _children(tmp_path)
        assert running(first)  # sensitivity: the child outlives its launch
        assert subject.check(WINDOWED).verdict is Verdict.CRASH  # the worker exits: its child goes with it
        assert ended(first)
        assert subject.check(PLAIN).verdict is Verdict.PASS
        second = _children(tmp_path)[-1]
        assert second != first and running(second)
    finally:
        subject.close()
    assert ended(second)  # a worker stopped by its campaign takes its children too


ROOT = Path(__file__).resolve().parents[1]


def _in_a_session_of_its_own(command: list[str], folder: Path) -> subprocess.CompletedProcess:
    """``command`` in ``folder``, leading a session of its own: a kernel that signals its group there
    reaches it and nothing of this test's."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("CI", None)
    return subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=600,
                          start_new_session=True)


def test_without_isolation_a_kernel_that_kills_the_campaign_s_group_is_the_next_run_s_crash(tmp_path):
    command = [sys.executable, "-m", "nanfuzz", "fuzz", "--kernel", "tests.subjects:kills_its_group_by_pid_zero",
               "--device", "cpu", "--no-isolation", "--max-examples", "100", "--seed", "0", "--launch-timeout", "60"]
    first = _in_a_session_of_its_own(command, tmp_path)
    assert first.returncode == -signal.SIGKILL, first.stdout + first.stderr  # the campaign itself dies
    assert list((tmp_path / ".nanfuzz" / "journal").glob("*.json")), "its case in flight is journaled"
    second = _in_a_session_of_its_own(command, tmp_path)
    assert second.returncode == 1, second.stdout + second.stderr
    assert "replayed in a fresh worker it gives CRASH" in second.stderr
    assert "CRASH: the worker process was killed by SIGKILL during a launch" in second.stdout
    assert list((tmp_path / ".nanfuzz" / "repros").glob("*crash*.json"))


_INLINE = """
import os, sys
import nanfuzz
from tests.torch_kernels import CAPS, attention

def run(batch, out):
    if batch.case.sliding_window:
        os.kill(0, 9)
    return attention(batch, out)

def main():
    kernel = nanfuzz.Kernel("inline@kills-its-group", run, CAPS)  # no import path: it runs in this process
    campaign = nanfuzz.fuzz(kernel, device="cpu", max_examples=100, seed=0, use_database=False)
    print(campaign.failure.summary if campaign.failed else "PASS")
    return 1 if campaign.failed else 0

if __name__ == "__main__":
    sys.exit(main())
"""


def test_a_kernel_only_the_campaign_s_process_runs_that_kills_it_twice_on_one_case_is_a_crash(tmp_path):
    (tmp_path / "campaign.py").write_text(_INLINE)
    command = [sys.executable, "campaign.py"]
    assert _in_a_session_of_its_own(command, tmp_path).returncode == -signal.SIGKILL
    assert _in_a_session_of_its_own(command, tmp_path).returncode == -signal.SIGKILL  # its replay, there too
    third = _in_a_session_of_its_own(command, tmp_path)
    assert third.returncode == 1, third.stdout + third.stderr
    assert third.stdout.startswith("CRASH: the campaign's process died running this case, and died again")
