"""FlashAttention's AMD Triton backend, loaded by ``harness.adapters.loader``.

The backend is ``flash_attn/flash_attn_triton_amd/`` (what
``FLASH_ATTENTION_TRITON_AMD_ENABLE=TRUE`` selects on ROCm); its ``interface_fa.py``
imports every forward and backward module, so all of them are loaded, and those
that do not import on this Triton (a backward kernel whose autotune keys a later
Triton refuses) are replaced by placeholders, said in ``nanfuzz list``.  A tree comes
from ``--fa-src DIR`` / ``$NANFUZZ_FA_SRC`` (an unpacked source distribution or a
checkout) or the installed flash_attn.
"""
from __future__ import annotations

import os

from nanfuzz.harness.adapters import fa_standins, loader
from nanfuzz.harness.adapters.loader import KernelModule, LoadedKernels

ENV_VAR = "NANFUZZ_FA_SRC"
TESTED_VERSION = "2.8.3.post2"


def _backward(name: str) -> KernelModule:
    return KernelModule(name, (), replaceable=True)


# In load order: a module's in-package imports come before it.
GROUPS: dict[str, tuple[KernelModule, ...]] = {
    "kvcache": (
        KernelModule("utils", ("get_padded_headsize",)),
        KernelModule("fwd_prefill", ("attention_prefill_forward_triton_impl",), replaceable=True),
        _backward("bwd_prefill"),
        _backward("bwd_prefill_split"),
        _backward("bwd_prefill_fused"),
        _backward("bwd_prefill_onekernel"),
        KernelModule("fwd_decode", ("attention_decode_forward_triton_impl", "_fwd_kernel_splitK", "_splitK_reduce")),
        KernelModule("fwd_ref", (), replaceable=True),
        _backward("bwd_ref"),
        KernelModule("interface_fa", ("fwd_kvcache",)),
    ),
}

FLASH_ATTN = loader.Library(
    name="FlashAttention", package="flash_attn", ops_package="flash_attn.flash_attn_triton_amd", option="--fa-src",
    env_var=ENV_VAR, distribution="flash_attn", tested=f"flash-attn {TESTED_VERSION}", groups=GROUPS,
    standins=fa_standins.build, prefix="fa_amd", release="source distribution",
)


def load(group: str, source: str | os.PathLike | None = None) -> LoadedKernels:
    """The kernel modules of ``group`` ("kvcache"), loaded once per source.

    ``source`` is an unpacked flash-attn source distribution or checkout (``--fa-src``, or
    ``$NANFUZZ_FA_SRC`` read at the edge); None: the installed flash_attn.
    """
    return loader.load(FLASH_ATTN, group, source)
