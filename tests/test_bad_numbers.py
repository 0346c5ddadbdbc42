"""Every number from the command line and the environment is checked (finite, in range) before
anything starts: one line, exit 2.  (A NaN launch timeout once switched the watchdog off.)"""
from __future__ import annotations

import math

import pytest

from nanfuzz.harness.campaign.settings import Settings
from nanfuzz.harness.cli import main
from nanfuzz.reference.errors import NanfuzzError

FUZZ = ["fuzz", "--kernel", "tests.subjects:hangs", "--device", "cpu"]


@pytest.mark.parametrize("argv, words", [
    ([*FUZZ, "--launch-timeout", "nan"], "--launch-timeout=nan must be a finite number > 0"),
    ([*FUZZ, "--launch-timeout", "inf"], "--launch-timeout=inf must be a finite number > 0"),
    ([*FUZZ, "--launch-timeout", "0"], "--launch-timeout=0 must be a finite number > 0"),
    ([*FUZZ, "--time-budget", "nan"], "--time-budget=nan must be a finite number > 0"),
    ([*FUZZ, "--time-budget", "-5"], "--time-budget=-5 must be a finite number > 0"),
    ([*FUZZ, "--max-examples", "0"], "--max-examples=0 must be >= 1"),
    ([*FUZZ, "--compile-jobs", "-1"], "--compile-jobs=-1 must be >= 0"),
    (["bench", "--seconds", "nan", "--device", "cpu"], "--seconds=nan must be a finite number > 0"),
    (["bench", "--detect-examples", "0", "--device", "cpu"], "--detect-examples=0 must be >= 1"),
    (["perf", "--kernel", "paged_decode@masked", "--baseline", "paged_decode@unmasked", "--threshold", "nan"],
     "--threshold=nan must be a finite number >= 0"),
    (["perf", "--kernel", "paged_decode@masked", "--baseline", "paged_decode@unmasked", "--runs", "0"],
     "--runs=0 must be >= 1"),
])
def test_a_number_out_of_range_is_one_line_and_exit_2_before_anything_runs(argv, words, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"nanfuzz: {words}", err


def test_a_state_folder_that_is_a_file_is_an_error_not_a_note(tmp_path, capsys, monkeypatch):
    blocked = tmp_path / "state"
    blocked.write_text("a file where the folder should be")
    assert main(["fuzz", "--kernel", "paged_decode@masked", "--device", "cpu", "--state-dir", str(blocked)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("nanfuzz: the state folder") and "is a file" in err and "\n" not in err
    with pytest.raises(NanfuzzError, match="is a file"):
        Settings.from_environment({"NANFUZZ_STATE_DIR": str(blocked / "below")})
    assert Settings.from_environment({"NANFUZZ_STATE_DIR": str(tmp_path / "new" / "state")}).state_dir.name == "state"


def test_a_memory_ledger_folder_that_is_a_file_is_an_error(tmp_path):
    blocked = tmp_path / "ledger"
    blocked.write_text("a file where the folder should be")
    with pytest.raises(NanfuzzError, match=r"the memory ledger folder \(NANFUZZ_MEMORY_DIR\) .* is a file"):
        Settings.from_environment({"NANFUZZ_MEMORY_DIR": str(blocked)})
    made = Settings.from_environment({"NANFUZZ_MEMORY_DIR": str(tmp_path / "shared")})
    assert made.memory.ledger_dir == str(tmp_path / "shared")


@pytest.mark.parametrize("options, words", [
    ({"launch_timeout": math.nan}, "launch_timeout=nan must be a finite number > 0"),
    ({"time_budget": -5.0}, "time_budget=-5 must be a finite number > 0"),
    ({"time_budget": math.inf}, "time_budget=inf must be a finite number > 0"),
    ({"max_examples": 0}, "max_examples=0 must be >= 1"),
    ({"max_examples": 2.5}, "max_examples=2.5 must be a whole number"),
    ({"jobs": 0}, "jobs=0 must be >= 1"),
])
def test_every_edge_that_builds_settings_checks_its_numbers(options, words):
    # the pytest plugin and nanfuzz.fuzz() build their Settings here too
    with pytest.raises(NanfuzzError, match=words.replace("(", r"\(").replace(".", r"\.")):
        Settings.from_environment({}, **options)
    with pytest.raises(NanfuzzError, match="NANFUZZ_COMPILE_JOBS='nan' must be a whole number"):
        Settings.from_environment({"NANFUZZ_COMPILE_JOBS": "nan"})


@pytest.mark.parametrize("command", [
    ["bench", "--device", "cpu", "--kernel", "tests.subjects:hangs"],
    ["bench", "--scaling", "--device", "cpu", "--kernel", "tests.subjects:hangs"],
    ["perf", "--device", "cpu", "--kernel", "tests.subjects:hangs", "--baseline", "tests.subjects:hangs"],
])
@pytest.mark.parametrize("where, words", [
    ("missing/out.json", "there is no folder"),
    (".", "is a folder; name a file"),
])
def test_an_output_file_that_cannot_be_written_is_one_line_and_exit_2_before_anything_runs(
        tmp_path, capsys, command, where, words):
    # the kernel hangs: only a check made before the run can answer at once
    assert main([*command, "--json", str(tmp_path / where)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("nanfuzz: --json") and words in err and "\n" not in err, err


def test_a_summary_that_cannot_be_written_is_one_line_and_exit_2_before_anything_runs(tmp_path, capsys):
    assert main([*FUZZ, "--summary-json", str(tmp_path / "missing" / "summary.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("nanfuzz: --summary-json") and "there is no folder" in err and "\n" not in err, err
