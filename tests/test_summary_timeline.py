"""--summary-json places each campaign in the command's time: when it began, and when the summary was written."""
from __future__ import annotations

import json
import time

from nanfuzz.harness import cli


def test_a_campaign_s_start_and_the_summary_are_timed_from_the_command_s_start(tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "_BEGAN", time.time() - 100.0)  # a command begun 100 s ago
    summary = tmp_path / "summary.json"
    assert cli.main(["fuzz", "--kernel", "paged_decode@masked", "--device", "cpu", "--max-examples", "3",
                     "--state-dir", str(tmp_path / "state"), "--summary-json", str(summary)]) == 0
    written = json.loads(summary.read_text())
    (entry,) = written["kernels"]
    assert written["timeline"]["first_cases_drawn_s"] is None  # no farm under the interpreter: nothing drawn ahead
    assert 100.0 <= entry["began_s"] <= entry["began_s"] + entry["elapsed_s"] <= written["timeline"]["summary_s"]
    assert written["timeline"]["summary_s"] < 100.0 + 120.0
    # its own start's steps, from its start: its worker's process started, its main began, it loaded the
    # kernel and was ready, before its first example
    steps = entry["startup_s"]
    assert 0.0 <= steps["worker_loaded_s"] <= steps["worker_ready_s"] <= entry["elapsed_s"], steps
    assert 0.0 <= steps["worker_started_s"] and steps["worker_began_s"] <= steps["worker_loaded_s"], steps
