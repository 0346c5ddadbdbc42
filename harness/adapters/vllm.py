"""vLLM's real attention kernels as nanfuzz kernels.

``vllm:rocm_attn``
    The ROCM_ATTN backend's Triton path: ``chunked_prefill_paged_decode``,
    which runs ``context_attention_fwd`` (prefix_prefill.py) for sequences
    with more than one query token and ``kernel_paged_attention_2d`` for the
    rest.  ROCm's custom HIP decode kernel is switched off (the loader's
    stand-in for ``vllm.platforms.rocm`` always declines it), so the same
    Triton code runs on every GPU and under the interpreter.  vLLM itself
    decodes with this Triton kernel on ROCm whenever a sliding window, sinks,
    fp32, a head size other than 64/128 or a block size other than 16/32 is
    in play, and always prefills with ``context_attention_fwd``.

``vllm:triton_attn``
    The TRITON_ATTN backend: ``unified_attention``.  It has a 2D path (one
    program per query block and KV head) and a 3D split-K path for small
    decode batches (the KV length cut into softmax segments, merged by
    ``reduce_segments``).  vLLM picks 3D when the caller hands it segment
    scratch and the batch is short: query length at most 8 (1 + speculative
    tokens), causal, and few enough query blocks.  The adapter offers the
    scratch for odd ``data_seed`` and withholds it for even ones, so every
    kind of case meets both paths and a repro replays on the path it failed
    on; ``vllm:triton_attn@2d`` and ``@3d`` pin the choice.

``vllm:triton_attn_int4``
    TRITON_ATTN with ``kv_cache_dtype="int4_per_token_head"``: ``unified_attention``
    with ``KVQuantMode.INT4_PER_TOKEN_HEAD`` hands the batch to
    ``unified_attention_int4`` (``int4_per_token_head.py``), which rotates q
    (vLLM's single randomized Hadamard transform), runs ``_attn_packed`` (2D,
    or 3D split-K with ``reduce_segments`` for decode batches, as above) over
    the packed cache and rotates the output back.  Causal only, as vLLM asserts.
    ``@2d`` / ``@3d`` pin the path.

``vllm:triton_mla``
    The TRITON_MLA backend's decode: ``decode_attention_fwd`` over the latent cache
    (``harness.adapters.vllm_mla``).

``vllm:triton_attn_diffkv``
    The TRITON_ATTN_DIFFKV backend: ``unified_attention_diffkv`` over the packed cache of a model
    whose V head size differs from K's (``harness.adapters.vllm_diffkv``).

``vllm:rocm_segmented_attn``
    The ROCM_SEGMENTED_ATTN backend: ``segmented_attention``, token-major segmented attention
    for RDNA GPUs (``harness.adapters.vllm_segmented``).

``vllm:turboquant``
    The TURBOQUANT backend's Triton decode with fp8 keys and 3- or 4-bit
    values (``harness.adapters.vllm_turboquant``).

Both paged adapters convert the window as their backend does (W keys, the query's
own position included): ROCM_ATTN receives ``sliding_window=W``,
``unified_attention`` ``window_size=(W-1, 0)`` causal and ``(W-1, W-1)``
non-causal, ``(-1, -1)`` for none.

Quantized caches go in as each backend passes them (vLLM 0.33.0's
``rocm_attn.py`` / ``triton_attn.py``).  The platform's fp8 is e4m3fnuz on
MI300-class GPUs and e4m3fn elsewhere (what the kernels' own
``current_platform.fp8_dtype()`` says).

- ROCM_ATTN: ``kv_cache_dtype`` "fp8" (the platform's fp8) or "fp8_e5m2",
  caches stored as bytes and handed over as the platform's fp8 dtype (the
  kernels re-view e5m2), per-tensor ``k_scale``/``v_scale``; the new tokens'
  ``key``/``value`` in the query dtype.
- TRITON_ATTN: per-tensor scales for the platform's fp8 only (the backend
  views every fp8 cache, e5m2 included, as the platform's fp8), as
  ``KVQuantMode.FP8_PER_TENSOR`` with ``k_descale``/``v_descale``; and the
  per-token-head modes ``FP8_PER_TOKEN_HEAD`` (platform fp8) and
  ``INT8_PER_TOKEN_HEAD``, whose caches the backend packs as
  ``[num_blocks, num_kv_heads, block_size, 2 * (head_size + 4)]`` bytes, each
  (block, head, slot) row holding K's codes, K's float32 scale, V's codes,
  V's scale; ``k_scale_cache``/``v_scale_cache`` are strided float32 views of
  those scale bytes.  The adapter builds that packing from the batch, dead
  slots and their scales included.
- TRITON_ATTN's ``INT4_PER_TOKEN_HEAD`` (``INT4_CACHE``): the same packing with
  head_size / 2 bytes of codes a row, two 4-bit codes a byte (the even
  element in the low nibble), and a float32 word per (slot, head) whose 4
  low mantissa bits are the zero point and whose other bits the scale; what
  the cache holds is rotated (``reference.rotation``, the signs of vLLM's
  ``_get_rht_signs(d, 0)``).  The case's cache is that format exactly.
"""
from __future__ import annotations

import functools

import torch

from nanfuzz.harness.adapters import vllm_diffkv, vllm_loader, vllm_mla, vllm_segmented, vllm_turboquant
from nanfuzz.harness.adapters.vllm_loader import platform_fp8
from nanfuzz.harness.kernel import Kernel
from nanfuzz.reference.batch import PagedBatch
from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.case import Case, KVCache
from nanfuzz.reference.errors import NanfuzzError
from nanfuzz.reference.layouts import scheduled
from nanfuzz.reference.quantization import codes_of
from nanfuzz.reference.windows import window_size

INT4_NAME = "vllm:triton_attn_int4"
KERNEL_NAMES = ("vllm:rocm_attn", "vllm:triton_attn", INT4_NAME, vllm_mla.NAME, vllm_diffkv.NAME, vllm_segmented.NAME,
                vllm_turboquant.NAME)
UNIFIED_PATHS = ("2d", "3d")
VARIANTS = (*(f"{base}@{p}" for base in ("vllm:triton_attn", INT4_NAME) for p in UNIFIED_PATHS),
            *vllm_mla.VARIANTS, *vllm_diffkv.VARIANTS)

# Both backends take any multiple of 16 (MultipleOf(16)); 48 stands for the
# non-power-of-two sizes of hybrid models, which ROCM_ATTN tiles by 32.
BLOCK_SIZES = (16, 32, 64, 48)
# Both compile per window width, head count, head and block size, causality
# and sinks (all tl.constexpr): a GPU campaign covers this many of those
# combinations (see strategies.specialisations), so its compiles are reused.
POOL = 16
# unified_attention's split-K segment count in the TRITON_ATTN backend.
SOFTMAX_SEGMENTS = 16


# ROCM_ATTN's head sizes: RocmAttentionBackend.get_supported_head_sizes() in vLLM 0.33.0
# (64 and 128 have a HIP decode kernel, the rest go to the Triton path fuzzed here).
ROCM_ATTN_HEAD_SIZES = (32, 64, 80, 96, 128, 160, 192, 224, 256)
# TRITON_ATTN takes any head size from 32 (TritonAttentionBackend.supports_head_size); the
# kernels pad it to a power of two: ROCM_ATTN's sizes, and sizes between them that are no
# multiple of 16 (72, 112) or of 32 (144, 208).
TRITON_ATTN_HEAD_SIZES = (32, 64, 72, 80, 96, 112, 128, 144, 160, 192, 208, 224, 256)

# What both backends' Triton kernels take: every mode, windows, sinks (only
# ROCm's HIP decode kernel lacks them), fp16/bf16/fp32 (the default dtypes).
# Their fp32 dots use TF32 on NVIDIA GPUs.
BOTH_BACKENDS = Capabilities(
    head_sizes=ROCM_ATTN_HEAD_SIZES,
    block_sizes=BLOCK_SIZES,
    causal=True,
    non_causal=True,
    sliding_window=True,
    sinks=True,
    specialisation_pool=POOL,
)


# -- vllm:rocm_attn ----------------------------------------------------------------

ROCM_ATTN_CAPABILITIES = BOTH_BACKENDS.restrict(
    # ROCM_ATTN sends windowed non-causal (encoder) layers to a separate, non-paged
    # kernel; its paged path windows only keys before the query (p - k < W).
    non_causal_window=False,
)


def rocm_key_cache(key_cache: torch.Tensor) -> torch.Tensor:
    """``[blocks, B, H, D]`` -> ROCM_ATTN's ``[blocks, H, D/x, B, x]``, x = 16 bytes of elements."""
    blocks, block_size, heads, head_size = key_cache.shape
    x = 16 // key_cache.element_size()
    assert head_size % x == 0, (head_size, x)
    split = key_cache.reshape(blocks, block_size, heads, head_size // x, x)
    return split.permute(0, 2, 3, 1, 4).contiguous()


def rocm_value_cache(value_cache: torch.Tensor) -> torch.Tensor:
    """``[blocks, B, H, D]`` -> ROCM_ATTN's ``[blocks, H, D, B]``."""
    return value_cache.permute(0, 2, 3, 1).contiguous()


def run_rocm_attn(batch: PagedBatch, out: torch.Tensor, source: str | None = None) -> torch.Tensor:
    case = batch.case
    loaded = vllm_loader.load("rocm_attn", source)
    entry = loaded["chunked_prefill_paged_decode"].chunked_prefill_paged_decode
    # vLLM schedules no sequence without a query token, and the decode kernel writes a row at
    # such a sequence's start offset, which belongs to the next sequence: they stay out of the launch.
    kept = scheduled(batch)
    if not kept:
        return out
    kv = case.kv_cache
    if kv.quantized:
        # vLLM keeps the caches as bytes; the backend views them as the platform's fp8
        fp8 = loaded["chunked_prefill_paged_decode"].current_platform.fp8_dtype()
        key_cache = rocm_key_cache(codes_of(batch.key_cache)).view(fp8)
        value_cache = rocm_value_cache(codes_of(batch.value_cache)).view(fp8)
        kv_cache_dtype = "fp8_e5m2" if kv.dtype == "fp8_e5m2" else "fp8"
        k_scale, v_scale = batch.k_scale, batch.v_scale
    else:
        key_cache, value_cache = rocm_key_cache(batch.key_cache), rocm_value_cache(batch.value_cache)
        kv_cache_dtype = "auto"
        k_scale = v_scale = torch.ones(1, dtype=torch.float32, device=batch.q.device)
    with loaded.active():
        entry(
            query=batch.q, key=batch.k, value=batch.v, output=out,
            kv_cache_dtype=kv_cache_dtype,
            key_cache=key_cache,
            value_cache=value_cache,
            block_table=kept.block_table, query_start_loc=kept.query_start_loc, seq_lens=kept.seq_lens,
            max_seq_len=kept.max_seq_len,
            max_query_len=case.max_query_len,
            k_scale=k_scale, v_scale=v_scale,
            sliding_window=case.sliding_window,  # W itself; 0 = none
            sm_scale=case.scale,
            sinks=batch.sinks,
            causal=case.causal,
        )
    return out


# -- vllm:triton_attn -------------------------------------------------------------

TRITON_ATTN_CAPABILITIES = BOTH_BACKENDS.restrict(head_sizes=TRITON_ATTN_HEAD_SIZES)

# vLLM's INT4 per-token-head cache: 4-bit codes two a byte, the even element in the low nibble
# (pack_int4_nibbles), a zero point in the low 4 bits of a float32 scale word, rotated by vLLM's
# single RHT (_get_rht_signs(d, 0) seeds torch's generator with 0x9E3779B9 + 0 * 0x517CC1B7).
INT4_CACHE = KVCache("uint4", "token-head", zero_points="code", scale_format="float32-zp4", rotation="hadamard",
                     rotation_seed=0x9E3779B9)
INT4_CAPABILITIES = BOTH_BACKENDS.restrict(
    non_causal=False,                # unified_attention asserts INT4_PER_TOKEN_HEAD is causal
    kv_cache_dtypes=(), token_head_dtypes=(), cache_formats=(INT4_CACHE,),
    # single_rht rotates q and the output in bfloat16 on GPUs (Triton's MMA Hadamard, or hadacore
    # with a bfloat16 round trip for float32); float32 under the interpreter, which this covers
    rotation_dtype="bfloat16",
)
INT4_NOTES = ("reshape_and_cache_int4 (the cache writer): not driven; the case writes the cache as the format says",)


def offers_split_k(case: Case, path: str | None = None) -> bool:
    """Does the adapter hand ``unified_attention`` split-K scratch for this case?"""
    if path is not None:
        return path == "3d"
    return case.data_seed % 2 == 1


# Per-token-head modes keep one float32 scale after each head's codes (4 one-byte elements).
SCALE_ELEMENTS = 4


def packed_token_head_caches(batch: PagedBatch) -> torch.Tensor:
    """TRITON_ATTN's per-token-head cache: uint8 ``[num_blocks, num_kv_heads, block_size, 2 * (row + 4)]``,
    each row K's codes, K's scale, V's codes, V's scale (every slot copied, dead ones included); ``row``
    is a head's code bytes (head_size, or head_size / 2 for INT4's packed nibbles)."""
    blocks, block_size, heads, head_size = batch.key_cache.shape
    padded = head_size + SCALE_ELEMENTS
    packed = torch.empty(blocks, heads, block_size, 2 * padded, dtype=torch.uint8, device=batch.key_cache.device)
    for half, cache, scales in ((0, batch.key_cache, batch.k_scale_cache), (1, batch.value_cache, batch.v_scale_cache)):
        start = half * padded
        packed[..., start:start + head_size] = codes_of(cache).permute(0, 2, 1, 3)
        packed[..., start + head_size:start + padded] = (
            scales.permute(0, 2, 1).contiguous().view(torch.uint8).view(blocks, heads, block_size, SCALE_ELEMENTS))
    return packed


def copies_token_head_caches(case) -> bool:
    """TRITON_ATTN reads plain and per-tensor fp8 caches in place, and packs per-token-head ones anew."""
    return case.kv_cache.token_head


def token_head_views(packed: torch.Tensor, head_size: int, dtype: torch.dtype):
    """The backend's views of a packed cache: key and value codes ``[num_blocks, block_size, num_kv_heads,
    head_size + 4]`` as ``dtype``, and the float32 scale caches ``[num_blocks, block_size, num_kv_heads]``."""
    blocks, heads, block_size, row = packed.shape
    padded = row // 2
    key_cache, value_cache = packed.view(dtype).transpose(1, 2).split(padded, dim=-1)
    words = torch.tensor([], dtype=torch.float32, device=packed.device).set_(packed.untyped_storage())
    block, head, slot = (stride // 4 for stride in packed.stride()[:3])
    base = packed.storage_offset() // 4
    scale_caches = [torch.as_strided(words, (blocks, block_size, heads), (block, slot, head),
                                     base + (start + head_size) // 4) for start in (0, padded)]
    return key_cache, value_cache, scale_caches[0], scale_caches[1]


def run_triton_attn(batch: PagedBatch, out: torch.Tensor, *, path: str | None = None,
                    source: str | None = None, group: str = "triton_attn") -> torch.Tensor:
    case = batch.case
    g = case.geometry
    loaded = vllm_loader.load(group, source)
    module = loaded["triton_unified_attention"]
    entry = module.unified_attention
    device = batch.q.device
    num_seqs = len(case.sequences)
    kv = case.kv_cache
    key_cache, value_cache = batch.key_cache, batch.value_cache
    quant = dict(kv_quant_mode=module.KVQuantMode.NONE)
    descales = [torch.ones(1, dtype=torch.float32, device=device).expand(num_seqs, g.num_kv_heads)] * 2
    if kv == INT4_CACHE:  # codes and scale words packed as the backend keeps them, as bytes
        key_cache, value_cache, k_scales, v_scales = token_head_views(
            packed_token_head_caches(batch), batch.key_cache.shape[-1], torch.uint8)
        quant = dict(kv_quant_mode=module.KVQuantMode.INT4_PER_TOKEN_HEAD, k_scale_cache=k_scales,
                     v_scale_cache=v_scales)
        descales = [None, None]
    elif kv.token_head:
        int8 = kv.dtype == "int8"
        mode = module.KVQuantMode.INT8_PER_TOKEN_HEAD if int8 else module.KVQuantMode.FP8_PER_TOKEN_HEAD
        key_cache, value_cache, k_scales, v_scales = token_head_views(
            packed_token_head_caches(batch), g.head_size, torch.int8 if int8 else key_cache.dtype)
        quant = dict(kv_quant_mode=mode, k_scale_cache=k_scales, v_scale_cache=v_scales)
        descales = [None, None]
    elif kv.quantized:
        quant = dict(kv_quant_mode=module.KVQuantMode.FP8_PER_TENSOR)
        descales = [scale.expand(num_seqs, g.num_kv_heads) for scale in (batch.k_scale, batch.v_scale)]
    split_k: dict = {}
    if offers_split_k(case, path) and case.num_tokens > 0:
        # Stale scratch is realistic (vLLM reuses it across layers and steps),
        # so it starts as NaN: a segment the merge reads without writing shows.
        padded = 1 << (g.head_size - 1).bit_length()  # HEAD_SIZE_PADDED
        rows = (case.num_tokens, g.num_q_heads, SOFTMAX_SEGMENTS)
        split_k = dict(
            # at least num_seqs * ceil(max_query_len / BLOCK_Q): vLLM's size rule never vetoes
            seq_threshold_3D=num_seqs * max(1, case.max_query_len),
            num_par_softmax_segments=SOFTMAX_SEGMENTS,
            softmax_segm_output=torch.full((*rows, padded), float("nan"), dtype=torch.float32, device=device),
            softmax_segm_max=torch.full(rows, float("nan"), dtype=torch.float32, device=device),
            softmax_segm_expsum=torch.full(rows, float("nan"), dtype=torch.float32, device=device),
        )
    with loaded.active():
        entry(
            q=batch.q, k=key_cache, v=value_cache, out=out,
            cu_seqlens_q=batch.query_start_loc, max_seqlen_q=case.max_query_len,
            seqused_k=batch.seq_lens, max_seqlen_k=case.max_seq_len,
            softmax_scale=case.scale, causal=case.causal, window_size=window_size(case),
            block_table=batch.block_table, softcap=0,
            q_descale=None, k_descale=descales[0], v_descale=descales[1],
            sinks=batch.sinks,
            **split_k, **quant,
        )
    return out


# -- registry entry -----------------------------------------------------------------

def kernel(name: str, source: str | None = None) -> Kernel:
    """The Kernel for ``vllm:rocm_attn``, ``vllm:triton_attn`` and ``vllm:triton_attn_int4`` (or ``@2d`` /
    ``@3d``), ``vllm:triton_mla`` (``harness.adapters.vllm_mla``), ``vllm:triton_attn_diffkv``,
    ``vllm:rocm_segmented_attn`` or ``vllm:turboquant`` (``harness.adapters.vllm_turboquant``), with vLLM's
    kernel files from ``source`` (a source tree or unpacked wheel; None: the installed vllm).

    The kernel files are loaded here, so a missing or unusable vLLM source is
    a configuration error now rather than a crash of the first case.
    """
    if name == "vllm:rocm_attn":
        loaded = vllm_loader.load("rocm_attn", source)
        caps = ROCM_ATTN_CAPABILITIES.restrict(
            kv_cache_dtypes=("auto", platform_fp8(loaded, "chunked_prefill_paged_decode"), "fp8_e5m2"))
        return Kernel(name=name, run=functools.partial(run_rocm_attn, source=source),
                      capabilities=caps, source=source)
    base, _, path = name.partition("@")
    if base == "vllm:triton_attn" and path in ("", *UNIFIED_PATHS):
        loaded = vllm_loader.load("triton_attn", source)
        fp8 = platform_fp8(loaded, "triton_unified_attention")
        caps = TRITON_ATTN_CAPABILITIES.restrict(kv_cache_dtypes=("auto", fp8), token_head_dtypes=(fp8, "int8"))
        return Kernel(name=name, run=functools.partial(run_triton_attn, path=path or None, source=source),
                      capabilities=caps, source=source, copies_caches=copies_token_head_caches)
    if base == INT4_NAME and path in ("", *UNIFIED_PATHS):
        vllm_loader.load("triton_attn_int4", source)
        return Kernel(name=name, run=functools.partial(run_triton_attn, path=path or None, source=source,
                                                       group="triton_attn_int4"),
                      capabilities=INT4_CAPABILITIES, source=source, notes=INT4_NOTES)
    if name in (vllm_mla.NAME, *vllm_mla.VARIANTS):
        return vllm_mla.kernel(name, source)
    if name in (vllm_diffkv.NAME, *vllm_diffkv.VARIANTS):
        return vllm_diffkv.kernel(name, source)
    if name == vllm_segmented.NAME:
        return vllm_segmented.kernel(name, source)
    if name == vllm_turboquant.NAME:
        return vllm_turboquant.kernel(name, source)
    raise NanfuzzError(f"unknown vLLM kernel {name!r}; known: {', '.join((*KERNEL_NAMES, *VARIANTS))}")
