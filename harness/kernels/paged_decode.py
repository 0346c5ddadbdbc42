"""Paged-attention decode: one query per sequence, keys read through a block table.

One kernel, three variants chosen by constexpr switches:

- ``unmasked``: the old kernel.  Dead keys get a -inf score, but K and V of
  every tile from key 0 up to seq_len rounded up to the tile are loaded
  without a per-key mask, so tail slots and expired (freed) blocks reach
  ``p @ V`` with weight 0, and 0 * NaN = NaN.
- ``tail-masked``: slots >= seq_len are load-masked on the last tile, but
  tiles below the sliding window are still loaded (the freed-block bug).
- ``masked``: the fix.  The tile loop starts at the first tile holding an
  allowed key, and per-key load masks apply only on the two tiles that
  straddle the window start and seq_len; interior tiles load whole, in a
  loop of their own, so it pipelines exactly like the old kernel's.

Every variant reads fp8 caches with per-tensor scales (``KV_QUANT``): a
loaded tile becomes code x scale in float32, then the query dtype, as in
vLLM's ``kernel_paged_attention_2d``.

One program per (sequence, KV head) computes all query heads of that KV head
at once, padded to a ``tl.dot``-friendly row count.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanfuzz.harness.kernels._common import (GPU_POOL, PER_TENSOR_DTYPES, device_function, dot_rows, family_kernels, kv_quant,
                                             scale_arguments, softmax_step)
from nanfuzz.reference.batch import PagedBatch
from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.case import Case

VARIANTS = {
    "unmasked": dict(MASK_TAIL=False, MASK_WINDOW=False),
    "tail-masked": dict(MASK_TAIL=True, MASK_WINDOW=False),
    "masked": dict(MASK_TAIL=True, MASK_WINDOW=True),
}
# Keys per loop step; independent of the physical block size.
DEFAULT_TILE_SIZE = 32


@device_function
def _attend_tile(acc, l_i, m_i, q, k_head, v_head, table_row, tile, lo, seq_len, scale, k_scale, v_scale,
                 table_width, offs_t, offs_d, dim_ok, stride_kb, stride_ks, stride_vb, stride_vs,
                 TILE_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr, LOAD_MASK: tl.constexpr,
                 KV_QUANT: tl.constexpr):
    """Fold keys ``[tile * TILE_SIZE, +TILE_SIZE)`` into the softmax state.

    LOAD_MASK 0: load every key of the tile (an interior tile, or the old
    kernel's every tile); 1: load only keys < seq_len; 2: only allowed keys.
    Scores of keys outside ``[lo, seq_len)`` are -inf either way.
    """
    keys = tile * TILE_SIZE + offs_t
    allowed = (keys >= lo) & (keys < seq_len)
    # -- where each key lives; keys past the table read its last entry --------
    blocks = tl.load(table_row + tl.minimum(keys // BLOCK_SIZE, table_width - 1)).to(tl.int64)
    slots = keys % BLOCK_SIZE
    k_ptrs = k_head + blocks[None, :] * stride_kb + slots[None, :] * stride_ks + offs_d[:, None]
    v_ptrs = v_head + blocks[:, None] * stride_vb + slots[:, None] * stride_vs + offs_d[None, :]
    # -- K : (HEAD_PAD, TILE_SIZE), V : (TILE_SIZE, HEAD_PAD) -------------------
    if LOAD_MASK == 0:
        k = tl.load(k_ptrs, mask=dim_ok[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=dim_ok[None, :], other=0.0)
    else:
        load_ok = allowed if LOAD_MASK == 2 else keys < seq_len
        k = tl.load(k_ptrs, mask=dim_ok[:, None] & load_ok[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=load_ok[:, None] & dim_ok[None, :], other=0.0)
    if KV_QUANT == 1:  # PER_TENSOR: codes x scale
        k = (k.to(tl.float32) * k_scale).to(q.dtype)
        v = (v.to(tl.float32) * v_scale).to(q.dtype)
    # -- scores, dead keys to -inf, online softmax -------------------------------
    qk = tl.dot(q, k, input_precision="ieee") * scale
    qk = tl.where(allowed[None, :], qk, float("-inf"))
    return softmax_step(acc, l_i, m_i, qk, v)


@device_function
def _query_heads(Q, token, kv_head, head_size, queries_per_kv, stride_qt, stride_qh,
                 HEAD_PAD: tl.constexpr, QUERY_ROWS: tl.constexpr):
    """The query rows of ``kv_head``'s query heads, ``(QUERY_ROWS, HEAD_PAD)``, padding rows 0."""
    rows = tl.arange(0, QUERY_ROWS)
    offs_d = tl.arange(0, HEAD_PAD)
    row_ok = rows < queries_per_kv
    dim_ok = offs_d < head_size
    heads = kv_head * queries_per_kv + rows
    q = tl.load(Q + token * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    return q, rows, heads, row_ok, offs_d, dim_ok


@device_function
def _attend_tiles(acc, l_i, m_i, q, k_head, v_head, table_row, lo, seq_len, scale, k_scale, v_scale,
                  table_width, offs_t, offs_d, dim_ok, stride_kb, stride_ks, stride_vb, stride_vs,
                  first, full_lo, full_hi, tail, num_tiles,
                  TILE_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr, EDGE_MASK: tl.constexpr,
                  LAST_MASK: tl.constexpr, KV_QUANT: tl.constexpr):
    """Fold tiles ``[first, num_tiles)`` in three loops: ``[first, full_lo)`` and
    ``[tail, num_tiles)`` masked as ``EDGE_MASK`` / ``LAST_MASK`` (see ``_attend_tile``),
    ``[full_lo, full_hi)`` loaded whole, so that loop pipelines like an unmasked one."""
    for tile in range(first, full_lo):
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, k_head, v_head, table_row, tile, lo, seq_len, scale,
                                     k_scale, v_scale, table_width, offs_t, offs_d, dim_ok, stride_kb, stride_ks,
                                     stride_vb, stride_vs, TILE_SIZE, BLOCK_SIZE, EDGE_MASK, KV_QUANT)
    for tile in range(full_lo, full_hi):
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, k_head, v_head, table_row, tile, lo, seq_len, scale,
                                     k_scale, v_scale, table_width, offs_t, offs_d, dim_ok, stride_kb, stride_ks,
                                     stride_vb, stride_vs, TILE_SIZE, BLOCK_SIZE, 0, KV_QUANT)
    for tile in range(tail, num_tiles):
        acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, k_head, v_head, table_row, tile, lo, seq_len, scale,
                                     k_scale, v_scale, table_width, offs_t, offs_d, dim_ok, stride_kb, stride_ks,
                                     stride_vb, stride_vs, TILE_SIZE, BLOCK_SIZE, LAST_MASK, KV_QUANT)
    return acc, l_i, m_i


# Integers that vary from batch to batch with no bearing on alignment: Triton
# would otherwise compile once more for each being 1 or a multiple of 16.
# The head size and the strides stay specialised: unspecialised, the head
# size alone made this kernel 2.7x slower on an H200 (masked loads along it
# lose their vector width).
DO_NOT_SPECIALIZE = ["window", "queries_per_kv", "table_width"]


@triton.jit(do_not_specialize=DO_NOT_SPECIALIZE)
def _paged_decode_kernel(
    Out, Q, KCache, VCache, KScale, VScale, Sinks, BlockTable, SeqLens, QueryStartLoc,
    scale, window, head_size, queries_per_kv, table_width,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    TILE_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr, QUERY_ROWS: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
    MASK_TAIL: tl.constexpr, MASK_WINDOW: tl.constexpr, KV_QUANT: tl.constexpr,
):
    tl.static_assert(TILE_SIZE >= 16, "tl.dot needs at least 16 keys per tile")
    tl.static_assert(QUERY_ROWS >= 16, "tl.dot needs at least 16 query rows")
    tl.static_assert(MASK_TAIL or not MASK_WINDOW, "a window mask without a tail mask is no shipped variant")
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)

    # -- a sequence without a query (padding) has no output row ---------------
    token = tl.load(QueryStartLoc + seq)
    if tl.load(QueryStartLoc + seq + 1) == token:
        return
    token = token.to(tl.int64)
    seq_len = tl.load(SeqLens + seq)
    # the query sits at p = seq_len - 1; its allowed keys are [lo, seq_len)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)

    # -- the query heads of this KV head: q : (QUERY_ROWS, HEAD_PAD) -----------
    q, rows, heads, row_ok, offs_d, dim_ok = _query_heads(Q, token, kv_head, head_size, queries_per_kv,
                                                         stride_qt, stride_qh, HEAD_PAD, QUERY_ROWS)
    offs_t = tl.arange(0, TILE_SIZE)

    # -- softmax state; a sink starts as the running maximum with weight 1 ----
    acc = tl.zeros([QUERY_ROWS, HEAD_PAD], dtype=tl.float32)
    k_scale = 1.0
    v_scale = 1.0
    if KV_QUANT == 1:  # PER_TENSOR
        k_scale = tl.load(KScale)
        v_scale = tl.load(VScale)
    if HAS_SINKS:
        m_i = tl.load(Sinks + heads, mask=row_ok, other=float("-inf")).to(tl.float32)
        l_i = tl.where(row_ok, 1.0, 0.0)
    else:
        m_i = tl.full([QUERY_ROWS], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([QUERY_ROWS], dtype=tl.float32)

    # -- tile ranges ----------------------------------------------------------
    # [first, full_lo): the tile the window starts in (masked variant only)
    # [full_lo, full_hi): interior tiles, loaded whole, so the loop pipelines
    #   like the old kernel's; the fixed kernel starts it at the window
    # [tail, num_tiles): the tile seq_len ends in
    num_tiles = tl.cdiv(seq_len, TILE_SIZE)
    first = 0
    full_lo = 0
    full_hi = num_tiles
    if MASK_WINDOW:
        first = lo // TILE_SIZE
        full_lo = tl.cdiv(lo, TILE_SIZE)
    if MASK_TAIL:
        full_hi = seq_len // TILE_SIZE
    tail = tl.maximum(full_hi, full_lo)
    table_row = BlockTable + seq.to(tl.int64) * stride_bt
    k_head = KCache + kv_head * stride_kh
    v_head = VCache + kv_head * stride_vh
    acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, k_head, v_head, table_row, lo, seq_len, scale, k_scale, v_scale,
                                  table_width, offs_t, offs_d, dim_ok, stride_kb, stride_ks, stride_vb, stride_vs,
                                  first, full_lo, full_hi, tail, num_tiles, TILE_SIZE, BLOCK_SIZE, 2,
                                  2 if MASK_WINDOW else 1, KV_QUANT)

    # -- epilogue: normalise, write the real heads ----------------------------
    acc = acc / l_i[:, None]
    out_ptrs = Out + token * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def specialisation(case: Case, variant: str) -> dict:
    """The constexpr arguments of a launch on ``case``'s batch (see ``_common``).

    The block size stays a constexpr on purpose: as a run-time divisor it made
    the decode kernel several times slower on an H200 (integer division per key
    instead of a shift), and the shipped fix must be as fast as the old kernel.
    """
    g = case.geometry
    return dict(TILE_SIZE=DEFAULT_TILE_SIZE, BLOCK_SIZE=g.block_size,
                HEAD_PAD=triton.next_power_of_2(g.head_size), QUERY_ROWS=dot_rows(g.queries_per_kv),
                HAS_WINDOW=case.sliding_window > 0, HAS_SINKS=case.sinks, KV_QUANT=kv_quant(case),
                **VARIANTS[variant])


def paged_decode(batch: PagedBatch, out: torch.Tensor, *, variant: str = "masked",
                 tile_size: int = DEFAULT_TILE_SIZE, **launch) -> torch.Tensor:
    """Decode attention of ``batch`` into ``out`` ``[num_tokens, num_q_heads, head_size]``."""
    assert batch.max_query_len <= 1, f"paged_decode is decode-only, got query_len {batch.max_query_len}"
    q, key_cache, value_cache, table = batch.q, batch.key_cache, batch.value_cache, batch.block_table
    num_tokens, num_q_heads, head_size = q.shape
    num_kv_heads = key_cache.shape[2]
    assert q.stride(2) == out.stride(2) == key_cache.stride(3) == value_cache.stride(3) == 1, \
        "the head dimension must be contiguous"
    if num_tokens == 0:
        return out
    queries_per_kv = num_q_heads // num_kv_heads
    window = batch.sliding_window
    grid = (table.shape[0], num_kv_heads)
    k_scale, v_scale = scale_arguments(batch)
    _paged_decode_kernel[grid](
        out, q, key_cache, value_cache, k_scale, v_scale, batch.sinks, table, batch.seq_lens, batch.query_start_loc,
        batch.scale, window, head_size, queries_per_kv, table.shape[1],
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        table.stride(0),
        **{**specialisation(batch.case, variant), "TILE_SIZE": tile_size},
        **launch,  # num_warps / num_stages, for tuning
    )
    return out


# For decode (p = seq_len - 1) the symmetric non-causal window allows the same keys.
CAPABILITIES = Capabilities(max_query_len=1, causal=True, non_causal=True, sliding_window=True, sinks=True,
                            kv_cache_dtypes=PER_TENSOR_DTYPES, precision="ieee", specialisation_pool=GPU_POOL)

KERNELS = family_kernels("paged_decode", paged_decode, CAPABILITIES,
                         {"unmasked": "caught", "tail-masked": "caught", "masked": "pass"})
