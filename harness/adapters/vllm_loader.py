"""vLLM's attention-kernel modules, loaded by ``harness.adapters.loader``.

The kernels live in ``vllm/v1/attention/ops/``; without vLLM's runtime they
import the stand-ins of ``harness.adapters.vllm_standins``.  A tree comes
from ``--vllm-src DIR`` / ``$NANFUZZ_VLLM_SRC`` or the installed vllm.
"""
from __future__ import annotations

import os

import torch

from nanfuzz.harness.adapters import loader, vllm_standins
from nanfuzz.harness.adapters.loader import KernelModule, LoadedKernels
from nanfuzz.reference.errors import NanfuzzError

ENV_VAR = "NANFUZZ_VLLM_SRC"

# In load order: a module's in-package imports come before it.
GROUPS: dict[str, tuple[KernelModule, ...]] = {
    "rocm_attn": (
        KernelModule("prefix_prefill", ("context_attention_fwd",)),
        KernelModule("chunked_prefill_paged_decode", ("chunked_prefill_paged_decode", "kernel_paged_attention_2d")),
    ),
    "triton_attn": (
        KernelModule("triton_attention_helpers", (), optional=True),
        KernelModule("triton_unified_attention", ("unified_attention", "kernel_unified_attention", "reduce_segments")),
    ),
    "triton_attn_diffkv": (
        KernelModule("triton_attention_helpers", ()),
        KernelModule("triton_unified_attention_diffkv", ("unified_attention_diffkv", "kernel_unified_attention_diffkv",
                                                         "kernel_reduce_segments_diffkv")),
    ),
    "rocm_segmented_attn": (
        KernelModule("triton_attention_helpers", (), optional=True),
        KernelModule("triton_unified_attention", ("unified_attention",)),
        KernelModule("segmented_attention", ("segmented_attention", "can_use_segmented_attention",
                                             "_segmented_attention_stage", "_segmented_attention_reduce")),
    ),
    "triton_mla": (
        KernelModule("triton_decode_attention", ("decode_attention_fwd", "_fwd_grouped_kernel_stage1",
                                                 "_fwd_kernel_stage2")),
    ),
    # TRITON_ATTN's INT4 per-token-head cache: unified_attention hands it to int4_per_token_head,
    # which it imports on the call
    "triton_attn_int4": (
        KernelModule("triton_attention_helpers", ()),
        KernelModule("triton_unified_attention", ("unified_attention", "reduce_segments")),
        KernelModule("int4_per_token_head", ("unified_attention_int4", "_attn_packed", "single_rht")),
    ),
    "turboquant": (
        KernelModule("triton_decode_attention", ("_fwd_kernel_stage2",)),
        KernelModule("triton_turboquant_decode", ("triton_turboquant_decode_attention", "_tq_decode_stage1")),
    ),
}


def _native_call_modules():
    # chunked_prefill_paged_decode imports vllm.platforms.rocm on every call to
    # ask whether ROCm's custom kernel should run; even a real vLLM gets a
    # module that always says no, so the Triton path under test runs on every device.
    return {"vllm.platforms.rocm": vllm_standins.rocm_platform_module()}


VLLM = loader.Library(
    name="vLLM", package="vllm", ops_package="vllm.v1.attention.ops", option="--vllm-src", env_var=ENV_VAR,
    distribution="vllm", tested="vLLM 0.33.0", groups=GROUPS, standins=vllm_standins.build,
    native_call_modules=_native_call_modules,
)

_cache = loader._cache  # every library's loaded kernels, one per (library, group, source)


def load(group: str, source: str | os.PathLike | None = None) -> LoadedKernels:
    """The kernel modules of ``group`` (a key of ``GROUPS``), loaded once per source.

    ``source`` is a vLLM source tree or unpacked wheel (``--vllm-src``, or
    ``$NANFUZZ_VLLM_SRC`` read at the edge); None: the installed vllm.
    """
    return loader.load(VLLM, group, source)


def platform_fp8(loaded, module: str | None = None) -> str:
    """The platform's fp8 cache dtype as the loaded kernels see it: "fp8_e4m3fn" or "fp8_e4m3fnuz".
    ``module``: a loaded module that imports ``current_platform``; None (kernel files that do not ask
    the platform themselves): the stand-in's answer from torch."""
    platform = loaded[module].current_platform if module else vllm_standins.Platform()
    dtype = platform.fp8_dtype()
    names = {torch.float8_e4m3fn: "fp8_e4m3fn", torch.float8_e4m3fnuz: "fp8_e4m3fnuz"}
    if dtype not in names:
        raise NanfuzzError(f"vLLM's current_platform.fp8_dtype() is {dtype}, which nanfuzz has no cache dtype for")
    return names[dtype]
