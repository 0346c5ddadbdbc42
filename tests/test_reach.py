"""A campaign steers toward the production targets it has not met, grows and rotates its pool, and
says which targets it did not reach and why.  Campaigns here run on a subject that judges nothing
(``tests.draw_only``), at the GPU's production sizes: what a search reaches, in the time its draws take."""
import argparse
import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest

from nanfuzz.harness.adapters import aiter, vllm
from nanfuzz.harness.campaign import pool_rounds, reach
from nanfuzz.harness.campaign.focus import Focus
from nanfuzz.harness.campaign.runner import Hooks, fuzz
from nanfuzz.harness.campaign.scope import with_next_pool_round
from nanfuzz.harness.campaign.settings import Settings
from nanfuzz.harness.gate.report import GateResult, Row, reach_lines
from nanfuzz.harness.report.statistics import Statistics
from nanfuzz.harness.scaling import drawn
from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.strategies.aims import Aims
from nanfuzz.strategies.cases import campaign_pool, paged_cases
from nanfuzz.strategies.production import PRODUCTION_SIZE
from nanfuzz.strategies.specialisations import Specialisation
from nanfuzz.strategies.geometry import Shape
from nanfuzz.strategies.targets import production_targets
from tests.draw_only import DrawOnly, kernel_like

# The campaigns the H200 statistics were measured on, as their capabilities.
CAMPAIGNS = {
    "vllm:rocm_attn --no-window": ("vllm:rocm_attn", vllm.ROCM_ATTN_CAPABILITIES, Focus(no_window=True)),
    "vllm:rocm_attn --prefill-only --no-window": ("vllm:rocm_attn", vllm.ROCM_ATTN_CAPABILITIES,
                                                  Focus(prefill_only=True, no_window=True)),
    "vllm:triton_attn --causal-only --kv-cache-dtype auto": ("vllm:triton_attn", vllm.TRITON_ATTN_CAPABILITIES,
                                                             Focus(causal_only=True, kv_cache_dtype="auto")),
    "aiter:pa_decode --dtype float16": ("aiter:pa_decode", aiter.PA_DECODE_CAPABILITIES, Focus(dtype="float16")),
}


def _all_met(campaign) -> bool:
    stats = campaign.statistics
    return bool(stats.targets) and not reach.unmet(stats.targets, stats)


def _simulated(name: str, caps, focus: Focus, tmp_path, max_examples: int, **overrides):
    """A production campaign as it runs on a GPU, every case drawn and passed, until it has met every
    target within reach ``QUOTA`` times (or ``max_examples``)."""
    done = {}
    return fuzz(kernel_like(name, caps), device="cuda", size="production", focus=focus, max_examples=max_examples,
                seed=7, use_database=False, state_dir=tmp_path, subject=DrawOnly(), check_leftovers=False,
                hooks=Hooks(on_example=lambda c: done.update(all=_all_met(c)), should_stop=lambda: done.get("all")),
                **overrides)


@pytest.mark.parametrize("label", CAMPAIGNS)
def test_a_production_campaign_meets_every_target_within_reach_a_few_times(label, tmp_path):
    name, caps, focus = CAMPAIGNS[label]
    campaign = _simulated(name, caps, focus, tmp_path, 250)
    stats = campaign.statistics
    assert stats.targets.within_reach() and not reach.unmet(stats.targets, stats), stats.unreached_line()
    # what it did not reach is out of reach, with the reason; nothing is left to the budget
    assert all(not why.startswith("budget") for _, why in stats.unreached())
    assert campaign.examples < 250


def test_without_aims_the_same_examples_leave_targets_unmet(tmp_path, monkeypatch):
    name, caps, focus = CAMPAIGNS["vllm:triton_attn --causal-only --kv-cache-dtype auto"]
    aimed = _simulated(name, caps, focus, tmp_path / "aimed", 250)
    monkeypatch.setattr(reach, "aims", lambda targets, statistics, forgiven=None: Aims())
    free = _simulated(name, caps, focus, tmp_path / "free", aimed.examples)
    assert reach.unmet(free.statistics.targets, free.statistics)
    assert any(why.startswith("budget") for _, why in free.statistics.unreached())


def test_aims_go_to_the_unmet_targets_then_to_all_of_them_at_a_steady_share():
    targets = production_targets(Capabilities(max_query_len=1, sliding_window=False), PRODUCTION_SIZE)
    stats = Statistics(targets=targets)
    first = reach.aims(targets, stats)
    assert first.urgent and [a.kind for a in first.aims] == ["decode"]
    assert first.aims[0].situations == {"gqa-group>16", "largest-head-size", "offsets>2^31", "seq-len>=32768",
                                        "sequences>=128"}
    for name in targets.within_reach():
        stats.counts["target:" + name] = reach.QUOTA
    stats.counts["target:decode:offsets>2^31"] = reach.QUOTA - 1
    assert reach.aims(targets, stats).aims[0].situations == {"offsets>2^31"}
    stats.counts["target:decode:offsets>2^31"] += 1
    steady = reach.aims(targets, stats)
    assert not steady.urgent and steady.aims == first.aims and steady.weights() == (1, 1)


def test_statistics_and_the_gate_name_each_target_not_reached_and_why():
    caps = Capabilities(max_query_len=1, sliding_window=False, head_sizes=(64, 128))
    targets = production_targets(caps, PRODUCTION_SIZE)
    stats = Statistics.for_capabilities(caps, targets)
    for case in drawn(paged_cases(caps, tier="production", aims=Aims(targets.aims(["decode:seq-len>=32768"]))), 12):
        stats.add(case)
    reached = {name for name in targets.within_reach() if stats.target_count(name)}
    assert "decode:seq-len>=32768" in reached
    missed = dict(stats.unreached())
    assert missed["decode:far-window"] == "capabilities: no sliding window"
    assert all(missed[name] == "budget: not met in 12 examples" for name in set(targets.within_reach()) - reached)
    again = Statistics.from_dict(json.loads(json.dumps(stats.to_dict())))
    assert again.unreached() == stats.unreached() and again.target_count("decode:seq-len>=32768")
    merged = Statistics().merge(again).merge(again)
    assert merged.target_count("decode:seq-len>=32768") == 2 * stats.target_count("decode:seq-len>=32768")
    assert "not reached: decode:far-window (capabilities: no sliding window)" in stats.table()
    row = Row("k@v", 0, "cuda0", "gw0", stats.examples, 1.0, "PASS", "PASS", statistics=stats.to_dict())
    lines = "\n".join(reach_lines(GateResult([row], [], [])))
    assert "production targets not reached: " in lines
    assert "decode:far-window (capabilities: no sliding window)" in lines
    # once every target within reach is met, only those out of reach are named
    for name in targets.within_reach():
        stats.counts["target:" + name] += 1
    assert [name for name, _ in stats.unreached()] == list(targets.out_of_reach())


def test_a_run_with_jobs_names_once_the_targets_no_job_reached():
    """Each job's campaign notes its own unreached targets; the run that merges them says once what
    every job together left unreached (a target one job met is no longer named)."""
    from nanfuzz.harness.campaign.jobs import _merge
    from nanfuzz.harness.campaign.result import Campaign

    caps = Capabilities(max_query_len=1, sliding_window=False, head_sizes=(64, 128))
    targets = production_targets(caps, PRODUCTION_SIZE)

    def job(strategy):
        campaign = Campaign(kernel="k@v", device="cuda", statistics=Statistics.for_capabilities(caps, targets))
        for case in drawn(strategy, 4):
            campaign.statistics.add(case)
        campaign.examples = campaign.statistics.examples
        campaign.note_unreached()
        return campaign

    def missed(campaign):
        return {name for name, why in campaign.statistics.unreached() if why.startswith("budget")}

    first, second = (job(paged_cases(caps, tier="production", aims=Aims(targets.aims([aim]))))
                     for aim in ("decode:gqa-group>16", "decode:seq-len>=32768"))
    only_one_met = missed(first) ^ missed(second)
    assert only_one_met and all(name in first.notes[0] + second.notes[0] for name in only_one_met)
    merged = _merge("k@v", "cuda", [(first, (0.0, 1.0)), (second, (0.0, 1.0))], 0.0)
    (note,) = [note for note in merged.notes if "production targets not reached" in note]
    assert missed(merged) == missed(first) & missed(second)
    assert all(name not in note for name in only_one_met)


def test_a_small_tier_campaign_declares_no_target(tmp_path):
    caps = vllm.TRITON_ATTN_CAPABILITIES
    campaign = fuzz(kernel_like("vllm:triton_attn", caps), device="cuda", size="small", max_examples=5, seed=1,
                    use_database=False, state_dir=tmp_path, subject=DrawOnly(), check_leftovers=False)
    assert not campaign.statistics.targets and campaign.statistics.unreached_line() is None
    assert not any("production targets" in note for note in campaign.notes)


def test_a_campaign_that_misses_targets_says_so_in_its_notes(tmp_path):
    name, caps, focus = CAMPAIGNS["vllm:rocm_attn --no-window"]
    campaign = _simulated(name, caps, focus, tmp_path, 3)
    note = next(note for note in campaign.notes if "production targets not reached" in note)
    assert "(budget: not met in 3 examples)" in note and "far-window (capabilities: no sliding window)" in note


def _entry(case) -> Specialisation:
    g = case.geometry
    return Specialisation(Shape(g.dtype, g.num_q_heads, g.num_kv_heads, g.head_size, g.block_size), case.causal,
                          case.sliding_window, case.sinks, (case.kv_cache.dtype, case.kv_cache.token_head))


def test_a_long_campaign_grows_its_pool_a_few_entries_at_a_time(tmp_path, monkeypatch):
    monkeypatch.setattr(reach, "GROWTH_SECONDS", 0.0)  # as soon as the examples allow: the clock is no test's
    caps = vllm.TRITON_ATTN_CAPABILITIES
    subject = DrawOnly()
    campaign = fuzz(kernel_like("vllm:triton_attn", caps), device="cuda", size="small", time_budget=3.0,
                    pool_size=2, seed=3, use_database=False, state_dir=tmp_path, subject=subject,
                    check_leftovers=False)
    first = campaign_pool(caps, 2, 3)
    growths = int(next(n for n in campaign.notes if "pool grew" in n).split("grew ")[1].split(" time")[0])
    grown = campaign_pool(caps, 2, 3, growth=growths)
    assert growths >= 1 and len(grown) == len(first) + 4 * growths
    entries = [_entry(case) for case in subject.cases]
    assert set(entries[:reach.EXAMPLES_PER_ENTRY * len(first)]) <= set(first)  # its own entries, until it grows
    assert set(entries) <= set(grown) and set(entries) - set(first)


def test_a_pool_does_not_grow_before_its_time():
    assert not reach.pool_growth_due(10**6, reach.GROWTH_SECONDS - 1, 20, 0)
    assert reach.pool_growth_due(200, reach.GROWTH_SECONDS, 20, 0)
    assert not reach.pool_growth_due(199, reach.GROWTH_SECONDS, 20, 0)  # ten examples an entry
    assert not reach.pool_growth_due(10**6, 3 * reach.GROWTH_SECONDS, 24, 2)  # four times as long, the third time
    assert not reach.pool_growth_due(10**6, 10**6, 0, 0)  # no pool


def test_each_run_takes_the_next_round_and_a_broken_state_file_starts_again(tmp_path):
    assert [pool_rounds.take(tmp_path, "vllm:rocm_attn") for _ in range(3)] == [0, 1, 2]
    assert pool_rounds.take(tmp_path, "vllm:triton_attn") == 0  # each kernel its own
    (tmp_path / "pools" / "vllm_rocm_attn.json").write_text("{not json")
    assert pool_rounds.take(tmp_path, "vllm:rocm_attn") == 0
    assert pool_rounds.take(tmp_path, "vllm:rocm_attn") == 1
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert pool_rounds.take(blocked, "vllm:rocm_attn") == 0  # no folder to keep it in: round 0, as before


def test_only_an_unseeded_run_with_a_pool_moves_to_the_next_round(tmp_path):
    kernel = kernel_like("vllm:rocm_attn", vllm.ROCM_ATTN_CAPABILITIES)
    gpu = Settings(device="cuda", state_dir=tmp_path)
    assert [with_next_pool_round(kernel, gpu).pool_round for _ in range(2)] == [0, 1]
    assert with_next_pool_round(kernel, gpu.replace(seed=4)).pool_round == 0  # a seeded run repeats itself
    assert with_next_pool_round(kernel, gpu.replace(pool_size=0)).pool_round == 0  # no pool
    assert with_next_pool_round(kernel, Settings(device="cpu", state_dir=tmp_path)).pool_round == 0
    assert pool_rounds.take(tmp_path, "vllm:rocm_attn") == 2  # the two rounds taken above, no more


def test_a_rounds_pool_is_the_one_its_campaign_draws_from(tmp_path):
    caps = vllm.TRITON_ATTN_CAPABILITIES
    subject = DrawOnly()
    fuzz(kernel_like("vllm:triton_attn", caps), device="cuda", size="small", max_examples=40, pool_size=2, seed=3,
         pool_round=5, use_database=False, state_dir=tmp_path, subject=subject, check_leftovers=False)
    rotated = campaign_pool(caps, 2, 3, pool_round=5)
    assert {_entry(case) for case in subject.cases} <= set(rotated)
    assert {_entry(case) for case in subject.cases} - set(campaign_pool(caps, 2, 3))  # the round's own entries met


def _reach_script():
    spec = importlib.util.spec_from_file_location("production_reach",
                                                  Path(__file__).resolve().parents[1] / "ci" / "production_reach.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_the_reach_script_reads_what_each_campaign_reached_from_its_summary(tmp_path, capsys):
    script = _reach_script()
    name, caps, focus = CAMPAIGNS["aiter:pa_decode --dtype float16"]
    campaign = _simulated(name, caps, focus, tmp_path / "state", 250)
    entry = {"verdict": "PASS", "examples": campaign.examples, "elapsed_s": 10.0, "compiles": 3,
             "statistics": campaign.statistics.to_dict()}
    (tmp_path / "pa_decode.json").write_text(json.dumps({"kernels": [entry]}))
    assert script._report("pa_decode", tmp_path)
    shown = capsys.readouterr().out
    assert f"{campaign.examples} examples in 10 s" in shown and "decode:far-window" in shown
    assert "out of reach: capabilities: no sliding window" in shown
    entry["statistics"]["targets"][0]["count"] = 0  # a target within reach, never met
    (tmp_path / "pa_decode.json").write_text(json.dumps({"kernels": [entry]}))
    assert not script._report("pa_decode", tmp_path)
    assert not script._report("triton_attn", tmp_path)  # no summary: the campaign did not finish


def test_the_reach_script_bounds_a_campaign_by_its_time_and_hands_it_the_trees(tmp_path, monkeypatch):
    """A campaign stops at its time budget, not at the profile's number of examples, and is given the
    trees as options (which ``nanfuzz fuzz`` also sets as the variables a user module such as
    tests/past_findings.py reads: tests/test_user_kernels.py)."""
    script = _reach_script()
    started = {}
    monkeypatch.setattr(script.subprocess, "Popen", lambda command, **options: started.update(options, command=command))
    options = argparse.Namespace(vllm_src="/trees/vllm", aiter_src="/trees/aiter", time_budget=600.0)
    script._start("pa_decode-past-findings", options, tmp_path)
    command = started["command"]
    assert int(command[command.index("--max-examples") + 1]) >= 100_000
    assert command[command.index("--time-budget") + 1] == "600.0"
    assert command[command.index("--aiter-src") + 1] == "/trees/aiter"
    assert command[command.index("--vllm-src") + 1] == "/trees/vllm"


def _int32_offsets(case):
    g = case.geometry
    return "an int32 block offset" if g.num_blocks * g.block_size * g.num_kv_heads * g.slot_width >= 1 << 31 else None


def _declining(tmp_path, examples: int):
    caps = aiter.PA_DECODE_CAPABILITIES
    chosen = dataclasses.replace(kernel_like("aiter:pa_decode", caps), supports=_int32_offsets)
    return fuzz(chosen, device="cuda", size="production", focus=Focus(dtype="float16"), max_examples=examples, seed=7,
                use_database=False, state_dir=tmp_path, subject=DrawOnly(), check_leftovers=False)


def test_targets_the_kernel_declines_stop_drawing_the_search_and_are_named_with_why(tmp_path, monkeypatch):
    """A kernel whose supports() declines caches past 2^31 elements: once the cases steered at that
    target have been declined ``DECLINED_QUOTA`` times, the search aims elsewhere, and the campaign
    names the target as declined by the kernel rather than left to the budget."""
    aimed = _declining(tmp_path / "aimed", 120)
    stats = aimed.statistics
    offsets = [name for name in stats.targets.within_reach() if name.endswith("offsets>2^31")]
    assert offsets and all(stats.declined_targets[name] >= reach.DECLINED_QUOTA for name in offsets)
    missed = dict(stats.unreached())
    assert all(missed[name].startswith("supports(): the kernel declined") for name in offsets), missed
    assert not set(offsets) & set(reach.unmet(stats.targets, stats))
    again = Statistics.from_dict(json.loads(json.dumps(stats.to_dict())))
    assert again.declined_targets == stats.declined_targets
    monkeypatch.setattr(reach, "DECLINED_QUOTA", 10 ** 9)  # aimed at for ever, as before
    stubborn = _declining(tmp_path / "stubborn", 120)
    assert sum(stats.declined.values()) < sum(stubborn.statistics.declined.values()) / 2, (
        sum(stats.declined.values()), sum(stubborn.statistics.declined.values()))


def _wide(case_or_entry) -> bool:
    shape = getattr(case_or_entry, "shape", None) or case_or_entry.geometry
    return shape.num_q_heads // shape.num_kv_heads > 16


def _declining_the_pool_s_wide_entries(name: str, caps, focus: Focus, tmp_path, max_examples: int):
    """A kernel whose supports() declines a group past 16 in the dtype and head size of every such
    entry its campaign's pool starts with (as AITER's unified_attention past its findings declines
    float32 at head 256, a seed's only wide entry)."""
    from nanfuzz.harness.campaign.scope import campaign_capabilities, campaign_pool_of, campaign_tier

    kernel = kernel_like(name, caps)
    settings = Settings(device="cuda", size="production", focus=focus, seed=7, use_database=False)
    pool, _ = campaign_pool_of(campaign_capabilities(kernel, settings)[0], settings, None,
                               campaign_tier(kernel, settings))
    refused = {(e.shape.dtype, e.shape.head_size) for e in pool if _wide(e)}

    def no_wide_group_here(case):
        g = case.geometry
        return "no such group here" if _wide(case) and (g.dtype, g.head_size) in refused else None

    chosen = dataclasses.replace(kernel, supports=no_wide_group_here)
    done = {}
    campaign = fuzz(chosen, device="cuda", size="production", focus=focus, max_examples=max_examples, seed=7,
                    use_database=False, state_dir=tmp_path, subject=DrawOnly(), check_leftovers=False,
                    hooks=Hooks(on_example=lambda c: done.update(all=_all_met(c)), should_stop=lambda: done.get("all")))
    return campaign, refused


def test_a_target_the_pool_s_entries_are_declined_for_gets_an_entry_the_kernel_takes(tmp_path, monkeypatch):
    """The pool's only entries with a group past 16 are ones the kernel declines: the campaign adds an
    entry it takes, and meets every wide-group target; without that, those targets stay declined."""
    name, caps, focus = CAMPAIGNS["vllm:rocm_attn --no-window"]
    campaign, refused = _declining_the_pool_s_wide_entries(name, caps, focus, tmp_path / "mended", 400)
    stats = campaign.statistics
    wide = [t for t in stats.targets.within_reach() if t.endswith("gqa-group>16")]
    assert refused and wide
    assert all(stats.target_count(t) >= reach.QUOTA for t in wide), stats.unreached_line()
    assert not reach.unmet(stats.targets, stats), stats.unreached_line()
    assert any("the pool took an entry it takes" in note for note in campaign.notes), campaign.notes

    from nanfuzz.harness.campaign.runner import CampaignRunner

    monkeypatch.setattr(CampaignRunner, "add_entries_it_takes", lambda self: None)
    before, _ = _declining_the_pool_s_wide_entries(name, caps, focus, tmp_path / "before", campaign.examples)
    missed = dict(before.statistics.unreached())
    assert any(missed.get(t, "").startswith("supports(): the kernel declined") for t in wide), missed


def test_a_kernel_that_declines_the_situation_itself_gets_no_entry_for_it(tmp_path):
    """Caches past 2^31 elements declined on int32 offsets: no candidate entry is taken, nothing is added."""
    campaign = _declining(tmp_path, 120)
    assert not any("the pool took an entry" in note for note in campaign.notes), campaign.notes


def test_a_candidate_entry_with_no_drawable_aimed_case_is_passed_over(monkeypatch):
    from hypothesis.errors import Unsatisfiable

    from nanfuzz.harness.campaign import accepted_entry
    from nanfuzz.harness.campaign.scope import campaign_production_size

    draws = []
    real = accepted_entry.drawn

    def first_unsatisfiable(strategy, count):
        draws.append(count)
        if len(draws) == 1:
            raise Unsatisfiable("no case of this entry reaches the aim")
        return real(strategy, count)

    monkeypatch.setattr(accepted_entry, "drawn", first_unsatisfiable)
    caps = vllm.ROCM_ATTN_CAPABILITIES
    settings = Settings(device="cuda", size="production")
    targets = production_targets(caps, campaign_production_size(settings))
    entry = accepted_entry.entry_it_takes("decode:gqa-group>16", targets, caps, settings, (), "k", lambda case: True)
    assert len(draws) == 2 and entry.shape.num_q_heads // entry.shape.num_kv_heads > 16
    taken_by_none = accepted_entry.entry_it_takes("decode:gqa-group>16", targets, caps, settings, (), "k",
                                                  lambda case: False)
    assert taken_by_none is None and len(draws) == 2 + accepted_entry.CANDIDATES
