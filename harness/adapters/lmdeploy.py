"""lmdeploy's Triton attention kernels (its PyTorch engine's, which lmdeploy also runs on ROCm) as
nanfuzz kernels, called as its attention backend ``backends/cuda/attention/default.py`` calls them.

``lmdeploy:decode``
    ``flash_attn_with_kvcache`` (``pagedattention.py``), the backend's decoding step: one query per
    request over the paged cache (``[num_blocks, block_size, num_kv_heads, head_size]``, lmdeploy's
    own layout), GQA heads of a KV head in one program, the keys split into ``SPLIT_K`` parts
    (``_fwd_grouped_split_kernel``, or ``_fwd_grouped_split_quant_kernel`` for an fp8 cache) merged by
    ``_reduce_split_kernel``, which also adds the sinks.  ``SPLIT_K`` comes from the device's SM count
    and the batch, as lmdeploy sizes it.
``lmdeploy:decode@block``
    The same entry point as a dLLM's block decoding calls it (``block_sparse_size`` new tokens per
    request, ``max_seqlen_q`` of them): every query of a request's block reads all of its keys, so
    nanfuzz draws these as non-causal cases with one query length per batch, without a window (the
    kernel's window is the block's, one edge for all of its queries).
``lmdeploy:prefill``
    The backend's prefill step: ``flatten_kv_cache`` gathers each request's keys from the paged
    cache into a contiguous ``[num_kv_heads, tokens, head_size]`` buffer (an fp8 cache dequantized
    on the way), padded by one block and a guard block it zero-fills, then
    ``flash_attn_varlen_func`` (``flashattention.py``) attends over it, causal or not.

The window goes in as lmdeploy's kernels read it, keys ``p - window_size .. p`` (FlashAttention's
left window), so ``window_size = W - 1``, and 0 means none: W = 1 cannot be said
(``Capabilities(min_window=2)``).  The prefill's non-causal window bounds only the keys before a
query, so non-causal cases come without one.  fp8 caches are lmdeploy's ``QuantPolicy.FP8``
(e4m3fn) and ``FP8_E5M2`` with per-tensor scales.
"""
from __future__ import annotations

import functools

import torch

from nanfuzz.harness.adapters import lmdeploy_loader, lmdeploy_standins
from nanfuzz.harness.device import interpreting
from nanfuzz.harness.kernel import Kernel
from nanfuzz.reference.batch import PagedBatch
from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.errors import NanfuzzError, UnsupportedHere
from nanfuzz.reference.layouts import scheduled
from nanfuzz.reference.windows import window_left

DECODE, PREFILL = "lmdeploy:decode", "lmdeploy:prefill"
KERNEL_NAMES = (DECODE, PREFILL)
VARIANTS = (f"{DECODE}@block",)
# lmdeploy's kernels tile a block as one tile of keys (tl.dot wants a power of two of at least 16);
# its engine's default block is 64.
BLOCK_SIZES = (16, 32, 64)
# Powers of two, and 80 and 96, which both kernels split into a power-of-two tile and a second
# one (BLOCK_DMODEL1); 256 for the largest heads.
HEAD_SIZES = (64, 128, 80, 96, 256)
# Every kernel compiles per head count, head and block size, window, sinks and cache dtype
# (tl.constexpr): a GPU campaign covers this many of those combinations.
POOL = 16
# dLLMs decode blocks of 4 to 32 tokens (SDAR's 4, LLaDA2's 32): block_sparse_size.
MAX_BLOCK_TOKENS = 32
# The QuantPolicy of each cache dtype the backend passes with per-tensor scales.
POLICIES = {"auto": "NONE", "fp8_e4m3fn": "FP8", "fp8_e5m2": "FP8_E5M2"}

COMMON = Capabilities(
    dtypes=("float16", "bfloat16"),   # the PyTorch engine's model dtypes
    head_sizes=HEAD_SIZES,
    block_sizes=BLOCK_SIZES,
    min_window=2,                     # window_size = W - 1, and 0 means none
    sinks=True,
    kv_cache_dtypes=tuple(POLICIES),
    specialisation_pool=POOL,
)
DECODE_CAPABILITIES = COMMON.restrict(max_query_len=1)
BLOCK_DECODE_CAPABILITIES = COMMON.restrict(
    max_query_len=MAX_BLOCK_TOKENS, uniform_query_len=True, causal=False, non_causal=True, sliding_window=False)
PREFILL_CAPABILITIES = COMMON.restrict(non_causal=True, non_causal_window=False)

# What ``nanfuzz list`` says each entry point leaves out.
LEFT_OUT = (
    "int4/int8 caches with zero points (QuantPolicy.INT4/INT8, per-token scale and zero point): not yet "
    "(the case model has no zero points)",
    "TurboQuant caches (QuantPolicy.TURBO_QUANT: packed 4-bit K, 2-bit V, a Hadamard rotation): not driven",
    "ALiBi slopes and logit softcapping: not driven (the case model has neither)",
)
DECODE_NOTES = (*LEFT_OUT, "the 'bhsd' cache layout: not driven (the backend passes 'bshd')")
BLOCK_DECODE_NOTES = (*DECODE_NOTES, "the block's window: not driven (one edge for every query of a block, not "
                                     "nanfuzz's window per query)")
PREFILL_NOTES = (*LEFT_OUT, "block-sparse (dLLM) prefill, block_sparse_size > 1: not driven (a block-causal mask "
                            "nanfuzz's semantics do not have)")


def _policy(module, kv_cache_dtype: str):
    """The ``QuantPolicy`` (as ``module``, a kernel file, imports it) of a cache dtype."""
    return getattr(module.QuantPolicy, POLICIES[kv_cache_dtype])


def _scales(batch: PagedBatch):
    """The backend's ``k_scales_zeros``/``v_scales_zeros`` of a per-tensor fp8 cache, else None."""
    if not batch.case.kv_cache.quantized:
        return None, None
    return batch.k_scale, batch.v_scale


def _overrides(loaded, modules: tuple[str, ...]) -> dict:
    """Under Triton's interpreter, lmdeploy's device queries answer for the stood-in GPU."""
    return lmdeploy_standins.interpreter_overrides(loaded, modules) if interpreting() else {}


# -- lmdeploy:decode ------------------------------------------------------------------

def run_decode(batch: PagedBatch, out: torch.Tensor, *, source: str | None = None) -> torch.Tensor:
    case = batch.case
    loaded = lmdeploy_loader.load("decode", source)
    module = loaded["pagedattention"]
    # lmdeploy schedules no request without a new token; the kernel takes num_tokens // batch per request
    kept = scheduled(batch)
    if not kept:
        return out
    k_scales, v_scales = _scales(batch)
    with loaded.active(_overrides(loaded, ("pagedattention",))):
        result = module.flash_attn_with_kvcache(
            batch.q, batch.key_cache, batch.value_cache,
            cache_seqlens=kept.seq_lens, page_table=kept.block_table,
            cu_seqlens_q=kept.query_start_loc, max_seqlen_q=kept.max_query_len,
            softmax_scale=case.scale,
            softcap=-1,  # the backend's "no softcapping"
            window_size=window_left(case),
            sinks=batch.sinks, alibi_slopes=None,
            quant_policy=_policy(module, case.kv_cache.dtype),
            k_scales_zeros=k_scales, v_scales_zeros=v_scales,
        )
    out.copy_(result.view_as(out))
    return out


# -- lmdeploy:prefill -----------------------------------------------------------------

def run_prefill(batch: PagedBatch, out: torch.Tensor, *, source: str | None = None) -> torch.Tensor:
    case = batch.case
    loaded = lmdeploy_loader.load("prefill", source)
    kept = scheduled(batch)
    if not kept:
        return out
    device = batch.q.device
    block_size = case.geometry.block_size
    sequences = [case.sequences[i] for i in kept.indices]
    # the backend's sequence metadata (step_metadata.py): cumulative lengths, the flat buffer's size
    cu_seqlens_k = torch.tensor([0, *torch.tensor([s.seq_len for s in sequences]).cumsum(0).tolist()],
                                dtype=torch.int32, device=device)
    flat_keys = sum(s.seq_len for s in sequences)
    out_size = -(-flat_keys // block_size) * block_size + block_size  # "pad one more block"
    k_scales, v_scales = _scales(batch)
    policy = _policy(loaded["flatten_kv_cache"], case.kv_cache.dtype)
    with loaded.active(_overrides(loaded, ("flatten_kv_cache", "flashattention"))):
        flat_k, flat_v = loaded["flatten_kv_cache"].flatten_kv_cache(
            batch.key_cache, batch.value_cache, kept.seq_lens, kept.block_table,
            start_loc=cu_seqlens_k[:-1], out_size=out_size, out_dtype=batch.q.dtype,
            k_scales_zeros=k_scales, v_scales_zeros=v_scales, quant_policy=policy, flatten_kv_layout="hsd")
        result = loaded["flashattention"].flash_attn_varlen_func(
            batch.q, flat_k, flat_v,
            cu_seqlens_q=kept.query_start_loc, cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=kept.max_query_len, max_seqlen_k=kept.max_seq_len,
            window_size=window_left(case), softmax_scale=case.scale,
            softcap=-1, causal=case.causal,
            sinks=batch.sinks, alibi_slopes=None, block_sparse_size=1, kv_layout="hsd",
        )
    out.copy_(result.view_as(out))
    return out


# -- registry entry -------------------------------------------------------------------

def block_pointers_removed() -> bool:
    """Has this Triton removed block pointers (``tl.make_block_ptr``), as Triton 3.9 has?"""
    import triton.language as tl

    try:  # from Triton 3.9 the builtin refuses before it looks at its semantic
        tl.make_block_ptr(None, None, None, None, None, None, _semantic=object())
    except NotImplementedError:
        return True
    except Exception:  # noqa: BLE001 - an older Triton got as far as the (dummy) semantic
        return False
    return False


def kernel(name: str, source: str | None = None) -> Kernel:
    """The Kernel for an ``lmdeploy:*`` name, with lmdeploy's kernel files from ``source`` (a source
    tree or unpacked wheel; None: the installed lmdeploy).  The files are loaded here, so a missing
    or unusable tree is a configuration error now rather than a crash of the first case."""
    if name == PREFILL:
        lmdeploy_loader.load("prefill", source)
        if block_pointers_removed():
            import triton

            raise UnsupportedHere(
                f"{PREFILL} cannot run on Triton {triton.__version__}: lmdeploy's flashattention.py tiles K and V "
                "with tl.make_block_ptr, which Triton 3.9 removed (lmdeploy 0.18.0 requires triton>=3.4,<=3.7.1); "
                "gate it where Triton 3.7 or earlier is installed")
        return Kernel(name=name, run=functools.partial(run_prefill, source=source),
                      capabilities=PREFILL_CAPABILITIES, source=source, notes=PREFILL_NOTES)
    if name in (DECODE, *VARIANTS):
        lmdeploy_loader.load("decode", source)
        block = name.endswith("@block")
        return Kernel(name=name, run=functools.partial(run_decode, source=source),
                      capabilities=BLOCK_DECODE_CAPABILITIES if block else DECODE_CAPABILITIES, source=source,
                      notes=BLOCK_DECODE_NOTES if block else DECODE_NOTES)
    raise NanfuzzError(f"unknown lmdeploy kernel {name!r}; known: {', '.join((*KERNEL_NAMES, *VARIANTS))}")
