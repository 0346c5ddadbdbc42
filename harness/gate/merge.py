#!/usr/bin/env python3
"""Merge the outputs of a fleet's gate runners into one report: each failure once, with its finders.

    nanfuzz gate merge [--out DIR] RUNNER_OUTPUT ...

Each RUNNER_OUTPUT is the output folder of one ``nanfuzz gate --shard I/N``
run (its ``summary.json``, ``repros/``), or a folder holding several (one
downloaded artifact per runner).  Writes DIR/summary.md (also appended to
``$GITHUB_STEP_SUMMARY``), DIR/summary.json, DIR/junit.xml and DIR/repros/.
A failure that several runners found is one failure when they shrank it to
the same case (the same repro name: kernel, verdict, case hash), listed with
every runner and shard that found it.  A runner whose output is missing
makes the report INCOMPLETE.  Exit 0: every runner passed; 1: a failure, or
a runner missing or incomplete; 2: a usage error.  Needs no GPU, torch or Triton.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from nanfuzz.harness.gate.outputs import append_step_summary, write_junit, write_summary, write_summary_json
from nanfuzz.reference.errors import NanfuzzError
from nanfuzz.harness.gate.report import (Failure, GateResult, Row, closing_lines, headline, junit_xml, shown,
                                         table_row)

DEFAULT_OUT = "nanfuzz-fleet"


class MergeUsageError(NanfuzzError):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, like the gate
        raise MergeUsageError(f"{message} (see --help)")


@dataclass
class Runner:
    label: str                   # as the merged report names it
    name: str
    shard: int
    shards: int
    folder: Path
    summary: dict


@dataclass
class FleetFailure:
    failure: Failure
    found_by: dict[str, list[str]] = field(default_factory=dict)  # runner label -> its shards that found it


def find_summaries(paths: list[str]) -> list[Path]:
    found: list[Path] = []
    for given in map(Path, paths):
        if (given / "summary.json").is_file():
            found.append(given / "summary.json")
        elif given.is_dir():
            found += sorted(given.glob("*/summary.json"))
        else:
            raise MergeUsageError(f"{str(given)!r} is not a folder")
    if not found:
        raise MergeUsageError(f"no summary.json in {', '.join(paths)}: give the gate runners' output folders")
    return found


def load_runners(summaries: list[Path]) -> list[Runner]:
    runners = []
    for path in summaries:
        try:
            data = json.loads(path.read_text())
            identity = data.get("runner") or {}
            runners.append(Runner("", identity.get("name") or path.parent.name, int(identity.get("shard", 1)),
                                  int(identity.get("shards", 1)), path.parent, data))
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            raise MergeUsageError(f"{path}: not a gate summary ({exc})") from None
    names = [r.name for r in runners]
    for runner in runners:  # two runners on one host share a name: tell them apart by shard
        runner.label = runner.name if names.count(runner.name) == 1 else f"{runner.name}[{runner.shard}/{runner.shards}]"
    return sorted(runners, key=lambda r: (r.shard, r.label))


def merge(runners: list[Runner], repro_dir: Path) -> tuple[GateResult, dict[int, dict[str, list[str]]]]:
    """The runners' rows and failures as one result, and for each failure (by number) who found it."""
    rows: list[Row] = []
    failures: dict[str, FleetFailure] = {}
    problems: list[str] = []
    notes: dict[str, None] = {}
    repro_dir.mkdir(parents=True, exist_ok=True)
    counts = {r.shards for r in runners}
    if len(counts) > 1:
        problems.append(f"the runners disagree on the fleet's size ({', '.join(map(str, sorted(counts)))} runners)")
    expected = max(counts)
    seen = [r.shard for r in runners]
    for shard in range(1, expected + 1):
        if shard not in seen:
            problems.append(f"no output from runner shard {shard}/{expected}: it did not run, or did not finish")
        elif seen.count(shard) > 1:
            problems.append(f"shard {shard}/{expected} appears {seen.count(shard)} times")
    for runner in runners:
        summary = runner.summary
        problems += [f"runner {runner.label}: {p}" for p in summary.get("problems", [])]
        notes.update(dict.fromkeys(f"runner {runner.label}: {n}" for n in summary.get("notes", [])))
        by_number = {f["number"]: f for f in summary.get("failures", [])}
        for entry in summary.get("shards", []):
            row = Row(entry["kernel"], entry["shard"], entry["slot"], entry["worker"], entry["examples"],
                      entry["elapsed_s"], entry["verdict"], entry["summary"], statistics=entry.get("statistics"),
                      runner=runner.label)
            rows.append(row)
            if entry.get("failure") is None:
                continue
            found = by_number[entry["failure"]]
            names = [Path(p).name for p in found["repro"]]
            key = Path(names[0]).stem if names else f"{found['kernel']}\0{found['verdict']}\0{found['summary']}"
            if key not in failures:
                failure = Failure(len(failures) + 1, found["kernel"], found["verdict"], found["summary"],
                                  _gather(runner.folder, names, repro_dir),
                                  replay_options=found.get("replay_options", ""))
                if failure.repro and failure.repro[2].exists():
                    failure.picture = failure.repro[2].read_text()
                failures[key] = FleetFailure(failure)
            fleet_failure = failures[key]
            fleet_failure.found_by.setdefault(runner.label, []).append(f"{row.shard} ({row.worker})")
            row.failure = fleet_failure.failure.number
    result = GateResult(rows, [f.failure for f in failures.values()], problems, list(notes))
    return result, {f.failure.number: f.found_by for f in failures.values()}


def _gather(folder: Path, names: list[str], repro_dir: Path) -> list[Path]:
    gathered = []
    for name in names:
        source = folder / "repros" / name
        target = repro_dir / name
        if source.exists():
            shutil.copyfile(source, target)
        gathered.append(target)
    return gathered if all(p.exists() for p in gathered) else []


def _found_by(runners: dict[str, list[str]]) -> str:
    parts = [f"runner `{label}` (shard {', '.join(shards)})" for label, shards in runners.items()]
    return f"Found by {len(parts)} runner(s): " + "; ".join(parts) + "."


def markdown(result: GateResult, found_by: dict, runners: list[Runner], *, replay_prefix: str) -> str:
    kernels = len({r.kernel for r in result.rows})
    lines = [headline(result, "fleet", kernels, runners=len(runners)), "",
             "| runner | shard of fleet | device | profile | wall | verdict |", "|---|---|---|---|---:|---|"]
    for runner in runners:
        s = runner.summary
        verdict = "PASS" if s.get("passed") else "FAIL"
        lines.append(f"| `{runner.label}` | {runner.shard}/{runner.shards} | {s.get('device', '-')} | "
                     f"`{s.get('profile', '-')}` | {s.get('wall_s', 0):.0f} s | {verdict} |")
    lines += ["", "| runner | kernel | shard | worker | examples | time | verdict |", "|---|---|---|---|---:|---:|---|"]
    lines += [f"| `{row.runner}` {table_row(row)}" for row in result.rows]
    lines += closing_lines(result, lambda failure: _found_by(found_by[failure.number]), replay_prefix)
    return "\n".join(lines) + "\n"


def summary_json(result: GateResult, found_by: dict, runners: list[Runner], *, exit_code: int) -> dict:
    return {
        "passed": result.passed, "exit_code": exit_code,
        "runners": [{"label": r.label, "name": r.name, "shard": r.shard, "shards": r.shards,
                     "passed": r.summary.get("passed"), "folder": str(r.folder)} for r in runners],
        "shards": [{"runner": r.runner, "kernel": r.kernel, "shard": r.shard, "slot": r.slot, "worker": r.worker,
                    "examples": r.examples, "elapsed_s": r.elapsed, "verdict": r.verdict, "summary": r.summary,
                    "failure": r.failure} for r in result.rows],
        "failures": [{"number": f.number, "kernel": f.kernel, "verdict": f.verdict, "summary": f.summary,
                      "repro": [str(p) for p in f.repro], "runners": list(found_by[f.number]),
                      "found_by": found_by[f.number], "replay_options": f.replay_options}
                     for f in result.failures],
        "problems": result.problems,
        "notes": result.notes,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = _Parser(prog="nanfuzz gate merge", description=__doc__.split("\n\n")[0])
    parser.add_argument("runners", nargs="+", metavar="RUNNER_OUTPUT",
                        help="a gate runner's output folder (with summary.json), or a folder of them")
    parser.add_argument("--out", default=DEFAULT_OUT, metavar="DIR", help=f"merged output (default {DEFAULT_OUT}/)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        runners = load_runners(find_summaries(args.runners))
        out = Path(args.out).resolve()
        shutil.rmtree(out / "repros", ignore_errors=True)
        result, found_by = merge(runners, out / "repros")
    except MergeUsageError as exc:
        print(f"nanfuzz merge: {exc}", file=sys.stderr)
        return 2
    exit_code = result.exit_code
    text = markdown(result, found_by, runners, replay_prefix="nanfuzz replay")
    write_summary(out / "summary.md", text)
    write_summary_json(out / "summary.json", summary_json(result, found_by, runners, exit_code=exit_code))
    fleet = {"runners": len(runners), "profiles": " ".join(sorted({str(r.summary.get("profile")) for r in runners}))}
    write_junit(out / "junit.xml", junit_xml(result, fleet, replay_prefix="nanfuzz replay", name="nanfuzz-fleet"))
    append_step_summary(text)
    print(text, flush=True)
    print(f"nanfuzz merge: {'PASS' if result.passed else 'FAIL'}; {len(result.failures)} distinct failure(s) from "
          f"{len(runners)} runner(s); summary {shown(out / 'summary.md')}", flush=True)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
