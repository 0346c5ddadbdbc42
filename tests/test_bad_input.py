"""Bad repros and cases: one line and exit 2, before anything is allocated or run; never a traceback."""
from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from nanfuzz.harness.report.repro import write_repro
from nanfuzz.harness.judge.check import Outcome, Verdict
from nanfuzz.reference.case import Case, Geometry, Sequence

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def good_record(tmp_path_factory):
    case = Case(Geometry(1, 1, 32, 16, 2, "float32"), (Sequence(1, 3, (1,)),)).validate()
    paths = write_repro("paged_decode@masked", case, Outcome(Verdict.PASS, "PASS"), tmp_path_factory.mktemp("r"), "cpu")
    return json.loads(paths[0].read_text())


def _replay(tmp_path, content: bytes | str, *extra):
    path = tmp_path / "repro.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return subprocess.run([sys.executable, "-m", "nanfuzz", "replay", str(path), "--device", "cpu", *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)


def _mutated(record, change):
    data = copy.deepcopy(record)
    change(data)
    return json.dumps(data)


@pytest.mark.parametrize("change, words", [
    (lambda d: d["case"]["geometry"].__setitem__("num_blocks", 10**12), "num_blocks=1000000000000 is beyond"),
    (lambda d: d["case"]["geometry"].__setitem__("block_size", 10**9), "block_size=1000000000 is beyond"),
    (lambda d: d["case"].__setitem__("causal", "false"), "causal='false' must be true or false"),
    (lambda d: d["case"]["sequences"][0].__setitem__("seq_len", "3"), "seq_len='3' must be an integer"),
    (lambda d: d["case"].__setitem__("sequences", {"0": 1}), "must be a list"),
    (lambda d: d.__setitem__("kernel", ["paged_decode@masked"]), "lacks \"kernel\""),
    (lambda d: d.__setitem__("kernel", "os:getcwd"), "not a nanfuzz Kernel"),
    (lambda d: d.__setitem__("kernel", "sys:exit"), "not a nanfuzz Kernel"),
    (lambda d: d["case"]["geometry"].update(num_q_heads=128, num_kv_heads=128, num_blocks=1 << 21),
     "GiB the device has; declined"),
], ids=["huge-num-blocks", "huge-block-size", "causal-as-string", "length-as-string", "sequences-not-a-list",
        "kernel-not-a-string", "os-getcwd", "sys-exit", "beyond-free-memory"])
def test_a_bad_repro_is_one_line_and_exit_2(tmp_path, good_record, change, words):
    proc = _replay(tmp_path, _mutated(good_record, change))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and lines[0].startswith("nanfuzz: "), proc.stderr


def test_non_utf8_bytes_are_one_line_and_exit_2(tmp_path):
    proc = _replay(tmp_path, b'{"schema": "\xff\xfe"}')
    assert proc.returncode == 2 and "not UTF-8" in proc.stderr and "Traceback" not in proc.stderr


def test_the_unchanged_repro_replays(tmp_path, good_record):
    proc = _replay(tmp_path, json.dumps(good_record))
    assert proc.returncode == 0, proc.stdout + proc.stderr
