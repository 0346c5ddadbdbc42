"""Small stand-ins for what FlashAttention's AMD Triton backend imports beside its own files.

``interface_fa.py`` imports ``einops`` and ``flash_attn.layers.rotary`` for the
rotary embedding it applies to new tokens, which nanfuzz's call never asks for
(no ``rotary_cos``/``rotary_sin``); ``import flash_attn`` itself wants its CUDA
extension.  The loader registers these modules under the real names while the
kernel files run, and only then; called, they say so.
"""
from __future__ import annotations

import functools
import types

from nanfuzz.harness.adapters.standins import standin_module
from nanfuzz.reference.errors import NanfuzzError

PACKAGES = ("flash_attn", "flash_attn.layers", "flash_attn.flash_attn_triton_amd")


def _not_driven(name: str):
    def refuse(*_args, **_kwargs):
        raise NanfuzzError(f"{name} is a stand-in: nanfuzz's call to the AMD backend applies no rotary embedding")
    refuse.__name__ = name.rpartition(".")[2]
    return refuse


_module = functools.partial(standin_module, library="FlashAttention")


def build() -> dict[str, types.ModuleType]:
    """A fresh set of stand-in modules by dotted name, parents linked to children."""
    modules = {name: _module(name, {}, package=True) for name in PACKAGES}
    modules["flash_attn.layers.rotary"] = _module(
        "flash_attn.layers.rotary", {"apply_rotary_emb": _not_driven("flash_attn.layers.rotary.apply_rotary_emb")})
    modules["einops"] = _module("einops", {"rearrange": _not_driven("einops.rearrange"),
                                           "repeat": _not_driven("einops.repeat")})
    for name, module in modules.items():
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(modules[parent], child, module)
    return modules
