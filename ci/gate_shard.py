"""One shard of a gate run, inside a pytest-xdist worker: campaigns until the budget is spent.

The shard runs ``harness.fuzz.fuzz`` in rounds whose size follows the measured
cost of an example: ``fuzz`` looks at the clock only between batches of up to
250 examples, which under Triton's interpreter could overrun a budget by
minutes.  With rounds the budget holds to within about one example.  The first
failure ends the shard, shrunk, with its repro in the slot's own folder (the
gate gathers them).

Rounds take no explicit seed: Hypothesis's ``@seed`` switches the example
database off, and the database is what replays a known failure first.  Each
worker process draws its own random seed, so the shards still differ.
A shard always runs one round, however late it starts: a shard that tried
nothing must not read as a pass.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from gate_plan import Plan, ShardRecord

# Rounds are sized to fill this share of the time left, so they shrink
# geometrically toward the deadline and the last one overshoots by little.
ROUND_SHARE = 0.5
MAX_ROUND = 250          # harness.fuzz's own batch size for time-bounded campaigns
FIRST_ROUND = {"cpu": 2, "cuda": 32}   # before any example has been timed


def round_size(seconds_per_example: float | None, remaining: float, device: str, examples_left: int | None) -> int:
    if seconds_per_example is None:
        size = FIRST_ROUND[device]
    else:
        size = int(ROUND_SHARE * remaining / max(seconds_per_example, 1e-6))
    size = max(1, min(size, MAX_ROUND))
    return size if examples_left is None else max(1, min(size, examples_left))


def run_shard(plan: Plan, kernel_name: str, slot: str, device: str) -> ShardRecord:
    """Fuzz ``kernel_name`` in this worker until the shard's budget is spent or it fails."""
    from nanfuzz.harness.check import Verdict
    from nanfuzz.harness.fuzz import STATE_DIR, fuzz
    from nanfuzz.harness.registry import resolve
    from nanfuzz.harness.repro import environment, write_repro

    kernel = resolve(kernel_name)
    record = ShardRecord(kernel=kernel_name, slot=slot, kernel_name=kernel.name,
                         worker=os.environ.get("PYTEST_XDIST_WORKER", "main"), pid=os.getpid(),
                         examples_db=str((STATE_DIR / "examples").resolve()),
                         environment=environment(device))
    path = plan.record_file(kernel_name, slot)
    record.write(path)  # "running": if this process dies, the gate knows where
    start = time.perf_counter()
    budget_end = start + plan.shard_budget(kernel_name, time.time())
    seconds_per_example = None
    failure = None
    while True:
        remaining = budget_end - time.perf_counter()
        examples_left = None if plan.max_examples is None else plan.max_examples - record.examples
        if (remaining <= 0 and record.rounds) or examples_left == 0:
            break
        size = 1 if remaining <= 0 else round_size(seconds_per_example, remaining, device, examples_left)
        campaign = fuzz(kernel, device=device, profile=plan.profile, max_examples=size,
                        time_budget=remaining if remaining > 0 else None)
        record.rounds += 1
        if campaign.failed and campaign.examples_to_first_failure is not None:
            round_start = time.perf_counter() - campaign.elapsed
            record.time_to_first_failure = round_start + campaign.time_to_first_failure - start
            record.examples_to_first_failure = record.examples + campaign.examples_to_first_failure
            record.shrink_time = campaign.shrink_time
        record.examples += campaign.examples
        for verdict, count in campaign.verdicts.items():
            record.verdicts[verdict] = record.verdicts.get(verdict, 0) + count
        if campaign.failed:
            failure = campaign
            break
        if campaign.examples == 0:
            break  # Hypothesis found nothing to generate; another round would not either
        seconds_per_example = campaign.elapsed / campaign.examples

    record.elapsed = time.perf_counter() - start
    record.status = "done"
    if failure is None and record.examples == 0:
        record.status, record.verdict = "error", "ERROR"
        record.summary = "no example ran: Hypothesis generated no case the kernel supports"
    elif failure is None:
        record.verdict, record.summary = Verdict.PASS.value, "PASS"
    else:
        record.verdict, record.summary = failure.failure.verdict.value, failure.failure.summary
        record.recovered_crash = failure.recovered_crash
        paths = write_repro(kernel.name, failure.failing_case, failure.failure, plan.shard_repro_dir(slot), device)
        record.repro = [str(p) for p in paths]
    record.write(path)
    return record


def record_error(plan: Plan, kernel_name: str, slot: str, message: str, started: float) -> ShardRecord:
    """The shard stopped on a configuration problem (not a kernel failure)."""
    path = plan.record_file(kernel_name, slot)
    record = ShardRecord.read(path) if path.exists() else ShardRecord(kernel=kernel_name, slot=slot)
    record.status, record.verdict, record.summary = "error", "ERROR", message
    record.elapsed = time.perf_counter() - started
    record.write(path)
    return record


def previous_record(plan: Plan, kernel_name: str, slot: str) -> ShardRecord | None:
    path: Path = plan.record_file(kernel_name, slot)
    return ShardRecord.read(path) if path.exists() else None
