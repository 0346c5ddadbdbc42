"""nanfuzz: NaN-poisoning fuzz and regression harness for paged-attention Triton kernels.

The public face.  Names are imported on first use, so ``import nanfuzz`` (and
the pytest plugin that comes with it) costs nothing until a kernel is fuzzed;
torch and Triton are not imported here.

    from nanfuzz import Kernel, Capabilities, PagedBatch
    campaign = nanfuzz.fuzz(kernel, max_examples=500)

Adapters find what they convert the canonical batch into here too: the scheduled
sequences, live key ranges, token indices, window conventions and a loader for a
library's kernel files (see docs/adapters.md).
"""
from __future__ import annotations

import importlib
import os

# In a source checkout the subpackages are folders beside this one (pyproject.toml maps
# them in an install).  When the checkout itself is on sys.path, as it is for tests run
# from its root, this package is found first and must reach them too.
_checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if all(os.path.isfile(os.path.join(_checkout, *parts)) for parts in
       (("reference", "oracle.py"), ("strategies", "cases.py"), ("harness", "cli.py"))):
    __path__.append(_checkout)

__version__ = "0.2.0"

_EXPORTS = {
    "Kernel": "nanfuzz.harness.kernel",
    "Capabilities": "nanfuzz.reference.capabilities",
    "PagedBatch": "nanfuzz.reference.batch",
    "Case": "nanfuzz.reference.case",
    "NanfuzzError": "nanfuzz.reference.errors",
    "Verdict": "nanfuzz.harness.judge.check",
    "Outcome": "nanfuzz.harness.judge.check",
    "check": "nanfuzz.harness.api",
    "check_repro": "nanfuzz.harness.api",
    "Finding": "nanfuzz.harness.report.finding",
    "Campaign": "nanfuzz.harness.campaign.result",
    "NanfuzzFixture": "nanfuzz.harness.plugin",
    "fuzz": "nanfuzz.harness.api",
    "replay": "nanfuzz.harness.api",
    "resolve": "nanfuzz.harness.registry",
    # helpers for adapters
    "scheduled": "nanfuzz.reference.layouts",
    "Scheduled": "nanfuzz.reference.layouts",
    "live_key_ranges": "nanfuzz.reference.layouts",
    "token_indices": "nanfuzz.reference.layouts",
    "TokenIndices": "nanfuzz.reference.layouts",
    "req_to_token": "nanfuzz.reference.layouts",
    "sliding_window": "nanfuzz.reference.windows",
    "window_size": "nanfuzz.reference.windows",
    "window_left": "nanfuzz.reference.windows",
    "load_kernel_files": "nanfuzz.harness.adapters.kernel_files",
    "KernelFiles": "nanfuzz.harness.adapters.kernel_files",
    "DeviceProperties": "nanfuzz.harness.device",
    "device_properties": "nanfuzz.harness.device",
    "MI355X": "nanfuzz.harness.device",
    "H200": "nanfuzz.harness.device",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'nanfuzz' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
