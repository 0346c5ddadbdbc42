"""One shard of a gate run, inside a pytest-xdist worker: a campaign until the budget is spent.

The shard is one call of the campaign runner (``nanfuzz.harness.campaign.runner``) with
the shard's time budget: the runner sizes its Hypothesis runs from the
measured cost of an example, so the budget holds to within about one
example, and it always runs at least one example (a shard that tried nothing
must not read as a pass).  Launches run in the runner's supervised worker, so
a kernel that crashes or hangs is a verdict of this shard, not a dead pytest
worker.  The first failure ends the shard, shrunk, with its repro in the
slot's own folder (the gate gathers them).

No explicit seed: each worker process draws its own random seed, so the
shards differ; and each slot of each runner fuzzes its own specialisation
pool (``Plan.pool_seed``), in the next round the slot's state folder holds
(``harness.campaign.pool_rounds``), so that CI runs after one another meet
shapes the ones before did not.  The example database replays known failures
first, whatever the pool.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from nanfuzz.harness.gate.plan import Plan, ShardRecord


def run_shard(plan: Plan, kernel_name: str, slot: str, device: str) -> ShardRecord:
    """Fuzz ``kernel_name`` in this worker until the shard's budget is spent or it fails."""
    from nanfuzz.harness.judge.check import Verdict
    from nanfuzz.harness.campaign.focus import Focus
    from nanfuzz.harness.campaign.runner import fuzz
    from nanfuzz.harness.registry import resolve
    from nanfuzz.harness.report.failures import report_failure
    from nanfuzz.harness.report.repro import environment
    from nanfuzz.harness.campaign.scope import with_next_pool_round
    from nanfuzz.harness.campaign.settings import Settings

    # the gate sets this worker's NANFUZZ_STATE_DIR (its slot's folder); read once, here
    settings = Settings.from_environment(device=device, profile=plan.profile,
                                         repro_dir=plan.shard_repro_dir(slot), example_db=plan.example_db,
                                         examples_dir=plan.examples_dir, focus=Focus(window_only=plan.window_only))
    kernel = resolve(kernel_name, **settings.sources)
    settings = with_next_pool_round(kernel, settings)  # the slot's state folder travels between CI runs
    record = ShardRecord(kernel=kernel_name, slot=slot, kernel_name=kernel.name,
                         worker=os.environ.get("PYTEST_XDIST_WORKER", "main"), pid=os.getpid(),
                         examples_db=str(settings.examples_path.resolve()),
                         environment=environment(device))
    path = plan.record_file(kernel_name, slot)
    record.write(path)  # "running": if this process dies, the gate knows where
    start = time.perf_counter()
    budget = max(0.0, plan.shard_budget(kernel_name, time.time()))
    campaign = fuzz(kernel, settings.replace(time_budget=budget, max_examples=plan.max_examples or 10**9,
                                             remember_paths=False, size=plan.size),
                    pool_seed=plan.pool_seed(slot))
    record.rounds = 1
    record.examples = campaign.examples
    record.seed, record.pool_seed, record.pool_round = campaign.seed, campaign.pool_seed, campaign.pool_round
    record.verdicts = dict(campaign.verdicts)
    record.time_to_first_failure = campaign.time_to_first_failure
    record.examples_to_first_failure = campaign.examples_to_first_failure
    record.shrink_time = campaign.shrink_time
    record.statistics = campaign.statistics.to_dict()
    record.notes = list(campaign.notes)
    record.elapsed = time.perf_counter() - start
    record.status = "done"
    if not campaign.failed and record.examples == 0:
        record.status, record.verdict = "error", "ERROR"
        record.summary = "no example ran: Hypothesis generated no case the kernel supports"
    elif not campaign.failed:
        record.verdict, record.summary = Verdict.PASS.value, "PASS"
    else:
        record.verdict, record.summary = campaign.failure.verdict.value, campaign.failure.summary
        record.recovered_crash = campaign.recovered_crash
        record.repro = report_failure(kernel, campaign, settings)
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
