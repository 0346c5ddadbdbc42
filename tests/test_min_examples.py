"""A PASS on too few examples is INCOMPLETE: ``nanfuzz fuzz --min-examples`` and the gate's floor per kernel."""
from __future__ import annotations

import xml.etree.ElementTree as ET

from nanfuzz.harness.cli import main as cli
from nanfuzz.harness.gate.floor import DEFAULT_FLOOR, apply_floor, floor
from nanfuzz.harness.gate.report import GateResult, Row, headline, junit_xml, table_row


def _rows(kernel: str, *examples: int, verdict: str = "PASS") -> list[Row]:
    return [Row(kernel, shard, f"cpu{shard}", f"gw{shard}", n, 1.0, verdict, verdict) for shard, n in enumerate(examples)]


def test_a_kernel_under_the_floor_is_incomplete_in_the_summary_and_junit():
    result = GateResult(_rows("a@fixed", 20, 27) + _rows("b@fixed", 300, 1), [], [])
    apply_floor(result, 300)
    assert [r.verdict for r in result.rows] == ["INCOMPLETE", "INCOMPLETE", "PASS", "PASS"]
    assert not result.passed and len(result.problems) == 1 and "`a@fixed` passed on 47 examples" in result.problems[0]
    assert result.exit_code == 3  # not green, and no finding: exit 1 means a finding and nothing else
    assert headline(result, "gate", 2).startswith("## nanfuzz gate: INCOMPLETE (no failure found, but too few examples")
    assert "**INCOMPLETE**: PASS on 47 examples, under the floor of 300" in table_row(result.rows[0])
    suite = ET.fromstring(junit_xml(result, {}, replay_prefix="nanfuzz replay")).find("testsuite")
    failures = [c.find("failure") for c in suite.iter("testcase")]
    assert [f.get("type") if f is not None else None for f in failures] == ["INCOMPLETE", "INCOMPLETE", None, None]


def test_a_failing_kernel_stays_a_failure_and_a_kernel_over_the_floor_passes():
    result = GateResult(_rows("a@old", 3, verdict="NONFINITE") + _rows("b@fixed", 10), [], [])
    apply_floor(result, 10)
    assert [r.verdict for r in result.rows] == ["NONFINITE", "PASS"] and not result.problems


def test_the_floor_defaults_by_device_and_never_exceeds_the_example_cap():
    assert floor(None, "cuda", None, 4) == DEFAULT_FLOOR["cuda"] and floor(None, "cpu", None, 1) == DEFAULT_FLOOR["cpu"]
    assert floor(None, "cuda", 2, 4) == 8 and floor(0, "cuda", None, 1) == 0 and floor(50, "cpu", None, 1) == 50


def test_fuzz_under_min_examples_is_incomplete_exit_3(tmp_path, capsys):
    code = cli(["fuzz", "--kernel", "paged_decode@masked", "--device", "cpu", "--max-examples", "1",
                "--min-examples", "5", "--seed", "3", "--state-dir", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 3, captured.out + captured.err
    assert "passed on 1 examples, fewer than --min-examples 5: INCOMPLETE" in captured.err
    assert "INCOMPLETE" in captured.out and "seed 3 (--seed 3 runs the same search)" in captured.out
    assert cli(["fuzz", "--kernel", "paged_decode@masked", "--min-examples", "-1"]) == 2


def test_a_replay_after_the_fix_says_pass_plainly(capsys):
    from pathlib import Path

    repro = Path(__file__).parent / "regressions" / "paged_decode-tail-past-seq-len.json"
    assert cli(["replay", str(repro), "--kernel", "paged_decode@masked", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("paged_decode@masked: PASS (recorded NONFINITE): the finding no longer reproduces")
    assert "DIFFER" not in out


def test_hypothesis_s_own_files_go_into_the_state_folder_while_a_campaign_runs(tmp_path):
    from hypothesis.configuration import storage_directory

    from nanfuzz.harness.campaign.hypothesis_home import hypothesis_files_in

    before = storage_directory("constants", intent_to_write=False).path
    with hypothesis_files_in(tmp_path):
        assert storage_directory("constants", intent_to_write=False).path == tmp_path / "hypothesis" / "constants"
    assert storage_directory("constants", intent_to_write=False).path == before


def test_nanfuzz_list_wraps_long_cells_on_a_terminal_and_cuts_none(monkeypatch, capsys):
    import shutil
    import sys

    from nanfuzz.harness import cli as cli_module

    monkeypatch.setattr(sys.stdout, "isatty", lambda: True, raising=False)
    monkeypatch.setattr(shutil, "get_terminal_size", lambda *a: __import__("os").terminal_size((80, 24)))
    reason = "needs NANFUZZ_VLLM_SRC or an installed vllm: a reason long enough to wrap at eighty columns"
    cli_module._table([("kernel", "capabilities"), ("vllm:rocm_attn", reason)])
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= 80 and len(lines) > 3
    assert " ".join(line[16:].strip() for line in lines[2:]) == reason  # every word, none cut
