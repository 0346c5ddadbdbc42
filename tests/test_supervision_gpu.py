"""On a GPU: a kernel that faults on an illegal address, one whose tile loop overshoots the table,
and one that spins on the device.

The fault kills the worker's CUDA context for good; the campaign records a
CRASH, starts a fresh worker, shrinks, and ``nanfuzz replay`` reproduces it in
a fresh process.  The overshoot reads the block table's redzone columns,
which point at a NaN block: the same NONFINITE verdict on every seed.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from nanfuzz.harness.judge.check import Verdict
from nanfuzz.harness.campaign.runner import fuzz
from nanfuzz.harness.campaign.settings import Settings

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]


def test_an_illegal_address_is_a_crash_shrunk_and_replayed_in_a_fresh_process(tmp_path):
    from tests import triton_subjects

    settings = Settings(device="cuda", state_dir=tmp_path / "state", repro_dir=tmp_path / "repros",
                        use_database=False, seed=0, max_examples=200)
    campaign = fuzz(triton_subjects.follows_garbage_table_entry, settings)
    assert campaign.failed and campaign.failure.verdict is Verdict.CRASH, campaign.failure
    # the fault itself, not what a library set up on the dead context said after it (cuBLAS's "not initialized")
    assert "illegal" in campaign.failure.summary.lower() or "died" in campaign.failure.summary, campaign.failure.summary
    assert len(campaign.failing_case.sequences) == 1 and campaign.failing_case.sliding_window > 0
    from nanfuzz.harness.report.failures import report_failure

    (repro, *_) = report_failure(triton_subjects.follows_garbage_table_entry, campaign, settings)
    proc = subprocess.run([sys.executable, "-m", "nanfuzz", "replay", repro, "--device", "cuda"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1 and "CRASH" in proc.stdout, proc.stdout + proc.stderr
    print(campaign.failure.summary, "| worker restarts:", campaign.worker_restarts,
          "| replay:", proc.stdout.splitlines()[0])


def test_a_tile_loop_past_the_table_is_nonfinite_on_every_seed(tmp_path):
    from tests import triton_subjects

    verdicts = []
    for seed in range(10):
        settings = Settings(device="cuda", state_dir=tmp_path / f"s{seed}", use_database=False, seed=seed,
                            max_examples=100, replays=0)
        campaign = fuzz(triton_subjects.overshoots_the_table, settings)
        verdicts.append(campaign.failure.verdict.value if campaign.failed else "PASS")
    print("overshoot verdicts over 10 seeds:", verdicts)
    assert verdicts == ["NONFINITE"] * 10


def test_the_correct_triton_subject_passes(tmp_path):
    from tests import triton_subjects

    settings = Settings(device="cuda", state_dir=tmp_path / "state", use_database=False, seed=0, max_examples=200)
    campaign = fuzz(triton_subjects.correct, settings)
    assert not campaign.failed, campaign.failure and campaign.failure.summary


def test_a_kernel_spinning_on_the_device_is_a_hang_of_its_launch():
    # its launch returns at once: the hang shows in the wait for the device, which the watchdog times too
    from nanfuzz.harness.launch.subjects import worker_spec
    from nanfuzz.harness.launch.worker import Supervised
    from tests import triton_subjects
    from tests.cases import consecutive_case

    subject = Supervised(worker_spec(triton_subjects.spins, Settings(device="cuda")), launch_timeout=3.0)
    try:
        outcome = subject.check(consecutive_case([(1, 20)], q_heads=2, kv_heads=1, head_size=32, dtype="float32"))
        assert outcome.verdict is Verdict.HANG and outcome.evidence["during_launch"], outcome.summary
        assert "did not return within 3 s" in outcome.summary
    finally:
        subject.close()
