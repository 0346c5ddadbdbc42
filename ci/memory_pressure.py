"""Production-size campaigns at once on one GPU, one process each, as a CI machine with several jobs
runs them: every one must end with exit 0, or with exit 1 and its repro; none with exit 2.

    python ci/memory_pressure.py --time-budget 600 --out pressure/
    python ci/memory_pressure.py --kernel "vllm:rocm_attn --no-window" --kernel aiter:pa_decode ... --vllm-src ...
    python ci/memory_pressure.py --size mixed --kernel K --kernel "K --poison unreferenced" ...  # K beside its control

Each campaign is a separate ``nanfuzz fuzz --size production`` command (``--size`` another tier) in a folder
of its own (its own state folder, example database and repros, as separate CI jobs have); they share the
device through the memory governor's ledger (``harness/judge/memory.py``; ``--memory-dir``, else the default
folder). By default the nine are the built-in variants at production size, fixed and old: an old variant's
finding must survive the pressure whole (shrunk, replayed, written). Prints one row per campaign (exit status,
verdict, examples, the first failure and its shrink, checks that waited for memory and for how long, cases
declined for memory, whether its repro is on disk) and exits 0 only when every campaign ended with 0, or with
1 and a repro. Run it from the repository root.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

# Fixed and old built-ins: the old ones find their bug at every size, so each of them must end
# with exit 1 and its repro however short the device is.
STOP_GRACE = 60.0  # seconds a campaign past its grace has after SIGTERM to write what it found

DEFAULT_KERNELS = ("paged_decode@masked", "prefix_prefill@masked", "unified@masked", "split_decode@masked",
                   "paged_decode@masked --seed 1", "paged_decode@unmasked", "prefix_prefill@unmasked",
                   "unified@overshoot", "split_decode@drops-last-partition")


def _start(index: int, run: str, out: Path, budget: float, device: str, size: str, extra: list[str],
           env: dict) -> tuple:
    kernel, *flags = shlex.split(run)
    folder = out / f"{index:02d}-{kernel.replace(':', '_').replace('@', '-')}"
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "nanfuzz", "fuzz", "--kernel", kernel, "--device", device, "--size", size,
               "--time-budget", str(budget), "--state-dir", str(folder / "state"),
               "--summary-json", str(folder / "summary.json"), *flags, *extra]
    log = open(folder / "log.txt", "w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=Path.cwd())
    return run, folder, process, log


def _row(run: str, folder: Path, code: int, overran: bool = False) -> dict:
    row = {"campaign": run, "exit": code, "verdict": "-", "examples": 0, "memory_waits": 0, "memory_wait_s": 0.0,
           "declined": 0, "judging_oom": 0, "repro": "-", "last_line": "", "summary": "", "first_failure": "-",
           "shrink_s": None}
    lines = [line for line in (folder / "log.txt").read_text(errors="replace").splitlines() if line.strip()]
    row["last_line"] = next((line for line in reversed(lines) if line.startswith("nanfuzz:")), lines[-1] if lines else "")
    row["traceback"] = any(line.startswith("Traceback") for line in lines)
    summary = folder / "summary.json"
    if summary.exists():
        (entry,) = json.loads(summary.read_text())["kernels"]
        row.update(verdict=entry["verdict"], examples=entry["examples"], memory_waits=entry.get("memory_waits", 0),
                   memory_wait_s=entry.get("memory_wait_s", 0.0), declined=entry.get("declined_for_memory", 0),
                   judging_oom=entry.get("judging_out_of_memory", 0), summary=entry.get("summary", ""),
                   shrink_s=entry.get("shrink_s"))
        if entry.get("examples_to_first_failure"):
            row["first_failure"] = f"{entry['examples_to_first_failure']} ex/{entry['time_to_first_failure_s']:.1f}s"
        if entry["repro"]:
            row["repro"] = "on disk" if Path(entry["repro"][0]).exists() or (Path.cwd() / entry["repro"][0]).exists() \
                else "MISSING"
    elif code == 1:
        row["repro"] = "MISSING"
    row["ok"] = not overran and (code == 0 or (code == 1 and row["repro"] == "on disk"))
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernel", action="append", metavar='"KERNEL [fuzz flags]"',
                   help="a campaign (repeatable; default: nine built-in variants, fixed and old)")
    p.add_argument("--time-budget", type=float, default=600.0, help="seconds each campaign searches (default 600)")
    p.add_argument("--grace", type=float, default=300.0,
                   help="seconds past the budget a campaign may take (shrinking, replays, memory waits) before it "
                        "is killed and counted a failure (default 300)")
    p.add_argument("--out", default="memory-pressure", help="where each campaign's folder goes")
    p.add_argument("--memory-dir", help="the ledger folder the campaigns share (NANFUZZ_MEMORY_DIR)")
    p.add_argument("--json", help="also write the rows as JSON")
    p.add_argument("--device", default="cuda", help="cuda (default), or cpu to try the script under the interpreter")
    p.add_argument("--size", default="production", choices=("small", "production", "mixed"),
                   help="each campaign's --size (default production)")
    args, extra = p.parse_known_args()  # anything else goes to every campaign (--vllm-src DIR, --jobs N, ...)
    runs = args.kernel or list(DEFAULT_KERNELS)
    out = Path(args.out)
    env = dict(os.environ)
    if args.memory_dir:
        env["NANFUZZ_MEMORY_DIR"] = args.memory_dir
    started = time.perf_counter()
    campaigns = [_start(i, run, out, args.time_budget, args.device, args.size, extra, env)
                 for i, run in enumerate(runs)]
    print(f"memory pressure: {len(campaigns)} {args.size}-size campaigns at once on one {args.device} device, "
          f"{args.time_budget:g} s each; logs in {out}/", flush=True)
    rows = []
    deadline = started + args.time_budget + args.grace
    for run, folder, process, log in campaigns:
        overran = False
        try:
            code = process.wait(max(0.0, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:  # a campaign that never ends is a defect, not a wait
            # SIGTERM first: a campaign stopped while it shrinks writes the smallest failure it has
            process.terminate()
            try:
                code = process.wait(STOP_GRACE)
                print(f"{run}: still running {args.grace:g} s past its budget; stopped (SIGTERM)", flush=True)
            except subprocess.TimeoutExpired:
                process.kill()
                code = process.wait()
                print(f"{run}: still running {args.grace:g} s past its budget, and {STOP_GRACE:g} s after SIGTERM; "
                      "killed", flush=True)
            overran = True
        log.close()
        rows.append(_row(run, folder, code, overran))
    head = ("campaign", "exit", "verdict", "examples", "first failure", "shrink s", "waits", "wait s", "declined",
            "judging oom", "repro")
    table = [head] + [(r["campaign"], r["exit"], r["verdict"], r["examples"], r["first_failure"],
                       "-" if r["shrink_s"] is None else f"{r['shrink_s']:.1f}", r["memory_waits"], r["memory_wait_s"],
                       r["declined"], r["judging_oom"], r["repro"]) for r in rows]
    widths = [max(len(str(row[i])) for row in table) for i in range(len(head))]
    for n, row in enumerate(table):
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)))
        if n == 0:
            print("  ".join("-" * width for width in widths))
    for r in rows:
        if r["verdict"] not in ("-", "PASS"):
            print(f"{r['campaign']}: {r['summary']}")
        if not r["ok"] or r["traceback"]:
            print(f"{r['campaign']}: exit {r['exit']}{' with a traceback' if r['traceback'] else ''}: {r['last_line']}")
    good = all(r["ok"] and not r["traceback"] for r in rows)
    print(f"\n{'every campaign ended with exit 0, or exit 1 and its repro' if good else 'FAILED: see the rows above'} "
          f"({time.perf_counter() - started:.0f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
