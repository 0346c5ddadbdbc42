"""Small stand-ins for the SGLang runtime helpers its Triton attention files import.

``decode_attention.py`` and ``extend_attention.py`` import SGLang's environment
flags (``sglang.srt.environ.envs``) and a few platform queries
(``sglang.srt.utils``); ``import sglang`` itself needs its compiled extensions and
server machinery.  The loader registers these modules under the real names while
the kernel files run, and only then.  The platform is the visible GPU's; under
Triton's interpreter, the GPU the run stands in for (``nanfuzz.device_properties()``:
an MI355X unless the kernel declares another), so the kernels take its code paths.
"""
from __future__ import annotations

import functools
import types

from nanfuzz.harness.adapters.standins import amd_arch, standin_module
from nanfuzz.harness.device import device_properties

PACKAGES = ("sglang", "sglang.srt", "sglang.kernels", "sglang.kernels.ops", "sglang.kernels.ops.attention")

# The flags the attention files read, at SGLang 0.5.23's defaults (sglang/srt/environ.py).
ENV_DEFAULTS = {
    "SGLANG_TRITON_DECODE_ATTN_STATIC_KV_SPLITS": False,
    "SGLANG_MLA_DECODE_TUNE": False,
    "SGLANG_TRITON_FP8_PREFILL_ATTN": True,
    "SGLANG_TRITON_COMPACT_EXTEND_ATTENTION": True,
    "SGLANG_DISABLE_LEAN_ATTENTION": False,
}


class _Flag:
    def __init__(self, value):
        self.value = value

    def get(self):
        return self.value


class Envs:
    """``sglang.srt.environ.envs``: each flag a ``.get()`` of its default."""

    def __getattr__(self, name: str) -> _Flag:
        if name not in ENV_DEFAULTS:
            raise AttributeError(f"nanfuzz's stand-in for sglang.srt.environ.envs has no {name!r}; "
                                 "this SGLang version needs more of its runtime")
        return _Flag(ENV_DEFAULTS[name])


def is_hip() -> bool:
    return device_properties().is_hip


def is_cuda() -> bool:
    return not device_properties().is_hip


def get_device_core_count(device_id: int = 0) -> int:
    return device_properties(device_id).compute_units


_module = functools.partial(standin_module, library="SGLang")


def build() -> dict[str, types.ModuleType]:
    """A fresh set of stand-in modules by dotted name, parents linked to children."""
    modules = {name: _module(name, {}, package=True) for name in PACKAGES}
    modules["sglang.srt.environ"] = _module("sglang.srt.environ", {"envs": Envs()})
    modules["sglang.srt.utils"] = _module("sglang.srt.utils", {
        "is_hip": is_hip, "is_cuda": is_cuda, "get_device_core_count": get_device_core_count,
        "is_gfx95_supported": lambda: amd_arch() == "gfx950", "is_gfx1250_supported": lambda: amd_arch() == "gfx1250"})
    for name, module in modules.items():
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(modules[parent], child, module)
    return modules
