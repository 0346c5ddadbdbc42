"""What an exported repro hands a user's adapter as ``nanfuzz`` where nanfuzz is not installed.

An adapter imports its ``Kernel`` and ``Capabilities`` from nanfuzz, and
perhaps the helpers for other layouts and window conventions and the device
a run stands in for.  The script of
such an adapter carries them, copied from nanfuzz with the rest of its code,
and before it imports the adapter ``provide_nanfuzz`` puts a module named
``nanfuzz`` holding them (``GIVEN``) in ``sys.modules``, unless nanfuzz is
installed: the adapter then gets nanfuzz itself.  An adapter that imports
anything else of nanfuzz fails to load, and the script says to install it
(exit status 2, never a finding).
"""
from __future__ import annotations

import importlib.util
import sys
import types

from nanfuzz.harness.device import H200, MI355X, DeviceProperties, device_properties
from nanfuzz.harness.kernel import Kernel
from nanfuzz.reference.batch import PagedBatch
from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.case import Case
from nanfuzz.reference.errors import NanfuzzError
from nanfuzz.reference.layouts import Scheduled, TokenIndices, live_key_ranges, req_to_token, scheduled, token_indices
from nanfuzz.reference.windows import sliding_window, window_left, window_size

# What the stand-in gives: the kernel contract and the helpers adapters convert the batch with.
GIVEN = {
    "Kernel": Kernel, "Capabilities": Capabilities, "PagedBatch": PagedBatch, "Case": Case,
    "NanfuzzError": NanfuzzError, "Scheduled": Scheduled, "scheduled": scheduled, "live_key_ranges": live_key_ranges,
    "TokenIndices": TokenIndices, "token_indices": token_indices, "req_to_token": req_to_token,
    "sliding_window": sliding_window, "window_size": window_size, "window_left": window_left,
    "DeviceProperties": DeviceProperties, "device_properties": device_properties,
    "MI355X": MI355X, "H200": H200,
}


def provide_nanfuzz() -> bool:
    """Put the stand-in in ``sys.modules`` as ``nanfuzz`` unless nanfuzz is installed; True when it did."""
    if "nanfuzz" in sys.modules or importlib.util.find_spec("nanfuzz") is not None:
        return False
    stand_in = types.ModuleType("nanfuzz", "This script's stand-in for nanfuzz, which is not installed: "
                                           + ", ".join(GIVEN) + ".")
    stand_in.__dict__.update(GIVEN, __stand_in__=True, __all__=list(GIVEN))
    sys.modules["nanfuzz"] = stand_in
    return True

