"""The released adapters with the geometry of a finding on file left out, for campaigns "past the findings".

``NANFUZZ_VLLM_SRC=DIR nanfuzz fuzz --kernel tests.past_findings:triton_attn_int4_without_windows`` from
the repository root: vLLM 0.33.0's INT4 per-token-head attention multiplies P by the V scales of keys
below its sliding window (tests/regressions/vllm_triton_attn_int4-nan-v-scale-below-window.json);
without windows every other dead slot is still poisoned.  The vLLM tree comes from
``$NANFUZZ_VLLM_SRC`` (None: the installed vllm), which a user module reads itself.
"""
from __future__ import annotations

import dataclasses
import os

from nanfuzz.harness.adapters import vllm


def _without_windows(name: str):
    kernel = vllm.kernel(name, os.environ.get("NANFUZZ_VLLM_SRC") or None)
    return dataclasses.replace(kernel, name=f"{name} without windows", spec="",
                               capabilities=kernel.capabilities.restrict(sliding_window=False))


triton_attn_int4_without_windows = _without_windows(vllm.INT4_NAME)
