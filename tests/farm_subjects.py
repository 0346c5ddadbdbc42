"""Kernels for the compile farm's tests: correct plain-torch attention whose host code, on
windowed cases, is slow (as a compile is), raises, or ends its process."""
from __future__ import annotations

import os
import time

from nanfuzz.harness.kernel import Kernel
from tests.subjects import _before_windowed_launches
from tests.torch_kernels import CAPS


def _planted_error():
    raise RuntimeError("planted error in the kernel's host code")


slow = Kernel(name="farm@slow", run=_before_windowed_launches(lambda: time.sleep(0.5)), capabilities=CAPS,
              spec="tests.farm_subjects:slow")
raises = Kernel(name="farm@raises", run=_before_windowed_launches(_planted_error), capabilities=CAPS,
                spec="tests.farm_subjects:raises")


class _Stamped:
    """Stands in for a Triton function: what a built mark records of it is its ``cache_key``."""

    cache_key = "source-hash-1"


stamped = _Stamped()


def _leave(batch, out):
    os._exit(3)


# ends its farm process at its first case, leaving every later task in the farm's queue
leaves_at_once = Kernel(name="farm@leaves_at_once", run=_leave, capabilities=CAPS,
                        spec="tests.farm_subjects:leaves_at_once")


def report_farm_parents(prefer_fork: bool, marks_folder: str) -> None:
    """Run in a fresh interpreter (a campaign's process stands so): start a farm of ``slow``'s pool with
    ``prefer_fork``, and print as JSON this process's pid, its farm processes' parents, the fork server
    it started (None: none) and whether the farm built every task."""
    import json
    from multiprocessing import forkserver

    from nanfuzz.harness.campaign.scope import campaign_capabilities, campaign_pool_of
    from nanfuzz.harness.campaign.settings import Settings
    from nanfuzz.harness.launch.farm import BuiltMarks, Farm, Plan, sample_cases
    from nanfuzz.harness.launch.subjects import worker_spec

    settings = Settings(device="cpu", pool_size=2)
    caps, _ = campaign_capabilities(slow, settings)
    pool, _ = campaign_pool_of(caps, settings, 1)
    plan = Plan(worker_spec(slow, settings), caps, None, pool, samples=1)
    with Farm([plan], processes=2, marks=BuiltMarks(marks_folder), first_cases_later=True,
              prefer_fork=prefer_fork) as farm:
        parents = [int(open(f"/proc/{p.pid}/stat").read().rsplit(")", 1)[1].split()[1]) for p in farm._processes]
        farm.schedule({0: tuple(sample_cases(plan, plan.entries[0], 1))})
        built = farm.wait(timeout=300)
        summary = farm.summary()
    print(json.dumps({"me": os.getpid(), "parents": parents, "plain_forked": farm.plain_forked,
                      "fork_server": getattr(forkserver._forkserver, "_forkserver_pid", None),
                      "built": built and summary.get("failed", 0) == 0, "tasks": summary.get("tasks")}))
