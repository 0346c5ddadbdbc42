"""Several kernels' campaigns at once (``--kernels-at-once``): the rows one after another gives, in
the same order; a campaign process that dies is its kernel's one line, exit 2 alone and exit 1
beside another kernel's finding; under the interpreter the default is one campaign per core, on a
GPU the whole self-check at once."""
from __future__ import annotations

import pytest

from nanfuzz.harness.campaign.side_by_side import default_at_once
from nanfuzz.harness.cli import main

KERNELS = ("paged_decode@unmasked", "paged_decode@masked", "tests.torch_kernels:window_off_by_one")


def _rows(out: str) -> list[list[str]]:
    """The summary table's rows: kernel, expect, verdict, examples, first failure (examples), result."""
    lines = out.splitlines()
    start = next(n for n, line in enumerate(lines) if line.startswith("kernel ") and "verdict" in line)
    rows = []
    for line in lines[start + 2:]:
        if not line.strip():
            break
        cells = line.split()
        rows.append([cells[0], cells[2], cells[3], cells[4].split("/")[0], cells[-1]])
    return rows


def _fuzz(tmp_path, capsys, name: str, at_once: int, *kernels: str) -> tuple[int, str, str]:
    argv = ["fuzz", *(arg for kernel in kernels for arg in ("--kernel", kernel)), "--device", "cpu",
            "--seed", "1", "--max-examples", "20", "--no-shrink", "--kernels-at-once", str(at_once),
            "--state-dir", str(tmp_path / name)]
    status = main(argv)
    out, err = capsys.readouterr()
    return status, out, err


def test_side_by_side_gives_the_rows_one_after_another_gives_in_the_kernels_order(tmp_path, capsys):
    alone, alone_out, _ = _fuzz(tmp_path, capsys, "in-turn", 1, *KERNELS)
    together, together_out, _ = _fuzz(tmp_path, capsys, "at-once", 3, *KERNELS)
    assert alone == together == 1
    rows = _rows(together_out)
    assert rows == _rows(alone_out)
    assert [(row[0], row[1]) for row in rows] == [("paged_decode@unmasked", "NONFINITE"),
                                                  ("paged_decode@masked", "PASS"),
                                                  ("torch@window-off-by-one", "MISMATCH")]
    # each campaign's own lines come before the next one's, as one after another prints them
    seeds = [line.split(":")[0] for line in together_out.splitlines() if ": seed " in line]
    assert seeds == ["paged_decode@unmasked", "paged_decode@masked", "torch@window-off-by-one"]
    # under the interpreter campaigns share no device memory: each reruns alone as drawn
    assert "NANFUZZ_CAMPAIGNS_PER_DEVICE" not in together_out


def test_a_campaign_process_that_dies_is_one_line_exit_2_alone_and_exit_1_beside_a_finding(tmp_path, capsys):
    status, out, err = _fuzz(tmp_path, capsys, "alone", 2, "tests.dies_in_its_campaign:kernel", "paged_decode@masked")
    assert status == 2, out + err
    assert err.strip().splitlines() == ["nanfuzz: kernel torch@dies-in-its-campaign: its campaign's process died "
                                        "outside the kernel's launches (exit status 7); run the kernel alone to see why"]
    status, out, err = _fuzz(tmp_path, capsys, "beside", 2, "tests.dies_in_its_campaign:kernel", "paged_decode@unmasked")
    assert status == 1, out + err
    assert "its campaign's process died outside the kernel's launches (exit status 7)" in err
    assert [row[:2] for row in _rows(out)] == [["paged_decode@unmasked", "NONFINITE"]]
    assert list((tmp_path / "beside" / "repros").glob("paged_decode-unmasked-*.json"))


@pytest.mark.parametrize("device, cores, kernels, self_check, expected",
                         [("cpu", 2, 9, True, 2), ("cpu", 16, 9, True, 9), ("cpu", 4, 1, False, 1),
                          ("cpu", 2, 3, False, 2), ("cuda", 16, 9, True, 9), ("cuda", 4, 9, True, 9),
                          ("cuda", 16, 3, False, 1)])
def test_by_default_one_campaign_per_core_under_the_interpreter_and_on_a_gpu_the_whole_self_check(
        monkeypatch, device, cores, kernels, self_check, expected):
    monkeypatch.setattr("nanfuzz.harness.launch.backend.usable_cores", lambda: cores)
    assert default_at_once(device, kernels, self_check) == expected


@pytest.mark.gpu
def test_on_a_gpu_the_self_check_side_by_side_catches_every_old_variant_and_passes_every_fixed(tmp_path, capsys,
                                                                                               monkeypatch):
    monkeypatch.setenv("NANFUZZ_MEMORY_DIR", str(tmp_path / "ledger"))  # a ledger of its own: see test_compile_ahead_gpu
    status = main(["fuzz", "--state-dir", str(tmp_path / "state")])  # on a GPU its nine campaigns at once by default
    out, err = capsys.readouterr()
    assert status == 0, out + err
    assert "self-check: every old variant caught, every fixed variant passed" in out
    reruns = [line for line in out.splitlines() if ": seed " in line]
    assert len(reruns) == 9 and all("with NANFUZZ_CAMPAIGNS_PER_DEVICE=9" in line for line in reruns), reruns


def test_campaigns_started_before_their_first_cases_are_drawn_begin_their_searches_once_they_are(tmp_path):
    import time

    from nanfuzz.harness.campaign.settings import Settings
    from nanfuzz.harness.campaign.side_by_side import CampaignOrders, side_by_side
    from nanfuzz.harness.launch.processes import fork_server_context

    drawn = fork_server_context().Event()
    settings = Settings(device="cpu", max_examples=4, use_database=False, shrink=False, state_dir=str(tmp_path))
    orders = [CampaignOrders(i, name, name, settings, start_after=drawn)
              for i, name in enumerate(("paged_decode@masked", "paged_decode@unmasked"))]
    calls = []

    def draw() -> None:  # as the self-check draws the first cases while its campaigns start
        calls.append(time.time())
        time.sleep(1.0)
        calls.append(time.time())
        drawn.set()

    outcomes = dict(side_by_side(orders, at_once=2, once_started=draw))
    assert len(calls) == 2  # once
    for campaign in outcomes.values():  # each searched only once the drawing was done
        assert calls[1] <= campaign.startup["first_cases_drawn"] and campaign.examples
    assert not outcomes[0].failed  # the masked kernel passes as it would alone


def test_a_campaign_beside_others_forks_its_worker_from_its_own_process(tmp_path, capsys):
    """A campaign's process is fresh from the run's fork server and runs no torch op: a worker forked
    from it costs a fork, where a fork server of its own would import torch again first."""
    forked_only = "tests.torch_kernels:correct_in_a_forked_worker"  # NaN unless its worker is such a fork
    status, out, err = _fuzz(tmp_path, capsys, "at-once", 2, forked_only, "paged_decode@masked")
    assert status == 0, out + err
    assert [(row[0], row[1]) for row in _rows(out)] == [("torch@correct-in-a-forked-worker", "PASS"),
                                                        ("paged_decode@masked", "PASS")]
    # the kernel tells: run in this process, the campaign's worker comes from the fork server
    status, out, err = _fuzz(tmp_path, capsys, "in-turn", 1, forked_only)
    assert status == 1, out + err
    assert [(row[0], row[1]) for row in _rows(out)] == [("torch@correct-in-a-forked-worker", "NONFINITE")]


def test_campaigns_beside_others_are_told_the_gpu_s_fp8_skips_by_their_run(tmp_path, capsys, monkeypatch):
    """Asking Triton which fp8 types the GPU compiles initialises CUDA in the asking process, which
    then cannot fork its worker: the run asks once and tells its campaigns."""
    from nanfuzz.harness.judge import encodings
    from tests.torch_kernels import TOLD_GPU_SKIPS

    monkeypatch.setattr(encodings, "gpu_skips_for", lambda device: TOLD_GPU_SKIPS)  # as a GPU run's would be
    told_only = "tests.torch_kernels:correct_where_told_the_gpu_skips"  # NaN in a process not told them
    status, out, err = _fuzz(tmp_path, capsys, "at-once", 2, told_only, "paged_decode@masked")
    assert status == 0, out + err
    assert [(row[0], row[1]) for row in _rows(out)] == [("torch@correct-where-told-the-gpu-skips", "PASS"),
                                                        ("paged_decode@masked", "PASS")]


def test_a_kernel_that_kills_the_process_it_runs_under_is_a_crash_with_a_repro_beside_others(tmp_path, capsys):
    """A campaign's worker is a fork of the campaign's process: the kernel takes the campaign down, and
    the case it left in the campaign's journal, replayed in a fresh worker, is its CRASH."""
    status, out, err = _fuzz(tmp_path, capsys, "killer", 2, "tests.subjects:kills_the_fork_server",
                             "paged_decode@masked")
    assert status == 1, out + err
    rows = _rows(out)
    assert [(row[0], row[1]) for row in rows] == [("hostile@kills_the_fork_server", "CRASH"),
                                                  ("paged_decode@masked", "PASS")]
    # its row counts the examples the campaign had told, and the case it died under, its first failure
    assert int(rows[0][2]) == int(rows[0][3]) >= 1, rows
    assert "a campaign process died while running this case earlier; replayed in a fresh worker it gives CRASH" in out + err
    assert list((tmp_path / "killer" / "repros").glob("hostile-kills_the_fork_server-crash-*.json"))


def test_a_campaign_killed_once_under_a_case_that_then_passes_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    """As the host's out-of-memory killer might end it: the case replays PASS, so no verdict, and the
    run says where the process died rather than pass the kernel."""
    monkeypatch.chdir(tmp_path)  # where the subject notes that it killed once
    status, out, err = _fuzz(tmp_path, capsys, "once", 2, "tests.subjects:kills_the_fork_server_once",
                             "paged_decode@masked")
    assert status == 2, out + err
    assert ("nanfuzz: kernel hostile@kills_the_fork_server_once: its campaign's process died while checking a "
            "case that gives no failure replayed in a fresh worker (exit status -9)") in err
