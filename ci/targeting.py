"""Does steering the search (Hypothesis's target()) find planted bugs in fewer examples?

    python ci/targeting.py [--seeds 10] [--examples 200] [--kernel tests.planted_errors:bf16_long_rows ...]

Runs each kernel's campaign once per seed with targeting and once without, the same seeds,
no example database, no shrinking, and prints the examples to the first failure of each
(">N": none within the budget) and the medians.  Hypothesis optimises its targets from
half the budget on (for budgets under 1000), so a bug random generation meets early is
met as early either way.  The default kernels are the two of tests/: a 1% error on long
bfloat16 rows (tests/planted_errors.py) and a kernel that loads a dead V slot only in a
rare geometry (tests/read_subjects.py).  Run from the repository root.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ("tests.planted_errors:bf16_long_rows", "tests.read_subjects:mostly_dead")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--first-seed", type=int, default=0, help="seeds FIRST.. (to share the seeds among processes)")
    p.add_argument("--examples", type=int, default=200)
    p.add_argument("--kernel", action="append", help="package.module:attr (repeatable; default: the two of tests/)")
    p.add_argument("--json", metavar="FILE")
    a = p.parse_args()
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit module is imported
    sys.path.insert(0, str(ROOT))
    from nanfuzz.harness.campaign.runner import fuzz
    from nanfuzz.harness.registry import resolve

    state = Path(tempfile.mkdtemp(prefix="nanfuzz-targeting-"))  # no journal or database of another run
    results = {}
    for name in a.kernel or KERNELS:
        kernel = resolve(name)
        found = {}
        for targeting in (True, False):
            found[targeting] = []
            for seed in range(a.first_seed, a.first_seed + a.seeds):
                campaign = fuzz(kernel, device="cpu", max_examples=a.examples, seed=seed, use_database=False,
                                shrink=False, replays=0, isolation=False, targeting=targeting, state_dir=state)
                found[targeting].append(campaign.examples_to_first_failure)
                print(f"{name} targeting={'on' if targeting else 'off'} seed {seed}: "
                      f"{_shown(campaign.examples_to_first_failure, a.examples)}", file=sys.stderr, flush=True)
        results[name] = {"on": found[True], "off": found[False]}
        print(f"{name}: examples to the first failure over seeds {a.first_seed}..{a.first_seed + a.seeds - 1}, "
              f"budget {a.examples}")
        for label, key in (("with target()", True), ("without", False)):
            counts = found[key]
            print(f"  {label:14s} " + " ".join(_shown(n, a.examples) for n in counts)
                  + f"   median {_shown(_median(counts, a.examples), a.examples)}, found {sum(n is not None for n in counts)}"
                  f"/{len(counts)}")
    if a.json:
        Path(a.json).write_text(json.dumps({"examples": a.examples, "seeds": a.seeds, "kernels": results}, indent=1))


def _median(counts: list[int | None], budget: int) -> float:
    """The median, a seed that found nothing counted as past the budget."""
    return statistics.median(budget + 1 if n is None else n for n in counts)


def _shown(n, budget: int) -> str:
    return f">{budget}" if n is None or n > budget else f"{n:g}"


if __name__ == "__main__":
    main()
