"""Two installs of nanfuzz side by side in one call: throughput, first example, self-check, detection.

    python ci/speed_ab.py --a HEAD --b 0af6f59 [--rounds 2] [--jobs 14] [--seconds 35]
        [--kernel paged_decode@masked] [--size small] [--self-check] [--detect vllm:rocm_attn]
        [--detect-seeds 10] [--device cuda] [--json FILE] [-- EXTRA BENCH OPTIONS]

Each of ``--a`` and ``--b`` is a git revision of this repository or ``tree:DIR``, a folder
holding one (``git archive REV | tar -x -C DIR``, where the machine has no git history),
installed (not editable, as a user installs it) into a virtual environment of its own over
this interpreter's packages (torch, Triton and Hypothesis stay the same); or
``python:PATH``, an interpreter that has nanfuzz installed already.  The measurements alternate A, B, B, A, ... so that drift
of the machine hits both alike, and the table gives each figure of A and of B (medians over
the rounds) and their ratio A/B:

- ``nanfuzz bench --jobs N --seconds S --warmup 0 --seeds 0``: examples per second, seconds
  to the first example (from the start, workers and farm included), milliseconds per example
  by phase (and outside the checks' phases: an install from before memory wait, admission,
  handoff, tally, startup and close were measured counts them as generation), CPU milliseconds per example
  of the campaigns and of judging, and the milliseconds a campaign's search waited for a core
  (run queue; Linux).  ``--size`` goes
  to an install whose bench takes it (one from before size tiers draws small cases only);
- ``--self-check``: ``nanfuzz fuzz`` (every built-in kernel) from an empty Triton cache and
  state folder, seconds from the command's start to its end, and its compile farm's tasks;
- ``--detect K``: ``nanfuzz bench --kernel K --detect --examples 0 --seeds N``, the median
  and largest seconds to the first failure over the seeds.

With ``--cold`` every bench run starts from an empty Triton cache too (the cold start);
otherwise each install compiles into a cache of its own that later rounds reuse.
Options after ``--`` go to every bench run (``--vllm-src DIR``, say).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("generation", "materialize", "kernel", "oracle", "reference", "verdict",
          "memory wait", "admission", "handoff", "tally", "startup", "close")  # the last six: installs that measure them
# what an install that does not measure them counts as generation: the one figure both sides give
AROUND_CHECKS = ("generation", "memory wait", "admission", "handoff", "tally", "startup", "close")
# what a check's memory wait stood behind (``harness.judge.memory.WAIT_CAUSES``; an install from before
# the ledger's two were told apart counts both as "held or wanted by other nanfuzz processes")
WAIT_CAUSES = ("held by other nanfuzz processes", "wanted first by other nanfuzz processes",
               "held or wanted by other nanfuzz processes", "not free on the device")


@dataclass
class Install:
    """One side: its label, its interpreter, the folder its commands run in and what its bench takes."""

    label: str
    python: str
    cwd: Path
    takes_size: bool = False
    triton_cache: str = ""
    results: dict = field(default_factory=lambda: {"bench": [], "self_check": [], "detect": []})

    def run(self, args: list[str], env: dict | None = None) -> tuple[int, str, float]:
        started = time.perf_counter()
        done = subprocess.run([self.python, "-m", "nanfuzz", *args], cwd=self.cwd, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        return done.returncode, done.stdout, time.perf_counter() - started


def _site_folders() -> list[str]:
    """This interpreter's package folders (its virtual environment's and those it layers on)."""
    return [p for p in sys.path if p.rstrip("/").endswith(("site-packages", "dist-packages")) and os.path.isdir(p)]


def _copy_packages(tree: Path, site: Path) -> None:
    """Install ``tree``'s packages into ``site`` as its pyproject.toml lays them out (pure Python:
    a copy of each package folder, no build step, nothing fetched)."""
    import tomllib

    setup = tomllib.loads((tree / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {"nanfuzz": "nanfuzz", **setup.get("package-dir", {})}
    for package, folder in sorted(folders.items()):  # a package before the ones inside it
        shutil.copytree(tree / folder, site / package.replace(".", "/"), dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__"))


def _install(revision: str, workdir: Path, label: str) -> Install:
    """``revision`` (a git revision, or ``python:PATH``) as an Install.  Its commands run in a folder
    of their own, never the repository root, whose ``nanfuzz/`` would shadow the install; a
    revision's ``tests`` package is reachable there (for kernels such as ``tests.planted_errors:exact``)."""
    cwd = workdir / f"{label}-run"
    cwd.mkdir()
    if revision.startswith("python:"):
        python = revision.partition(":")[2]
    else:
        tree, venv = workdir / f"{label}-tree", workdir / f"{label}-venv"
        if revision.startswith("tree:"):
            tree = Path(revision.partition(":")[2]).resolve()
        else:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), revision],
                           check=True)
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        python = str(venv / "bin" / "python")
        site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              text=True, capture_output=True, check=True).stdout.strip()
        Path(site, "nanfuzz-ab-base.pth").write_text("\n".join(_site_folders()) + "\n")  # torch, Triton, ...
        _copy_packages(tree, Path(site))
        (cwd / "tests").symlink_to(tree / "tests")
    where = subprocess.run([python, "-c", "import nanfuzz, os; print(os.path.dirname(nanfuzz.__file__))"],
                           cwd=cwd, text=True, capture_output=True, check=True).stdout.strip()
    if not revision.startswith("python:") and not where.startswith(str(workdir)):
        raise SystemExit(f"{label}: {python} imports nanfuzz from {where}, not from its own install")
    helps = subprocess.run([python, "-m", "nanfuzz", "bench", "--help"], cwd=cwd, text=True, capture_output=True).stdout
    print(f"{label}: {revision}, nanfuzz from {where}", flush=True)
    return Install(label, python, cwd, takes_size="--size" in helps)


def _remove_trees(workdir: Path) -> None:
    for tree in workdir.glob("*-tree"):
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)


def _env(triton_cache: str, state: str) -> dict:
    return {**os.environ, "TRITON_CACHE_DIR": triton_cache, "NANFUZZ_STATE_DIR": state}


def _bench(side: Install, a, workdir: Path, round_: int) -> None:
    out = workdir / f"{side.label}-bench-{round_}.json"
    cache = str(workdir / f"{side.label}-cold-{round_}") if a.cold else side.triton_cache
    args = ["bench", "--kernel", a.kernel, "--jobs", str(a.jobs), "--seconds", str(a.seconds), "--warmup", "0",
            "--seeds", "0", "--json", str(out), *(["--device", a.device] if a.device else []),
            *(["--size", a.size] if a.size and side.takes_size else []), *a.extra]
    code, text, _ = side.run(args, _env(cache, str(workdir / f"{side.label}-state")))
    if code != 0:
        raise SystemExit(f"{side.label}: nanfuzz bench exited {code}:\n{text[-3000:]}")
    side.results["bench"].append(json.loads(out.read_text())["kernels"][0]["throughput"])


def _self_check(side: Install, a, workdir: Path, round_: int) -> None:
    out = workdir / f"{side.label}-self-check-{round_}.json"
    cold = workdir / f"{side.label}-self-check-cache-{round_}"
    state = workdir / f"{side.label}-self-check-state-{round_}"
    code, text, seconds = side.run(["fuzz", "--summary-json", str(out), "--state-dir", str(state),
                                    *(["--device", a.device] if a.device else [])], _env(str(cold), str(state)))
    if code != 0:
        raise SystemExit(f"{side.label}: the self-check exited {code}:\n{text[-3000:]}")
    summary = json.loads(out.read_text())
    farm = summary.get("compile_farm") or {}
    side.results["self_check"].append({"seconds": seconds, "tasks": farm.get("tasks"),
                                       "compile_seconds": farm.get("compile_seconds"), "farm": farm,
                                       "timeline": summary.get("timeline") or {},
                                       "campaigns": [_campaign_figures(k) for k in summary.get("kernels", [])]})


# What the self-check's JSON keeps of each of its campaigns: where its seconds went, to the shrink's
# examples one by one (an install's summary that lacks a field gives None).
CAMPAIGN_FIGURES = ("kernel", "verdict", "elapsed_s", "examples", "examples_to_first_failure",
                    "time_to_first_failure_s", "shrink_s", "time_to_first_example_s", "phase_seconds", "compiles",
                    "deferred", "early_examples", "began_s", "startup_s")


def _campaign_figures(entry: dict) -> dict:
    return {name: entry.get(name) for name in CAMPAIGN_FIGURES}


def _detect(side: Install, a, workdir: Path, round_: int) -> None:
    out = workdir / f"{side.label}-detect-{round_}.json"
    args = ["bench", "--kernel", a.detect, "--detect", "--examples", "0", "--seeds", str(a.detect_seeds),
            "--json", str(out), *(["--device", a.device] if a.device else []), *a.extra]
    code, text, _ = side.run(args, _env(side.triton_cache, str(workdir / f"{side.label}-state")))
    if code != 0:
        raise SystemExit(f"{side.label}: nanfuzz bench --detect exited {code}:\n{text[-3000:]}")
    detection = json.loads(out.read_text())["kernels"][0]["detection"]
    side.results["detect"].append(detection)


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def figures(side: Install) -> dict[str, float | None]:
    """Each figure of one side: the median over its rounds."""
    found: dict[str, float | None] = {}
    bench = side.results["bench"]
    if bench:
        found["examples/s"] = _median(t["examples_per_second"] for t in bench)
        found["first example s"] = _median(t["time_to_first_example_s"] for t in bench)
        for phase in PHASES:
            found[f"ms/ex {phase}"] = _median(1e3 * t["seconds_per_example"][phase] for t in bench
                                              if phase in t["seconds_per_example"])
        found["ms/ex outside the checks' phases"] = _median(
            1e3 * sum(t["seconds_per_example"].get(p, 0.0) for p in AROUND_CHECKS) for t in bench)
        for who in ("campaign", "judging"):
            found[f"cpu ms/ex {who}"] = _median(1e3 * t["cpu_seconds_per_example"][who] for t in bench
                                                if "cpu_seconds_per_example" in t)
        found["cases declined for memory"] = _median(t.get("declined_for_memory") for t in bench)
        for cause in WAIT_CAUSES:
            found[f"memory waits: {cause}"] = _median((t.get("memory_wait_causes") or {}).get(cause, 0)
                                                     if "memory_wait_causes" in t else None for t in bench)
        queued = [(t.get("run_queue_seconds_per_example") or {}).get("campaign") for t in bench]
        found["run-queue ms/ex campaign"] = _median(None if q is None else 1e3 * q for q in queued)
        # where the first example's time goes (an install that reports them)
        found["worker ready s"] = _median((t.get("startup_s") or {}).get("worker_ready_s") for t in bench)
        found["farm first built s"] = _median((t.get("compile_farm") or {}).get("first_built_seconds") for t in bench)
    if side.results["self_check"]:
        found["self-check s"] = _median(r["seconds"] for r in side.results["self_check"])
        found["self-check farm tasks"] = _median(r["tasks"] for r in side.results["self_check"])
        shrinks = [sum(c["shrink_s"] or 0.0 for c in r["campaigns"]) for r in side.results["self_check"]
                   if r.get("campaigns")]
        found["self-check shrink s"] = _median(shrinks)
        # where its start goes: the first cases drawn (tasks sent out), the farm's first binary
        farms = [r.get("farm") or {} for r in side.results["self_check"]]
        found["self-check farm scheduled s"] = _median(f.get("scheduled_seconds") for f in farms)
        found["self-check farm first built s"] = _median(f.get("first_built_seconds") for f in farms)
        # and from the command's start: the first cases drawn, the first campaign begun, the last one ended
        found["self-check cases drawn at s"] = _median(r.get("timeline", {}).get("first_cases_drawn_s")
                                                       for r in side.results["self_check"])
        spans = [[(c["began_s"], c["began_s"] + c["elapsed_s"]) for c in r["campaigns"]
                  if c.get("began_s") is not None and c.get("elapsed_s") is not None] for r in side.results["self_check"]
                 if r.get("campaigns")]
        found["self-check first began at s"] = _median(min(b for b, _ in run) for run in spans if run)
        found["self-check last ended at s"] = _median(max(e for _, e in run) for run in spans if run)
    if side.results["detect"]:
        found["detect s median"] = _median(d["time_to_first_failure_s"]["median"] for d in side.results["detect"])
        found["detect s max"] = _median(d["time_to_first_failure_s"]["max"] for d in side.results["detect"])
        found["detect caught"] = _median(d["caught"] for d in side.results["detect"])
    return found


def table(a_side: Install, b_side: Install) -> list[tuple[str, str, str, str]]:
    fa, fb = figures(a_side), figures(b_side)
    rows = [("figure", a_side.label, b_side.label, "A/B")]
    for name in fa:
        x, y = fa[name], fb.get(name)
        ratio = f"{x / y:.2f}" if x is not None and y else "-"
        rows.append((name, "-" if x is None else f"{x:.3g}", "-" if y is None else f"{y:.3g}", ratio))
    return rows


def _write_json(a, sides: list[Install]) -> None:
    Path(a.json).write_text(json.dumps({"a": a.a, "b": a.b, "figures": {s.label: figures(s) for s in sides},
                                        "runs": {s.label: s.results for s in sides}}, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--a", default="HEAD", help="a git revision, tree:DIR or python:PATH (default HEAD)")
    p.add_argument("--b", required=True, help="a git revision, tree:DIR or python:PATH")
    p.add_argument("--rounds", type=int, default=2, help="measurements of each side, alternating (default 2)")
    p.add_argument("--kernel", default="paged_decode@masked")
    p.add_argument("--jobs", type=int, default=14)
    p.add_argument("--seconds", type=float, default=35.0)
    p.add_argument("--size", help="--size for an install whose bench takes it (default: each kernel's own)")
    p.add_argument("--device", choices=("cpu", "cuda"))
    p.add_argument("--cold", action="store_true", help="every bench run from an empty Triton cache")
    p.add_argument("--no-throughput", dest="throughput", action="store_false")
    p.add_argument("--self-check", action="store_true", help="time the self-check from an empty Triton cache")
    p.add_argument("--detect", metavar="K", help="time to detect K's bug (e.g. vllm:rocm_attn)")
    p.add_argument("--detect-seeds", type=int, default=10)
    p.add_argument("--json", metavar="FILE", help="also write every run's figures as JSON")
    p.add_argument("--keep", metavar="DIR", help="work in DIR and keep it (default: a temporary folder)")
    p.add_argument("extra", nargs="*", help="after --: options for every bench run")
    a = p.parse_args()
    if a.rounds < 1:
        p.error(f"--rounds={a.rounds} must be >= 1")
    workdir = Path(a.keep or tempfile.mkdtemp(prefix="nanfuzz-ab-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        sides = [_install(a.a, workdir, "A"), _install(a.b, workdir, "B")]
        for side in sides:
            side.triton_cache = str(workdir / f"{side.label}-triton")
        steps = ([_bench] if a.throughput else []) + ([_self_check] if a.self_check else []) + (
            [_detect] if a.detect else [])
        for round_ in range(a.rounds):
            for side in (sides if round_ % 2 == 0 else sides[::-1]):
                for step in steps:
                    step(side, a, workdir, round_)
                    kind = step.__name__.strip("_")
                    # each run's figures as they come, so that a call cut short still shows them
                    print(f"  round {round_ + 1}: {side.label} {kind} done: {json.dumps(side.results[kind][-1])}",
                          flush=True)
                    if a.json:  # as it goes, so that a run stopped early keeps what it measured
                        _write_json(a, sides)
        rows = table(*sides)
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        print()
        for n, row in enumerate(rows):
            print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
            if n == 0:
                print("  ".join("-" * w for w in widths))
        if a.json:
            _write_json(a, sides)
    finally:
        _remove_trees(workdir)
        if not a.keep:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
