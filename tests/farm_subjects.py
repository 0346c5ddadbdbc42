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
