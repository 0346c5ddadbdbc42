"""The GPU a launch runs on, or the one a run under Triton's interpreter stands in for.

Kernels size their launches from their device: its compute units, its architecture, what it
has (programmatic dependent launch from NVIDIA's sm_90 on, OCP or fnuz fp8 on AMD).  On a GPU
``device_properties()`` answers from torch for the visible device.  Under Triton's interpreter
there is no device to ask, and it answers for the GPU the run stands in for: the one the kernel
under test declares (``Kernel(stands_in_for=...)``, in force while nanfuzz launches it), else an
MI355X, the GPU nanfuzz's users gate on.  Adapters answer a library's device queries (its
platform module, its SM count) from here, so every library a CPU run loads sees one device:

    from nanfuzz import device_properties
    props = device_properties()
    props.compute_units, props.arch, props.capability   # 256, "gfx950", (9, 5) under the interpreter
"""
from __future__ import annotations

import contextlib
import contextvars
import os
from dataclasses import dataclass, replace
from typing import Iterator

from nanfuzz.reference.errors import NanfuzzError


@dataclass(frozen=True)
class DeviceProperties:
    """What kernels ask of their GPU.  ``major``/``minor`` are torch's ``get_device_capability()``:
    (9, 0) on an H100 or H200, and on ROCm the gfx number's digits ((9, 4) for gfx942, (9, 5) for
    gfx950)."""

    name: str             # "AMD Instinct MI355X", "NVIDIA H200"
    vendor: str           # "amd" or "nvidia"
    arch: str             # "gfx950", "gfx942", "sm_90"
    compute_units: int    # compute units (AMD) or SMs (NVIDIA): torch's multi_processor_count
    major: int
    minor: int
    warp_size: int        # threads a warp (NVIDIA) or wavefront (AMD) runs: 32 or 64
    interpreted: bool = False  # these are a stood-in device's (a run under Triton's interpreter)

    def __post_init__(self):
        if self.vendor not in ("amd", "nvidia"):
            raise NanfuzzError(f"DeviceProperties(vendor={self.vendor!r}) must be 'amd' or 'nvidia'")
        for field_name in ("compute_units", "warp_size"):
            value = getattr(self, field_name)
            if type(value) is not int or value < 1:
                raise NanfuzzError(f"DeviceProperties({field_name}={value!r}) must be a whole number >= 1")

    @property
    def is_hip(self) -> bool:
        """An AMD GPU, which torch and Triton drive through HIP."""
        return self.vendor == "amd"

    @property
    def capability(self) -> tuple[int, int]:
        return (self.major, self.minor)


# AMD's and NVIDIA's published figures for the GPUs a CPU run may stand in for.
MI355X = DeviceProperties("AMD Instinct MI355X", "amd", "gfx950", compute_units=256, major=9, minor=5, warp_size=64)
MI300X = DeviceProperties("AMD Instinct MI300X", "amd", "gfx942", compute_units=304, major=9, minor=4, warp_size=64)
H200 = DeviceProperties("NVIDIA H200", "nvidia", "sm_90", compute_units=132, major=9, minor=0, warp_size=32)
STOOD_IN_BY_DEFAULT = MI355X

_stood_in: contextvars.ContextVar[DeviceProperties] = contextvars.ContextVar(
    "nanfuzz_stood_in", default=replace(STOOD_IN_BY_DEFAULT, interpreted=True))


def interpreting() -> bool:
    """Do kernels run under Triton's interpreter here (``TRITON_INTERPRET=1``, or no GPU at all)?"""
    import torch

    return os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available()


def device_properties(index: int | None = None) -> DeviceProperties:
    """The visible GPU's properties (``index``: which one; default the current), or under Triton's
    interpreter those of the GPU the run stands in for (see the module's notes)."""
    if interpreting():
        return _stood_in.get()
    import torch

    index = torch.cuda.current_device() if index is None else index
    props = torch.cuda.get_device_properties(index)
    hip = torch.version.hip is not None
    arch = getattr(props, "gcnArchName", "").split(":")[0] if hip else f"sm_{props.major}{props.minor}"
    return DeviceProperties(props.name, "amd" if hip else "nvidia", arch, props.multi_processor_count,
                            props.major, props.minor, getattr(props, "warp_size", 64 if hip else 32))


@contextlib.contextmanager
def standing_in_for(device: DeviceProperties | None) -> Iterator[None]:
    """Within, a run under the interpreter stands in for ``device`` (None: leave it as it is)."""
    if device is None:
        yield
        return
    if not isinstance(device, DeviceProperties):
        raise NanfuzzError(f"stands_in_for={device!r} is not a nanfuzz.DeviceProperties "
                           "(e.g. nanfuzz.MI355X, nanfuzz.H200, or DeviceProperties(...) of your own)")
    token = _stood_in.set(replace(device, interpreted=True))
    try:
        yield
    finally:
        _stood_in.reset(token)
