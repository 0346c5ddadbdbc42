"""Stand-in modules for a kernel library's runtime (its logger, platform, device info).

A library's Triton files import a little of the library around them; the
loader puts small modules in their place so that only the kernel files run.
A name a stand-in lacks fails with a message that says so, not a bare
AttributeError deep in the library's import.
"""
from __future__ import annotations

import types
from typing import Any

import torch


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
    """The AMD architecture (gfx942, gfx950) a library's platform query answers; "" on other GPUs."""
    if not torch.cuda.is_available():
        return "gfx950"  # the interpreter stands in for an MI355X
    if torch.version.hip is None:
        return ""
    return getattr(torch.cuda.get_device_properties(0), "gcnArchName", "").split(":")[0]
