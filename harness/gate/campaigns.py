"""The gate's campaigns as pytest tests: one test per kernel, run by every worker.

``nanfuzz gate`` (``harness.gate.run``) writes the plan and runs this file under pytest-xdist with
``--dist each``, so worker slot i runs shard i of every kernel.  Run alone
(no plan in ``NANFUZZ_GATE_PLAN``) the module skips itself; the project's
own ``pytest`` never collects it (``testpaths = ["tests"]``).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from nanfuzz.harness.gate.plan import PLAN_ENV, SLOT_ENV, Plan

if not os.environ.get(PLAN_ENV):
    pytest.skip(f"run by nanfuzz gate, which sets {PLAN_ENV}", allow_module_level=True)

PLAN = Plan.read(os.environ[PLAN_ENV])


def _slot() -> str:
    slot = os.environ.get(SLOT_ENV)
    if slot not in PLAN.slots:
        pytest.fail(f"{SLOT_ENV}={slot!r} is not one of the plan's slots {PLAN.slots}; run nanfuzz gate", pytrace=False)
    return slot


@pytest.mark.parametrize("kernel_name", PLAN.kernels)
def test_shard(kernel_name, nanfuzz_device, record_property):
    from nanfuzz.harness.gate.shard import previous_record, record_error, run_shard
    from nanfuzz.reference.errors import NanfuzzError

    slot = _slot()
    earlier = previous_record(PLAN, kernel_name, slot)
    if earlier is not None:
        # pytest-xdist may hand a restarted worker its dead predecessor's tests
        # again; a shard runs once a gate run (the gate reports the dead one).
        pytest.skip(f"shard {slot} of {kernel_name} already ran in this gate run ({earlier.status})")
    assert nanfuzz_device == PLAN.device, f"worker runs on {nanfuzz_device}, the plan says {PLAN.device}"
    started = time.perf_counter()
    try:
        record = run_shard(PLAN, kernel_name, slot, nanfuzz_device)
    except NanfuzzError as exc:
        record = record_error(PLAN, kernel_name, slot, str(exc), started)
    except Exception as exc:  # a bug of the gate's own: say so in the record, then show the traceback
        record_error(PLAN, kernel_name, slot, f"internal error: {type(exc).__name__}: {exc}", started)
        raise
    for key in ("slot", "worker", "examples", "verdict"):
        record_property(key, getattr(record, key))
    if record.status == "error":
        pytest.fail(f"{kernel_name} [{slot}]: {record.summary}", pytrace=False)
    if record.failed:
        picture, repro = (Path(record.repro[2]).read_text(), record.repro[0]) if record.repro else ("", "-")
        pytest.fail(f"{kernel_name} [{slot}]: {record.summary}\n{picture}repro: {repro}", pytrace=False)
