"""Calibrate and check MISMATCH's bound (harness/judge/tolerance.py) on a device.

Two parts, each optional:

* **survey**: fuzz campaigns of correct kernels (``--run "KERNEL [fuzz flags]"``,
  repeatable), one per dtype, through the CLI.  Each campaign's summary holds
  the histogram of its passing examples' worst error ratio; the survey merges
  them per arithmetic and prints the quantiles next to the bound.  A campaign
  that fails is listed with its verdict: for a correct kernel, a MISMATCH here
  is a false positive of the bound.
* **sensitivity** (``--planted-seeds N``): each kernel of tests/planted_errors.py
  (exact up to rounding, plus one small planted error) for N seeds of at most
  ``--planted-examples`` examples; prints the examples to detection.

    python ci/tolerance_survey.py --device cuda --jobs 14 --examples 10000 \\
        --run "paged_decode@masked" --run "vllm:triton_attn --causal-only" \\
        --planted-seeds 5 --json survey.json

Run it from the repository root (tests/planted_errors.py is imported from there).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DTYPES = ("float16", "bfloat16", "float32")


def survey(runs: list[str], dtypes: tuple[str, ...], examples: int, jobs: int, device: str,
           extra: list[str], save) -> dict:
    from nanfuzz.harness.judge.accuracy import Accuracy

    merged = Accuracy()
    campaigns = []

    def so_far() -> dict:
        return {"campaigns": campaigns, "accuracy": merged.to_dict()}

    with tempfile.TemporaryDirectory() as tmp:
        for run in runs:
            kernel, *flags = shlex.split(run)
            for dtype in dtypes:
                if dtype == "bfloat16" and device == "cpu":
                    continue  # no bfloat16 arithmetic under Triton's interpreter
                summary = Path(tmp) / "summary.json"
                command = [sys.executable, "-m", "nanfuzz", "fuzz", "--kernel", kernel, "--dtype", dtype,
                           "--device", device, "--jobs", str(jobs), "--max-examples", str(examples),
                           "--no-shrink", "--summary-json", str(summary), *flags, *extra]
                start = time.perf_counter()
                done = subprocess.run(command, capture_output=True, text=True)
                seconds = time.perf_counter() - start
                if done.returncode == 2 or not summary.exists():
                    line = (done.stderr.strip().splitlines() or ["no output"])[-1]
                    campaigns.append({"kernel": kernel, "flags": flags, "dtype": dtype, "error": line})
                    print(f"{kernel} {dtype}: not run: {line}", flush=True)
                    continue
                entry = json.loads(summary.read_text())["kernels"][0]
                merged.merge(Accuracy.from_dict(entry.get("accuracy", {})))
                campaigns.append({"kernel": kernel, "flags": flags, "dtype": dtype, "verdict": entry["verdict"],
                                  "examples": entry["examples"], "seconds": round(seconds, 1),
                                  "summary": entry["summary"], "accuracy": entry.get("accuracy", {})})
                worst = {n: round(d["worst"], 3) for n, d in entry.get("accuracy", {}).items()}
                print(f"{kernel} {' '.join(flags)} {dtype}: {entry['verdict']} after {entry['examples']} examples "
                      f"in {seconds:.0f} s; worst ratio {worst}", flush=True)
                if entry["verdict"] != "PASS":
                    print(f"  {entry['summary']}", flush=True)
                save(so_far())
    print(merged.table(), flush=True)
    return so_far()


def sensitivity(seeds: int, examples: int, device: str) -> list[dict]:
    sys.path.insert(0, os.getcwd())
    from nanfuzz.harness.campaign.runner import fuzz
    from nanfuzz.harness.campaign.settings import Settings
    from tests.planted_errors import PLANTED

    rows = []
    for kernel in PLANTED:
        found = []
        for seed in range(seeds):
            settings = Settings(device=device, max_examples=examples, seed=seed, shrink=False,
                                use_database=False, isolation=False)
            campaign = fuzz(kernel, settings)
            verdict = campaign.failure.verdict.value if campaign.failed else "PASS"
            found.append({"seed": seed, "verdict": verdict, "examples": campaign.examples_to_first_failure,
                          "summary": campaign.failure.summary if campaign.failed else ""})
        counts = [f["examples"] for f in found if f["verdict"] == "MISMATCH"]
        print(f"{kernel.name}: MISMATCH in {len(counts)}/{seeds} seeds; examples to detection "
              f"{counts}", flush=True)
        rows.append({"kernel": kernel.name, "seeds": found})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", action="append", default=[], metavar='"KERNEL [FLAGS]"')
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--examples", type=int, default=10_000)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--planted-seeds", type=int, default=0)
    parser.add_argument("--planted-examples", type=int, default=300)
    parser.add_argument("--fuzz-arg", action="append", default=[], help="passed to every fuzz campaign")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    result: dict = {"device": args.device}

    def save(part: dict | None = None, key: str = "survey") -> None:
        if part is not None:
            result[key] = part
        if args.json:  # after every campaign: a survey cut short keeps what it measured
            Path(args.json).write_text(json.dumps(result, indent=1))

    if args.run:
        save(survey(args.run, tuple(args.dtypes.split(",")), args.examples, args.jobs, args.device,
                    args.fuzz_arg, save))
    if args.planted_seeds:
        save(sensitivity(args.planted_seeds, args.planted_examples, args.device), "sensitivity")
    return 0


if __name__ == "__main__":
    sys.exit(main())
