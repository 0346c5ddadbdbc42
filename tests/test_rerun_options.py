"""The options a campaign prints after its seed draw its cases again, where ``--seed`` alone would not.

An unseeded run with a specialisation pool fuzzes pool 0 in the state folder's next round
(``harness.campaign.pool_rounds``); ``--seed S`` alone picks pool S in round 0.
"""
from __future__ import annotations

import json
import re

import pytest

from nanfuzz.harness.campaign.result import Campaign
from nanfuzz.harness.campaign.settings import Settings
from nanfuzz.harness.cli import main as cli, rerun_options
from nanfuzz.harness.kernels._common import INTERPRETED

KERNEL = ["--kernel", "paged_decode@masked", "--device", "cpu", "--profile", "dev", "--max-examples", "12",
          "--pool", "4"]


def _fuzz(capsys, state, *options) -> tuple[str, dict]:
    summary = state.with_name(state.name + ".json")
    code = cli(["fuzz", *KERNEL, "--state-dir", str(state), "--summary-json", str(summary), *options])
    out = capsys.readouterr().out
    assert code == 0, out
    entry = json.loads(summary.read_text())["kernels"][0]
    entry["statistics"].pop("seconds")  # what was drawn, not how long it took
    return out, entry


CPU_CAMPAIGN = pytest.mark.skipif(not INTERPRETED, reason="a CPU campaign in a pytest of its own")


@CPU_CAMPAIGN
def test_an_unseeded_run_prints_the_pool_it_fuzzed_and_those_options_draw_its_cases_again(tmp_path, capsys):
    state = tmp_path / "state"
    _fuzz(capsys, state)  # round 0; the next run takes round 1
    out, first = _fuzz(capsys, state)
    assert (first["pool_seed"], first["pool_round"]) == (0, 1)
    seed = first["seed"]
    rerun = re.search(r"seed \d+ \((.*) runs the same search\)", out).group(1)
    assert rerun == f"--seed {seed} --pool-seed 0 --pool-round 1"

    _, again = _fuzz(capsys, tmp_path / "again", *rerun.split())
    assert again["statistics"] == first["statistics"] and again["examples"] == first["examples"]
    assert (again["seed"], again["pool_seed"], again["pool_round"]) == (seed, 0, 1)
    # sensitivity: the seed alone picks another pool, and draws other cases
    out, seed_alone = _fuzz(capsys, tmp_path / "seed-alone", "--seed", str(seed))
    assert (seed_alone["pool_seed"], seed_alone["pool_round"]) == (seed, 0)
    assert seed_alone["statistics"] != first["statistics"]
    assert f"(--seed {seed} runs the same search)" in out


@CPU_CAMPAIGN
def test_a_pinned_pool_takes_no_round_from_the_state_folder(tmp_path, capsys):
    state = tmp_path / "state"
    for _ in range(2):
        _, entry = _fuzz(capsys, state, "--pool-round", "3")
        assert (entry["pool_seed"], entry["pool_round"]) == (0, 3)
    _, entry = _fuzz(capsys, state)  # the rounds it would have taken are still there
    assert entry["pool_round"] == 0
    assert cli(["fuzz", *KERNEL, "--pool-seed", "-1"]) == 2 and cli(["fuzz", *KERNEL, "--pool-round", "-2"]) == 2


def test_the_options_name_the_pool_only_where_the_seed_does_not_pick_it():
    settings, jobs = Settings(device="cpu"), Settings(device="cpu", jobs=4)
    assert rerun_options(Campaign("k", "cpu", seed=5), settings) == "--seed 5"
    assert rerun_options(Campaign("k", "cuda", seed=5, pool_seed=5, pool_round=0), settings) == "--seed 5"
    assert rerun_options(Campaign("k", "cuda", seed=5, pool_seed=0, pool_round=2), settings) == \
        "--seed 5 --pool-seed 0 --pool-round 2"
    assert rerun_options(Campaign("k", "cuda", seed=5, pool_seed=5, pool_round=0), jobs) == "--seed 5 --jobs 4"


def test_a_self_check_campaign_names_its_kernel_and_the_size_and_examples_the_self_check_gave_it():
    command = Settings(device="cuda")
    small = command.replace(size="small")
    production = command.replace(max_examples=48)
    campaign = Campaign("paged_decode@masked", "cuda", seed=5, pool_seed=0, pool_round=0)
    assert rerun_options(campaign, small, command) == "--kernel paged_decode@masked --seed 5 --pool-seed 0 --size small"
    assert rerun_options(campaign, production, command) == \
        "--kernel paged_decode@masked --seed 5 --pool-seed 0 --max-examples 48"


def test_on_a_gpu_a_self_check_campaign_draws_from_a_pool_of_8_unless_pool_says_and_its_rerun_line_names_it():
    from nanfuzz.harness.campaign.profiles import get_profile
    from nanfuzz.harness.cli import SELF_CHECK_POOL, _self_check_settings
    from nanfuzz.harness.registry import builtin_kernels

    kernel, dev = builtin_kernels()["paged_decode@masked"], get_profile("dev")
    command = Settings(device="cuda")
    given = _self_check_settings(kernel, command, dev)
    assert given.pool_size == SELF_CHECK_POOL == 8
    campaign = Campaign("paged_decode@masked", "cuda", seed=5, pool_seed=0, pool_round=0)
    assert rerun_options(campaign, given, command) == \
        "--kernel paged_decode@masked --seed 5 --pool-seed 0 --size small --pool 8"
    asked = command.replace(pool_size=3)
    assert _self_check_settings(kernel, asked, dev).pool_size == 3  # --pool 3
    assert rerun_options(campaign, _self_check_settings(kernel, asked, dev), asked) == \
        "--kernel paged_decode@masked --seed 5 --pool-seed 0 --size small"
    # under the interpreter a campaign draws freely, the self-check's included
    assert _self_check_settings(kernel, Settings(device="cpu"), dev).pool_size is None
