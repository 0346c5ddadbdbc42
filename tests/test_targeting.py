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
