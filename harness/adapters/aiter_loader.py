"""AITER's Triton attention modules, loaded by ``harness.adapters.loader``.

The launchers live in ``aiter/ops/triton/`` and the ``@triton.jit`` kernels
in ``aiter/ops/triton/_triton_kernels/``; without AITER's runtime they import
the stand-ins of ``harness.adapters.aiter_standins``.  A tree comes from
``--aiter-src DIR`` / ``$NANFUZZ_AITER_SRC`` or the installed aiter.
"""
from __future__ import annotations

import os

from nanfuzz.harness.adapters import aiter_standins, loader
from nanfuzz.harness.adapters.loader import KernelModule, LoadedKernels

ENV_VAR = "NANFUZZ_AITER_SRC"
TESTED_VERSION = "0.1.7.post2.dev18"


def _kernel_module(name: str, functions: tuple[str, ...]) -> KernelModule:
    """A module of ``aiter/ops/triton/`` (launchers) or ``_triton_kernels/`` (the kernels); later
    AITER trees keep both in an ``attention/`` subfolder, which is looked for second."""
    folder, _, base = name.rpartition(".")
    return KernelModule(name, functions, moved_to=(f"{folder}.attention.{base}" if folder else f"attention.{base}",))


_PA_PREFILL = (
    _kernel_module("_triton_kernels.pa_prefill", ("_fwd_kernel",)),
    _kernel_module("pa_prefill", ("context_attention_fwd",)),
)

# In load order: a module's imports come before it.  The launcher modules are
# the ones without a leading underscore (see launchers()).
GROUPS: dict[str, tuple[KernelModule, ...]] = {
    "unified_attention": (
        _kernel_module("_triton_kernels.unified_attention",
                       ("kernel_unified_attention_2d", "kernel_unified_attention_3d", "reduce_segments")),
        _kernel_module("unified_attention", ("unified_attention", "use_2d_kernel")),
    ),
    "pa_decode": (
        _kernel_module("_triton_kernels.pa_decode",
                       ("_paged_attn_decode_v1_w_dot_kernel", "_paged_attn_decode_v2_w_dot_kernel")),
        _kernel_module("pa_decode", ("paged_attention_decode", "paged_attn_decode_v1", "paged_attn_decode_v2",
                                     "paged_attn_decode_v1_per_token_quant", "paged_attn_decode_v2_per_token_quant")),
    ),
    "pa_prefill": _PA_PREFILL,
    "chunked_pa_prefill": (
        *_PA_PREFILL,
        _kernel_module("_triton_kernels.chunked_pa_prefill", ("_kernel_paged_attention_2d",)),
        _kernel_module("chunked_pa_prefill", ("chunked_prefill_paged_decode",)),
    ),
}

AITER = loader.Library(
    name="AITER", package="aiter", ops_package="aiter.ops.triton", option="--aiter-src", env_var=ENV_VAR,
    distribution="amd_aiter", tested=f"AITER {TESTED_VERSION}", groups=GROUPS, standins=aiter_standins.build,
)


def load(group: str, source: str | os.PathLike | None = None) -> LoadedKernels:
    """The kernel modules of ``group`` (a kernel name after ``aiter:``), loaded once per source.

    ``source`` is an AITER source tree or unpacked amd-aiter wheel
    (``--aiter-src``, or ``$NANFUZZ_AITER_SRC`` read at the edge); None: the installed aiter.
    """
    return loader.load(AITER, group, source)


def launchers(loaded: LoadedKernels) -> dict:
    """The group's launcher modules (those that launch kernels) by name."""
    return {name: module for name, module in loaded.modules.items() if not name.startswith("_")}
