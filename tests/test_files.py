"""Repros, summaries and JUnit files are whole or absent (a full disk leaves nothing half written
and the finding printed in full); a repro over the size or nesting limit is one line and exit 2."""
from __future__ import annotations

import errno
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nanfuzz.harness.campaign.result import Campaign
from nanfuzz.harness.campaign.settings import Settings
from nanfuzz.harness.cli import main
from nanfuzz.harness.judge.check import Outcome, Verdict
from nanfuzz.harness.report import atomic, repro
from nanfuzz.harness.report.atomic import write_atomically
from nanfuzz.harness.report.failures import report_failure
from nanfuzz.harness.report.repro import write_repro
from tests.test_check import WINDOWED
from tests.torch_kernels import torch_kernel

ROOT = Path(__file__).resolve().parents[1]


def _disk_fills_after(monkeypatch, room: int) -> None:
    """A stand-in for ``write`` on a disk with ``room`` bytes left."""
    left = [room]

    def write(fd, data):
        if len(data) > left[0]:
            if left[0]:
                os.write(fd, data[:left[0]])
                left[0] = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        left[0] -= len(data)
        return os.write(fd, data)

    monkeypatch.setattr(atomic, "_write", write)


def test_a_file_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    target = tmp_path / "summary.json"
    write_atomically(target, "old")
    _disk_fills_after(monkeypatch, 3)
    with pytest.raises(OSError) as raised:
        write_atomically(target, "x" * 100)
    assert raised.value.errno == errno.ENOSPC
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["summary.json"]  # no temporary file left
    _disk_fills_after(monkeypatch, 1000)
    write_atomically(target, b"new bytes")
    assert target.read_bytes() == b"new bytes"


def _failure() -> Campaign:
    outcome = Outcome(Verdict.NONFINITE, "NONFINITE: planted for the test", {"bad_rows": 1})
    return Campaign(kernel="torch@mask-multiply", device="cpu", failure=outcome, failing_case=WINDOWED)


@pytest.mark.parametrize("fits", [0, 1, 2], ids=["full", "room-for-the-json", "room-for-two-files"])
def test_on_a_full_disk_no_repro_file_is_left_and_the_finding_is_printed_whole(fits, tmp_path, monkeypatch, capsys):
    kernel, campaign = torch_kernel("mask-multiply"), _failure()
    sizes = [p.stat().st_size for p in write_repro(kernel, campaign.failing_case, campaign.failure, tmp_path, "cpu")]
    _disk_fills_after(monkeypatch, sum(sizes[:fits]) + 10)  # the next file starts, and does not fit
    shown = io.StringIO()
    paths = report_failure(kernel, campaign, Settings(device="cpu", repro_dir=tmp_path / "repros"), stream=shown)
    assert paths == [] and os.listdir(tmp_path / "repros") == []
    printed = shown.getvalue()
    record = json.loads(printed.split("repro JSON (save it and run `nanfuzz replay FILE.json`):\n", 1)[1])
    assert record["schema"] == "nanfuzz-repro" and record["verdict"] == "NONFINITE"
    assert "cannot write the repro" in capsys.readouterr().err


def _unshare_works() -> bool:
    if not sys.platform.startswith("linux") or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not _unshare_works(), reason="no mount namespace to mount a small tmpfs in (the stand-in "
                                                  "for write above covers the same ground)")
def test_a_campaign_on_a_nearly_full_tmpfs_leaves_no_repro_file_and_prints_the_finding(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    listing = tmp_path / "left.txt"
    # two pages: room for the JSON and the picture, not for the script
    script = (f"mount -t tmpfs -o size=8k tmpfs {disk} && {sys.executable} -m nanfuzz fuzz --kernel "
              f"tests.subjects:writes_past_out --max-examples 60 --seed 0 --device cpu --state-dir "
              f"{tmp_path / 'state'} --repro-dir {disk / 'repros'}; status=$?; ls -A {disk / 'repros'} > {listing}; "
              f"exit $status")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("CI", None)
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "cannot write the repro" in proc.stderr and "Traceback" not in proc.stderr
    assert '"schema": "nanfuzz-repro"' in proc.stdout and "CLOBBER" in proc.stdout
    assert listing.read_text().split() == []


def _good_repro(folder: Path) -> Path:
    paths = write_repro("paged_decode@masked", WINDOWED.replace(sliding_window=0).validate(),
                        Outcome(Verdict.PASS, "PASS"), folder, "cpu")
    return paths[0]


def test_a_repro_over_the_size_limit_is_refused_unread(tmp_path, capsys):
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(repro.MAX_REPRO_BYTES + 1)  # sparse: nothing written to disk
    assert main(["replay", str(big), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"nanfuzz: {big}: over 64 MiB, more than any repro nanfuzz writes; a repro is the .json nanfuzz wrote"


def test_a_repro_nested_deeper_than_the_limit_is_refused_before_it_is_parsed(tmp_path, capsys):
    deep = tmp_path / "deep.json"
    deep.write_text('{"schema": "nanfuzz-repro", "x": ' + "[" * 200_000 + "]" * 200_000 + "}")
    assert main(["replay", str(deep), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert "nested more than 32 levels deep" in err and "\n" not in err
    good = json.loads(_good_repro(tmp_path).read_text())
    good["evidence"] = {"a": [[[["brackets ]]]] in strings do not count"]]]]}  # within the limit: read
    shallow = tmp_path / "shallow.json"
    shallow.write_text(json.dumps(good))
    assert repro.load_repro(shallow)["evidence"] == good["evidence"]
