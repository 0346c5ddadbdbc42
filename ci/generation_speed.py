"""How long Hypothesis takes to draw one case, and how many choices a case takes.

    python ci/generation_speed.py [--examples 500] [--interpreter] [--profile KERNEL]

For each built-in kernel family, with free draws and with a 16-entry pool:
milliseconds per case through ``@given`` (generate phase only, no database,
derandomized, empty body) and the mean number of choices per case.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.control import current_build_context

from nanfuzz.harness.kernels import paged_decode, prefix_prefill, unified
from nanfuzz.strategies import paged_cases
from nanfuzz.strategies.cases import campaign_pool

FAMILIES = {"paged_decode": paged_decode.CAPABILITIES, "prefix_prefill": prefix_prefill.CAPABILITIES,
            "unified": unified.CAPABILITIES}


def strategy(caps, pooled: bool, interpreter: bool):
    pool = campaign_pool(caps, 16, 0, interpreter=interpreter) if pooled else None
    return paged_cases(caps, interpreter=interpreter, pool=pool)


def time_given(strat, examples: int) -> tuple[float, float]:
    """Seconds per case of a generate-only ``@given`` run, and choices per case."""
    count, choices = [0], [0]

    @settings(max_examples=examples, phases=[Phase.generate], database=None, derandomize=True, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(strat)
    def body(case):
        count[0] += 1
        choices[0] += len(current_build_context().data.choices)

    start = time.perf_counter()
    body()
    seconds = time.perf_counter() - start
    return seconds / max(count[0], 1), choices[0] / max(count[0], 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=500)
    parser.add_argument("--interpreter", action="store_true", help="the interpreter's sizes and dtypes")
    parser.add_argument("--profile", metavar="FAMILY", help="cProfile one family's free draws instead")
    args = parser.parse_args()
    if args.profile:
        strat = strategy(FAMILIES[args.profile], False, args.interpreter)
        profiler = cProfile.Profile()
        profiler.enable()
        time_given(strat, args.examples)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(45)
        return
    print(f"{'family':16} {'pool':>5} {'ms/case':>8} {'choices/case':>13}")
    for name, caps in FAMILIES.items():
        for pooled in (False, True):
            strat = strategy(caps, pooled, args.interpreter)
            seconds, choices = time_given(strat, args.examples)
            print(f"{name:16} {'16' if pooled else '-':>5} {1000 * seconds:8.2f} {choices:13.1f}")


if __name__ == "__main__":
    main()
