"""The search reports what to climb toward to Hypothesis's target(): dead slots addressed, error over the bound.

Whether it finds planted bugs sooner is measured, not tested: ``python ci/targeting.py``.
"""
from __future__ import annotations

from types import SimpleNamespace

from nanfuzz.harness.campaign import search
from nanfuzz.harness.campaign.runner import fuzz
from nanfuzz.harness.campaign.settings import Settings
from nanfuzz.harness.campaign.upcoming import UPCOMING_CASES
from nanfuzz.harness.judge.outcome import Outcome, Verdict
from tests import planted_errors, read_subjects


def _spy(monkeypatch) -> list:
    seen = []
    monkeypatch.setattr(search, "target", lambda value, label: seen.append((label, value)))
    return seen


def test_each_example_reports_its_dead_slots_and_its_error_over_the_bound(monkeypatch):
    seen = _spy(monkeypatch)
    campaign = fuzz(read_subjects.zeroed, device="cpu", max_examples=3, seed=1, use_database=False, isolation=False)
    assert not campaign.failed
    dead = [value for label, value in seen if label == "dead slots addressed"]
    ratios = [value for label, value in seen if label == "error over the bound"]
    assert len(dead) == len(ratios) == 3 and max(dead) > 0 and all(0 <= r < 1 for r in ratios)
    seen.clear()
    fuzz(planted_errors.exact, device="cpu", max_examples=3, seed=1, use_database=False, isolation=False)
    assert {label for label, _ in seen} == {"error over the bound"}  # plain torch: no traced loads to count


def test_each_triton_launch_reports_how_many_of_its_kernels_the_campaign_has_launched_rarely(monkeypatch):
    from nanfuzz.harness.campaign import reach

    seen = _spy(monkeypatch)
    fuzz(read_subjects.zeroed, device="cpu", max_examples=reach.QUOTA + 2, seed=1, use_database=False,
         isolation=False)
    rare = [value for label, value in seen if label == "kernel paths launched rarely"]
    # one Triton kernel a launch: rare for the first QUOTA examples, then no longer
    assert rare == [1.0] * reach.QUOTA + [0.0] * 2


def test_no_target_reports_nothing(monkeypatch):
    seen = _spy(monkeypatch)
    fuzz(read_subjects.zeroed, device="cpu", max_examples=2, seed=1, use_database=False, isolation=False,
         targeting=False)
    assert seen == []


def test_a_search_with_a_pool_reports_nothing_for_the_cases_drawn_ahead(monkeypatch):
    seen = _spy(monkeypatch)
    probe = search.Search.__new__(search.Search)
    probe.run = SimpleNamespace(settings=Settings(device="cuda"))
    probe.calls, probe.drawn_ahead = 0, True
    passed = Outcome(Verdict.PASS, "PASS", {"max_error_ratio": 1.0, "bound": 2.5})
    for _ in range(UPCOMING_CASES + 3):
        probe._target(passed)
    assert seen == [("error over the bound", 0.4)] * 3


def test_the_summary_gives_the_highest_ratio_the_search_reached(monkeypatch, tmp_path, capsys):
    import json

    from nanfuzz.harness.cli import main

    seen = _spy(monkeypatch)
    summary = tmp_path / "summary.json"
    assert main(["fuzz", "--kernel", "tests.planted_errors:exact", "--device", "cpu", "--max-examples", "12",
                 "--seed", "4", "--no-isolation", "--state-dir", str(tmp_path / "state"),
                 "--summary-json", str(summary)]) == 0
    (row,) = json.loads(summary.read_text())["kernels"]
    highest = row["highest_error_ratio"]
    reported = [value for label, value in seen if label == "error over the bound"]
    assert len(reported) == 12 and 0 < max(reported) < 1
    # the highest ratio is the example that climbed nearest its bound, in the bound's units and in the target's
    assert abs(highest["ratio"] / highest["bound"] - max(reported)) < 1e-9
    assert highest["arithmetic"] in row["accuracy"]


def test_the_measuring_scripts_run_and_print_their_figures(tmp_path):
    # ci/targeting.py and ci/read_overhead.py are how the docs' figures are measured: they must keep running
    import json
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    found = tmp_path / "targeting.json"
    proc = subprocess.run([sys.executable, "ci/targeting.py", "--seeds", "1", "--examples", "3", "--kernel",
                           "tests.planted_errors:exact", "--json", str(found)], cwd=root, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "with target()  >3   median >3, found 0/1" in proc.stdout  # a correct kernel: nothing found either way
    assert json.loads(found.read_text())["kernels"]["tests.planted_errors:exact"] == {"on": [None], "off": [None]}
    proc = subprocess.run([sys.executable, "ci/read_overhead.py", "--cases", "2", "--kernel", "paged_decode@masked"],
                          cwd=root, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.search(r"^all: untraced [\d.]+ s, traced [\d.]+ s, ratio \d+\.\d{3}$", proc.stdout, re.M), proc.stdout
