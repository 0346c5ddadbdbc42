"""Kernels under test by name: built-ins, vLLM's, and users' own ``module:callable``.

What a kernel is lives in ``harness.kernel``.  Built-in kernel modules and
the vLLM adapters are imported lazily, so the caller can decide on
``TRITON_INTERPRET`` before any ``@triton.jit`` is defined.
"""
from __future__ import annotations

import importlib
from dataclasses import replace

from nanfuzz.harness.kernel import Kernel
from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.errors import NanfuzzError

# Built-in families: module path under harness.kernels; each exposes KERNELS.
BUILTIN_MODULES = ("paged_decode", "prefix_prefill", "unified")


def builtin_kernels() -> dict[str, Kernel]:
    kernels: dict[str, Kernel] = {}
    for family in BUILTIN_MODULES:
        module = importlib.import_module(f"nanfuzz.harness.kernels.{family}")
        for kernel in module.KERNELS:
            kernels[kernel.name] = kernel
    return kernels


def resolve(name: str) -> Kernel:
    """Turn a kernel name from the command line or a repro into a Kernel."""
    kernel = _resolve(name)
    return kernel if kernel.spec else replace(kernel, spec=name)


def _resolve(name: str) -> Kernel:
    if name.startswith("vllm:"):
        from nanfuzz.harness.adapters import vllm as vllm_adapters

        return vllm_adapters.kernel(name)
    if "@" in name or ":" not in name:
        known = builtin_kernels()
        if name not in known:
            from nanfuzz.harness.adapters.vllm import KERNEL_NAMES

            raise NanfuzzError(f"unknown kernel {name!r}; known: {', '.join(sorted(known))}, "
                               f"{', '.join(KERNEL_NAMES)}, or package.module:callable")
        return known[name]
    return _user_kernel(name)


def _user_kernel(spec: str) -> Kernel:
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # a user's module may fail in any way while importing
        raise NanfuzzError(f"kernel {spec!r}: cannot import module {module_name!r} ({type(exc).__name__}: {exc})") from None
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise NanfuzzError(f"kernel {spec!r}: module {module_name!r} has no attribute {attr!r}") from None
    if isinstance(obj, Kernel):
        return obj
    if callable(obj) and isinstance(getattr(obj, "capabilities", None), Capabilities):
        return Kernel(name=spec, run=obj, capabilities=obj.capabilities)
    if callable(obj):
        try:
            made = obj()
        except TypeError:
            made = None
        if isinstance(made, Kernel):
            return made
    raise NanfuzzError(
        f"kernel {spec!r} is neither a nanfuzz.Kernel, a factory returning one, "
        "nor a callable with a .capabilities attribute")
