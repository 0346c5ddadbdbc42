"""Subjects for the tests of a shared example database.

``stops_the_server``: the window off-by-one bug of ``tests.torch_kernels``,
and its first windowed launch also kills the process whose pid is in
``NANFUZZ_TEST_STOP_PID`` (the example database's server): the server goes
away in the middle of the run, just before the failure is found.
"""
from __future__ import annotations

import os
import signal

from nanfuzz.harness.kernel import Kernel
from tests.torch_kernels import CAPS, attention

STOP_PID_VAR = "NANFUZZ_TEST_STOP_PID"


def _stop_the_server_then_misbehave(batch, out):
    if batch.case.sliding_window and os.environ.get(STOP_PID_VAR):
        try:
            os.kill(int(os.environ[STOP_PID_VAR]), signal.SIGKILL)
        except ProcessLookupError:
            pass  # stopped already
    return attention(batch, out, bug="window-off-by-one")


stops_the_server = Kernel(name="fleet@stops-the-server", run=_stop_the_server_then_misbehave, capabilities=CAPS,
                          expect="caught", spec="tests.fleet_subjects:stops_the_server")
