"""The released adapters with the geometry of a finding on file left out, for campaigns "past the findings".

``NANFUZZ_VLLM_SRC=DIR nanfuzz fuzz --kernel tests.past_findings:triton_attn_int4_without_windows`` from
the repository root.  Each library's tree comes from its environment variable (``NANFUZZ_VLLM_SRC``,
``NANFUZZ_AITER_SRC``, ``NANFUZZ_FA_SRC``, ``NANFUZZ_LMDEPLOY_SRC``; None: the installed package), which a user
module reads itself; ``--vllm-src DIR`` and its siblings on the command line set them too.
What each leaves out, and the repro on file that is why:

- ``triton_attn_int4_without_windows``: vLLM 0.33.0's INT4 per-token-head attention multiplies P by the
  V scales of keys below its window (vllm_triton_attn_int4-nan-v-scale-below-window.json);
- ``rocm_segmented_attn_without_windows``: ROCM_SEGMENTED_ATTN loads a window's first tile whole
  (vllm_rocm_segmented_attn-window-first-tile-loads-expired-v.json);
- ``triton_mla_two_heads``: TRITON_MLA's per-head stage 1 sums q.k in bf16/fp16 where a rank has one
  query head (tests/near_bound/vllm_triton_mla-per-head-stage-1-sums-qk-in-bf16.json, within the error
  model since): cases of one query head declined, so a campaign meets the grouped stage 1 alone;
- ``pa_decode_float16``: AITER's pa_decode crashes (v1) and misreads padding lanes (v2) at 48-slot blocks
  and computes a block's element offset in int32 (aiter_pa_decode-*.json): float16, no 48-slot blocks,
  no cache whose block offsets pass 2^31 elements;
- ``pa_prefill_without_windows``: AITER's pa_prefill reads a window's expired slots of a block that still
  holds live keys (aiter_pa_prefill-window-expired-slots-of-a-live-block.json) and computes a context
  block's element offset in int32 (aiter_pa_prefill-block-offset-past-2-31-crash.json): no window, no cache
  whose block offsets pass 2^31 elements;
- ``chunked_pa_prefill_prefills_without_windows``: AITER's chunked_pa_prefill decodes with a kernel that
  loads every block whole, its tail included, so NaN there or stale finite values overflow
  (aiter_chunked_pa_prefill-decode-tail-*.json), and prefills with pa_prefill's kernel, window finding
  included (aiter_chunked_pa_prefill-prefill-window-expired-slots.json): its prefill chunks (every
  scheduled sequence of two new tokens or more) with no window and no cache past 2^31 elements;
- ``unified_attention_without_windows``: AITER's unified_attention loads V past ``seq_len`` unmasked
  (aiter_unified_attention-*-tail-past-seq-len.json), reads a window's expired slots and the null block
  (aiter_unified_attention-window-*.json), and fails to compile its 3D merge for a head size that is not
  a power of two (80 on file, 96 as well) and its decode for 48-slot blocks
  (aiter_unified_attention-*-crash.json), and its float32 tiles for a head of 256 need 256 KiB of shared
  memory (docs/libraries.md): no window, heads of 32, 64, 128 or 256 (256 not in float32), no 48-slot block, run
  with ``--poison null-block --poison padding --poison unreferenced`` so that the tails, which nearly
  every batch holds, keep finite values (the tail finding is on file);
- ``fa_contiguous_one_tile``: FlashAttention's AMD decode ignores the window and masks later tiles from
  the tile's start (fa_amd_kvcache-contiguous-*.json): no window, sequences of one 64-key tile;
- ``lmdeploy_decode_without_windows``: lmdeploy's decode loads each block's V whole, tail included
  (lmdeploy_decode-*tail-past-seq-len.json), and a window's first block with its expired keys
  (lmdeploy_decode-window-expired-slots-of-a-live-block.json): no window, run with ``--poison null-block
  --poison padding --poison unreferenced`` so that the tails, which nearly every batch holds, keep finite
  values;
- ``lmdeploy_block_decode_unquantized``: the same kernel as a dLLM's block decode loads the same tails, and
  over an fp8 cache its quantized kernel reads other tokens' queries and unwritten scratch (a test in
  tests/test_lmdeploy_adapters.py): unquantized caches, run with the decode's ``--poison`` options;
- ``lmdeploy_prefill_without_windows``: lmdeploy's prefill weighs the expired keys of a query tile's first
  block (lmdeploy_prefill-window-expired-slots-of-a-live-block.json): no window.

Each subject loads its own library when it is first named, so a campaign of one needs that library's tree
alone; lmdeploy's prefill cannot load on Triton 3.9.
"""
from __future__ import annotations

import dataclasses
import os

from nanfuzz.harness.adapters import aiter, fa_amd, lmdeploy, vllm


def _past(kernel, what: str, supports=None, **capabilities):
    def declines(case):
        return (kernel.supports(case) if kernel.supports else None) or (supports(case) if supports else None)

    return dataclasses.replace(kernel, name=f"{kernel.name} {what}", spec="", supports=declines,
                               capabilities=kernel.capabilities.restrict(**capabilities))


def _source(variable: str):
    return os.environ.get(variable) or None


def _one_head(case):
    return "one query head: the per-head stage 1 on file" if case.geometry.num_q_heads == 1 else None


def _offsets_past_2_31(case):
    g = case.geometry
    if g.num_blocks * g.block_size * g.num_kv_heads * g.head_size >= 1 << 31:
        return "block offsets past 2^31 elements: the int32 offset on file"
    return None


def _float32_past_head_128(case):
    g = case.geometry
    if g.dtype == "float32" and g.head_size > 128:
        return "float32 with a head past 128: tiles that need 256 KiB of shared memory (seen on an H200)"
    return None


def _vllm(name: str):
    return vllm.kernel(name, _source("NANFUZZ_VLLM_SRC"))


def _aiter(name: str):
    return aiter.kernel(name, _source("NANFUZZ_AITER_SRC"))


def _pa_decode_float16():
    kernel = _aiter("aiter:pa_decode")
    return _past(kernel, "in float16 without 48-slot blocks", supports=_offsets_past_2_31,
                 dtypes=("float16",), interpreter_dtypes=("float16",),
                 block_sizes=tuple(b for b in kernel.capabilities.block_sizes if b != 48))


def _unified_attention_without_windows():
    kernel = _aiter("aiter:unified_attention")
    return _past(kernel, "without windows, with power-of-two heads and no 48-slot block",
                 supports=_float32_past_head_128, sliding_window=False,
                 head_sizes=tuple(h for h in kernel.capabilities.head_sizes if h & (h - 1) == 0),
                 block_sizes=tuple(b for b in kernel.capabilities.block_sizes if b != 48))


def _lmdeploy(name: str, what: str, **capabilities):
    return lambda: _past(lmdeploy.kernel(name, _source("NANFUZZ_LMDEPLOY_SRC")), what, **capabilities)


# name: how its subject is built.  Each is built when first named and loads its own library alone, so
# that a campaign of one subject needs that library's tree and no other.
_SUBJECTS = {
    "triton_attn_int4_without_windows": lambda: _past(_vllm(vllm.INT4_NAME), "without windows",
                                                      sliding_window=False),
    "rocm_segmented_attn_without_windows": lambda: _past(_vllm("vllm:rocm_segmented_attn"), "without windows",
                                                         sliding_window=False),
    "triton_mla_two_heads": lambda: _past(_vllm("vllm:triton_mla"), "with two query heads or more",
                                          supports=_one_head),
    "pa_decode_float16": _pa_decode_float16,
    "pa_prefill_without_windows": lambda: _past(_aiter("aiter:pa_prefill"), "without windows",
                                                supports=_offsets_past_2_31, sliding_window=False),
    "chunked_pa_prefill_prefills_without_windows": lambda: _past(
        _aiter("aiter:chunked_pa_prefill"), "prefill chunks without windows", supports=_offsets_past_2_31,
        sliding_window=False, min_query_len=2),
    "unified_attention_without_windows": _unified_attention_without_windows,
    "fa_contiguous_one_tile": lambda: _past(fa_amd.kernel("fa_amd:kvcache@contiguous", _source("NANFUZZ_FA_SRC")),
                                            "without windows, sequences of one 64-key tile",
                                            sliding_window=False, max_seq_len=64),
    "lmdeploy_decode_without_windows": _lmdeploy("lmdeploy:decode", "without windows", sliding_window=False),
    "lmdeploy_block_decode_unquantized": _lmdeploy("lmdeploy:decode@block", "over unquantized caches",
                                                   kv_cache_dtypes=("auto",)),
    "lmdeploy_prefill_without_windows": _lmdeploy("lmdeploy:prefill", "without windows", sliding_window=False),
}


def __getattr__(name: str):
    if name not in _SUBJECTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    subject = _SUBJECTS[name]()
    globals()[name] = subject  # built once: later look-ups find it without this function
    return subject
