"""Unified paged attention: every key, context and new alike, read from the paged cache.

One program covers ``block_q`` query positions of one sequence times the
``queries_per_kv`` query heads that share one KV head; its BLOCK_M rows are
(query, head) pairs.  Keys are visited in tiles of TILE_SIZE, independent of
the physical block size: each key looks up its own block in the block table.
A program finds its sequence by a binary search over ``query_start_loc``.

Both variants come from one kernel source:

- ``masked`` (fixed): the tile loop covers exactly the keys some row of the
  program may read, clamped to seq_len and pruned by the window at both
  ends.  Only the (at most two) tiles that straddle an edge load with a
  per-key mask; keys outside the edges are never loaded, so no dead slot
  meets any arithmetic.
- ``overshoot`` (old): for non-causal attention the upper edge is the last
  query plus the window (or, without a window, seq_len rounded up to a
  tile) clamped to the block table's capacity instead of to seq_len.  Tail
  slots and padding-table blocks are loaded and only their scores masked,
  so a NaN there reaches ``p @ V`` as 0 * NaN.  Causal attention is correct.

Both read quantized caches (``KV_QUANT``): fp8 with per-tensor scales, and
fp8 or int8 with per-token-head scales, each key's scale loaded from the
``[num_blocks, block_size, num_kv_heads]`` scale cache beside its codes and
under the same mask, so the old variant also reads dead slots' scales (a
NaN scale times a masked value is NaN).

On a GPU every new specialisation is a compile, so only what shapes the
program is constexpr: the variant, the fixed tile sizes, the padded head
size ``tl.arange`` needs and the row count (one for decode-only batches,
one for batches with prefill).  Block size, head size, group size, window,
causality and sinks are runtime values (window 0 = none, sinks through a
dummy tensor when absent), and no integer argument is specialised on being
1 or a multiple of 16.  ``specialisation`` names the compile a batch needs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanfuzz.harness.kernels._common import (GPU_POOL, INTERPRETED, MIN_DOT_SIZE, PER_TENSOR_DTYPES, TOKEN_HEAD_DTYPES,
                                             device_function, dot_rows, family_kernels, kv_quant, scale_arguments,
                                             sinks_argument, softmax_step)
from nanfuzz.reference.batch import PagedBatch
from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.case import Case

VARIANTS = {"overshoot": dict(OVERSHOOT=True), "masked": dict(OVERSHOOT=False)}

# Keys per tile.  Deliberately unrelated to the block size (8 .. 64, and 48).
TILE_SIZE = 32
TILE_SIZE_INTERPRETED = 128
# Rows per program for batches with prefill; decode-only batches use one
# query per program and the fewest rows tl.dot accepts.
PREFILL_ROWS = 64
# float32 runs tl.dot as exact FMAs ("ieee"), which the compiler unrolls in full:
# 64 rows took 12.7 s to compile for sm_90 (Triton 3.9) against 6.6 s for 32 (head size 128),
# the one compile every cold float32 campaign waits for.
PREFILL_ROWS_FLOAT32 = 32
# a whole sequence of an interpreter batch (16 new tokens x 8 query heads)
PREFILL_ROWS_INTERPRETED = 128
DECODE_ROWS = MIN_DOT_SIZE


@device_function
def _find_sequence(Query_start_loc, program, num_seqs, block_q):
    """The sequence whose query blocks include ``program``.

    Sequence s owns the programs from ``start_s // block_q + s`` up to the
    next sequence's first: the ``+ s`` gives every sequence one spare
    program, enough for a partial last block wherever its queries start.
    """
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_program = tl.load(Query_start_loc + mid) // block_q + mid
        if first_program <= program:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@device_function
def _key_edges(first_pos, last_pos, seq_len, table_capacity, window, causal,
               OVERSHOOT: tl.constexpr, TILE_SIZE: tl.constexpr):
    """The half-open key range ``[key_lo, key_hi)`` the program loads.

    ``masked``: the union of the allowed sets of queries ``first_pos ..
    last_pos``, every key of it live.  ``overshoot``: the same lower edge,
    but a non-causal upper edge that ignores seq_len.  ``window`` 0 is none.
    """
    has_window = window > 0
    key_lo = tl.where(has_window, tl.maximum(first_pos - window + 1, 0), 0)
    if OVERSHOOT:
        # the bug: bounded by what the block table can address, not by seq_len
        beyond = tl.where(has_window, last_pos + window, (seq_len + TILE_SIZE - 1) // TILE_SIZE * TILE_SIZE)
        key_hi = tl.minimum(beyond, table_capacity)
    else:
        key_hi = tl.where(has_window, tl.minimum(last_pos + window, seq_len), seq_len)
    key_hi = tl.where(causal, last_pos + 1, key_hi)
    return key_lo, key_hi


@device_function
def _token_head_scales(Scales, block, slot, kv_head, stride_b, stride_s, stride_h, key_ok, EDGE: tl.constexpr):
    """``(TILE_SIZE,)`` float32: each key's entry in a per-token-head scale cache,
    loaded under the same mask as its codes (an EDGE tile's keys outside the edges read 0)."""
    ptrs = Scales + block * stride_b + slot * stride_s + kv_head * stride_h
    if EDGE:
        return tl.load(ptrs, mask=key_ok, other=0.0)
    return tl.load(ptrs)


@device_function
def _attend_tiles(acc, l_i, m_i, q,
                  K_cache, V_cache, Table_row, kv_head,
                  stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                  K_scales, V_scales, k_scale, v_scale,
                  stride_ksb, stride_kss, stride_ksh, stride_vsb, stride_vss, stride_vsh,
                  position, seq_len, window, causal, block_size, key_lo, key_hi, tile_lo, tile_hi,
                  scale, offs_d, d_ok,
                  EDGE: tl.constexpr, TILE_SIZE: tl.constexpr, KV_QUANT: tl.constexpr):
    """Fold key tiles ``tile_lo .. tile_hi - 1`` into ``(acc, l_i, m_i)`` and return them.

    EDGE tiles straddle ``key_lo`` or ``key_hi``: their table entries, K and
    V (and per-token-head scales) load under a per-key mask (0 outside).
    Other tiles lie wholly inside ``[key_lo, key_hi)`` and load without one.
    Scores are masked per row to the row's allowed set either way.
    """
    offs_t = tl.arange(0, TILE_SIZE)
    for tile in range(tile_lo, tile_hi):
        keys = tile * TILE_SIZE + offs_t
        # -- find each key's slot: block_table[seq, key // block_size] ---------
        key_ok = (keys >= key_lo) & (keys < key_hi)  # consulted on EDGE tiles only
        if EDGE:
            block = tl.load(Table_row + keys // block_size, mask=key_ok, other=0).to(tl.int64)
        else:
            block = tl.load(Table_row + keys // block_size).to(tl.int64)
        slot = keys % block_size
        k_ptrs = (K_cache + block[None, :] * stride_kb + slot[None, :] * stride_ks
                  + kv_head * stride_kh + offs_d[:, None])
        v_ptrs = (V_cache + block[:, None] * stride_vb + slot[:, None] * stride_vs
                  + kv_head * stride_vh + offs_d[None, :])
        # -- load K (D, TILE) and V (TILE, D) --------------------------------------
        if EDGE:
            k = tl.load(k_ptrs, mask=d_ok[:, None] & key_ok[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
        # -- quantized caches: codes x scale, in float32, then the query dtype --------
        if KV_QUANT == 1:  # PER_TENSOR
            k = (k.to(tl.float32) * k_scale).to(q.dtype)
            v = (v.to(tl.float32) * v_scale).to(q.dtype)
        if KV_QUANT == 2:  # PER_TOKEN_HEAD
            k_scales = _token_head_scales(K_scales, block, slot, kv_head, stride_ksb, stride_kss, stride_ksh,
                                          key_ok, EDGE)
            v_scales = _token_head_scales(V_scales, block, slot, kv_head, stride_vsb, stride_vss, stride_vsh,
                                          key_ok, EDGE)
            k = (k.to(tl.float32) * k_scales[None, :]).to(q.dtype)
            v = (v.to(tl.float32) * v_scales[:, None]).to(q.dtype)
        # -- compute qk, -inf outside each row's allowed set -----------------------
        qk = tl.dot(q, k, input_precision="ieee") * scale  # qk : (BLOCK_M, TILE_SIZE)
        distance = position[:, None] - keys[None, :]
        allowed = tl.where(causal, distance >= 0, keys[None, :] < seq_len)
        distance = tl.where(causal, distance, tl.abs(distance))
        allowed = allowed & ((distance < window) | (window == 0))
        qk = tl.where(allowed, qk, float("-inf"))
        # -- online softmax --------------------------------------------------------
        acc, l_i, m_i = softmax_step(acc, l_i, m_i, qk, v)
    return acc, l_i, m_i


# Integer arguments Triton would otherwise specialise on being 1 or a multiple of 16.
DO_NOT_SPECIALIZE = [
    "window", "causal", "has_sinks", "num_seqs", "table_width", "block_size", "head_size",
    "queries_per_kv", "block_q",
    "stride_qt", "stride_qh", "stride_ot", "stride_oh",
    "stride_kb", "stride_ks", "stride_kh", "stride_vb", "stride_vs", "stride_vh", "stride_bt",
    "stride_ksb", "stride_kss", "stride_ksh", "stride_vsb", "stride_vss", "stride_vsh",
]


@triton.jit(do_not_specialize=DO_NOT_SPECIALIZE)
def _unified_attention(
    Out, Q, K_cache, V_cache, Block_table, Seq_lens, Query_start_loc, Sinks,
    K_scale, V_scale, K_scales, V_scales,
    scale, window, causal, has_sinks, num_seqs, table_width, block_size, head_size,
    queries_per_kv, block_q,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    stride_ksb, stride_kss, stride_ksh, stride_vsb, stride_vss, stride_vsh,
    BLOCK_M: tl.constexpr, TILE_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
    OVERSHOOT: tl.constexpr, KV_QUANT: tl.constexpr,
):
    tl.static_assert(BLOCK_M >= 16, "tl.dot needs at least 16 rows")
    tl.static_assert(TILE_SIZE >= 16, "tl.dot needs at least 16 keys per tile")
    program = tl.program_id(0)
    kv_head = tl.program_id(1)
    is_causal = causal != 0

    # -- which sequence, which of its query blocks ----------------------------------
    seq = _find_sequence(Query_start_loc, program, num_seqs, block_q)
    q_start = tl.load(Query_start_loc + seq)
    query_len = tl.load(Query_start_loc + seq + 1) - q_start
    q_block = program - (q_start // block_q + seq)
    if q_block * block_q >= query_len:
        return  # a padding sequence, or a program past the sequence's last block
    seq_len = tl.load(Seq_lens + seq)
    context_len = seq_len - query_len

    # -- rows are (query, head) pairs; the launcher keeps block_q * queries_per_kv <= BLOCK_M
    rows = tl.arange(0, BLOCK_M)
    query = q_block * block_q + rows // queries_per_kv
    head = kv_head * queries_per_kv + rows % queries_per_kv
    last_query = tl.minimum(q_block * block_q + block_q, query_len) - 1
    row_ok = (rows < block_q * queries_per_kv) & (query < query_len)
    # spare rows stand in for the last query: finite work, never stored
    query = tl.where(row_ok, query, last_query)
    position = context_len + query
    token = (q_start + query).to(tl.int64)
    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < head_size
    q = tl.load(Q + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # -- softmax state; a sink enters as m = sink, l = exp(sink - m) = 1 -----------
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    sinks_ok = (rows * 0 + has_sinks) != 0  # the flag, one per row
    m_i = tl.load(Sinks + head, mask=sinks_ok, other=float("-inf")).to(tl.float32)
    l_i = tl.where(sinks_ok, 1.0, 0.0)
    k_scale = 1.0
    v_scale = 1.0
    if KV_QUANT == 1:  # PER_TENSOR
        k_scale = tl.load(K_scale)
        v_scale = tl.load(V_scale)

    # -- tiles: lower edge, interior, upper edge -----------------------------------
    key_lo, key_hi = _key_edges(context_len + q_block * block_q, context_len + last_query,
                                seq_len, table_width * block_size, window, is_causal,
                                OVERSHOOT, TILE_SIZE)
    tile_lo = key_lo // TILE_SIZE
    tile_hi = (key_hi + TILE_SIZE - 1) // TILE_SIZE
    inner_lo = tl.minimum((key_lo + TILE_SIZE - 1) // TILE_SIZE, tile_hi)
    inner_hi = tl.maximum(key_hi // TILE_SIZE, inner_lo)
    Table_row = Block_table + seq.to(tl.int64) * stride_bt
    acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, K_cache, V_cache, Table_row, kv_head,
                                  stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                                  K_scales, V_scales, k_scale, v_scale,
                                  stride_ksb, stride_kss, stride_ksh, stride_vsb, stride_vss, stride_vsh,
                                  position, seq_len, window, is_causal, block_size, key_lo, key_hi,
                                  tile_lo, inner_lo, scale, offs_d, d_ok, True, TILE_SIZE, KV_QUANT)
    acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, K_cache, V_cache, Table_row, kv_head,
                                  stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                                  K_scales, V_scales, k_scale, v_scale,
                                  stride_ksb, stride_kss, stride_ksh, stride_vsb, stride_vss, stride_vsh,
                                  position, seq_len, window, is_causal, block_size, key_lo, key_hi,
                                  inner_lo, inner_hi, scale, offs_d, d_ok, False, TILE_SIZE, KV_QUANT)
    acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, K_cache, V_cache, Table_row, kv_head,
                                  stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                                  K_scales, V_scales, k_scale, v_scale,
                                  stride_ksb, stride_kss, stride_ksh, stride_vsb, stride_vss, stride_vsh,
                                  position, seq_len, window, is_causal, block_size, key_lo, key_hi,
                                  inner_hi, tile_hi, scale, offs_d, d_ok, True, TILE_SIZE, KV_QUANT)

    # -- epilogue: out[token, head, :] in the output's dtype ---------------------------
    out = acc / l_i[:, None]
    tl.store(Out + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _rows(case: Case) -> int:
    """BLOCK_M: one fixed row count for decode-only batches, one for batches with prefill (per dtype)."""
    if INTERPRETED:
        prefill_rows = PREFILL_ROWS_INTERPRETED
    else:
        prefill_rows = PREFILL_ROWS_FLOAT32 if case.geometry.dtype == "float32" else PREFILL_ROWS
    rows = DECODE_ROWS if case.max_query_len <= 1 else prefill_rows
    return max(rows, dot_rows(case.geometry.queries_per_kv))


def specialisation(case: Case, variant: str) -> dict:
    """The constexpr arguments of a launch on ``case``'s batch (see ``_common``)."""
    return dict(BLOCK_M=_rows(case), TILE_SIZE=TILE_SIZE_INTERPRETED if INTERPRETED else TILE_SIZE,
                HEAD_PAD=triton.next_power_of_2(case.geometry.head_size), KV_QUANT=kv_quant(case),
                **VARIANTS[variant])


def unified_attention(batch: PagedBatch, out: torch.Tensor, *, variant: str) -> torch.Tensor:
    """Write attention for every query token of ``batch`` into ``out`` ``[T, Hq, D]``."""
    case = batch.case
    g = case.geometry
    if case.num_tokens == 0:
        return out
    constexprs = specialisation(case, variant)
    assert str(batch.q.dtype).removeprefix("torch.") == g.dtype and constexprs["HEAD_PAD"] >= g.head_size
    qpk = g.queries_per_kv
    block_q = 1 if case.max_query_len <= 1 else constexprs["BLOCK_M"] // qpk
    # sum over sequences of ceil(query_len / block_q) <= num_tokens // block_q + num_seqs
    grid = (case.num_tokens // block_q + len(case.sequences), g.num_kv_heads)
    k_cache, v_cache = batch.key_cache, batch.value_cache
    assert _unit_stride_heads(batch.q, out, k_cache, v_cache)
    sinks = sinks_argument(batch)
    k_scale, v_scale = scale_arguments(batch)
    k_scales, v_scales = batch.k_scale_cache, batch.v_scale_cache
    if k_scales is not None:  # per-token-head scale caches
        scale_strides = (*k_scales.stride(), *v_scales.stride())
    else:  # stand-ins, never read, with no strides
        scale_strides = (0,) * 6
        k_scales = v_scales = k_scale
    _unified_attention[grid](
        out, batch.q, k_cache, v_cache, batch.block_table, batch.seq_lens, batch.query_start_loc, sinks,
        k_scale, v_scale, k_scales, v_scales,
        case.scale, case.sliding_window, int(case.causal), int(batch.sinks is not None),
        len(case.sequences), batch.block_table.shape[1], g.block_size, g.head_size, qpk, block_q,
        batch.q.stride(0), batch.q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), batch.block_table.stride(0),
        *scale_strides,
        **constexprs,
    )
    return out


def _unit_stride_heads(*tensors: torch.Tensor) -> bool:
    """The kernel steps along the head dimension with stride 1."""
    return all(t.stride(-1) == 1 for t in tensors)


CAPABILITIES = Capabilities(causal=True, non_causal=True, sliding_window=True, sinks=True,
                            kv_cache_dtypes=PER_TENSOR_DTYPES, token_head_dtypes=TOKEN_HEAD_DTYPES,
                            precision="ieee", specialisation_pool=GPU_POOL)

KERNELS = family_kernels("unified", unified_attention, CAPABILITIES, {"overshoot": "caught", "masked": "pass"})
