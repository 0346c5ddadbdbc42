"""After the workers: recover dead shards, gather repros once, write the summary and JUnit.

Every shard of the plan ends as exactly one row: its record says PASS or a
failure with its repro; a record still ``running`` is a worker that died
(its in-flight case comes back from the slot's pending file as a CRASH
repro); no record at all is a shard that never ran.  Repros are gathered into
one folder by name (kernel, verdict, case hash), so two shards that shrink to
the same case are one failure found twice, counted once.
"""
from __future__ import annotations

import shutil
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from nanfuzz.harness.gate.plan import Plan, ShardRecord

PICTURE_LINES = 120   # longer pictures are cut in the Markdown summary (the .txt keeps all)


@dataclass
class Row:
    kernel: str
    shard: int
    slot: str
    worker: str
    examples: int | None
    elapsed: float | None
    verdict: str             # PASS, CRASH, NONFINITE, ..., ERROR, NOT RUN
    summary: str
    failure: int | None = None   # number of the distinct failure this row found
    statistics: dict | None = None  # what the shard's campaign exercised (Statistics.to_dict())
    runner: str = ""             # the runner, in a fleet's merged report

    @property
    def failed(self) -> bool:
        return self.verdict != "PASS"


@dataclass
class Failure:
    number: int
    kernel: str
    verdict: str
    summary: str
    repro: list[Path]            # gathered .json, .py, .txt; empty when the worker left no case
    shards: list[str] = field(default_factory=list)
    picture: str = ""
    replay_options: str = ""     # e.g. --kernel where the repro's kernel name does not resolve, --vllm-src

    def replay(self, prefix: str) -> str:
        return f"{prefix} {shown(self.repro[0])}{self.replay_options}"


def shown(path: Path) -> Path:
    """A path as a reader of the summary uses it: relative to where the gate ran (the artifact's layout)."""
    try:
        return path.relative_to(Path.cwd())
    except ValueError:
        return path


@dataclass
class GateResult:
    rows: list[Row]
    failures: list[Failure]
    problems: list[str]          # things that make the run itself incomplete
    notes: list[str] = field(default_factory=list)  # the campaigns' notes, each once
    paths_missed: dict[str, list[str]] = field(default_factory=dict)  # kernel -> Triton kernels earlier runs
                                                                     # launched and this one did not

    @property
    def passed(self) -> bool:
        return not self.failures and not self.problems and all(not r.failed for r in self.rows)

    @property
    def exit_code(self) -> int:
        """0: every shard passed; 1: a finding; 3: no finding, and not a pass either (a shard that did
        not finish, a problem of the run, a kernel under its floor of examples): not green."""
        return 0 if self.passed else 1 if self.failures else 3


# -- recovering shards whose worker died ---------------------------------------------

def recover_dead_shard(plan: Plan, record: ShardRecord, *, stopped_at_deadline: bool, stop_time: float,
                       pytest_message: str) -> ShardRecord:
    """A ``running`` record whose worker died: its in-flight case, from the slot's journal, is replayed
    in a fresh supervised worker; it is a CRASH (or HANG) only if it fails that way again."""
    from nanfuzz.harness.launch.subjects import make_subject
    from nanfuzz.harness.launch.worker import Declined
    from nanfuzz.harness.campaign.journal import leftovers
    from nanfuzz.harness.registry import resolve
    from nanfuzz.harness.report.repro import write_repro
    from nanfuzz.harness.campaign.settings import Settings

    why = "the gate stopped the worker at its deadline" if stopped_at_deadline else "the worker process died"
    record.status, record.worker_died = "done", True
    cases = leftovers(plan.slot_state_dir(record.slot), record.kernel_name)
    if not cases:
        record.verdict = "PASS" if stopped_at_deadline else "CRASH"
        record.summary = (f"{why} between cases (no case in flight); {record.examples} examples ran" if stopped_at_deadline
                          else f"CRASH: {why} outside a kernel launch (no in-flight case to recover)")
        return record
    case = cases[0].case
    settings = Settings.from_environment(device=plan.device, state_dir=plan.slot_state_dir(record.slot))
    kernel = resolve(record.kernel, **settings.sources)
    subject = make_subject(kernel, settings)
    try:
        outcome = subject.check(case, digest=True, patience=settings.shrink_budget)
    finally:
        subject.close()
    if isinstance(outcome, Declined):  # told as a death without its case: the case's memory never came free
        record.verdict = "PASS" if stopped_at_deadline else "CRASH"
        record.summary = (f"{why} while a case was in flight, which could not be replayed ({outcome.reason}); "
                          f"{record.examples} examples ran" if stopped_at_deadline else
                          f"CRASH: {why} while a case was in flight, which could not be replayed ({outcome.reason})")
        return record
    outcome.evidence = {**outcome.evidence, "shard": why, **({"pytest": pytest_message} if pytest_message else {})}
    if outcome.verdict.value not in ("CRASH", "HANG"):
        record.verdict = "PASS"
        record.summary = (f"{why} while a case was in flight; replayed in a fresh worker it gives "
                          f"{outcome.verdict.value}, so it is no finding")
        return record
    record.verdict, record.summary = outcome.verdict.value, f"{outcome.summary} ({why}; it repeats on replay)"
    paths = write_repro(kernel, case, outcome, plan.shard_repro_dir(record.slot), plan.device)
    record.repro = [str(p) for p in paths]
    record.recovered_crash = True
    return record


def pytest_crash_messages(junit_path: Path) -> dict[str, str]:
    """xdist's reports of crashed workers, by worker id (``worker 'gw0' crashed while running ...``)."""
    messages: dict[str, str] = {}
    if not junit_path.exists():
        return messages
    try:
        root = ET.parse(junit_path).getroot()
    except ET.ParseError:
        return messages
    for element in root.iter():
        if element.tag not in ("failure", "error"):
            continue
        text = f"{element.get('message', '')}\n{element.text or ''}"
        for line in text.splitlines():
            if "crashed while running" in line and "worker '" in line:
                worker = line.split("worker '", 1)[1].split("'", 1)[0]
                messages.setdefault(worker, line.strip())
    return messages


# -- consolidating ------------------------------------------------------------------

def consolidate(plan: Plan, repro_dir: Path, *, stopped_at_deadline: bool, stop_time: float,
                pytest_junit: Path, sources: dict[str, str | None] | None = None) -> GateResult:
    """``sources``: the kernel libraries' trees (``resolve()``'s keywords), for replay commands."""
    from nanfuzz.harness.registry import library_of, source_flag, source_key

    crashes = pytest_crash_messages(pytest_junit)
    rows: list[Row] = []
    failures: dict[str, Failure] = {}
    problems: list[str] = []
    notes: dict[str, None] = {}
    repro_dir.mkdir(parents=True, exist_ok=True)
    for kernel in plan.kernels:
        for shard, slot in enumerate(plan.slots):
            path = plan.record_file(kernel, slot)
            if not path.exists():
                why = "the gate's deadline came first" if stopped_at_deadline else "its worker never reached it"
                rows.append(Row(kernel, shard, slot, "-", None, None, "NOT RUN", why))
                continue
            record = ShardRecord.read(path)
            if record.status == "running":
                record = recover_dead_shard(plan, record, stopped_at_deadline=stopped_at_deadline,
                                            stop_time=stop_time, pytest_message=crashes.get(record.worker, ""))
                record.write(path)
            # a dead worker's counts stopped at its last record: unknown, not zero
            row = Row(kernel, shard, slot, record.worker, None if record.worker_died else record.examples,
                      None if record.worker_died else record.elapsed, record.verdict, record.summary,
                      statistics=record.statistics or None)
            rows.append(row)
            notes.update(dict.fromkeys(record.notes))
            if record.verdict == "PASS":
                continue
            # same kernel, verdict and case (the repro's name) = the same failure; without a case, the same message
            key = Path(record.repro[0]).stem if record.repro else f"{kernel}\0{record.verdict}\0{record.summary}"
            if key not in failures:
                options = f" --kernel {kernel}" if record.kernel_name not in ("", kernel) else ""
                library = library_of(kernel)
                if library and (sources or {}).get(source_key(library)):
                    options += f" {source_flag(library)} {sources[source_key(library)]}"
                failures[key] = Failure(len(failures) + 1, kernel, record.verdict, record.summary,
                                        _gather(record.repro, repro_dir), replay_options=options)
                if failures[key].repro:
                    failures[key].picture = failures[key].repro[2].read_text()
            failures[key].shards.append(f"{shard} ({record.worker})")
            row.failure = failures[key].number
    if any(r.verdict == "NOT RUN" for r in rows):
        problems.append("some shards did not run: raise --time-budget, or see the pytest log")
    return GateResult(rows, list(failures.values()), problems, list(notes))


def _gather(paths: list[str], repro_dir: Path) -> list[Path]:
    gathered = []
    for source in map(Path, paths):
        target = repro_dir / source.name
        shutil.copyfile(source, target)
        gathered.append(target)
    return gathered


# -- writing --------------------------------------------------------------------------

def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} s"


def markdown(result: GateResult, plan: Plan, *, workers: str, budget: float, wall: float,
             replay_prefix: str) -> str:
    fleet = f"runner `{plan.runner}`, shard {plan.shard}/{plan.shards} · " if plan.shards > 1 else ""
    lines = [headline(result, "gate", len(plan.kernels)), "",
             f"{fleet}profile `{plan.profile}` · {workers} · time budget {budget:.0f} s · wall {wall:.0f} s",
             ""]
    lines += ["| kernel | shard | worker | examples | time | verdict |", "|---|---|---|---:|---:|---|"]
    lines += [table_row(row) for row in result.rows]
    lines += reach_lines(result)
    lines += closing_lines(result, lambda failure: f"Found by shard {', '.join(failure.shards)}.", replay_prefix)
    return "\n".join(lines) + "\n"


def reach_lines(result: GateResult) -> list[str]:
    """Per kernel, what its shards together reached: the Triton kernels launched (with each switch
    that took both values), the production sizes drawn, the production targets not reached and why
    (``Statistics.unreached``), and the kernels earlier runs launched and this one did not
    (``GateResult.paths_missed``)."""
    from nanfuzz.harness.report.statistics import Statistics

    lines = []
    for kernel, stats in kernel_statistics(result).items():
        groups = stats["groups"]
        launched = [f"`{name[len('path:'):]}` {entry['share']:.0%}" for name, entry in
                    groups.get("kernel paths", {}).items()]
        switches = [f"{name} {entry['share']:.0%}" for name, entry in groups.get("kernel switches", {}).items()]
        sizes = [f"{name} {entry['share']:.0%}" for name, entry in groups.get("sizes", {}).items() if entry["count"]]
        missed = result.paths_missed.get(kernel, [])
        parts = [f"kernels launched: {', '.join(launched) or 'none recorded'}"]
        if switches:
            parts.append(f"switches: {', '.join(switches)}")
        parts.append(f"sizes reached: {', '.join(sizes) or 'small only'}")
        unreached = Statistics.from_dict(stats).unreached_line()
        if unreached:
            parts.append(f"**{unreached}**")
        if missed:
            parts.append(f"**never launched this run, launched by earlier runs**: {', '.join(f'`{m}`' for m in missed)}")
        lines.append(f"- `{kernel}`: " + "; ".join(parts))
    return ["", "What each kernel's examples reached:", "", *lines] if lines else []


def headline(result: GateResult, title: str, kernels: int, *, runners: int | None = None) -> str:
    """A summary's first line: PASS, INCOMPLETE or FAIL with its counts (a fleet's counts its runners too)."""
    fleet = "" if runners is None else f"{runners} runner(s)"
    if result.passed:
        examples = sum(r.examples or 0 for r in result.rows)
        counts = ", ".join(filter(None, (fleet, f"{kernels} kernel(s)", f"{examples} examples")))
        return f"## nanfuzz {title}: PASS ({counts})"
    if not result.failures:
        if any(r.verdict == "INCOMPLETE" for r in result.rows):
            return f"## nanfuzz {title}: INCOMPLETE (no failure found, but too few examples to call it a pass)"
        ran = "every shard" if runners is None else "every runner or shard"
        return f"## nanfuzz {title}: INCOMPLETE (no failure found, but not {ran} ran)"
    failed_kernels = len({f.kernel for f in result.failures})
    counts = ", ".join(filter(None, (f"{len(result.failures)} failure(s) in {failed_kernels} of {kernels} kernel(s)",
                                     fleet)))
    return f"## nanfuzz {title}: FAIL ({counts})"


def table_row(row: Row) -> str:
    """A shard's row of the summary's table: kernel, shard (slot), worker, examples, time, verdict."""
    verdict = row.verdict if row.failure is None else f"**{row.verdict}** (failure {row.failure})"
    if row.verdict in ("NOT RUN", "ERROR", "INCOMPLETE"):
        verdict = f"**{row.verdict}**: {row.summary}".replace("|", "\\|")  # a table cell
    examples = "-" if row.examples is None else str(row.examples)
    return (f"| `{row.kernel}` | {row.shard} ({row.slot}) | {row.worker} | {examples} | "
            f"{_seconds(row.elapsed)} | {verdict} |")


def closing_lines(result: GateResult, found_by: Callable[[Failure], str], replay_prefix: str) -> list[str]:
    """What follows the table: what each kernel's loads addressed, the problems, the notes, and each
    failure's section."""
    lines = coverage_lines(result)
    for problem in result.problems:
        lines += ["", f"> {problem}"]
    for note in result.notes:
        lines += ["", f"> note: {note}"]
    for failure in result.failures:
        lines += failure_lines(failure, found_by(failure), replay_prefix)
    return lines


def failure_lines(failure: Failure, found_by: str, replay_prefix: str) -> list[str]:
    """A failure's section of the Markdown summary: verdict, who found it, repro, replay, picture."""
    lines = ["", f"### Failure {failure.number}: `{failure.kernel}`: {failure.verdict}", "",
             failure.summary, "", found_by]
    if failure.repro:
        json_path = shown(failure.repro[0])
        lines += ["", f"Repro: `{json_path}` (with `{json_path.with_suffix('.py').name}` and "
                      f"`{json_path.with_suffix('.txt').name}`). Replay:", "",
                  "```", failure.replay(replay_prefix), "```"]
    if failure.picture:
        picture = failure.picture.rstrip("\n").splitlines()
        if len(picture) > PICTURE_LINES:
            picture = picture[:PICTURE_LINES] + [f"... ({len(picture) - PICTURE_LINES} more lines in the .txt)"]
        lines += ["", "```text", *picture, "```"]
    return lines


def remember_paths(result: GateResult, state_dir: Path) -> None:
    """Each kernel's Triton kernels, this run's and earlier runs' (``STATE/paths``): what earlier
    runs launched and this one did not goes into ``result.paths_missed``."""
    from nanfuzz.harness.campaign import paths_seen
    from nanfuzz.harness.report.statistics import Statistics

    for kernel, stats in kernel_statistics(result).items():
        missed = paths_seen.remember(state_dir, kernel, Statistics.from_dict(stats).paths())
        if missed:
            result.paths_missed[kernel] = missed


def kernel_statistics(result: GateResult) -> dict:
    """What each kernel's shards exercised together: shares of examples by situation."""
    from nanfuzz.harness.report.statistics import Statistics

    merged: dict[str, Statistics] = {}
    for row in result.rows:
        if row.statistics:
            merged.setdefault(row.kernel, Statistics()).merge(Statistics.from_dict(row.statistics))
    return {kernel: stats.to_dict() for kernel, stats in merged.items()}


def coverage_lines(result: GateResult) -> list[str]:
    """Per kernel, the dead-slot classes its traced loads addressed: what its PASS covers."""
    from nanfuzz.harness.report import coverage
    from nanfuzz.harness.report.statistics import Statistics

    lines = [f"- `{kernel}`: {coverage.claim(Statistics.from_dict(stats))}"
             for kernel, stats in kernel_statistics(result).items()]
    return ["", *lines] if lines else []


def _shares(statistics: dict | None) -> list[tuple[str, str]]:
    """JUnit properties: ``share:<situation>`` = share of the shard's examples."""
    if not statistics:
        return []
    return [(f"share:{name}", f"{entry['share']:.4f}")
            for group in statistics["groups"].values() for name, entry in group.items()]


def summary_json(result: GateResult, plan: Plan, *, exit_code: int, wall: float) -> dict:
    return {
        "passed": result.passed, "exit_code": exit_code, "device": plan.device, "profile": plan.profile,
        "wall_s": round(wall, 2), "slots": plan.slots,
        "runner": {"name": plan.runner, "shard": plan.shard, "shards": plan.shards},
        "kernels": plan.kernels,
        "shards": [{"kernel": r.kernel, "shard": r.shard, "slot": r.slot, "worker": r.worker, "examples": r.examples,
                    "elapsed_s": None if r.elapsed is None else round(r.elapsed, 3), "verdict": r.verdict,
                    "summary": r.summary, "failure": r.failure, "statistics": r.statistics} for r in result.rows],
        "statistics": kernel_statistics(result),
        "failures": [{"number": f.number, "kernel": f.kernel, "verdict": f.verdict, "summary": f.summary,
                      "repro": [str(p) for p in f.repro], "shards": f.shards, "replay_options": f.replay_options}
                     for f in result.failures],
        "problems": result.problems,
        "notes": result.notes,
        "paths_missed": result.paths_missed,
    }


def junit_xml(result: GateResult, properties: dict, *, replay_prefix: str, name: str = "nanfuzz-gate") -> bytes:
    """One testcase a shard (a runner's shard in a fleet); a failing one carries its failure's picture
    and replay command."""
    by_number = {f.number: f for f in result.failures}
    failures = sum(1 for r in result.rows if r.failed and r.verdict not in ("NOT RUN", "ERROR"))
    errors = sum(1 for r in result.rows if r.verdict in ("NOT RUN", "ERROR"))
    total_time = sum(r.elapsed or 0.0 for r in result.rows)
    suites = ET.Element("testsuites", name=name, tests=str(len(result.rows)), failures=str(failures),
                        errors=str(errors), time=f"{total_time:.3f}")
    suite = ET.SubElement(suites, "testsuite", name=name, tests=str(len(result.rows)),
                          failures=str(failures), errors=str(errors), skipped="0", time=f"{total_time:.3f}",
                          timestamp=time.strftime("%Y-%m-%dT%H:%M:%S"))
    props = ET.SubElement(suite, "properties")
    for key, value in properties.items():
        ET.SubElement(props, "property", name=key, value=str(value))
    for row in result.rows:
        case = ET.SubElement(suite, "testcase", classname=f"nanfuzz.{row.kernel}",
                             name=f"{row.runner}/shard{row.shard}" if row.runner else f"shard{row.shard}",
                             time=f"{row.elapsed or 0.0:.3f}")
        case_props = ET.SubElement(case, "properties")
        for key, value in (("slot", row.slot), ("worker", row.worker), ("examples", row.examples),
                           *_shares(row.statistics)):
            ET.SubElement(case_props, "property", name=key, value="-" if value is None else str(value))
        if not row.failed:
            continue
        if row.verdict in ("NOT RUN", "ERROR"):
            ET.SubElement(case, "error", message=row.summary, type=row.verdict).text = row.summary
            continue
        if row.failure is None:  # INCOMPLETE: a pass on too few examples
            ET.SubElement(case, "failure", message=row.summary, type=row.verdict).text = row.summary
            continue
        failure = by_number[row.failure]
        text = [failure.summary]
        if failure.repro:
            text += [f"repro: {shown(failure.repro[0])}", f"replay: {failure.replay(replay_prefix)}"]
        if failure.picture:
            text += ["", failure.picture]
        ET.SubElement(case, "failure", message=row.summary, type=row.verdict).text = "\n".join(text)
    ET.indent(suites)
    return ET.tostring(suites, encoding="utf-8", xml_declaration=True)
