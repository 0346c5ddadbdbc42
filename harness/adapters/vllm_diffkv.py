"""vLLM's TRITON_ATTN for different K and V head sizes as a nanfuzz kernel: ``vllm:triton_attn_diffkv``.

``unified_attention_diffkv`` (``vllm/v1/attention/ops/triton_unified_attention_diffkv.py``) is
the kernel behind the TRITON_ATTN_DIFFKV backend, which serves models whose V head size
differs from K's (MiMo: K 192, V 128).  The backend keeps one packed cache per layer,
``[num_blocks, block_size, num_kv_heads, head_size_qk + head_size_v]``: each (slot, head) row
holds K's entries, then V's.  It hands the kernel two views of it, ``[..., :head_size_qk]`` as
the key cache and ``[..., head_size_qk:]`` as the value cache, with the window as
``(W - 1, 0)`` (decoder layers only: the kernel asserts causal attention), per-tensor fp8
scales for an fp8 cache, and split-K scratch whose rows are V-wide.

The adapter packs the case's K and V caches that way (every slot, dead ones and the caches'
margins included, so poison and redzones survive) and, like ``vllm:triton_attn``, offers the
split-K scratch (NaN, as stale scratch) for odd ``data_seed`` and withholds it for even ones:
with it, decode batches and short multi-query batches without a window take the 3D path
(per-segment partials and ``kernel_reduce_segments_diffkv``); ``@2d`` and ``@3d`` pin the choice.
"""
from __future__ import annotations

import functools

import torch

from nanfuzz.harness.adapters import vllm_loader
from nanfuzz.harness.kernel import Kernel
from nanfuzz.reference.batch import PagedBatch
from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.quantization import codes_of
from nanfuzz.reference.windows import window_size

NAME = "vllm:triton_attn_diffkv"
PATHS = ("2d", "3d")
VARIANTS = tuple(f"{NAME}@{path}" for path in PATHS)
# The backend takes any multiple of 16 (MultipleOf(16)); 48 stands for the non-powers of two.
BLOCK_SIZES = (16, 32, 64, 48)
# (K, V) head sizes: MiMo-V2's 192 / 128, and three that are cheap under the interpreter and pad
# each side differently (a V narrower than K, a non-power-of-two V, a V wider than K).
DIFF_KV = ((192, 128), (64, 32), (96, 48), (32, 64))
# V as wide as K: the backend takes any head size from 32 (supports_head_size).
HEAD_SIZES = (64, 128)
# A compile per head sizes, head counts, block size, window and sinks: a GPU campaign covers this many.
POOL = 16
# The TRITON_ATTN backend's split-K segment count (NUM_PAR_SOFTMAX_SEGMENTS).
SOFTMAX_SEGMENTS = 16

CAPABILITIES = Capabilities(
    head_sizes=HEAD_SIZES,
    diff_kv=DIFF_KV,
    block_sizes=BLOCK_SIZES,
    causal=True,
    non_causal=False,   # unified_attention_diffkv asserts causal; the backend serves decoder layers only
    sliding_window=True,
    sinks=True,
    specialisation_pool=POOL,
)


def packed_cache(batch: PagedBatch) -> torch.Tensor:
    """The backend's packed cache ``[num_blocks, block_size, num_kv_heads, head_size + v_head_size]``
    (K's entries, then V's; codes for a quantized cache, as uint8), inside the margins of the case's
    caches: every slot and every redzone block copied."""
    keys, values = batch.allocations.get("key_cache"), batch.allocations.get("value_cache")
    if keys is not None and values is not None and keys.index == values.index:
        key_base, value_base, blocks = keys.base, values.base, keys.index[0]
    else:  # a batch built without redzones
        key_base, value_base, blocks = batch.key_cache, batch.value_cache, slice(None)
    if batch.case.kv_cache.quantized:
        key_base, value_base = codes_of(key_base), codes_of(value_base)
    return torch.cat([key_base, value_base], dim=-1)[blocks]


def run_triton_attn_diffkv(batch: PagedBatch, out: torch.Tensor, *, path: str | None = None,
                           source: str | None = None) -> torch.Tensor:
    case = batch.case
    g = case.geometry
    loaded = vllm_loader.load("triton_attn_diffkv", source)
    entry = loaded["triton_unified_attention_diffkv"].unified_attention_diffkv
    device = batch.q.device
    kv_cache = packed_cache(batch)
    descales = {}
    if case.kv_cache.quantized:  # the platform's fp8 (the only one the capabilities take), scales per tensor
        kv_cache = kv_cache.view(batch.key_cache.dtype)
        descales = dict(k_descale=batch.k_scale, v_descale=batch.v_scale)
    split_k: dict = {}
    if (path == "3d" if path is not None else case.data_seed % 2 == 1) and case.num_tokens > 0:
        rows = (case.num_tokens, g.num_q_heads, SOFTMAX_SEGMENTS)
        padded = 1 << (g.v_head_size - 1).bit_length()  # next_power_of_2(head_size_v), as the backend's builder
        split_k = dict(
            # at least the batch's sequences: vLLM's size rule never vetoes the scratch offered
            seq_threshold_3D=len(case.sequences),
            num_par_softmax_segments=SOFTMAX_SEGMENTS,
            softmax_segm_output=torch.full((*rows, padded), float("nan"), dtype=torch.float32, device=device),
            softmax_segm_max=torch.full(rows, float("nan"), dtype=torch.float32, device=device),
            softmax_segm_expsum=torch.full(rows, float("nan"), dtype=torch.float32, device=device),
        )
    with loaded.active():
        entry(
            q=batch.q, k=kv_cache[..., :g.head_size], v=kv_cache[..., g.head_size:], out=out,
            cu_seqlens_q=batch.query_start_loc, seqused_k=batch.seq_lens, softmax_scale=case.scale,
            causal=True, window_size=window_size(case), block_table=batch.block_table, softcap=0,
            sinks=batch.sinks, max_seqlen_q=case.max_query_len, **split_k, **descales,
        )
    return out


def kernel(name: str, source: str | None = None) -> Kernel:
    """``vllm:triton_attn_diffkv`` (or ``@2d`` / ``@3d``), with vLLM's kernel files from ``source``."""
    loaded = vllm_loader.load("triton_attn_diffkv", source)
    path = name.partition("@")[2] or None
    # TritonAttentionDiffKVBackend: "auto", and "fp8" / "fp8_e4m3" read as the platform's fp8, per tensor
    caps = CAPABILITIES.restrict(kv_cache_dtypes=("auto", vllm_loader.platform_fp8(loaded)))
    return Kernel(name=name, run=functools.partial(run_triton_attn_diffkv, path=path, source=source),
                  capabilities=caps, source=source)
