"""Small stand-ins for the vLLM runtime modules that its attention kernels import.

vLLM's kernel files are plain Triton plus a handful of runtime imports
(``current_platform``, ``init_logger``, ``vllm.envs``, ``vllm.triton_utils``,
...).  The runtime itself will not import without vLLM's compiled
extensions, so the loader registers these modules under the real names
while it executes the kernel files, and only then.  Each answers exactly what
the kernels ask, from torch and Triton, and says so when asked for more.
"""
from __future__ import annotations

import enum
import functools
import logging
import types
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from nanfuzz.harness.adapters.standins import standin_module

# Parents of the modules below; they hold no code, and an empty __path__ keeps
# any other ``vllm.*`` import from silently reaching into a source tree.
PACKAGES = ("vllm", "vllm.platforms", "vllm.utils", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.ops",
            "vllm.v1.worker")


class DeviceCapability(NamedTuple):
    major: int
    minor: int

    def to_int(self) -> int:
        return self.major * 10 + self.minor


class Platform:
    """``vllm.platforms.current_platform``, answered from torch for the visible device."""

    def is_rocm(self) -> bool:
        return torch.version.hip is not None

    def is_cuda(self) -> bool:
        return torch.cuda.is_available() and not self.is_rocm()

    def is_cuda_alike(self) -> bool:
        return torch.cuda.is_available()

    def is_xpu(self) -> bool:
        return False

    def get_device_capability(self, device_id: int = 0) -> DeviceCapability | None:
        if not torch.cuda.is_available():
            return None
        return DeviceCapability(*torch.cuda.get_device_capability(device_id))

    def has_device_capability(self, capability: int | tuple[int, int], device_id: int = 0) -> bool:
        current = self.get_device_capability(device_id)
        if current is None:
            return False
        if isinstance(capability, tuple):
            return current >= capability
        return current.to_int() >= capability

    def is_device_capability(self, capability: int | tuple[int, int], device_id: int = 0) -> bool:
        current = self.get_device_capability(device_id)
        if current is None:
            return False
        return current == capability if isinstance(capability, tuple) else current.to_int() == capability

    def is_device_capability_family(self, capability: int, device_id: int = 0) -> bool:
        current = self.get_device_capability(device_id)
        return current is not None and current.to_int() // 10 == capability // 10

    def fp8_dtype(self) -> torch.dtype:
        # MI300-class (gfx94x) uses the fnuz encoding; every other device OCP e4m3.
        if self.is_rocm() and torch.cuda.is_available():
            arch = getattr(torch.cuda.get_device_properties(0), "gcnArchName", "")
            if "gfx94" in arch:
                return torch.float8_e4m3fnuz
        return torch.float8_e4m3fn

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"nanfuzz's stand-in for vllm.platforms.current_platform has no {name!r}")


class OnceLogger(logging.LoggerAdapter):
    """``vllm.logger.init_logger``'s logger: a plain logger plus the ``*_once`` helpers."""

    def __init__(self, logger: logging.Logger):
        super().__init__(logger, {})
        self._seen: set[tuple[int, str, tuple]] = set()

    def _once(self, level: int, msg: str, args: tuple) -> None:
        key = (level, msg, args)
        if key not in self._seen:
            self._seen.add(key)
            self.log(level, msg, *args)

    def debug_once(self, msg: str, *args: Any, **_scope: Any) -> None:
        self._once(logging.DEBUG, msg, args)

    def info_once(self, msg: str, *args: Any, **_scope: Any) -> None:
        self._once(logging.INFO, msg, args)

    def warning_once(self, msg: str, *args: Any, **_scope: Any) -> None:
        self._once(logging.WARNING, msg, args)


_LOGGER_ROOT = "nanfuzz.vllm"
# The kernels warn that they fall back from ROCm's custom kernel, which is
# what nanfuzz asks for; keep that off stderr unless logging is configured.
logging.getLogger(_LOGGER_ROOT).addHandler(logging.NullHandler())


def init_logger(name: str) -> OnceLogger:
    return OnceLogger(logging.getLogger(f"{_LOGGER_ROOT}.{name}"))


class KVQuantMode(enum.IntEnum):
    """The KV-cache quantisation modes the unified kernel dispatches on (same values as vLLM's)."""

    NONE = 0
    FP8_PER_TENSOR = 1
    INT8_PER_TOKEN_HEAD = 2
    FP8_PER_TOKEN_HEAD = 3
    INT4_PER_TOKEN_HEAD = 4


def largest_power_of_2_divisor(n: int) -> int:
    """``vllm.utils.math_utils.largest_power_of_2_divisor``: n's lowest set bit."""
    return n & -n


def _refuse_rocm_custom_kernel(*_args: Any, **_kwargs: Any) -> None:
    raise RuntimeError("ROCm's custom paged-attention kernel is disabled under nanfuzz; the Triton path is under test")


def _never_custom_paged_attention(*_args: Any, **_kwargs: Any) -> bool:
    return False


def _on_rdna() -> bool:
    # segmented_attention.py takes its Triton path only on RDNA (gfx1x; gfx12 for fp8 caches):
    # every device stands in for one, so that path is the one under test everywhere
    return True


def get_kv_quant_mode(kv_cache_dtype: str) -> KVQuantMode:
    """vLLM's map from a ``kv_cache_dtype`` string to its quantisation mode, for the per-tensor strings
    segmented_attention.py passes on."""
    modes = {"auto": KVQuantMode.NONE, "fp8": KVQuantMode.FP8_PER_TENSOR, "fp8_e4m3": KVQuantMode.FP8_PER_TENSOR}
    if kv_cache_dtype not in modes:
        raise ValueError(f"nanfuzz's stand-in for vllm.v1.kv_cache_interface has no mode for {kv_cache_dtype!r}")
    return modes[kv_cache_dtype]


def _no_workspace_manager() -> bool:
    return False


def _workspace_manager():
    raise RuntimeError("nanfuzz's stand-in for vllm.v1.worker.workspace has no workspace manager")


_module = functools.partial(standin_module, library="vLLM")


def rocm_platform_module() -> types.ModuleType:
    """``vllm.platforms.rocm`` as the kernels see it: the custom ROCm kernel is never chosen, and the
    device is an RDNA GPU where segmented attention asks."""
    return _module("vllm.platforms.rocm", {"use_rocm_custom_paged_attention": _never_custom_paged_attention,
                                           "on_gfx1x": _on_rdna, "on_gfx12x": _on_rdna})


def build() -> dict[str, types.ModuleType]:
    """A fresh set of stand-in modules by dotted name, parents linked to children."""
    modules = {name: _module(name, {}, package=True) for name in PACKAGES}
    modules["vllm.platforms"].current_platform = Platform()
    modules.update({
        "vllm.envs": _module("vllm.envs", {"VLLM_BATCH_INVARIANT": False}),
        "vllm.logger": _module("vllm.logger", {"init_logger": init_logger}),
        "vllm.triton_utils": _module("vllm.triton_utils", {"triton": triton, "tl": tl, "HAS_TRITON": True}),
        "vllm._custom_ops": _module("vllm._custom_ops", {"paged_attention_rocm": _refuse_rocm_custom_kernel}),
        "vllm.platforms.rocm": rocm_platform_module(),
        "vllm.v1.kv_cache_interface": _module("vllm.v1.kv_cache_interface", {"KVQuantMode": KVQuantMode,
                                                                            "get_kv_quant_mode": get_kv_quant_mode}),
        "vllm.v1.worker.workspace": _module("vllm.v1.worker.workspace", {
            "is_workspace_manager_initialized": _no_workspace_manager,
            "current_workspace_manager": _workspace_manager}),
        "vllm.utils.math_utils": _module("vllm.utils.math_utils",
                                         {"largest_power_of_2_divisor": largest_power_of_2_divisor}),
    })
    for name, module in modules.items():
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(modules[parent], child, module)
    return modules
