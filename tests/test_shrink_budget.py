"""Shrinking stops at its budget and the smallest failure found by then stands; the self-check
shrinks each caught variant for SELF_CHECK_SHRINK_BUDGET seconds at most."""
from __future__ import annotations

import pytest

from nanfuzz.harness.campaign.profiles import get_profile
from nanfuzz.harness.campaign.runner import fuzz
from nanfuzz.harness.campaign.settings import DEFAULT_SHRINK_BUDGET, Settings
from nanfuzz.harness.cli import SELF_CHECK_SHRINK_BUDGET, _self_check_settings
from nanfuzz.harness.registry import builtin_kernels
from tests.torch_kernels import torch_kernel

STOPPED = "shrinking stopped after"


def _campaign(**options):
    return fuzz(torch_kernel("mask-multiply"), device="cpu", max_examples=300, seed=3, use_database=False,
                isolation=False, **options)


def test_a_shrink_past_its_budget_stops_and_its_smallest_failure_so_far_stands():
    whole = _campaign()
    cut = _campaign(shrink_budget=1e-6)
    assert whole.failed and cut.failed
    assert not any(STOPPED in note for note in whole.notes)
    assert any(STOPPED in note for note in cut.notes)
    # the same search up to its first failure; the cut one then checked nothing more
    assert cut.examples_to_first_failure == whole.examples_to_first_failure
    assert cut.examples == cut.examples_to_first_failure < whole.examples
    assert cut.failure.verdict == whole.failure.verdict


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("name", ["paged_decode@tail-masked", "split_decode@drops-last-partition"])
def test_the_self_check_shrinks_each_campaign_for_its_own_budget_at_most(device, name):
    kernel, dev = builtin_kernels()[name], get_profile("dev")
    assert SELF_CHECK_SHRINK_BUDGET < DEFAULT_SHRINK_BUDGET
    assert _self_check_settings(kernel, Settings(device=device), dev).shrink_budget == SELF_CHECK_SHRINK_BUDGET
    shorter = Settings(device=device, shrink_budget=2.0)
    assert _self_check_settings(kernel, shorter, dev).shrink_budget == 2.0
