"""Small stand-ins for the AITER runtime helpers that its Triton attention files import.

AITER's kernel files are plain Triton plus a few helpers from
``aiter.ops.triton.utils``: a logger, the device's compute-unit count and
architecture, and the fp8 type the architecture uses.  Importing ``aiter`` itself pulls in its
JIT build machinery and compiled extensions, so the loader registers these
modules under the real names while it executes the kernel files, and only
then.  Each answers what the kernels ask, from torch and Triton, and says so
when asked for more.
"""
from __future__ import annotations

import functools
import logging
import types

import torch

from nanfuzz.harness.adapters.standins import amd_arch, standin_module
from nanfuzz.harness.device import device_properties

# Parents of the modules below; they hold no code, and an empty __path__ keeps
# any other ``aiter.*`` import from silently reaching into a source tree.
PACKAGES = ("aiter", "aiter.ops", "aiter.ops.triton", "aiter.ops.triton._triton_kernels", "aiter.ops.triton.utils",
            "aiter.ops.triton.utils._triton", "aiter.ops.triton.attention", "aiter.ops.triton._triton_kernels.attention")

# The chiplets (XCDs) of an MI300X or MI355X; AITER spreads work across them.
XCDS = 8


def get_num_sms() -> int:
    """Compute units (AMD) or SMs (NVIDIA) of the current device, or under Triton's interpreter of
    the GPU the run stands in for; AITER sizes launch grids by it."""
    return device_properties().compute_units


def get_num_xcds() -> int:
    return XCDS


def get_fp8_dtypes() -> tuple[torch.dtype, torch.dtype]:
    """(e5m2, e4m3) as AITER picks them: OCP on gfx950 and on non-AMD devices, fnuz on MI300-class gfx94x."""
    if amd_arch().startswith("gfx94"):
        return torch.float8_e5m2fnuz, torch.float8_e4m3fnuz
    return torch.float8_e5m2, torch.float8_e4m3fn


def get_fp8_e4m3_dtype() -> torch.dtype:
    return get_fp8_dtypes()[1]


class AiterTritonLogger:
    """``AiterTritonLogger``: one logger for every AITER Triton op, quiet unless logging is configured."""

    _LOGGER = logging.getLogger("nanfuzz.aiter")
    _LOGGER.addHandler(logging.NullHandler())

    def get_logger(self) -> logging.Logger:
        return self._LOGGER

    def debug(self, msg: str) -> None:
        self._LOGGER.debug(msg)

    def info(self, msg: str) -> None:
        self._LOGGER.info(msg)

    def warning(self, msg: str) -> None:
        self._LOGGER.warning(msg)

    def error(self, msg: str) -> None:
        self._LOGGER.error(msg)

    def critical(self, msg: str) -> None:
        self._LOGGER.critical(msg)


def _device() -> str:
    """AITER's name for the device (MI300X, MI350X), by architecture."""
    return {"gfx942": "MI300X", "gfx950": "MI350X"}.get(amd_arch(), amd_arch() or "not an AMD GPU")


_module = functools.partial(standin_module, library="AITER")


def build() -> dict[str, types.ModuleType]:
    """A fresh set of stand-in modules by dotted name, parents linked to children."""
    e5m2, e4m3 = get_fp8_dtypes()
    modules = {name: _module(name, {}, package=True) for name in PACKAGES}
    modules.update({
        "aiter.ops.triton.utils.logger": _module("aiter.ops.triton.utils.logger", {"AiterTritonLogger": AiterTritonLogger}),
        "aiter.ops.triton.utils.device_info": _module(
            "aiter.ops.triton.utils.device_info", {"get_num_sms": get_num_sms, "get_num_xcds": get_num_xcds}),
        "aiter.ops.triton.utils._triton.arch_info": _module("aiter.ops.triton.utils._triton.arch_info", {
            "get_arch": amd_arch, "get_device": _device,
            "is_fp8_avail": lambda: amd_arch() in ("gfx942", "gfx950"),
            "is_fp4_avail": lambda: amd_arch() == "gfx950"}),
        "aiter.ops.triton.utils.types": _module("aiter.ops.triton.utils.types", {
            "get_fp8_dtypes": get_fp8_dtypes, "get_fp8_e4m3_dtype": get_fp8_e4m3_dtype,
            "e5m2_dtype": e5m2, "e4m3_dtype": e4m3}),
    })
    for name, module in modules.items():
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(modules[parent], child, module)
    return modules
