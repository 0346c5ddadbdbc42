"""Stand-in modules for a kernel library's runtime (its logger, platform, device info).

A library's Triton files import a little of the library around them; the
loader puts small modules in their place so that only the kernel files run.
A name a stand-in lacks fails with a message that says so, not a bare
AttributeError deep in the library's import.  Device queries answer from
``nanfuzz.device_properties()``: the visible GPU, or under Triton's interpreter
the GPU the run stands in for.
"""
from __future__ import annotations

import types
from typing import Any

import torch

from nanfuzz.harness.device import DeviceProperties, device_properties


def standin_module(name: str, attrs: dict[str, Any], *, library: str, package: bool = False) -> types.ModuleType:
    """A module ``name`` holding ``attrs``; a package (empty ``__path__``) when ``package``."""
    module = types.ModuleType(name, f"nanfuzz stand-in for {name}")
    module.__dict__.update(attrs)
    module.__package__ = name if package else name.rpartition(".")[0]
    if package:
        module.__path__ = []

    def missing(attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise AttributeError(f"nanfuzz's stand-in for {name} has no {attr!r}; "
                             f"this {library} version needs more of its runtime")

    module.__getattr__ = missing  # PEP 562: unknown names fail with a message
    return module


def amd_arch() -> str:
    """The AMD architecture (gfx942, gfx950) a library's platform query answers; "" on other GPUs
    (under Triton's interpreter: the stood-in GPU's, ``nanfuzz.device_properties()``)."""
    device = device_properties()
    return device.arch if device.is_hip else ""


def torch_on(device: DeviceProperties) -> types.ModuleType:
    """``torch`` as a library sees it on ``device``: ``torch.cuda``'s device queries and
    ``torch.version.hip`` answer for that device; every other name is torch's own.  Under Triton's
    interpreter an adapter puts it in place of a kernel module's ``torch`` (a launch override), so
    the library's own device logic runs for the GPU the run stands in for."""
    properties = types.SimpleNamespace(
        name=device.name, multi_processor_count=device.compute_units, major=device.major, minor=device.minor,
        warp_size=device.warp_size, gcnArchName=device.arch if device.is_hip else "")
    cuda = types.SimpleNamespace(
        is_available=lambda: True, device_count=lambda: 1, current_device=lambda: 0,
        get_device_properties=lambda device=None: properties,
        get_device_capability=lambda device=None: (properties.major, properties.minor))
    version = types.SimpleNamespace(hip="nanfuzz stand-in" if device.is_hip else None,
                                    cuda=None if device.is_hip else "nanfuzz stand-in")

    class Torch(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            return getattr(torch, name)

    seen = Torch("torch", f"torch as a kernel sees it on {device.name} (a nanfuzz stand-in)")
    seen.cuda, seen.version = cuda, version
    return seen
