"""vLLM's TurboQuant decode with fp8 keys as a nanfuzz kernel: ``vllm:turboquant``.

``triton_turboquant_decode_attention`` (``vllm/v1/attention/ops/triton_turboquant_decode.py``)
is the TURBOQUANT backend's decode wherever FlyDSL's is not (every GPU but gfx950, and there
the layers FlyDSL declines go to the SoA kernels instead).  With ``key_fp8`` (the
``turboquant_k8v4`` preset, and the same with 3-bit values) it reads one combined cache
``[num_blocks, block_size, num_kv_heads, slot]`` of bytes; each (slot, head) row holds

    K: head_size fp8 e4m3fn codes, no scale (tl.float8e4nv; e4b15 on GPUs below sm_89)
    V: ceil(head_size x bits / 8) bytes of 3- or 4-bit codes as one little-endian bit string,
       then the fp16 scale and the fp16 zero (value = code x scale + zero), then a pad byte
       to an even slot

which is the case model's ``KVCache("fp8_e4m3fn", value=CacheSide(uintN, "token-head",
"offset", "float16"))`` (``CACHES``); the adapter lays the batch's caches out so, dead
slots and their scales included.  Stage 1 splits each sequence's keys over
``max_num_kv_splits`` (32, vLLM's ``tq_max_kv_splits_for_cuda_graph``) partitions,
stage 2 (``triton_decode_attention._fwd_kernel_stage2``) merges them into the output.

The Triton decode takes no sliding window and no sinks (the backend passes them to the
FlyDSL and SoA kernels only), so the adapter declares none; ``Pi`` and the centroids are
not read with fp8 keys and go in as NaN.
"""
from __future__ import annotations

import functools

import torch

from nanfuzz.harness.adapters import vllm_loader
from nanfuzz.harness.kernel import Kernel
from nanfuzz.reference.batch import PagedBatch
from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.case import CacheSide, KVCache
from nanfuzz.reference.layouts import scheduled
from nanfuzz.reference.quantization import codes_of

NAME = "vllm:turboquant"
# value bits -> the cache: fp8 keys beside 4-bit (turboquant_k8v4) or 3-bit values
CACHES = {bits: KVCache("fp8_e4m3fn", value=CacheSide(f"uint{bits}", "token-head", "offset", "float16"))
          for bits in (4, 3)}
# vLLM's attention_config.tq_max_kv_splits_for_cuda_graph: stage 1's partitions, a constexpr
MAX_KV_SPLITS = 32

CAPABILITIES = Capabilities(
    dtypes=("float16", "bfloat16"),  # what the backend's models run in; stage 2 casts to the query's
    block_sizes=(16, 32, 64, 48),    # MultipleOf(16)
    max_query_len=1,                 # the decode path
    causal=True,
    sliding_window=False,            # not passed to the Triton decode
    sinks=False,
    kv_cache_dtypes=(), token_head_dtypes=(), cache_formats=tuple(CACHES.values()),
    precision="ieee",                # scores and values summed with tl.sum, no tl.dot
    specialisation_pool=16,
)


def combined_cache(batch: PagedBatch) -> torch.Tensor:
    """The backend's uint8 ``[num_blocks, block_size, num_kv_heads, slot]`` rows from the batch's caches."""
    keys = codes_of(batch.key_cache)                  # [blocks, bs, heads, head_size]
    values = batch.value_cache                        # [blocks, bs, heads, value bytes]
    scales = batch.v_scale_cache.contiguous().view(torch.uint8).view(*values.shape[:3], 2)
    zeros = batch.v_zero_cache.contiguous().view(torch.uint8).view(*values.shape[:3], 2)
    parts = [keys, values, scales, zeros]
    width = sum(part.shape[-1] for part in parts)
    if width % 2:  # slot_size_aligned: the slot rounded up to an even number of bytes
        parts.append(torch.zeros(*values.shape[:3], 1, dtype=torch.uint8, device=values.device))
    return torch.cat(parts, dim=-1)


# What ``nanfuzz list`` says the entry leaves out.
NOTES = ("the MSE-key presets (turboquant_4bit_nc, k3v4_nc, 3bit_nc: Lloyd-Max centroids x norms in a rotated "
         "frame): not driven",
         "FlyDSL's gfx950 decode and the SoA Triton kernels it falls back to (where windows and sinks go): not driven")


def run_turboquant(batch: PagedBatch, out: torch.Tensor, *, source: str | None = None) -> torch.Tensor:
    case = batch.case
    g = case.geometry
    loaded = vllm_loader.load("turboquant", source)
    kept = scheduled(batch)  # one decode query per scheduled sequence, in order
    if not kept:
        return out
    bits = case.kv_cache.side("v").bits
    device = batch.q.device
    nan = float("nan")
    # Stale workspace is what the backend hands it (WorkspaceManager buffers): NaN shows a split
    # merged unwritten.  The output goes straight into ``out``, as into the backend's output buffer.
    rows = (len(kept), g.num_q_heads)
    with loaded.active():
        loaded["triton_turboquant_decode"].triton_turboquant_decode_attention(
            query=batch.q, kv_cache=combined_cache(batch), block_table=kept.block_table, seq_lens=kept.seq_lens,
            Pi=torch.full((g.head_size, g.head_size), nan, device=device),
            centroids=torch.full((1 << bits,), nan, device=device),
            scale=case.scale, mse_bits=0, key_packed_size=g.head_size, value_quant_bits=bits, key_fp8=True,
            norm_correction=False, PiT=None,
            mid_o_buf=torch.full((*rows, MAX_KV_SPLITS, g.head_size + 1), nan, device=device),
            output_buf=out, lse_buf=torch.full(rows, nan, device=device), max_num_kv_splits=MAX_KV_SPLITS)
    return out


def kernel(name: str, source: str | None = None) -> Kernel:
    """``vllm:turboquant``, with vLLM's kernel files from ``source``."""
    vllm_loader.load("turboquant", source)
    return Kernel(name=name, run=functools.partial(run_turboquant, source=source),
                  capabilities=CAPABILITIES, source=source, notes=NOTES)
