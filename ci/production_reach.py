"""Do production campaigns of real kernels reach every target they declare within a CI budget?

    python ci/production_reach.py --vllm-src DIR --aiter-src DIR [--time-budget 600] [--at-once 2]
                                  [--out DIR] [--only LABEL ...]

Runs the production campaigns below with ``nanfuzz fuzz --size production --show-statistics
--summary-json``, ``--at-once`` of them at a time on the GPU, and prints for each its examples,
its examples per second, and every production target it declares (``strategies.targets``) with
its count, or why it was not reached.  A campaign that draws a cache past 2^31 elements takes
up to about 40 GiB of the GPU at a time (the pooled caches and a kernel's copy of them in its own
layout): on one 141 GiB H200, two or three at once.  Each campaign writes its summary JSON,
log and repros under ``--out``.  Run from the repository root.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# label -> the kernel and the options after --kernel
CAMPAIGNS = {
    "rocm_attn": ("vllm:rocm_attn", ["--no-window"]),
    "rocm_attn-prefill": ("vllm:rocm_attn", ["--prefill-only", "--no-window"]),
    "triton_attn": ("vllm:triton_attn", ["--causal-only", "--kv-cache-dtype", "auto"]),
    "pa_decode": ("aiter:pa_decode", ["--dtype", "float16"]),
    # the released pa_decode crashes on a cache past 2^31 elements (its int32 block offsets, on file);
    # past that finding, the same kernel declines such caches and must reach the rest
    "pa_decode-past-findings": ("tests.past_findings:pa_decode_float16", []),
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vllm-src", required=True, help="a vLLM tree (the folder that holds vllm/)")
    p.add_argument("--aiter-src", required=True, help="an AITER tree (the folder that holds aiter/)")
    p.add_argument("--time-budget", type=float, default=600.0, help="seconds per campaign (default 600)")
    p.add_argument("--at-once", type=int, default=2, help="campaigns on the GPU at a time (default 2)")
    p.add_argument("--out", default="production-reach", help="where summaries, logs and repros go")
    p.add_argument("--only", action="append", choices=tuple(CAMPAIGNS), help="run only this campaign (repeatable)")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    labels = a.only or list(CAMPAIGNS)
    running: list[tuple[str, subprocess.Popen, float]] = []
    for label in labels:
        while len(running) >= a.at_once:
            running = _reap(running)
        running.append((label, _start(label, a, out), time.time()))
    while running:
        running = _reap(running)
    ok = True
    for label in labels:
        ok &= _report(label, out)
    return 0 if ok else 1


def _start(label: str, a, out: Path) -> subprocess.Popen:
    kernel, options = CAMPAIGNS[label]
    command = [sys.executable, "-m", "nanfuzz", "fuzz", "--device", "cuda", "--kernel", kernel, *options,
               "--size", "production", "--time-budget", str(a.time_budget), "--max-examples", "1000000",
               "--show-statistics",
               "--summary-json", str(out / f"{label}.json"), "--repro-dir", str(out / f"{label}-repros"),
               "--state-dir", str(out / f"{label}-state"), "--vllm-src", a.vllm_src, "--aiter-src", a.aiter_src]
    print("$ " + " ".join(command), flush=True)
    log = open(out / f"{label}.log", "w")
    # the command sets each tree as its NANFUZZ_*_SRC variable too, which a user module
    # (tests/past_findings.py) reads
    return subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)


def _reap(running):
    time.sleep(2)
    left = []
    for label, process, started in running:
        if process.poll() is None:
            left.append((label, process, started))
        else:
            print(f"{label}: exit {process.returncode} after {time.time() - started:.0f} s", flush=True)
    return left


def _report(label: str, out: Path) -> bool:
    """Print one campaign's reach; True when it reached every target it declares within reach."""
    path = out / f"{label}.json"
    try:
        entry = json.loads(path.read_text())["kernels"][0]
    except (OSError, ValueError, KeyError, IndexError):
        print(f"\n{label}: no summary ({path}); see {out / (label + '.log')}")
        return False
    stats = entry["statistics"]
    examples, elapsed = entry["examples"], entry["elapsed_s"]
    print(f"\n{label} ({' '.join(CAMPAIGNS[label][1])}): {entry['verdict']}, {examples} examples in {elapsed:.0f} s "
          f"({examples / max(elapsed, 1e-9):.2f}/s), {entry.get('compiles')} compiles, "
          f"{entry.get('declined_for_memory', 0)} declined for memory")
    reached = True
    for target in stats.get("targets", []):
        if target["out_of_reach"]:
            print(f"  {target['target']:34s}    - out of reach: {target['out_of_reach']}")
        elif not target["count"] and target.get("declined"):
            print(f"  {target['target']:34s}    - declined by the kernel's supports() {target['declined']} times")
        else:
            reached &= target["count"] > 0
            print(f"  {target['target']:34s} {target['count']:5d}")
    return reached and entry["verdict"] == "PASS"


if __name__ == "__main__":
    sys.exit(main())
