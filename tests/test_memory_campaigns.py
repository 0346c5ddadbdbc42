"""Findings under memory pressure: separate campaigns sharing one device end with exit 0, or exit 1
and a repro, never exit 2; a finding whose replays cannot get memory stands as found; a campaign
that could judge nothing is no pass."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from nanfuzz.harness.campaign.runner import fuzz
from nanfuzz.harness.campaign.settings import Settings
from nanfuzz.harness.launch.worker import Declined, InProcess
from nanfuzz.harness.report.failures import report_failure
from tests.torch_kernels import torch_kernel

ROOT = Path(__file__).resolve().parents[1]


def _start(folder: Path, ledger: Path, total_gib: float, case_gib: float, kernel: str, *options: str):
    """``nanfuzz fuzz`` in a folder of its own, on the simulated device named by ``ledger``."""
    folder.mkdir()
    command = [sys.executable, "-m", "tests.simulated_memory", str(ledger), str(total_gib), str(case_gib),
               "fuzz", "--kernel", kernel, "--device", "cpu", "--state-dir", "state", "--summary-json", "summary.json",
               "--launch-timeout", "120", *options]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("CI", None)
    return subprocess.Popen(command, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_campaigns_sharing_a_device_end_with_exit_0_or_a_finding_and_its_repro(tmp_path):
    # 10 GiB, 4 GiB a case: two cases at once; three campaigns whose launches hold their memory 0.1 s each
    ledger = tmp_path / "ledger"
    kernels = {"correct": ("tests.subjects:slow_correct", 0), "first": ("tests.subjects:slow_mask_multiply", 1),
               "second": ("tests.subjects:slow_mask_multiply", 1)}
    started = {name: _start(tmp_path / name, ledger, 10, 4, kernel, "--max-examples", "12", "--seed", str(n))
               for n, (name, (kernel, _)) in enumerate(kernels.items())}
    waits = 0
    for name, process in started.items():
        out, err = process.communicate(timeout=900)
        assert process.returncode == kernels[name][1], f"{name}: exit {process.returncode}\n{out}\n{err}"
        (entry,) = json.loads((tmp_path / name / "summary.json").read_text())["kernels"]
        waits += entry["memory_waits"]
        # each wait by what stood in the way: on the simulated device, the others' reservations
        assert sum(entry["memory_wait_causes"].values()) >= entry["memory_waits"]
        assert set(entry["memory_wait_causes"]) <= {"held by other nanfuzz processes",
                                                    "wanted first by other nanfuzz processes"}
        if process.returncode == 1:
            repro = json.loads((tmp_path / name / entry["repro"][0]).read_text())
            assert repro["verdict"] == "NONFINITE" and entry["evidence"]["repeated"] == "3/3"
    assert waits > 0  # the device was short: campaigns waited for each other's cases


def test_a_campaign_whose_every_case_needs_more_than_the_device_has_is_no_pass(tmp_path):
    process = _start(tmp_path / "alone", tmp_path / "ledger", 3, 4, "tests.subjects:slow_correct",
                     "--max-examples", "3")
    out, err = process.communicate(timeout=600)
    assert process.returncode == 2, out + err
    lines = [line for line in err.splitlines() if line.startswith("nanfuzz: kernel")]
    assert len(lines) == 1 and "every case drawn" in lines[0] and "declined for memory" in lines[0], err


class _NoMemoryOnceFound(InProcess):
    """The kernel in this process, on a device that has no memory left for anything after the
    first failure: every shrink candidate and every replay is declined."""

    found = False

    def check(self, case, *, patience=None, **options):
        if self.found:
            return Declined("this case needs about 4.0 GiB of GPU memory and 0.0 GiB are free to it after 120 s "
                            "of waiting; declined")
        outcome = super().check(case, **options)
        self.found = outcome.failed
        return outcome


def test_a_finding_whose_replays_cannot_get_memory_stands_unshrunk_with_its_repro(tmp_path):
    kernel = torch_kernel("mask-multiply")
    settings = Settings(device="cpu", state_dir=tmp_path / "state", repro_dir=tmp_path / "repros", use_database=False,
                        seed=3, max_examples=50)
    campaign = fuzz(kernel, settings, subject=_NoMemoryOnceFound(kernel, "cpu"))
    assert campaign.failed and campaign.failure.verdict.value == "NONFINITE"
    assert campaign.failure.evidence["repeated"] == "not replayed"
    assert any("was replayed 0 of 3 times: this case needs" in note for note in campaign.notes), campaign.notes
    assert any("did not get its device memory in time" in note for note in campaign.notes), campaign.notes
    assert campaign.examples == campaign.examples_to_first_failure  # nothing ran after it: unshrunk
    (path, *_) = report_failure(kernel, campaign, settings, stream=open(os.devnull, "w"))
    assert json.loads(Path(path).read_text())["verdict"] == "NONFINITE"


class _RecordsPatience(InProcess):
    patience: list = []

    def check(self, case, *, patience=None, **options):
        self.patience.append(patience)
        return super().check(case, **options)


def test_a_drawn_case_waits_for_memory_no_longer_than_the_time_budget_leaves():
    kernel = torch_kernel(None)
    subject = _RecordsPatience(kernel, "cpu")
    fuzz(kernel, Settings(device="cpu", use_database=False, seed=1, max_examples=5, time_budget=20.0), subject=subject)
    assert subject.patience and all(5.0 <= p <= 20.0 for p in subject.patience), subject.patience
    subject.patience.clear()
    fuzz(kernel, Settings(device="cpu", use_database=False, seed=1, max_examples=3), subject=subject)
    assert set(subject.patience) == {Settings().memory.search_wait}  # no budget: the governor's whole wait


def test_memory_pressure_stops_a_campaign_past_its_grace_so_that_the_failure_it_shrinks_is_written(tmp_path):
    # a HANG costs a launch timeout per shrink candidate: 35 s in it is still shrinking; beside it, a
    # passing campaign and one whose finding is shrunk well inside the budget are left alone
    beside = ["tests.torch_kernels:correct --size small --max-examples 20 --seed 2",
              "tests.torch_kernels:mask_multiply --size small --max-examples 200 --seed 0"]
    proc = subprocess.run([sys.executable, "ci/memory_pressure.py", "--device", "cpu", "--time-budget", "35",
                           "--grace", "0", "--out", str(tmp_path / "runs"), "--memory-dir", str(tmp_path / "ledger"),
                           "--json", str(tmp_path / "rows.json"),
                           "--kernel", "tests.subjects:hangs --size small --launch-timeout 2 --seed 1",
                           *(option for run in beside for option in ("--kernel", run))],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 1, proc.stdout + proc.stderr  # a campaign past its grace is a failure of the run
    assert "tests.subjects:hangs --size small --launch-timeout 2 --seed 1: still running 0 s past its budget; " \
           "stopped (SIGTERM)" in proc.stdout, proc.stdout
    assert proc.stdout.count("past its budget") == 1, proc.stdout
    hangs, correct, masked = json.loads((tmp_path / "rows.json").read_text())
    assert (hangs["exit"], hangs["verdict"], hangs["repro"], hangs["ok"]) == (1, "HANG", "on disk", False), hangs
    assert (correct["exit"], correct["verdict"], correct["ok"]) == (0, "PASS", True), correct
    assert (masked["exit"], masked["verdict"], masked["repro"], masked["ok"]) == (1, "NONFINITE", "on disk", True), masked
    assert re.fullmatch(r"\d+ ex/\d+\.\ds", masked["first_failure"]) and masked["shrink_s"] >= 0, masked
    assert (correct["first_failure"], correct["shrink_s"]) == ("-", None), correct
