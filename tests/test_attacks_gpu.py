"""On a GPU: kernels that attack their campaign from a worker with a live CUDA/HIP context, and a
stop signal to a campaign whose jobs, workers and compile farm all hold contexts of their own."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanfuzz.harness.campaign.runner import fuzz
from nanfuzz.harness.campaign.settings import Settings
from nanfuzz.harness.judge.check import Verdict
from nanfuzz.harness.launch.subjects import worker_spec
from nanfuzz.harness.launch.worker import Supervised
from tests import subjects
from tests.cases import consecutive_case
from tests.process_table import marked, marked_environment

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("subject", [subjects.kills_its_process_group, subjects.kills_the_fork_server],
                         ids=lambda s: s.name)
def test_a_kernel_that_kills_its_group_or_its_fork_server_is_a_crash_and_the_campaign_lives(subject, tmp_path):
    settings = Settings(device="cuda", state_dir=tmp_path / "state", repro_dir=tmp_path / "repros",
                        use_database=False, seed=0, max_examples=100, pool_size=0, replays=1,
                        shrink=False)  # each death costs a fresh context (and server): shrinking is the CPU test's
    campaign = fuzz(subject, settings)
    assert campaign.failed and campaign.failure.verdict is Verdict.CRASH, campaign.failure
    assert campaign.failing_case.sliding_window > 0 and campaign.failure.evidence["repeated"] == "1/1"
    print(subject.name, campaign.failure.summary, "| restarts:", campaign.worker_restarts)


def test_a_worker_after_a_killed_fork_server_opens_its_device_and_passes():
    subject = Supervised(worker_spec(subjects.kills_the_fork_server, Settings(device="cuda")), launch_timeout=60.0)
    try:
        plain, windowed = consecutive_case([(1, 20)]), consecutive_case([(1, 20)], window=4)
        assert subject.check(plain).verdict is Verdict.PASS
        assert subject.check(windowed).verdict is Verdict.CRASH
        assert subject.check(plain).verdict is Verdict.PASS and subject.restarts == 1
    finally:
        subject.close()


def test_sigterm_to_a_gpu_campaign_with_jobs_and_a_compile_farm_leaves_no_process(tmp_path):
    # a fixed built-in kernel: its pool is compiled by a farm, and it passes, so it runs until the signal
    env, mark = marked_environment({**os.environ, "PYTHONPATH": str(ROOT)})
    env.pop("CI", None)
    proc = subprocess.Popen([sys.executable, "-m", "nanfuzz", "fuzz", "--kernel", "paged_decode@masked",
                             "--device", "cuda", "--jobs", "2", "--max-examples", "100000", "--state-dir",
                             str(tmp_path / "state")], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    journal = tmp_path / "state" / "journal"
    deadline = time.monotonic() + 600  # a bound on a hang, not on speed
    while len(list(journal.glob("*.json"))) < 2:  # both jobs are in their searches
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-2000:]
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 143 and "Traceback" not in err, out[-2000:] + err[-2000:]
    assert err.strip().splitlines()[-1] == "nanfuzz: stopped by SIGTERM"
    while marked(mark) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marked(mark) == []
