"""AMD AITER's Triton attention kernels as nanfuzz kernels.

``aiter:unified_attention``
    ``aiter.ops.triton.unified_attention``: what vLLM's ROCM_AITER_UNIFIED_ATTN
    backend calls.  Causal only.  A 2D path (one program per query block
    and KV head) and a 3D split-K path whose segments ``reduce_segments``
    merges; AITER takes 3D only without a window, past 512 keys and when 2D
    would not fill the device, which no fuzz-sized batch reaches, so
    ``@2d`` and ``@3d`` pin the choice (``@3d`` without windows, which AITER
    never sends there).  The cache layout is the canonical one.

``aiter:pa_decode``
    ``aiter.ops.triton.pa_decode.paged_attention_decode``: decode only (one
    query per sequence), no window, no sinks; cache ``[blocks, kv_heads,
    block_size, head_size]``.  AITER picks v1 (one pass) up to 1024 keys and
    v2 (1024-key partitions merged by a reduce kernel) past them, and the
    per-token-quant copies of both when the scales are per slot.  ``@v1``,
    ``@v2``, ``@v1-per-token`` and ``@v2-per-token`` pin the path; the
    per-token paths get scale caches ``[blocks, kv_heads, block_size]`` of
    ones, which an unquantized cache never multiplies.

``aiter:pa_prefill``
    ``aiter.ops.triton.pa_prefill.context_attention_fwd``: any query length,
    causal, window ``W`` (keys ``p - k < W``), no sinks; caches in ROCm's
    ``[blocks, kv_heads, head_size/x, block_size, x]`` / ``[blocks, kv_heads,
    head_size, block_size]`` layout; new tokens' K/V from ``k`` / ``v``.

``aiter:chunked_pa_prefill``
    ``aiter.ops.triton.chunked_pa_prefill.chunked_prefill_paged_decode``:
    AITER's copy of vLLM's ROCM_ATTN entry, ``context_attention_fwd`` for
    sequences with more than one query token and ``_kernel_paged_attention_2d``
    for the rest; same layout and window convention as ``aiter:pa_prefill``.

Layouts are converted (whole caches, dead blocks included) before the launch
each adapter's ``prepare`` returns, so a timing leaves them out.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
import triton.language as tl

from nanfuzz.harness.adapters import aiter_loader, launches
from nanfuzz.harness.adapters.vllm import rocm_key_cache, rocm_value_cache
from nanfuzz.harness.kernel import Kernel
from nanfuzz.reference.batch import PagedBatch
from nanfuzz.reference.capabilities import DEFAULT_BLOCK_SIZES, Capabilities
from nanfuzz.reference.errors import NanfuzzError
from nanfuzz.reference.layouts import scheduled
from nanfuzz.reference.windows import window_size

UNIFIED_PATHS = ("2d", "3d")
PA_DECODE_PATHS = ("v1", "v2", "v1-per-token", "v2-per-token")
KERNEL_NAMES = ("aiter:unified_attention", "aiter:pa_decode", "aiter:pa_prefill", "aiter:chunked_pa_prefill")
VARIANTS = (*(f"aiter:unified_attention@{p}" for p in UNIFIED_PATHS), *(f"aiter:pa_decode@{p}" for p in PA_DECODE_PATHS))

# vLLM sends every multiple of 16 to ROCM_AITER_UNIFIED_ATTN (MultipleOf(16));
# 48 stands for the non-power-of-two sizes of hybrid models.  Sizes below 16
# cannot feed a tl.dot (16 is its smallest tile) in unified_attention's decode
# tiles or pa_decode's GQA path; pa_decode pads block sizes to a power of two.
DOT_BLOCK_SIZES = (16, 32, 64, 48)
# Both of their kernels compile per head and block size, group size and (unified)
# window, causality and sinks (tl.constexpr): a GPU campaign covers this many.
POOL = 16
# Every kernel here pads the head size to a power of two (triton.next_power_of_2) and masks the
# rest; vLLM sends ROCM_AITER_UNIFIED_ATTN any head size from 32 (supports_head_size) and its
# ROCm backends list 32 to 256: those (ROCM_ATTN's list in vLLM 0.33.0).
HEAD_SIZES = (32, 64, 80, 96, 128, 160, 192, 224, 256)

_COMPUTE_TYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}

Launch = Callable[[], torch.Tensor]


def _unit_scale(batch: PagedBatch) -> torch.Tensor:
    return torch.ones(1, dtype=torch.float32, device=batch.q.device)


def _overrides(loaded, extra: dict | None = None) -> dict:
    """Attributes the launcher modules hold during the call: kernels without AMD-only
    launch options where the kernel does not compile for AMD, and ``extra``."""
    return {**launches.portable_launches(aiter_loader.launchers(loaded)), **(extra or {})}


# -- aiter:unified_attention -----------------------------------------------------

UNIFIED_CAPABILITIES = Capabilities(
    head_sizes=HEAD_SIZES,
    block_sizes=DOT_BLOCK_SIZES,
    causal=True,
    non_causal=False,      # unified_attention asserts causal
    sliding_window=True,
    sinks=True,
    specialisation_pool=POOL,
)


def prepare_unified(batch: PagedBatch, out: torch.Tensor, *, path: str | None = None,
                    source: str | None = None) -> Launch:
    case = batch.case
    loaded = aiter_loader.load("unified_attention", source)
    entry = loaded["unified_attention"].unified_attention
    pinned = {} if path is None else {("unified_attention", "use_2d_kernel"): lambda *_: path == "2d"}
    overrides = _overrides(loaded, pinned)
    descale = _unit_scale(batch).expand(len(case.sequences), case.geometry.num_kv_heads)

    def launch() -> torch.Tensor:
        if case.num_tokens == 0:
            return out
        with loaded.active(overrides):
            entry(
                q=batch.q, k=batch.key_cache, v=batch.value_cache, out=out,
                cu_seqlens_q=batch.query_start_loc, max_seqlen_q=case.max_query_len,
                seqused_k=batch.seq_lens, max_seqlen_k=case.max_seq_len,
                softmax_scale=case.scale, causal=True, window_size=window_size(case),
                block_table=batch.block_table, softcap=0,
                q_descale=None, k_descale=descale, v_descale=descale,
                sinks=batch.sinks,
            )
        return out

    return launch


# -- aiter:pa_decode -------------------------------------------------------------------

PA_DECODE_CAPABILITIES = Capabilities(
    head_sizes=HEAD_SIZES,
    block_sizes=DOT_BLOCK_SIZES,
    max_query_len=1,
    causal=True,
    sliding_window=False,
    sinks=False,
    specialisation_pool=POOL,
)


def pa_decode_cache(cache: torch.Tensor) -> torch.Tensor:
    """``[blocks, B, H, D]`` -> pa_decode's ``[blocks, H, B, D]``."""
    return cache.permute(0, 2, 1, 3).contiguous()


def prepare_pa_decode(batch: PagedBatch, out: torch.Tensor, *, path: str | None = None,
                      source: str | None = None) -> Launch:
    case = batch.case
    g = case.geometry
    loaded = aiter_loader.load("pa_decode", source)
    module = loaded["pa_decode"]
    kept = scheduled(batch)
    block_table, seq_lens, max_seq_len = kept.block_table, kept.seq_lens, kept.max_seq_len
    key_cache, value_cache = pa_decode_cache(batch.key_cache), pa_decode_cache(batch.value_cache)
    per_token = path is not None and path.endswith("-per-token")
    if per_token:
        k_scale = torch.ones(key_cache.shape[:3], dtype=torch.float32, device=batch.q.device)
        v_scale = torch.ones_like(k_scale)
    else:
        k_scale = v_scale = _unit_scale(batch)
    common = dict(output=out, query=batch.q, key_cache=key_cache, value_cache=value_cache, seq_lens=seq_lens,
                  max_seq_len=max_seq_len, compute_type=_COMPUTE_TYPES[batch.q.dtype])
    if path is None:  # AITER's own choice of v1 / v2
        call = functools.partial(module.paged_attention_decode, block_tables=block_table, attn_scale=case.scale,
                                 k_scale=k_scale, v_scale=v_scale, **common)
    else:
        version = path.partition("-")[0]
        function = getattr(module, f"paged_attn_decode_{version}" + ("_per_token_quant" if per_token else ""))
        # v1 and v2 are also called with scalar scales (paged_attention_decode passes .item())
        scales = (k_scale, v_scale) if per_token else (1.0, 1.0)
        extra = {}
        if version == "v2":
            partition = module._SEQ_PARTITION_SIZE
            extra["max_num_partitions"] = -(-max_seq_len // partition)
        call = functools.partial(function, block_tables=block_table, num_kv_heads=g.num_kv_heads, scale=case.scale,
                                 alibi_slopes=None, k_scale=scales[0], v_scale=scales[1], **common, **extra)
    overrides = _overrides(loaded)

    def launch() -> torch.Tensor:
        if not kept:
            return out
        with loaded.active(overrides):
            call()
        return out

    return launch


# -- aiter:pa_prefill and aiter:chunked_pa_prefill --------------------------------------

PA_PREFILL_CAPABILITIES = Capabilities(
    head_sizes=HEAD_SIZES,
    block_sizes=DEFAULT_BLOCK_SIZES,   # the context loop indexes any block size
    causal=True,
    sliding_window=True,
    sinks=False,
    specialisation_pool=POOL,
)
# The decode kernel tiles a block with tl.arange(0, BLOCK_SIZE): powers of two only.
CHUNKED_CAPABILITIES = PA_PREFILL_CAPABILITIES.restrict(block_sizes=(16, 8, 32, 64))


def prepare_pa_prefill(batch: PagedBatch, out: torch.Tensor, *, source: str | None = None) -> Launch:
    case = batch.case
    loaded = aiter_loader.load("pa_prefill", source)
    entry = loaded["pa_prefill"].context_attention_fwd
    key_cache, value_cache = rocm_key_cache(batch.key_cache), rocm_value_cache(batch.value_cache)
    unit = _unit_scale(batch)
    overrides = _overrides(loaded)

    def launch() -> torch.Tensor:
        if case.num_tokens == 0:
            return out
        with loaded.active(overrides):
            entry(
                q=batch.q, k=batch.k, v=batch.v, o=out, kv_cache_dtype="auto",
                k_cache=key_cache, v_cache=value_cache,
                b_loc=batch.block_table, b_start_loc=batch.query_start_loc, b_seq_len=batch.seq_lens,
                max_input_len=case.max_query_len, k_scale=unit, v_scale=unit,
                sliding_window=case.sliding_window,  # W itself; 0 = none
                sm_scale=case.scale,
            )
        return out

    return launch


def prepare_chunked(batch: PagedBatch, out: torch.Tensor, *, source: str | None = None) -> Launch:
    case = batch.case
    loaded = aiter_loader.load("chunked_pa_prefill", source)
    entry = loaded["chunked_pa_prefill"].chunked_prefill_paged_decode
    kept = scheduled(batch)
    key_cache, value_cache = rocm_key_cache(batch.key_cache), rocm_value_cache(batch.value_cache)
    unit = _unit_scale(batch)
    overrides = _overrides(loaded)

    def launch() -> torch.Tensor:
        if not kept:
            return out
        with loaded.active(overrides):
            entry(
                query=batch.q, key=batch.k, value=batch.v, output=out, kv_cache_dtype="auto",
                key_cache=key_cache, value_cache=value_cache,
                block_table=kept.block_table, query_start_loc=kept.query_start_loc, seq_lens=kept.seq_lens,
                max_query_len=case.max_query_len, k_scale=unit, v_scale=unit,
                sliding_window=case.sliding_window,  # W itself; 0 = none
                sm_scale=case.scale,
            )
        return out

    return launch


# -- registry entry -----------------------------------------------------------------

def _run(batch: PagedBatch, out: torch.Tensor, *, prepare, **options) -> torch.Tensor:
    return prepare(batch, out, **options)()


# base name -> (prepare, its variants, capabilities by variant)
_ADAPTERS = {
    "aiter:unified_attention": (prepare_unified, UNIFIED_PATHS, {
        None: UNIFIED_CAPABILITIES, "2d": UNIFIED_CAPABILITIES,
        "3d": UNIFIED_CAPABILITIES.restrict(sliding_window=False)}),
    "aiter:pa_decode": (prepare_pa_decode, PA_DECODE_PATHS, dict.fromkeys((None, *PA_DECODE_PATHS),
                                                                          PA_DECODE_CAPABILITIES)),
    "aiter:pa_prefill": (prepare_pa_prefill, (), {None: PA_PREFILL_CAPABILITIES}),
    "aiter:chunked_pa_prefill": (prepare_chunked, (), {None: CHUNKED_CAPABILITIES}),
}


def kernel(name: str, source: str | None = None) -> Kernel:
    """The Kernel for an ``aiter:*`` name (with ``@path`` where the kernel has paths), with AITER's
    kernel files from ``source`` (a source tree or unpacked wheel; None: the installed aiter).

    The kernel files are loaded here, so a missing or unusable AITER source is
    a configuration error now rather than a crash of the first case.
    """
    base, _, path = name.partition("@")
    adapter = _ADAPTERS.get(base)
    if adapter is None or (path and path not in adapter[1]):
        raise NanfuzzError(f"unknown AITER kernel {name!r}; known: {', '.join((*KERNEL_NAMES, *VARIANTS))}")
    prepare, paths, capabilities = adapter
    aiter_loader.load(base.partition(":")[2], source)
    options = dict(source=source, **({"path": path or None} if paths else {}))
    prepare_fn = functools.partial(prepare, **options)
    return Kernel(name=name, run=functools.partial(_run, prepare=prepare, **options),
                  capabilities=capabilities[path or None], prepare=prepare_fn, source=source)
