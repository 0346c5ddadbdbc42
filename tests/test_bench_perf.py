"""``nanfuzz bench`` and ``nanfuzz perf`` end to end through the command line, on a tiny budget."""
import json
import os

import pytest

from nanfuzz.harness.cli import main
from nanfuzz.harness.campaign.result import EARLY_EXAMPLES
from nanfuzz.harness.kernels.paged_decode import KERNELS as DECODE_KERNELS
from nanfuzz.harness.kernel import Kernel

MASKED = next(k for k in DECODE_KERNELS if k.name == "paged_decode@masked")
PHASES = ("generation", "materialize", "kernel", "oracle", "reference", "verdict",
          "memory wait", "admission", "handoff", "tally", "startup", "close")
SPENT_EVERY_EXAMPLE = tuple(p for p in PHASES if p != "memory wait")  # no check waits for memory here


def _four_launches(batch, out):
    for _ in range(4):
        MASKED(batch, out)
    return out


# Resolved by perf as tests.test_bench_perf:slow_masked: the fixed kernel, four times the work.
slow_masked = Kernel("tests.test_bench_perf:slow_masked", _four_launches, MASKED.capabilities)


@pytest.fixture(autouse=True)
def private_state(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def test_bench_reports_throughput_by_phase_and_time_to_detect(tmp_path, nanfuzz_device, capsys):
    out = tmp_path / "bench.json"
    argv = ["bench", "--device", nanfuzz_device, "--kernel", "paged_decode@masked", "--kernel", "paged_decode@unmasked",
            "--examples", "4", "--warmup", "1", "--seeds", "2", "--detect-examples", "50", "--json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["device"] == nanfuzz_device and report["machine_at_start"]["cpus"] >= 1
    by_name = {k["kernel"]: k for k in report["kernels"]}
    assert set(by_name) == {"paged_decode@masked", "paged_decode@unmasked"}
    for entry in by_name.values():
        t = entry["throughput"]
        assert t["examples"] >= 4 and t["seconds"] > 0 and t["examples_per_second"] > 0
        assert set(t["seconds_per_example"]) == set(PHASES)
        assert all(t["seconds_per_example"][p] > 0 for p in SPENT_EVERY_EXAMPLE), t["seconds_per_example"]
        assert t["seconds_per_example"]["memory wait"] >= 0
        assert sum(t["share"].values()) == pytest.approx(1.0, rel=1e-6)
        assert t["specialisations_after_warmup"] is None or t["specialisations_after_warmup"] >= 0
        assert t["cpu_seconds_per_example"]["judging"] > 0 and t["cpu_seconds_per_example"]["campaign"] > 0
        assert t["declined_for_memory"] == 0  # nothing waits for device memory here
        queued = t["run_queue_seconds_per_example"]["campaign"]
        assert (queued is not None and queued >= 0) == os.path.exists("/proc/self/schedstat")
        assert t["stack_samples"] is None  # sampled only when asked (--stacks)
    assert by_name["paged_decode@masked"]["detection"] is None  # a fixed kernel has nothing to detect
    detection = by_name["paged_decode@unmasked"]["detection"]
    assert detection["seeds"] == 2 and detection["caught"] == 2
    for key in ("time_to_first_failure_s", "shrink_s", "examples_to_first_failure"):
        assert 0 < detection[key]["median"] <= detection[key]["max"]
    assert all(run["verdict"] != "PASS" for run in detection["runs"])
    for run in detection["runs"]:  # its first examples one by one, the first failure among them
        early = run["early_examples"]
        assert len(early) == min(EARLY_EXAMPLES, run["examples"])
        assert all(a["at_s"] + a["seconds"] <= b["at_s"] + 0.002 for a, b in zip(early, early[1:]))
        first = min(run["examples_to_first_failure"], EARLY_EXAMPLES)
        assert {e["verdict"] for e in early[:first - 1]} <= {"PASS"}
        assert run["examples_to_first_failure"] > EARLY_EXAMPLES or early[first - 1]["verdict"] == run["verdict"]
        assert all(e["farm_wait_s"] >= 0.0 and e["compiled_s"] >= 0.0 for e in early)
        assert all(e["phases"]["materialize"] > 0 for e in early)  # each check's own phases
        # the judging process's time holds its phases and its memory wait, and the round trip holds it
        assert all(sum(e["phases"].values()) + e["memory_wait_s"] <= e["judged_s"] + 0.002 for e in early)
        assert all(e["judged_s"] <= e["seconds"] + 0.002 for e in early)
    progress = capsys.readouterr().err
    for run in detection["runs"]:  # a line per seed as it ends, for long cold-cache runs
        assert (f"paged_decode@unmasked seed {run['seed']}: {run['verdict']} after "
                f"{run['examples_to_first_failure']} examples") in progress


def test_bench_with_jobs_measures_campaigns_side_by_side(tmp_path):
    out, stacks = tmp_path / "bench.json", tmp_path / "stacks.txt"
    argv = ["bench", "--device", "cpu", "--kernel", "tests.torch_kernels:correct", "--kernel", "tests.torch_kernels:mask_multiply",
            "--jobs", "2", "--examples", "12", "--warmup", "2", "--seeds", "1", "--detect", "--json", str(out),
            "--stacks", str(stacks)]
    assert main(argv) == 0
    by_name = {k["kernel"]: k for k in json.loads(out.read_text())["kernels"]}
    t = by_name["torch@correct"]["throughput"]
    # --stacks: both jobs' search threads sampled, written as collapsed stacks under the kernel's name
    sampled = t["stack_samples"]
    assert 0 < sampled["outside_checks_s"] < sampled["sampled_s"] <= t["busy_seconds"]
    assert all(ms > 0 for _, ms in sampled["ms_per_example_outside_checks"])
    lines = [line.rpartition(" ") for line in stacks.read_text().splitlines()]
    assert lines and all(stack.startswith(("torch@correct;", "torch@mask-multiply;")) and int(us) >= 0
                         for stack, _, us in lines)
    assert any("nanfuzz.harness.campaign.search:Search._judge;" in stack for stack, _, _ in lines)
    assert t["examples"] == 12 and t["campaigns"] == 2 and t["busy_seconds"] >= t["seconds"] * 0.5
    assert t["cpu_seconds_per_example"]["judging"] > 0  # the jobs' workers', summed over the jobs
    assert sum(t["share"].values()) == pytest.approx(1.0, rel=1e-6)
    assert by_name["torch@correct"]["detection"]["caught"] == 0  # --detect: measured, and nothing to find
    start = t["startup_s"]  # the first job's worker, from the run's start
    assert 0 < start["worker_began_s"] <= start["worker_loaded_s"] <= start["worker_ready_s"]
    seed_run = by_name["torch@mask-multiply"]["detection"]["runs"][0]  # a campaign that started its own worker
    assert 0 < seed_run["startup_s"]["worker_loaded_s"] <= seed_run["startup_s"]["worker_ready_s"]
    assert by_name["torch@mask-multiply"]["detection"]["caught"] == 1


def _perf(tmp_path, device, kernel, baseline, *extra, runs: int = 3):
    out = tmp_path / "perf.json"
    code = main(["perf", "--device", device, "--kernel", kernel, "--baseline", baseline, "--shape", "decode",
                 "--runs", str(runs), "--json", str(out), *extra])
    return code, json.loads(out.read_text())


def test_perf_same_kernel_is_not_slower(tmp_path, nanfuzz_device):
    # A generous threshold and five rounds: on a shared CPU one launch's wall clock is noisy (with three,
    # a busy machine once made a kernel twice as slow as itself).
    code, result = _perf(tmp_path, nanfuzz_device, "paged_decode@masked", "paged_decode@masked", "--threshold", "1.0",
                         runs=5)
    assert code == 0 and result["exit_code"] == 0 and result["slower"] == []
    assert [s["name"] for s in result["shapes"]] == ["decode-window", "decode"]
    for shape in result["shapes"]:
        assert shape["kind"] == "decode" and shape["query_len"] == 1
        assert len(shape["kernel_runs_s"]) == len(shape["baseline_runs_s"]) == 5
        for key in ("kernel_s", "baseline_s", "ratio", "kv_bytes", "hbm_bound_s", "kernel_x_bound", "baseline_x_bound"):
            assert shape[key] > 0, key
    windowed, full = result["shapes"]
    assert windowed["window"] > 0 and full["window"] == 0
    assert windowed["kv_bytes"] < full["kv_bytes"]  # the window needs only its own keys


def test_perf_exits_1_for_a_slower_kernel(tmp_path, nanfuzz_device):
    code, result = _perf(tmp_path, nanfuzz_device, "tests.test_bench_perf:slow_masked", "paged_decode@masked",
                         "--threshold", "1.0")
    assert code == 1 and result["exit_code"] == 1
    # four times the work: slower on a shape at least, and each shape named slower is past the threshold
    # (a shared CPU's noise can hide the gap on one shape of three interleaved rounds)
    assert result["slower"] and all(s["ratio"] > 2.0 for s in result["shapes"] if s["name"] in result["slower"])


def test_perf_without_a_common_shape_is_a_usage_error(capsys, nanfuzz_device):
    argv = ["perf", "--device", nanfuzz_device, "--kernel", "paged_decode@masked", "--baseline", "paged_decode@masked",
            "--shape", "prefill", "--runs", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("nanfuzz: perf: no shape both kernels support") and "\n" not in err


def test_bench_measures_over_seconds_or_only_time_to_detect(tmp_path, nanfuzz_device):
    timed, detect = tmp_path / "timed.json", tmp_path / "detect.json"
    assert main(["bench", "--device", nanfuzz_device, "--kernel", "paged_decode@masked", "--seconds", "3",
                 "--warmup", "0", "--seeds", "0", "--json", str(timed)]) == 0
    t = json.loads(timed.read_text())["kernels"][0]["throughput"]
    assert t["examples"] >= 1 and t["seconds"] >= 3 and t["campaigns"] == 1  # one campaign bounded by time
    assert 0 < t["time_to_first_example_s"] <= t["seconds"] + 5
    # where the first example's time went: its worker loaded the kernel, then was ready, before it
    start = t["startup_s"]
    assert 0 < start["worker_loaded_s"] <= start["worker_ready_s"] <= t["time_to_first_example_s"]
    assert main(["bench", "--device", nanfuzz_device, "--kernel", "paged_decode@unmasked", "--examples", "0",
                 "--seeds", "1", "--detect-examples", "50", "--json", str(detect)]) == 0
    only = json.loads(detect.read_text())["kernels"][0]
    assert only["throughput"] is None and only["detection"]["caught"] == 1
