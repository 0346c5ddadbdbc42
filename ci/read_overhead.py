"""What tracing a launch's loads costs under Triton's interpreter: checks with and without, same run.

    python ci/read_overhead.py [--cases 20] [--kernel paged_decode@masked ...] [--vllm-src DIR]

Draws the cases once per kernel and checks each twice, once with read coverage and once
without, alternating which goes first; prints per kernel the total seconds of each and
their ratio (traced / untraced).  The ratio holds the load tracing in the launch and the
mapping of its addresses (and, for a kernel launched on copies of the cache, the probe).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ("paged_decode@unmasked", "paged_decode@masked", "prefix_prefill@masked", "unified@masked")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kernel", action="append", help="a kernel name or package.module:attr (repeatable)")
    p.add_argument("--vllm-src", help="a vLLM tree, for vllm:* kernels")
    p.add_argument("--aiter-src", help="an AITER tree, for aiter:* kernels")
    a = p.parse_args()
    os.environ["TRITON_INTERPRET"] = "1"  # before any @triton.jit module is imported
    sys.path.insert(0, str(ROOT))
    from hypothesis import HealthCheck, given, seed, settings

    from nanfuzz.harness.campaign.scope import campaign_capabilities
    from nanfuzz.harness.campaign.settings import Settings
    from nanfuzz.harness.judge.check import check
    from nanfuzz.harness.registry import resolve
    from nanfuzz.strategies import paged_cases

    total = [0.0, 0.0]
    for name in a.kernel or KERNELS:
        kernel = resolve(name, vllm_src=a.vllm_src, aiter_src=a.aiter_src)
        cases = []

        @seed(a.seed)
        @settings(max_examples=a.cases, database=None, deadline=None, suppress_health_check=list(HealthCheck))
        @given(paged_cases(campaign_capabilities(kernel, Settings(device="cpu"))[0], interpreter=True))
        def draw(case):
            cases.append(case)

        draw()
        check(kernel, cases[0], "cpu", trace_reads=False)  # the interpreter's first rewrite of each kernel, untimed
        seconds = [0.0, 0.0]  # untraced, traced
        for i, case in enumerate(cases):
            for traced in ((False, True) if i % 2 else (True, False)):
                start = time.perf_counter()
                check(kernel, case, "cpu", trace_reads=traced)
                seconds[traced] += time.perf_counter() - start
        total = [t + s for t, s in zip(total, seconds)]
        print(f"{name}: {len(cases)} cases, untraced {seconds[0]:.2f} s, traced {seconds[1]:.2f} s, "
              f"ratio {seconds[1] / seconds[0]:.3f}", flush=True)
    print(f"all: untraced {total[0]:.2f} s, traced {total[1]:.2f} s, ratio {total[1] / total[0]:.3f}")


if __name__ == "__main__":
    main()
