"""SGLang's Triton attention modules, loaded by ``harness.adapters.loader``.

The kernels live in ``sglang/kernels/ops/attention/`` (earlier releases:
``sglang/srt/layers/attention/triton_ops/``); without SGLang's runtime they import
the stand-ins of ``harness.adapters.sglang_standins``.  A tree comes from
``--sglang-src DIR`` / ``$NANFUZZ_SGLANG_SRC`` or the installed sglang.
"""
from __future__ import annotations

import os

from nanfuzz.harness.adapters import loader, sglang_standins
from nanfuzz.harness.adapters.loader import KernelModule, LoadedKernels

ENV_VAR = "NANFUZZ_SGLANG_SRC"
TESTED_VERSION = "0.5.23"
EARLIER = "sglang.srt.layers.attention.triton_ops"  # where releases before 0.5.2x keep the files


def _module(name: str, functions: tuple[str, ...], *, optional: bool = False) -> KernelModule:
    return KernelModule(name, functions, optional=optional, moved_to=(f"{EARLIER}.{name}",))


_DECODE = (
    _module("score_mod", (), optional=True),
    _module("decode_attention", ("decode_attention_fwd", "_fwd_kernel_stage1", "_fwd_grouped_kernel_stage1",
                                 "_fwd_kernel_stage2")),
)
# In load order: a module's in-package imports come before it.
GROUPS: dict[str, tuple[KernelModule, ...]] = {
    "decode": _DECODE,
    "extend": (*_DECODE, _module("extend_attention", ("extend_attention_fwd", "_fwd_kernel"))),
}

SGLANG = loader.Library(
    name="SGLang", package="sglang", ops_package="sglang.kernels.ops.attention", option="--sglang-src",
    env_var=ENV_VAR, distribution="sglang", tested=f"SGLang {TESTED_VERSION}", groups=GROUPS,
    standins=sglang_standins.build,
)


def load(group: str, source: str | os.PathLike | None = None) -> LoadedKernels:
    """The kernel modules of ``group`` ("decode" or "extend"), loaded once per source.

    ``source`` is an SGLang source tree or unpacked wheel (``--sglang-src``, or
    ``$NANFUZZ_SGLANG_SRC`` read at the edge); None: the installed sglang.
    """
    return loader.load(SGLANG, group, source)
