"""lmdeploy's Triton attention modules (its PyTorch engine's), loaded by ``harness.adapters.loader``.

The kernels live in ``lmdeploy/pytorch/kernels/cuda/``; without lmdeploy's runtime they
import the stand-ins of ``harness.adapters.lmdeploy_standins``.  A tree comes from
``--lmdeploy-src DIR`` / ``$NANFUZZ_LMDEPLOY_SRC`` (a checkout or an unpacked wheel) or the
installed lmdeploy.
"""
from __future__ import annotations

import os

from nanfuzz.harness.adapters import lmdeploy_standins, loader
from nanfuzz.harness.adapters.loader import KernelModule, LoadedKernels

ENV_VAR = "NANFUZZ_LMDEPLOY_SRC"
TESTED_VERSION = "0.18.0"

# What both groups import from the kernels' folder.
_SHARED = (
    KernelModule("utils", ("get_device_props", "is_cuda")),
    KernelModule("turbo_quant", ("hadamard_rotate",)),
)
# In load order: a module's in-package imports come before it.
GROUPS: dict[str, tuple[KernelModule, ...]] = {
    "decode": (*_SHARED, KernelModule("pagedattention", (
        "flash_attn_with_kvcache", "_fwd_grouped_split_kernel", "_fwd_grouped_split_quant_kernel",
        "_reduce_split_kernel"))),
    "prefill": (*_SHARED, KernelModule("flatten_kv_cache", ("flatten_kv_cache", "_flatten_kv_cache",
                                                            "_flatten_kv_cache_fp8_scalar")),
                KernelModule("flashattention", ("flash_attn_varlen_func", "_flash_prefill_fwd_kernel"))),
}

LMDEPLOY = loader.Library(
    name="lmdeploy", package="lmdeploy", ops_package="lmdeploy.pytorch.kernels.cuda", option="--lmdeploy-src",
    env_var=ENV_VAR, distribution="lmdeploy", tested=f"lmdeploy {TESTED_VERSION}", groups=GROUPS,
    standins=lmdeploy_standins.build,
)


def load(group: str, source: str | os.PathLike | None = None) -> LoadedKernels:
    """The kernel modules of ``group`` ("decode" or "prefill"), loaded once per source.

    ``source`` is an lmdeploy source tree or unpacked wheel (``--lmdeploy-src``, or
    ``$NANFUZZ_LMDEPLOY_SRC`` read at the edge); None: the installed lmdeploy.
    """
    return loader.load(LMDEPLOY, group, source)
