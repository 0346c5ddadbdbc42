"""Several job processes on one campaign: work shared, first failure kept, dead jobs recovered."""
import json

import pytest

from pathlib import Path

from nanfuzz.harness.judge.check import Verdict
from nanfuzz.harness.campaign.jobs import fuzz_parallel, split
from nanfuzz.harness.registry import resolve
from nanfuzz.reference.case import Case, Geometry, Sequence


@pytest.fixture(autouse=True)
def private_state(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default state folder, .nanfuzz, is the test's own


def test_examples_are_split_over_jobs():
    assert split(10, 3) == [4, 3, 3]
    assert sum(split(1000, 7)) == 1000


def test_each_job_says_it_shares_the_device_and_draws_no_huge_cache():
    from nanfuzz.harness.campaign.jobs import job_settings
    from nanfuzz.harness.campaign.scope import campaign_production_size
    from nanfuzz.harness.campaign.settings import Settings

    run = Settings(device="cuda", jobs=14)
    job = job_settings(run, 10, 3, resolve("tests.torch_kernels:correct"))
    assert (job.jobs, job.max_examples, job.seed, job.campaigns_per_device) == (1, 10, 3, 14)
    shared, alone = campaign_production_size(job), campaign_production_size(run.replace(jobs=1))
    assert shared.huge_cache_bytes == 0 and alone.huge_cache_bytes > 0  # a huge cache for a campaign alone
    # a share of the live keys and of the new tokens (the oracle's rows), but never below the targets' batches
    assert shared.max_live_keys < alone.max_live_keys and shared.max_tokens < alone.max_tokens
    assert shared.max_tokens >= 128 * 2 and shared.max_query_len <= shared.max_tokens


def test_two_jobs_share_a_passing_campaign_and_its_database(tmp_path):
    campaign = fuzz_parallel(resolve("tests.torch_kernels:correct"), jobs=2, device="cpu", max_examples=30, seed=5)
    assert not campaign.failed
    assert campaign.examples == 30 and campaign.verdicts == {"PASS": 30}
    assert campaign.busy_seconds > 0 and set(campaign.phase_times) >= {"kernel", "oracle"}
    assert not list((Path(".nanfuzz") / "journal").glob("*.json")), "each job removes its journal"


def test_the_first_failure_stops_the_other_job_and_is_shrunk(tmp_path):
    campaign = fuzz_parallel(resolve("tests.torch_kernels:mask_multiply"), jobs=2, device="cpu",
                             max_examples=400, seed=0, profile="dev")
    assert campaign.failed and campaign.failure.verdict is Verdict.NONFINITE
    assert campaign.examples < 400, "the job without the failure should have stopped early"
    assert campaign.time_to_first_failure is not None and campaign.shrink_time is not None
    assert len(campaign.failing_case.sequences) == 1
    assert any((Path(".nanfuzz") / "examples").rglob("*")), "the shrunk failure goes to the shared database"


def test_a_kernel_that_kills_its_worker_is_a_crash_and_the_jobs_carry_on():
    campaign = fuzz_parallel(resolve("tests.torch_kernels:dies_on_windows"), jobs=2, device="cpu",
                             max_examples=200, seed=0, use_database=False)
    assert campaign.failed and campaign.failure.verdict is Verdict.CRASH
    assert "exited with status 70" in campaign.failure.summary
    assert campaign.failing_case.sliding_window > 0 and len(campaign.failing_case.sequences) == 1


def test_a_case_left_by_a_dead_job_is_replayed_before_anything_runs():
    case = Case(Geometry(1, 1, 32, 16, 2, "float32"), (Sequence(1, 3, (1,)),), sliding_window=2).validate()
    kernel = resolve("tests.torch_kernels:dies_on_windows")
    from nanfuzz.harness.campaign.journal import safe_name

    path = Path(".nanfuzz") / "journal" / f"{safe_name(kernel.name)}.12345.dead.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"kernel": kernel.name, "case": case.to_dict()}))
    campaign = fuzz_parallel(kernel, jobs=2, device="cpu", max_examples=10)
    assert campaign.recovered_crash and campaign.failing_case == case and campaign.examples == 0
    assert not path.exists()


def test_a_job_its_run_ended_on_a_stop_leaves_no_case_and_a_dead_job_still_does(tmp_path):
    from nanfuzz.harness.campaign import journal

    case = Case(Geometry(1, 1, 32, 16, 2, "float32"), (Sequence(1, 3, (1,)),), sliding_window=2).validate()
    folder = tmp_path / "journal"
    folder.mkdir()
    for pid in (111, 222):  # two jobs that never closed their journals
        (folder / f"{journal.safe_name('k@v')}.{pid}.abcd.json").write_text(
            json.dumps({"kernel": "k@v", "case": case.to_dict()}))
    journal.drop(tmp_path, "k@v", 111)  # the run killed job 111 when its stop's grace ran out
    (left,) = journal.leftovers(tmp_path, "k@v")
    assert left.case == case and not list(folder.glob("*.json"))


def test_bad_job_counts_are_refused():
    from nanfuzz.reference.errors import NanfuzzError

    kernel = resolve("tests.torch_kernels:correct")
    with pytest.raises(NanfuzzError, match="jobs"):
        fuzz_parallel(kernel, jobs=0, device="cpu", max_examples=10)
    with pytest.raises(NanfuzzError, match="cannot be shared"):
        fuzz_parallel(kernel, jobs=4, device="cpu", max_examples=3)


def test_a_job_dying_in_its_warm_up_does_not_hold_the_others_at_the_start():
    campaign = fuzz_parallel(resolve("tests.torch_kernels:dies_on_windows"), jobs=2, device="cpu",
                             max_examples=40, seed=0, use_database=False, warmup=30)
    assert campaign.failed and campaign.failure.verdict is Verdict.CRASH
    from nanfuzz.harness.campaign.jobs import _READY_TIMEOUT

    assert campaign.elapsed < _READY_TIMEOUT  # the job left waiting went on when the other died, not at the timeout


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads /proc")
def test_a_job_forks_its_worker_itself_rather_than_starting_a_fork_server(tmp_path):
    import os

    notes = tmp_path / "parents.txt"  # the subject's notes; jobs and workers start in this test's folder
    campaign = fuzz_parallel(resolve("tests.torch_kernels:notes_parent"), jobs=2, device="cpu", max_examples=6,
                             seed=1, use_database=False)
    assert not campaign.failed and campaign.examples == 6
    chains = [line.split() for line in notes.read_text().splitlines()]
    assert len({chain[0] for chain in chains}) == 2  # one worker per job
    # worker -> its job -> the campaign's fork server -> this process: no fork server of the job's own between
    assert {chain[3] for chain in chains} == {str(os.getpid())}
    assert len({chain[1] for chain in chains}) == 2 and len({chain[2] for chain in chains}) == 1


def test_jobs_are_told_the_gpu_s_fp8_skips_by_their_run(monkeypatch):
    """A job that asked Triton itself would initialise CUDA and could not fork its workers."""
    from nanfuzz.harness.judge import encodings
    from tests.torch_kernels import TOLD_GPU_SKIPS

    monkeypatch.setattr(encodings, "gpu_skips_for", lambda device: TOLD_GPU_SKIPS)  # as a GPU run's would be
    campaign = fuzz_parallel(resolve("tests.torch_kernels:correct_where_told_the_gpu_skips"), jobs=2, device="cpu",
                             max_examples=6, seed=1, use_database=False)
    assert not campaign.failed and campaign.examples == 6  # NaN rows in a worker whose job was not told


def test_the_jobs_examples_reach_one_progress_report_while_they_run():
    seen = []
    campaign = fuzz_parallel(resolve("tests.torch_kernels:correct"), jobs=2, device="cpu", max_examples=40, seed=3,
                             use_database=False, on_progress=lambda examples, shrinking: seen.append((examples, shrinking)))
    assert not campaign.failed and campaign.examples == 40
    totals = [examples for examples, _ in seen]
    assert totals and totals == sorted(totals) and 0 < totals[0] and totals[-1] <= 40
    assert not any(shrinking for _, shrinking in seen)


def test_a_job_shrinking_a_failure_is_reported_as_shrinking():
    seen = []
    campaign = fuzz_parallel(resolve("tests.torch_kernels:mask_multiply"), jobs=2, device="cpu", max_examples=400,
                             seed=0, profile="dev", use_database=False,
                             on_progress=lambda examples, shrinking: seen.append((examples, shrinking)))
    assert campaign.failed
    assert any(shrinking for _, shrinking in seen), "the shrink ran without a report saying so"
    first = next(i for i, (_, shrinking) in enumerate(seen) if shrinking)
    assert all(shrinking for _, shrinking in seen[first:]), "once shrinking, the report stays shrinking"


def test_a_campaign_over_jobs_prints_its_progress_line(monkeypatch, capsys):
    from nanfuzz.harness.cli import main
    from nanfuzz.harness.report import progress

    monkeypatch.setattr(progress, "LOG_EVERY", 0.0)  # a line at every report, not every half minute
    assert main(["fuzz", "--kernel", "tests.torch_kernels:correct", "--device", "cpu", "--jobs", "2",
                 "--max-examples", "30", "--seed", "2"]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("torch@")]
    assert any("/30 examples" in line and "searching" in line for line in lines), lines
    assert lines[-1].startswith("torch@correct: 30 examples in ") and lines[-1].endswith("done"), lines


def test_jobs_memory_waits_are_summed_by_cause():
    from nanfuzz.harness.campaign.jobs import _merge
    from nanfuzz.harness.campaign.result import Campaign

    jobs = [(Campaign(kernel="k", device="cuda", examples=5, memory_waits=2,
                      memory_wait_causes={"not free on the device": 2}), (0.0, 1.0)),
            (Campaign(kernel="k", device="cuda", examples=5, memory_waits=3,
                      memory_wait_causes={"not free on the device": 1, "held by other nanfuzz processes": 2}),
             (0.0, 1.0))]
    merged = _merge("k", "cuda", jobs, 0.0)
    assert merged.memory_waits == 5
    assert merged.memory_wait_causes == {"not free on the device": 3, "held by other nanfuzz processes": 2}
