"""Campaigns: sensitivity, silence, shrinking, no lost case, bit-exact replay."""
import json

import pytest

from pathlib import Path

from nanfuzz.harness.judge.check import Verdict
from nanfuzz.harness.campaign.focus import Focus
from nanfuzz.harness.campaign.runner import fuzz
from nanfuzz.harness.registry import builtin_kernels
from nanfuzz.harness.replay import replay
from nanfuzz.harness.report.repro import load_repro, write_repro
from nanfuzz.reference.case import Case, Geometry, Sequence
from tests.torch_kernels import torch_kernel

KERNELS = builtin_kernels()
# The masking families; split_decode draws production sizes only and has tests of its own
# (tests/test_kernel_split_decode.py): its bug is a lost partition, not a dead slot read.
OLD = sorted(name for name, k in KERNELS.items() if k.expect == "caught" and k.size != "production")
FIXED = sorted(name for name, k in KERNELS.items() if k.expect == "pass" and k.size != "production")


STATE = Path(".nanfuzz")


@pytest.fixture(autouse=True)
def private_state(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default state folder, .nanfuzz, is the test's own


def _leave_in_journal(kernel_name: str, case: Case) -> Path:
    """What a campaign process killed mid-case leaves: an unlocked journal file holding the case."""
    from nanfuzz.harness.campaign.journal import safe_name

    path = STATE / "journal" / f"{safe_name(kernel_name)}.99999.dead.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"kernel": kernel_name, "case": case.to_dict()}))
    return path


@pytest.mark.parametrize("name", OLD)
@pytest.mark.parametrize("seed", [1, 2])
def test_old_variants_are_caught_within_200_examples(name, seed, nanfuzz_device):
    campaign = fuzz(KERNELS[name], device=nanfuzz_device, max_examples=200, seed=seed, shrink=False, use_database=False)
    assert campaign.failed, f"{name} passed 200 examples (seed {seed})"
    assert campaign.failure.verdict in (Verdict.NONFINITE, Verdict.LEAK), campaign.failure.summary


@pytest.mark.parametrize("name", FIXED)
def test_fixed_variants_pass_300_examples(name, nanfuzz_device):
    campaign = fuzz(KERNELS[name], device=nanfuzz_device, max_examples=300, profile="ci", use_database=False)
    assert not campaign.failed, f"{campaign.failure.summary}\n{campaign.failing_case.to_json()}"
    assert campaign.examples >= 300


def test_window_bug_shrinks_to_a_minimal_repro(nanfuzz_device):
    kernel = KERNELS["paged_decode@unmasked"]
    campaign = fuzz(kernel, device=nanfuzz_device, max_examples=300, seed=0, use_database=False,
                    focus=Focus(poison_classes=("out-of-window",)))
    case = campaign.failing_case
    assert campaign.failure.verdict is Verdict.NONFINITE
    g = case.geometry
    assert len(case.sequences) == 1 and g.num_kv_heads == 1
    assert g.head_size == min(kernel.capabilities.head_sizes)
    assert g.num_blocks <= 4
    assert case.poison.tensors == "v" and case.poison.sites is not None and len(case.poison.sites) == 1
    assert case.poison.sites[0].offset is not None


def test_a_case_left_by_a_dead_process_is_replayed_and_only_a_repeat_is_a_crash():
    case = Case(Geometry(1, 1, 32, 16, 2, "float32"), (Sequence(1, 3, (1,)),), sliding_window=2).validate()
    dies = torch_kernel_module().dies_on_windows
    path = _leave_in_journal(dies.name, case)
    campaign = fuzz(dies, device="cpu", max_examples=5)
    assert campaign.failure.verdict is Verdict.CRASH and campaign.failing_case == case and campaign.recovered_crash
    assert not path.exists()

    correct = torch_kernel()
    path = _leave_in_journal(correct.name, case)
    campaign = fuzz(correct, device="cpu", max_examples=5, use_database=False)
    assert not campaign.failed, "a leftover that replays PASS is a note, never a verdict"
    assert any("not this kernel's doing" in note for note in campaign.notes)
    assert not path.exists()


def torch_kernel_module():
    import tests.torch_kernels

    return tests.torch_kernels


def test_the_journal_holds_each_case_before_its_launch():
    seen = []

    def spy(batch, out):
        (path,) = (STATE / "journal").glob("spy.*.json")
        seen.append(json.loads(path.read_text())["case"] == batch.case.to_dict())
        return torch_kernel().run(batch, out)

    from nanfuzz.harness.kernel import Kernel
    from tests.torch_kernels import CAPS

    fuzz(Kernel("spy", spy, CAPS), device="cpu", max_examples=5, use_database=False)
    assert seen and all(seen)
    assert not list((STATE / "journal").glob("spy.*"))


def test_replay_gives_identical_output_bits(tmp_path, nanfuzz_device):
    kernel = KERNELS["paged_decode@unmasked"]
    campaign = fuzz(kernel, device=nanfuzz_device, max_examples=50, seed=3, use_database=False)
    paths = write_repro(kernel.name, campaign.failing_case, campaign.failure, tmp_path, nanfuzz_device)
    record = load_repro(paths[0])
    assert record["case"] == campaign.failing_case
    again = replay(str(paths[0]), device=nanfuzz_device)
    assert again.still_fails and again.identical_output is True
    fixed = replay(str(paths[0]), kernel_name="paged_decode@masked", device=nanfuzz_device)
    assert not fixed.still_fails


def test_a_seeded_campaign_keeps_the_example_database(tmp_path):
    bad = KERNELS["paged_decode@unmasked"]
    first = fuzz(bad, device="cpu", max_examples=50, seed=5, use_database=True)
    assert first.failed
    saved = list((STATE / "examples").rglob("*"))
    assert any(p.is_file() for p in saved), "the failing example was not saved"
    again = fuzz(bad, device="cpu", max_examples=50, seed=6, use_database=True, shrink=False)
    assert again.examples_to_first_failure == 1  # replayed from the database first


def test_time_budget_is_kept_within_a_few_examples(monkeypatch):
    import time as time_module
    import types

    from nanfuzz.harness.campaign import runner, search
    from nanfuzz.harness.campaign.runner import Hooks

    # the campaign's clock, moved by hand: each example takes 0.1 s of it, whatever the machine does
    now = [0.0]
    clock = types.SimpleNamespace(perf_counter=lambda: now[0], process_time=time_module.process_time, time=time_module.time,
                                  sleep=time_module.sleep)
    monkeypatch.setattr(runner, "time", clock)
    monkeypatch.setattr(search, "time", clock)
    hooks = Hooks(on_example=lambda campaign: now.__setitem__(0, now[0] + 0.1))
    campaign = fuzz(KERNELS["paged_decode@masked"], device="cpu", max_examples=10_000, time_budget=3.0,
                    use_database=False, hooks=hooks)
    # 3 s of examples of 0.1 s: the last Hypothesis run ends on the deadline, or one example past it
    assert 30 <= campaign.examples <= 31 and campaign.elapsed == pytest.approx(campaign.examples * 0.1)


def test_time_budget_holds_when_examples_slow_down_after_the_first(monkeypatch):
    import time as time_module
    import types

    from nanfuzz.harness.campaign import runner, search
    from nanfuzz.harness.campaign.runner import Hooks

    # the first examples take 10 ms, every later one 1 s (as when production shapes start compiling):
    # a Hypothesis run sized at the early pace must still end at the deadline
    now, seen = [0.0], [0]

    def on_example(campaign):
        seen[0] += 1
        now[0] += 0.01 if seen[0] <= 2 else 1.0

    clock = types.SimpleNamespace(perf_counter=lambda: now[0], process_time=time_module.process_time, time=time_module.time,
                                  sleep=time_module.sleep)
    monkeypatch.setattr(runner, "time", clock)
    monkeypatch.setattr(search, "time", clock)
    campaign = fuzz(KERNELS["paged_decode@masked"], device="cpu", max_examples=10_000, time_budget=3.0,
                    use_database=False, hooks=Hooks(on_example=on_example))
    assert campaign.elapsed <= 4.0 and campaign.examples == 5


def _budget_campaign(monkeypatch, slow_launch_s: float):
    """A 1.5 s campaign on a clock moved by hand: each launch takes 0.1 s of it, but the first launch
    once 1 s has passed takes ``slow_launch_s`` (a binary compiling in the worker); in this process."""
    import time as time_module
    import types

    from nanfuzz.harness.campaign import runner, search
    from nanfuzz.harness.kernel import Kernel
    from tests.torch_kernels import CAPS, attention

    now, slowed = [0.0], [False]

    def launch(batch, out):
        late = now[0] >= 1.0 and not slowed[0]
        slowed[0] = slowed[0] or late
        now[0] += slow_launch_s if late else 0.1
        return attention(batch, out)

    clock = types.SimpleNamespace(perf_counter=lambda: now[0], process_time=time_module.process_time, time=time_module.time,
                                  sleep=time_module.sleep)
    monkeypatch.setattr(runner, "time", clock)
    monkeypatch.setattr(search, "time", clock)
    kernel = Kernel(name="torch@slow-once", run=launch, capabilities=CAPS)
    campaign = fuzz(kernel, device="cpu", max_examples=10_000, time_budget=1.5, use_database=False, isolation=False)
    return campaign, now[0]


def test_a_check_under_way_when_the_budget_runs_out_is_named_with_how_far_past_it_ended(monkeypatch):
    campaign, ended = _budget_campaign(monkeypatch, slow_launch_s=8.0)
    past = campaign.past_budget
    assert not campaign.failed and past["budget_s"] == 1.5 and past["at_s"] < 1.5
    assert past["past_s"] == pytest.approx(ended - 1.5) and past["past_s"] > 7.5
    # it was the last check: none began once the budget had run out
    assert past["at_s"] + past["seconds"] == pytest.approx(ended)
    notes = [note for note in campaign.notes if "past its time budget" in note]
    assert notes == [f"torch@slow-once: a check under way when the 1.5 s budget ran out ended {past['past_s']:.1f} s "
                     f"past its time budget, after {past['seconds']:.1f} s; a time budget stops new checks, not one "
                     "under way"]


def test_a_check_ending_just_past_the_budget_gets_no_note(monkeypatch):
    campaign, ended = _budget_campaign(monkeypatch, slow_launch_s=0.1)
    assert campaign.past_budget is not None and campaign.past_budget["past_s"] < 1.0
    assert not any("past its time budget" in note for note in campaign.notes)


def test_the_check_furthest_past_the_budget_is_the_one_noted():
    from nanfuzz.harness.campaign.result import Campaign

    campaign = Campaign(kernel="k", device="cuda")
    record = {"at_s": 40.0, "seconds": 30.0, "judged_s": 29.0, "memory_wait_s": 0.0, "farm_wait_s": 0.0,
              "compiled_s": 27.5, "verdict": "PASS", "phases": {}, "budget_s": 50.0}
    for past in (6.0, 20.0, 12.0):  # three jobs' checks
        campaign.passed_budget({**record, "past_s": past})
    campaign.note_past_budget()
    campaign.note_past_budget()  # a merged run notes again: one note stays
    assert campaign.past_budget["past_s"] == 20.0
    assert [note for note in campaign.notes if "past its time budget" in note] == [
        "k: a check under way when the 50 s budget ran out ended 20.0 s past its time budget, after 30.0 s "
        "(its worker compiling 27.5 s); a time budget stops new checks, not one under way"]


def test_cpu_seconds_tell_a_busy_worker_from_a_waiting_one(tmp_path, monkeypatch):
    """Three launches an example (poisoned, repeated, finite garbage), each 30 ms: spinning or asleep."""
    monkeypatch.chdir(tmp_path)
    from nanfuzz.harness.registry import resolve

    busy = fuzz(resolve("tests.torch_kernels:burns_cpu"), device="cpu", max_examples=4, seed=1, use_database=False)
    idle = fuzz(resolve("tests.torch_kernels:sleeps"), device="cpu", max_examples=4, seed=1, use_database=False)
    for campaign in (busy, idle):
        assert not campaign.failed and campaign.examples == 4
        assert campaign.phase_times["kernel"] / campaign.examples > 0.08
    # the same cases: the difference is the spinning, 3 x 30 ms an example, which the sleeper does not spend
    # (measured 60 to 70 ms a loaded 2-core machine)
    assert (busy.judging_cpu_seconds - idle.judging_cpu_seconds) / busy.examples > 0.045
    # the judging ran in the worker: the campaign's own process did not spin
    assert busy.cpu_seconds < busy.judging_cpu_seconds
