"""A seeded search's first cases are known before it starts (``harness.campaign.upcoming``), and the
compile farm builds them first, in the order the search meets them."""
from __future__ import annotations

import dataclasses

import pytest

from nanfuzz.harness.campaign.runner import fuzz

from nanfuzz.harness.campaign.scope import campaign_capabilities, campaign_pool_of

from nanfuzz.harness.campaign.search import chunk_seed, first_chunk, search_seed

from nanfuzz.harness.launch.subjects import worker_spec
from nanfuzz.harness.launch.farm import SAMPLES_PER_ENTRY, BuiltMarks, Farm, Plan, entry_of
from nanfuzz.harness.campaign.profiles import get_profile
from nanfuzz.harness.campaign.settings import Settings
from nanfuzz.harness.campaign.upcoming import upcoming_cases
from nanfuzz.harness.launch.worker import InProcess
from nanfuzz.strategies import paged_cases
from tests.torch_kernels import torch_kernel

POOL_SIZE, POOL_SEED = 6, 2


class _Recording(InProcess):
    def __init__(self, kernel):
        super().__init__(kernel, "cpu")
        self.cases = []

    def check(self, case, **kwargs):
        self.cases.append(case)
        return super().check(case, **kwargs)


@pytest.mark.parametrize("time_budget", [None, 600.0])
def test_the_cases_drawn_in_advance_are_the_ones_the_search_meets(time_budget):
    kernel = torch_kernel()
    settings = Settings(device="cpu", seed=7, max_examples=24, time_budget=time_budget, use_database=False,
                        pool_size=POOL_SIZE)
    recording = _Recording(kernel)
    campaign = fuzz(kernel, settings, subject=recording, pool_seed=POOL_SEED)
    assert not campaign.failed and len(recording.cases) == 24

    caps, _ = campaign_capabilities(kernel, settings)
    pool, _ = campaign_pool_of(caps, settings, POOL_SEED)
    first = first_chunk(24, time_budget, "cpu")
    predicted = upcoming_cases(paged_cases(caps, interpreter=True, pool=pool), chunk_seed(7, 0), first, count=24)
    assert len(predicted) == first and predicted == tuple(recording.cases[:first])
    # another seed draws other cases
    assert upcoming_cases(paged_cases(caps, interpreter=True, pool=pool), chunk_seed(8, 0), first, count=24) != predicted


def test_unseeded_campaigns_draw_their_own_seeds_and_derandomized_ones_seed_0():
    profile = get_profile("dev")
    seeds = {search_seed(Settings(), profile) for _ in range(4)}
    assert len(seeds) == 4  # jobs of one unseeded run no longer share their later chunks
    assert search_seed(Settings(seed=5), profile) == 5
    assert search_seed(Settings(), dataclasses.replace(profile, derandomize=True)) == 0


def test_the_farm_builds_the_upcoming_cases_first_in_the_campaign_s_order(tmp_path):
    kernel = torch_kernel()
    settings = Settings(device="cpu", pool_size=POOL_SIZE)
    caps, _ = campaign_capabilities(kernel, settings)
    pool, _ = campaign_pool_of(caps, settings, POOL_SEED)
    upcoming = upcoming_cases(paged_cases(caps, interpreter=True, pool=pool), 11, 40, count=12)
    plan = Plan(worker_spec(torch_kernel(), settings), caps, None, pool, upcoming)
    marks = BuiltMarks(tmp_path)
    built = pool.index(entry_of(upcoming[-1]))
    # every sample of one entry built: its samples are left out, but not its upcoming cases, which
    # may meet binaries its samples did not
    marks.mark(plan, pool[built], [])
    with Farm([plan], processes=1, marks=marks) as farm:
        tasks = list(farm._tasks)
        assert farm.wait(timeout=120)
        summary = farm.summary()
    entries = [pool.index(entry_of(case)) for case in upcoming]
    wanted = [(e, f"u{n}") for n, e in enumerate(entries)]  # one copy each: no claims to skip on a CPU
    assert [(e, s) for _, e, s in tasks[:len(wanted)]] == wanted  # in the order the campaign meets them
    samples = tasks[len(wanted):]
    assert all(isinstance(s, int) for _, _, s in samples) and built not in {e for _, e, _ in samples}
    assert summary["upcoming"] == len(wanted) and summary["given_up"] == 0
    assert summary["tasks"] == len(wanted) + SAMPLES_PER_ENTRY * len(pool)

    for entry in pool:  # a warm cache: no upcoming task, no farm process
        marks.mark(plan, entry, [])
    with Farm([plan], processes=2, marks=marks) as farm:
        assert not farm._processes and farm.summary()["upcoming"] == 0
