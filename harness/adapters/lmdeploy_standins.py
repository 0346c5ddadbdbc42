"""Small stand-ins for what lmdeploy's Triton attention files import beside their own folder.

``pagedattention.py`` and ``flatten_kv_cache.py`` import ``QuantPolicy`` from
``lmdeploy.messages`` and a logger from ``lmdeploy.utils``; ``import lmdeploy`` itself
pulls in its serving stack (and TurboMind's compiled engine).  The loader registers these
modules under the real names while the kernel files run, and only then.  The files of the
kernels' own folder (``utils.py``, ``turbo_quant.py``) are lmdeploy's, loaded as they are.

lmdeploy sizes its launches from ``torch.cuda.get_device_properties`` and asks Triton's
driver and ``torch.version.hip`` which vendor it runs on.  On a GPU those answer for
themselves; under Triton's interpreter ``interpreter_overrides`` puts ``torch`` as the
stood-in GPU shows it (``nanfuzz.device_properties()``: an MI355X unless the kernel declares
another) in the kernel modules' place for each call, so lmdeploy's own tables choose its
split count, tiles and PDL as they would there.
"""
from __future__ import annotations

import enum
import functools
import logging
import types

from nanfuzz.harness.adapters.standins import standin_module, torch_on
from nanfuzz.harness.device import device_properties

PACKAGES = ("lmdeploy", "lmdeploy.pytorch", "lmdeploy.pytorch.kernels", "lmdeploy.pytorch.kernels.cuda")


class QuantPolicy(enum.IntEnum):
    """``lmdeploy.messages.QuantPolicy``: the KV-cache quantization the kernels dispatch on (lmdeploy's values)."""

    NONE = 0
    INT4 = 4
    INT8 = 8
    FP8 = 16
    FP8_E5M2 = 17
    TURBO_QUANT = 42


_LOGGER_ROOT = "nanfuzz.lmdeploy"
# lmdeploy warns about head and block sizes it finds slow; keep that off stderr unless logging is configured.
logging.getLogger(_LOGGER_ROOT).addHandler(logging.NullHandler())


def get_logger(name: str | None = None, *_args, **_kwargs) -> logging.Logger:
    return logging.getLogger(f"{_LOGGER_ROOT}.{name or 'lmdeploy'}")


_module = functools.partial(standin_module, library="lmdeploy")


def build() -> dict[str, types.ModuleType]:
    """A fresh set of stand-in modules by dotted name, parents linked to children."""
    modules = {name: _module(name, {}, package=True) for name in PACKAGES}
    modules["lmdeploy.messages"] = _module("lmdeploy.messages", {"QuantPolicy": QuantPolicy})
    modules["lmdeploy.utils"] = _module("lmdeploy.utils", {"get_logger": get_logger})
    for name, module in modules.items():
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(modules[parent], child, module)
    return modules


def interpreter_overrides(loaded, kernel_modules: tuple[str, ...]) -> dict[tuple[str, str], object]:
    """The launch overrides (``LoadedKernels.active``) under which lmdeploy's device queries answer
    for the stood-in GPU: its ``utils.get_device_props`` uncached (lmdeploy caches it per process)
    reading ``torch`` as that GPU shows it, ``is_cuda()`` by its vendor, and ``torch.version.hip``
    in each of ``kernel_modules`` that reads it."""
    device = device_properties()
    seen = torch_on(device)
    uncached = loaded["utils"].get_device_props.__wrapped__
    overrides: dict[tuple[str, str], object] = {("utils", "torch"): seen}
    for name in kernel_modules:
        module = loaded[name]
        if hasattr(module, "get_device_props"):
            overrides[(name, "get_device_props")] = uncached
        if hasattr(module, "is_cuda"):
            overrides[(name, "is_cuda")] = lambda: not device.is_hip
        if name == "flashattention":
            overrides[(name, "torch")] = seen  # its tiles follow torch.version.hip
    return overrides
