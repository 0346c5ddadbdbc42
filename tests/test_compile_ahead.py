"""One compile farm for campaigns run in turn (harness.campaign.compile_ahead): each campaign's
first cases drawn ahead with the search seed it then runs with, built in campaign order, a few
samples per entry after them, and each campaign waiting for its own plan alone."""
from __future__ import annotations

import dataclasses
import os
import time

import pytest

from nanfuzz.harness.campaign import compile_ahead as ahead_module
from nanfuzz.harness.campaign.compile_ahead import compile_ahead
from nanfuzz.harness.campaign import drawn_ahead
from nanfuzz.harness.campaign.drawn_ahead import draw_at_once
from nanfuzz.harness.campaign.side_by_side import CampaignOrders
from nanfuzz.harness.campaign.runner import CampaignRunner, Hooks, fuzz
from nanfuzz.harness.campaign.scope import campaign_capabilities, campaign_pool_of
from nanfuzz.harness.campaign.settings import Settings
from nanfuzz.harness.launch.farm import SAMPLES_PER_ENTRY, BuiltMarks, Farm, FarmHandle, Plan, entry_of, sample_cases
from nanfuzz.harness.launch.processes import fork_server_context
from nanfuzz.harness.launch.subjects import worker_spec
from nanfuzz.harness.registry import import_path, resolve
from tests.test_upcoming import _Recording
from tests.torch_kernels import torch_kernel

POOL_SIZE, POOL_SEED = 4, 5


def _plan(spec: str, **fields) -> Plan:
    kernel = resolve(spec)
    settings = Settings(device="cpu", pool_size=POOL_SIZE)
    caps, _ = campaign_capabilities(kernel, settings)
    pool, _ = campaign_pool_of(caps, settings, POOL_SEED)
    return dataclasses.replace(Plan(worker_spec(kernel, settings), caps, None, pool), **fields)


def test_a_campaign_run_with_the_seed_its_cases_were_drawn_with_meets_them_first(monkeypatch):
    monkeypatch.setenv("NANFUZZ_PROFILE", "dev")  # random seeds (CI's profile derandomizes: every seed is 0)
    kernel = torch_kernel()
    settings = Settings(device="cpu", max_examples=12, use_database=False, pool_size=POOL_SIZE, pool_seed=POOL_SEED)
    planner = CampaignRunner(kernel, settings, Hooks())  # unseeded: it picks a seed of its own
    first = planner.first_cases(6)
    assert len(first) == 6 and planner.first_cases(0) == ()
    recording = _Recording(kernel)
    campaign = fuzz(kernel, settings, subject=recording, search_seed=planner.search_seed)
    assert not campaign.failed and campaign.seed == planner.search_seed
    assert tuple(recording.cases[:6]) == first
    other = CampaignRunner(kernel, settings, Hooks())  # another campaign's own seed draws other cases
    assert other.first_cases(6) != first


def _record_farms(monkeypatch, awaits_first_cases: bool = True) -> tuple[list, list]:
    """Stand in for the farm ``compile_ahead`` starts: what it was given, and when (its plans at its
    start, their first cases after)."""
    planned, scheduled = [], []

    class _Farm:
        handle = FarmHandle("a folder")

        def __init__(self, plans):
            self.awaits_first_cases = awaits_first_cases
            planned.append(plans)

        def schedule(self, first_cases, at_once=1, campaigns=None):
            scheduled.append(first_cases)
            self.at_once, self.campaigns = at_once, campaigns

    monkeypatch.setattr(ahead_module, "start_farm",
                        lambda plans, settings, first_cases_later: _Farm(plans) if first_cases_later else None)
    return planned, scheduled


def test_campaigns_in_turn_get_one_plan_each_in_their_order_with_their_seeds(monkeypatch):
    planned, scheduled = _record_farms(monkeypatch)
    base = Settings(device="cuda", pool_size=3, max_examples=20, use_database=False)
    slow, raises = resolve("tests.farm_subjects:slow"), resolve("tests.farm_subjects:raises")
    runs = [(slow, base), (torch_kernel(), base.replace(pool_size=0)), (raises, base.replace(jobs=2))]
    first = {slow.name: 5, raises.name: 7}
    ahead = compile_ahead(runs, base, lambda kernel: first.get(kernel.name, 64), samples=lambda tier: 1)
    (plans,), (first_cases,) = planned, scheduled
    assert ahead.plans == [0, None, 1]  # a kernel that draws freely compiles nothing ahead
    assert [p.spec.kernel for p in plans] == ["tests.farm_subjects:slow", "tests.farm_subjects:raises"]
    assert all(p.samples == 1 and p.upcoming == () for p in plans)
    assert len(first_cases[0]) == 5 and {entry_of(case) for case in first_cases[0]} <= set(plans[0].entries)
    # a campaign of several jobs draws its seeds in its jobs: no first cases, no seed picked here
    assert first_cases[1] == () and ahead.seeds[2] is None and isinstance(ahead.seeds[0], int)
    assert ahead.handle(0).plan == 0 and ahead.handle(1) is None and ahead.handle(2).plan == 1
    assert ahead.farm.campaigns == [0, 2]  # per plan, its campaign's place in the run
    cpu = compile_ahead(runs, base.replace(device="cpu"), lambda kernel: 8, samples=lambda tier: 1)
    assert cpu.farm is None and cpu.plans == [None] * 3 and len(planned) == 1  # nothing compiles ahead on a CPU


def test_a_plan_without_samples_builds_its_first_cases_alone(tmp_path):
    plan = _plan("tests.farm_subjects:slow", samples=0)
    upcoming = tuple(c for e in plan.entries[:2] for c in _samples(plan, e, 1))
    plan = dataclasses.replace(plan, upcoming=upcoming)
    sampled = _plan("tests.farm_subjects:slow", samples=1)
    with Farm([plan, sampled], processes=1, marks=BuiltMarks(tmp_path)) as farm:
        tasks = list(farm._tasks)
        assert farm.wait(timeout=300)
        summary = farm.summary()
    assert tasks == [(0, 0, "u0"), (0, 1, "u1")] + [(1, e, 0) for e in range(len(sampled.entries))]
    assert summary["compiled"] == len(tasks) and summary["given_up"] == 0 and summary["unbuilt"] == 0


def test_a_plan_of_production_cases_keeps_its_production_sample_among_fewer(tmp_path):
    small = _plan("tests.farm_subjects:slow", samples=2)
    production = dataclasses.replace(small, tier="production")
    assert small.sample_numbers() == (0, 1)
    assert production.sample_numbers() == (0, SAMPLES_PER_ENTRY - 1)  # the last sample is the production one
    assert dataclasses.replace(production, samples=1).sample_numbers() == (0,)
    every = dataclasses.replace(production, samples=SAMPLES_PER_ENTRY)
    assert every.sample_numbers() == tuple(range(SAMPLES_PER_ENTRY))
    held = fork_server_context().Event()  # never set: nothing is built here
    with Farm([production], processes=1, marks=BuiltMarks(tmp_path), after=held, device_wait=3600.0) as farm:
        assert sorted(farm._tasks) == sorted((0, e, i) for e in range(len(production.entries)) for i in (0, 3))


def test_the_self_check_builds_the_production_sample_of_a_family_whose_bug_lives_at_production_size(monkeypatch):
    # split_decode's bug needs a sequence past one partition: its shrink heads to each entry's split
    # path, which the entry's simplest case never launches
    from nanfuzz.harness import cli
    from nanfuzz.harness.campaign.profiles import get_profile
    from nanfuzz.harness.kernels import split_decode
    from nanfuzz.harness.registry import builtin_kernels

    planned, _ = _record_farms(monkeypatch, awaits_first_cases=False)
    settings = Settings(device="cuda", use_database=False)
    kernels = [builtin_kernels()[name] for name in ("paged_decode@masked", "split_decode@drops-last-partition")]
    runs = [(k, cli._self_check_settings(k, settings, get_profile("dev"))) for k in kernels]
    compile_ahead(runs, settings, lambda kernel: 0, cli.SELF_CHECK_SAMPLES.__getitem__)
    ((masking, split),) = planned
    assert masking.sample_numbers() == (0,)
    assert split.sample_numbers() == (0, SAMPLES_PER_ENTRY - 1)
    for entry in split.entries:
        assert sample_cases(split, entry)[-1].max_seq_len > split_decode.PARTITION_KEYS


def test_a_farm_starts_its_processes_before_it_is_given_the_first_cases(tmp_path):
    plan = _plan("tests.farm_subjects:slow", samples=1)
    first = tuple(c for e in reversed(plan.entries[:2]) for c in _samples(plan, e, 1))
    with Farm([plan], processes=2, marks=BuiltMarks(tmp_path), first_cases_later=True) as farm:
        assert len(farm._processes) == 2 and farm._tasks == []  # started, nothing sent yet
        assert farm.handle.running() and farm.handle.for_plan(0).running() and farm.awaits_first_cases
        assert farm.summary()["scheduled_seconds"] is None
        time.sleep(0.2)  # the campaign drawing its first cases
        farm.schedule({0: first})
        assert not farm.awaits_first_cases
        farm.schedule({0: ()})  # once only
        tasks = list(farm._tasks)
        assert farm.wait(timeout=300)
        summary = farm.summary()
    assert tasks == [(0, 1, "u0"), (0, 0, "u1")] + [(0, e, 0) for e in range(len(plan.entries))]
    assert summary["compiled"] == len(tasks) and summary["upcoming"] == 2
    assert summary["first_built_seconds"] is not None and summary["first_built_seconds"] >= 0
    assert 0.2 <= summary["scheduled_seconds"] <= summary["wall_seconds"]


def test_each_plan_s_campaign_waits_for_its_own_plan_alone(tmp_path):
    first, second = _plan("tests.farm_subjects:slow", samples=1), _plan("tests.farm_subjects:slow", samples=2)
    held = fork_server_context().Event()  # the farm process waits for it before its first task
    with Farm([first, second], processes=1, marks=BuiltMarks(tmp_path), after=held, device_wait=3600.0) as farm:
        handle = farm.handle
        assert handle.running() and handle.for_plan(0).running() and handle.for_plan(1).running()
        for task, (plan, _, _) in enumerate(farm._tasks):  # the first plan's tasks done (as a process marks them)
            if plan == 0:
                farm._marker(*farm._tasks[task], "done").write_text('{"ok": true, "error": null, "seconds": 0}')
        farm._note_plans_done()
        assert not handle.for_plan(0).running()
        assert handle.for_plan(1).running() and handle.running()  # the rest still held
        held.set()
        assert farm.wait(timeout=300)
        assert not handle.for_plan(1).running() and not handle.running()
    assert not handle.for_plan(0).running()  # a closed farm holds nobody


def test_a_plan_built_before_holds_its_campaign_for_nothing(tmp_path):
    marks = BuiltMarks(tmp_path)
    built, other = _plan("tests.farm_subjects:slow", samples=1), _plan("tests.farm_subjects:raises", samples=1)
    for entry in built.entries:
        marks.mark(built, entry, [], sample=0)
    held = fork_server_context().Event()
    with Farm([built, other], processes=1, marks=marks, after=held, device_wait=3600.0) as farm:
        assert not farm.handle.for_plan(0).running() and farm.handle.for_plan(1).running()
        held.set()
        assert farm.wait(timeout=300)
    for entry in other.entries:
        marks.mark(other, entry, [], sample=0)
    with Farm([built, other], processes=1, marks=marks, first_cases_later=True) as farm:
        # a warm cache: no process, nothing to draw first cases for, nobody held
        assert not farm._processes and not farm.awaits_first_cases and not farm.handle.running()


def _samples(plan: Plan, entry, count: int):
    from nanfuzz.harness.launch.farm import sample_cases

    return sample_cases(plan, entry, count)


@pytest.mark.parametrize("prefer_fork", [True, False])
def test_a_farm_started_in_a_campaign_s_process_forks_its_processes_from_it(tmp_path, prefer_fork):
    # a campaign's process beside others is fresh from its run's fork server: a fork server of its own
    # would import torch again before the farm's first compile
    import json
    import subprocess
    import sys

    script = f"from tests.farm_subjects import report_farm_parents; report_farm_parents({prefer_fork}, {str(tmp_path)!r})"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["built"] and seen["tasks"], seen
    assert seen["plain_forked"] is prefer_fork
    if prefer_fork:
        assert seen["parents"] == [seen["me"]] * 2 and seen["fork_server"] is None
    else:
        assert seen["fork_server"] is not None and set(seen["parents"]) == {seen["fork_server"]}


def test_a_fork_that_could_not_use_the_gpu_is_looked_at_in_a_fork(monkeypatch):
    # torch marks forks of a process that asked the driver anything; the farm then takes the fork server
    import multiprocessing

    import torch

    from nanfuzz.harness.launch import farm as farm_module, processes
    from nanfuzz.harness.launch.processes import fork_keeps_the_gpu

    # as in a campaign's process (this one may hold other tests' threads)
    monkeypatch.setattr(processes, "plain_fork_context", lambda: multiprocessing.get_context("fork"))
    assert fork_keeps_the_gpu()
    assert farm_module._farm_context(True, "cuda").get_start_method() == "fork"
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)  # what such a fork would find
    assert not fork_keeps_the_gpu()
    assert farm_module._farm_context(True, "cuda").get_start_method() == "forkserver"
    assert farm_module._farm_context(False, "cpu").get_start_method() == "forkserver"


def test_a_farm_of_several_plans_sends_each_plan_s_cases_and_samples_before_the_next_plan_s(tmp_path):
    # campaigns run in turn, and each meets its whole pool long before the last one starts
    first, second = _plan("tests.farm_subjects:slow", samples=1), _plan("tests.farm_subjects:slow", samples=1)
    held = fork_server_context().Event()
    with Farm([first, second], processes=1, marks=BuiltMarks(tmp_path), after=held, device_wait=3600.0,
              first_cases_later=True) as farm:
        farm.schedule({p: tuple(_samples(plan, plan.entries[0], 1)) for p, plan in enumerate((first, second))})
        tasks = list(farm._tasks)
    entries = range(len(first.entries))
    assert tasks == [(0, 0, "u0"), *((0, e, 0) for e in entries), (1, 0, "u0"), *((1, e, 0) for e in entries)]


def test_a_campaign_whose_first_cases_are_none_has_every_case_of_its_search_built_ahead(monkeypatch):
    # a fixed variant passes: its search draws exactly the cases drawn ahead, all of them
    scheduled = []

    class _Farm:
        handle = FarmHandle("a folder")
        awaits_first_cases = True

        def __init__(self, plans):
            pass

        def schedule(self, first_cases, at_once=1, campaigns=None):
            scheduled.append(first_cases)
            self.at_once, self.campaigns = at_once, campaigns

    monkeypatch.setattr(ahead_module, "start_farm", lambda plans, settings, first_cases_later: _Farm(plans))
    run = Settings(device="cuda", pool_size=3, max_examples=30, use_database=False)
    slow = resolve("tests.farm_subjects:slow")
    compile_ahead([(slow, run)], run, lambda kernel: None, samples=lambda tier: 1)
    (first_cases,) = scheduled
    assert len(first_cases[0]) == 30


def test_plans_whose_campaigns_run_side_by_side_take_turns_first_cases_before_samples(tmp_path):
    # campaigns that start together each wait for their first cases: no plan's samples go out before
    # every plan's first cases, and no plan's second case before every plan's first
    first, second = _plan("tests.farm_subjects:slow", samples=1), _plan("tests.farm_subjects:slow", samples=1)
    held = fork_server_context().Event()
    with Farm([first, second], processes=1, marks=BuiltMarks(tmp_path), after=held, device_wait=3600.0,
              first_cases_later=True) as farm:
        farm.schedule({p: tuple(_samples(plan, plan.entries[0], 2)) for p, plan in enumerate((first, second))},
                      at_once=2)
        tasks = list(farm._tasks)
    entries = range(len(first.entries))
    assert tasks == [(0, 0, "u0"), (1, 0, "u0"), (0, 0, "u1"), (1, 0, "u1"),
                     *((p, e, 0) for e in entries for p in (0, 1))]


def test_plans_group_by_their_campaigns_place_in_the_run_not_by_their_own_number(tmp_path):
    # campaigns 0, 1 and 2 run two at a time, and campaign 1 compiles nothing ahead: plan 1 is
    # campaign 2's, which starts only after campaign 0 ends, so plan 0's tasks all go out first
    first, third = _plan("tests.farm_subjects:slow", samples=1), _plan("tests.farm_subjects:slow", samples=1)
    held = fork_server_context().Event()
    upcoming = {p: tuple(_samples(plan, plan.entries[0], 2)) for p, plan in enumerate((first, third))}
    entries = range(len(first.entries))
    by_place = [(0, 0, "u0"), (0, 0, "u1"), *((0, e, 0) for e in entries),
                (1, 0, "u0"), (1, 0, "u1"), *((1, e, 0) for e in entries)]
    by_number = [(0, 0, "u0"), (1, 0, "u0"), (0, 0, "u1"), (1, 0, "u1"),
                 *((p, e, 0) for e in entries for p in (0, 1))]
    for campaigns, expected in (([0, 2], by_place), (None, by_number)):
        with Farm([first, third], processes=1, marks=BuiltMarks(tmp_path / str(campaigns)), after=held,
                  device_wait=3600.0, first_cases_later=True) as farm:
            farm.schedule(upcoming, at_once=2, campaigns=campaigns)
            assert list(farm._tasks) == expected, campaigns


def test_each_campaign_s_first_cases_are_drawn_in_a_process_of_its_own_as_this_one_draws_them(monkeypatch):
    monkeypatch.setattr(drawn_ahead, "LEAST_CORES", 1)  # however few cores the host has
    settings = Settings(device="cuda", pool_size=3, max_examples=40, use_database=False)
    runners = [CampaignRunner(resolve(spec), settings, Hooks(), seed=seed)
               for spec, seed in (("tests.farm_subjects:slow", 3), ("paged_decode@masked", 11))]
    orders = [(CampaignOrders(n, r.kernel.name, import_path(r.kernel), r.settings, search_seed=r.search_seed), 12)
              for n, r in enumerate(runners)]
    drawn_here = []
    drawn = draw_at_once(orders, lambda n: drawn_here.append(n) or runners[n].first_cases(12))
    assert drawn_here == []  # every campaign's came from its process
    assert drawn == {n: r.first_cases(12) for n, r in enumerate(runners)} and all(len(c) == 12 for c in drawn.values())
    # sensitivity: another search seed draws other cases
    assert draw_at_once([(dataclasses.replace(orders[1][0], search_seed=12), 12)], None)[1] != drawn[1]


def test_drawing_processes_are_told_the_gpu_s_fp8_skips_and_draw_what_a_campaign_told_them_draws(monkeypatch):
    """Asked of Triton, the skips would initialise CUDA in each drawing process (and here, with no GPU,
    leave out every fp8 encoding, drawing other cases than the campaign's)."""
    from nanfuzz.harness.judge import encodings
    from tests.torch_kernels import TOLD_GPU_SKIPS

    monkeypatch.setattr(drawn_ahead, "LEAST_CORES", 1)
    monkeypatch.setattr(encodings, "_known_gpu_skips", [TOLD_GPU_SKIPS])  # this run's, as a GPU's would be
    settings = Settings(device="cuda", pool_size=3, max_examples=40, use_database=False)
    runner = CampaignRunner(resolve("unified@masked"), settings, Hooks(), seed=5)  # it declares fp8 caches
    assert {"fp8_e4m3fn", "fp8_e5m2"} <= set(runner.caps.kv_cache_dtypes)
    orders = [(CampaignOrders(0, "unified@masked", "unified@masked", settings, search_seed=5), 12)]
    assert draw_at_once(orders, None) == {0: runner.first_cases(12)}


def test_a_campaign_its_process_cannot_draw_is_drawn_here(monkeypatch):
    monkeypatch.setattr(drawn_ahead, "LEAST_CORES", 1)
    settings = Settings(device="cuda", pool_size=3, max_examples=40, use_database=False)
    kernel = torch_kernel()  # made in this process: no import path resolves it in another
    runner = CampaignRunner(kernel, settings, Hooks(), seed=4)
    orders = [(CampaignOrders(0, kernel.name, "tests.no_such_module:kernel", settings, search_seed=4), 6)]
    drawn_here = []
    assert draw_at_once(orders, lambda n: drawn_here.append(n) or runner.first_cases(6)) == {0: runner.first_cases(6)}
    assert drawn_here == [0]
    # on a host of fewer cores than LEAST_CORES every campaign's are drawn here
    monkeypatch.setattr(drawn_ahead, "LEAST_CORES", 10 ** 6)
    drawn_here.clear()
    good = [(CampaignOrders(0, "paged_decode@masked", "paged_decode@masked", settings, search_seed=4), 6)]
    assert draw_at_once(good, lambda n: drawn_here.append(n) or ()) == {0: ()} and drawn_here == [0]


def test_a_run_that_draws_later_sends_the_farm_its_first_cases_once_and_then_lets_its_campaigns_begin(monkeypatch):
    planned, scheduled = _record_farms(monkeypatch)
    base = Settings(device="cuda", pool_size=3, max_examples=20, use_database=False)
    runs = [(resolve("tests.farm_subjects:slow"), base), (resolve("paged_decode@masked"), base)]
    ahead = compile_ahead(runs, base, lambda kernel: 4, samples=lambda tier: 1, at_once=2, draw_later=True)
    assert len(planned) == 1 and scheduled == []  # the farm started; nothing drawn yet
    assert not ahead.drawn.is_set()
    ahead.draw_first_cases()
    assert ahead.drawn.is_set() and len(scheduled) == 1
    assert [len(scheduled[0][p]) for p in (0, 1)] == [4, 4] and ahead.farm.at_once == 2
    ahead.draw_first_cases()  # once only
    assert len(scheduled) == 1
    # drawn at once (as before), the run has nothing to wait for
    now = compile_ahead(runs, base, lambda kernel: 4, samples=lambda tier: 1)
    assert now.drawn is None and len(scheduled) == 2 and [len(scheduled[1][p]) for p in (0, 1)] == [4, 4]


def test_a_campaign_told_to_wait_for_its_first_cases_starts_its_worker_first_and_checks_nothing_meanwhile():
    import threading

    event = fork_server_context().Event()
    settings = Settings(device="cpu", max_examples=6, use_database=False, shrink=False)
    runner = CampaignRunner(resolve("paged_decode@masked"), settings, Hooks(), start_after=event)
    seen = {}

    def draw_meanwhile():
        deadline = time.monotonic() + 60
        while runner.subject is None and time.monotonic() < deadline:
            time.sleep(0.02)
        seen["worker started"] = runner.subject is not None and runner.subject._process is not None
        time.sleep(0.5)  # the search, were it not waiting, would have checked a case by now
        seen["examples before"] = runner.campaign.examples
        seen["set at"] = time.time()
        event.set()

    drawing = threading.Thread(target=draw_meanwhile)
    drawing.start()
    campaign = runner.run()
    drawing.join()
    assert seen["worker started"] and seen["examples before"] == 0
    assert campaign.examples == 6 and not campaign.failed
    assert campaign.startup["first_cases_drawn"] >= seen["set at"]
    assert "first_cases_drawn_s" in campaign.startup_seconds()
