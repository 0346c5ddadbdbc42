"""Calibrate and check MISMATCH's error model (harness/judge/tolerance.py) on a device.

Three parts, each optional:

* **tiled** (``--tiled N``, on the CPU): the correct plain-torch kernels of
  tests/tiled_attention.py, which compute as Triton kernels do, on N small and N
  production-size batches each (rows to 128k keys, batches to 64 sequences) and on
  rows of 128k keys; prints the worst rows per arithmetic and size tier, and how
  many batches the same kernels with one planted bug fail.  This is where the
  model's factors come from, at full production lengths, in minutes.

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
        --run "vllm:rocm_attn --no-window --size production" \\
        --planted-seeds 5 --json survey.json
    python ci/tolerance_survey.py --tiled 40

Every table is per arithmetic and size tier ("float16" is the small tier, "float16 production"
the batches past it): examples, median, p99, p99.9, worst and bound of the passing examples.

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


def sensitivity(seeds: int, examples: int, device: str, size: str | None = None) -> list[dict]:
    sys.path.insert(0, os.getcwd())
    from nanfuzz.harness.campaign.runner import fuzz
    from nanfuzz.harness.campaign.settings import Settings
    from tests.planted_errors import PLANTED

    rows = []
    for kernel in PLANTED:
        found = []
        for seed in range(seeds):
            settings = Settings(device=device, max_examples=examples, seed=seed, shrink=False,
                                use_database=False, isolation=False, size=size)
            campaign = fuzz(kernel, settings)
            verdict = campaign.failure.verdict.value if campaign.failed else "PASS"
            found.append({"seed": seed, "verdict": verdict, "examples": campaign.examples_to_first_failure,
                          "summary": campaign.failure.summary if campaign.failed else ""})
        counts = [f["examples"] for f in found if f["verdict"] == "MISMATCH"]
        print(f"{kernel.name}: MISMATCH in {len(counts)}/{seeds} seeds; examples to detection "
              f"{counts}", flush=True)
        rows.append({"kernel": kernel.name, "seeds": found})
    return rows


def tiled(count: int) -> dict:
    """The tiled kernels' worst rows per arithmetic and tier, and the planted kernels' catches."""
    import dataclasses

    import torch

    sys.path.insert(0, os.getcwd())
    from nanfuzz.harness.judge.accuracy import Accuracy, size_tier
    from nanfuzz.reference.case import KVCache
    from tests import tiled_attention
    from tests.cases import consecutive_case

    torch.set_num_threads(1)  # thousands of small steps a row: threads only contend
    long_rows = []
    for dtype, kv in (("float16", "auto"), ("bfloat16", "fp8_e4m3fn"), ("float32", "fp8_e5m2")):
        case = consecutive_case([(1, 1 << 17), (4, 20_000)], q_heads=4, kv_heads=1, head_size=64, block_size=48,
                                dtype=dtype, seed=3)
        if kv != "auto":
            case = dataclasses.replace(case, kv_cache=KVCache(kv, "tensor", 0.75, 1.25)).validate()
        long_rows.append(case)
    accuracy, failures, started = Accuracy(), [], time.perf_counter()
    for kernel in tiled_attention.CORRECT:
        cases = tiled_attention.drawn_cases(kernel, count, tier="small") + tiled_attention.drawn_cases(kernel, count)
        cases += [c for c in long_rows if kernel.capabilities.unsupported(c) is None]
        for case in cases:
            errors, _ = tiled_attention.judged(kernel, case)
            worst = float(errors.ratio.max()) if errors.ratio.numel() else 0.0
            if errors.off().any():
                failures.append({"kernel": kernel.name, "ratio": worst, "case": case.to_dict()})
            accuracy.add({"max_error_ratio": worst, "arithmetic": errors.arithmetic, "bound": errors.bound,
                          "tier": size_tier(case)})
        print(f"{kernel.name}: {len(cases)} batches, {time.perf_counter() - started:.0f} s so far", flush=True)
    print(accuracy.table(), flush=True)
    caught = {}
    for kernel in tiled_attention.PLANTED:
        cases = tiled_attention.drawn_cases(kernel, count, at=1)
        caught[kernel.name] = sum(bool(tiled_attention.judged(kernel, c)[0].off().any()) for c in cases)
        print(f"{kernel.name}: MISMATCH in {caught[kernel.name]}/{len(cases)} production batches", flush=True)
    print(f"correct kernels: {len(failures)} failing batch(es)", flush=True)
    return {"accuracy": accuracy.to_dict(), "failures": failures, "planted_caught": caught}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", action="append", default=[], metavar='"KERNEL [FLAGS]"')
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--examples", type=int, default=10_000)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--tiled", type=int, default=0, metavar="N",
                        help="judge the tiled plain-torch kernels on N small and N production batches each (CPU)")
    parser.add_argument("--planted-seeds", type=int, default=0)
    parser.add_argument("--planted-examples", type=int, default=300)
    parser.add_argument("--planted-size", choices=("small", "production", "mixed"), default=None,
                        help="the planted campaigns' size tier (default: the device's)")
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
        save(sensitivity(args.planted_seeds, args.planted_examples, args.device, args.planted_size), "sensitivity")
    if args.tiled:
        save(tiled(args.tiled), "tiled")
    return 0


if __name__ == "__main__":
    sys.exit(main())
