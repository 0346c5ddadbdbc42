"""ci/speed_ab.py: two installs side by side, each figure of each and their ratio, in one call."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("speed_ab", ROOT / "ci" / "speed_ab.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("speed_ab", module)  # its dataclasses look their module up there
    spec.loader.exec_module(sys.modules["speed_ab"])
    return sys.modules["speed_ab"]


def _throughput(per_second: float, first: float, materialize_ms: float, around_checks: bool = True) -> dict:
    phases = dict.fromkeys(("generation", "materialize", "kernel", "oracle", "reference", "verdict"), 0.001)
    phases["materialize"] = materialize_ms / 1e3
    if around_checks:  # an install that measures the time around its checks
        phases.update({"memory wait": 0.0, "admission": 0.0, "handoff": 0.002, "tally": 0.0})
    return {"examples_per_second": per_second, "time_to_first_example_s": first, "seconds_per_example": phases,
            "cpu_seconds_per_example": {"campaign": 0.002, "judging": 0.004}}


def test_the_table_gives_each_side_s_median_and_their_ratio(tmp_path):
    ab = _script()
    a, b = ab.Install("A", "python", tmp_path), ab.Install("B", "python", tmp_path)
    a.results["bench"] = [_throughput(600, 3.0, 4.0), _throughput(500, 5.0, 6.0), _throughput(700, 4.0, 5.0)]
    b.results["bench"] = [_throughput(400, 8.0, 8.0, around_checks=False)]
    b.results["self_check"] = [{"seconds": 70.0, "tasks": 528, "compile_seconds": 400.0}]
    a.results["self_check"] = [{"seconds": 21.0, "tasks": 300, "compile_seconds": 90.0,
                                "campaigns": [ab._campaign_figures({"kernel": "k@old", "shrink_s": 3.5}),
                                              ab._campaign_figures({"kernel": "k@fixed", "shrink_s": None})]}]
    rows = {row[0]: row[1:] for row in ab.table(a, b)}
    assert rows["figure"] == ("A", "B", "A/B")
    assert rows["examples/s"] == ("600", "400", "1.50")           # A's median of three rounds against B's one
    assert rows["first example s"] == ("4", "8", "0.50")
    assert rows["ms/ex materialize"] == ("5", "8", "0.62")
    assert rows["ms/ex handoff"] == ("2", "-", "-")  # B's install does not measure it
    assert rows["ms/ex outside the checks' phases"] == ("3", "1", "3.00")  # B counts it as generation
    assert rows["self-check s"] == ("21", "70", "0.30")
    assert rows["self-check shrink s"] == ("3.5", "-", "-")  # B's runs kept no campaign's figures
    assert rows["cases declined for memory"] == ("-", "-", "-")  # neither install's bench said
    assert "detect s median" not in rows  # not measured: no row


def test_a_revision_installs_as_its_pyproject_lays_it_out_and_imports_from_there(tmp_path):
    site = tmp_path / "site"
    _script()._copy_packages(ROOT, site)
    assert (site / "nanfuzz" / "harness" / "cli.py").exists() and (site / "nanfuzz" / "reference" / "oracle.py").exists()
    assert not list(site.rglob("__pycache__"))
    where = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                            "import nanfuzz.harness.campaign.settings as s; print(s.__file__)", str(site)],
                           cwd=tmp_path, capture_output=True, text=True)
    assert where.returncode == 0, where.stderr[-2000:]
    assert where.stdout.strip().startswith(str(site))


def test_two_installs_run_side_by_side_and_the_table_is_printed(tmp_path):
    out = tmp_path / "ab.json"
    this = f"python:{sys.executable}"
    proc = subprocess.run([sys.executable, "ci/speed_ab.py", "--a", this, "--b", this, "--rounds", "1", "--jobs", "1",
                           "--seconds", "1", "--device", "cpu", "--kernel", "paged_decode@masked", "--json", str(out),
                           "--keep", str(tmp_path / "work")], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "round 1: A bench done" in proc.stdout and "round 1: B bench done" in proc.stdout
    found = json.loads(out.read_text())
    assert found["figures"]["A"]["examples/s"] > 0 and found["figures"]["B"]["examples/s"] > 0
    assert any(line.startswith("examples/s ") for line in proc.stdout.splitlines())


def test_the_self_check_keeps_each_campaign_s_figures():
    ab = _script()
    entry = {"kernel": "split_decode@drops-last-partition", "verdict": "NONFINITE", "elapsed_s": 34.3, "shrink_s": 33.0,
             "early_examples": [{"at_s": 0.1, "seconds": 0.2, "phases": {"materialize": 0.15}}], "repro": ["x.json"]}
    kept = ab._campaign_figures(entry)
    assert kept["shrink_s"] == 33.0 and kept["early_examples"] == entry["early_examples"]
    assert "repro" not in kept  # where its time went, not what it found
    assert kept["phase_seconds"] is None  # an older install's summary without the field


def test_the_table_has_a_row_for_every_cause_a_memory_wait_can_have():
    # the script drives installs of any age and imports none: its list of causes is its own copy
    from nanfuzz.harness.judge.memory import WAIT_CAUSES

    ab = _script()
    assert set(WAIT_CAUSES) <= set(ab.WAIT_CAUSES)
    side = ab.Install("A", "python", Path("."))
    side.results["bench"] = [{**_throughput(100, 1.0, 1.0), "memory_wait_causes": {WAIT_CAUSES[1]: 3}}]
    figures = ab.figures(side)
    assert figures[f"memory waits: {WAIT_CAUSES[1]}"] == 3
    assert all(figures[f"memory waits: {cause}"] == 0 for cause in WAIT_CAUSES if cause != WAIT_CAUSES[1])
