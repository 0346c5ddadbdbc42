"""A PASS says how much: a kernel whose shards passed on fewer examples than its floor is INCOMPLETE.

A gate whose runner was slow to start, whose compiles ate the budget or
whose kernel takes few cases can pass a kernel on a few dozen examples,
which shows little.  Each kernel's examples, summed over its shards on this
runner, must reach the floor (``--min-examples``); a kernel below it is no
finding, but the gate is not green either (exit 1, INCOMPLETE in the summary
and a failed testcase in JUnit).
"""
from __future__ import annotations

from nanfuzz.harness.gate.report import GateResult

INCOMPLETE = "INCOMPLETE"
# Examples per kernel a gate must reach by default.  GPU: the ci profile's campaign size, in which the
# project's CPU CI catches every old built-in variant (tests/test_fuzz.py catches each within 200); a GPU
# worker reaches it in seconds.  Interpreter: a dry run on a CPU, which manages a few examples a second.
DEFAULT_FLOOR = {"cuda": 300, "cpu": 10}


def floor(requested: int | None, device: str, max_examples: int | None, shards: int) -> int:
    """The floor in force: ``--min-examples`` if given, else the device's default, never more than the
    ``--max-examples`` cap allows the shards together."""
    wanted = DEFAULT_FLOOR[device] if requested is None else requested
    return wanted if max_examples is None else min(wanted, max_examples * shards)


def apply_floor(result: GateResult, least: int) -> None:
    """Mark the shards of each kernel that passed on fewer than ``least`` examples INCOMPLETE."""
    for kernel in dict.fromkeys(row.kernel for row in result.rows):
        rows = [row for row in result.rows if row.kernel == kernel]
        if any(row.verdict != "PASS" for row in rows):
            continue  # a failure, or a shard that did not run, says more already
        examples = sum(row.examples or 0 for row in rows)
        if examples >= least:
            continue
        why = f"PASS on {examples} examples, under the floor of {least} per kernel (--min-examples)"
        for row in rows:
            row.verdict, row.summary = INCOMPLETE, why
        result.problems.append(f"`{kernel}` passed on {examples} examples, fewer than the floor of {least}: raise "
                               "--time-budget, or lower --min-examples")
