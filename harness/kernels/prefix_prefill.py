"""Prefix prefill: chunked prefill with context, over a paged KV cache.

The same job as vLLM's ``context_attention_fwd``, written for this project.
One program takes a sequence, a KV head and a tile of query tokens; its rows
are (token, query head of the KV head's group) pairs, so each K/V tile is
loaded once for the whole group.  Two phases per program:

1. the context keys 0..context_len-1, read from the paged cache through the
   block table, one physical block lookup per key (so the key tile need not
   match the block size, which may be 48);
2. the new tokens' keys context_len..seq_len-1, read from the dense ``k``/``v``
   tensors, with the causal mask.

Variants (one kernel, the ``MASK_DEAD_SLOTS`` switch):

- ``unmasked``: the old bug.  Phase 1 walks every context tile from key 0 and
  loads K and V without a slot mask; disallowed keys only get a -inf score.
  Freed blocks below the sliding window and tail slots past seq_len in the
  last tile still meet ``p @ V`` with p = 0, and 0 * NaN = NaN.
- ``masked``: the fix.  Tiles wholly below the window are never visited, and
  the tiles that straddle the window's lower edge or the end of the context
  load through a per-slot mask; the tiles in between load without one.

Both read fp8 caches with per-tensor scales (``KV_QUANT``): context tiles
become code x scale in float32, then the query dtype; the new tokens' k/v
come dequantized already (as vLLM's ``context_attention_fwd`` receives them).

Compiles: only the variant, the tile sizes and the padded head size are
constexprs; block size, head size, window, causality and sinks are runtime
values and no integer argument is specialised, so a fuzz campaign compiles
one kernel per dtype x padded head size x variant (``specialisation``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanfuzz.harness.kernels._common import (GPU_POOL, INTERPRETED, PER_TENSOR_DTYPES, device_function, dot_rows, family_kernels,
                                             kv_quant, scale_arguments, sinks_argument, softmax_step)
from nanfuzz.reference.batch import PagedBatch
from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.case import Case

VARIANTS = {"unmasked": dict(MASK_DEAD_SLOTS=False), "masked": dict(MASK_DEAD_SLOTS=True)}

# Keys per tile in both phases.  Not tied to the block size on purpose: with
# blocks of 8 a tile spans four blocks, with 48 or 64 tiles split blocks.
BLOCK_N = 32
BLOCK_N_INTERPRETED = 128
# Rows (token x group head) per program, one size for every batch so that the
# tile is never a new compile; it must hold a whole GQA group (``dot_rows``).
BLOCK_M = 32
BLOCK_M_INTERPRETED = 128


@device_function
def _load_cache_tile(Key_cache, Value_cache, table_row, table_width, block_size, keys, slot_ok,
                     kv_head, offs_d, dim_ok,
                     stride_kc_block, stride_kc_slot, stride_kc_head,
                     stride_vc_block, stride_vc_slot, stride_vc_head,
                     MASK_SLOTS: tl.constexpr):
    """K transposed ``(D_PAD, BLOCK_N)`` and V ``(BLOCK_N, D_PAD)`` of the keys at
    absolute positions ``keys`` (``(BLOCK_N,)``), through the block table.

    With ``MASK_SLOTS`` the lanes where ``slot_ok`` is false read zeros, never
    the cache; without it every lane reads its slot, whatever it holds (only
    the head padding past ``dim_ok`` is never read).  The caller still masks
    the scores.
    """
    # the last tile can run past the table row: clamp so the table read stays in it
    logical = tl.minimum(keys // block_size, table_width - 1)
    block = tl.load(table_row + logical).to(tl.int64)        # (BLOCK_N,)
    slot = keys % block_size
    k_ptrs = (Key_cache + block[None, :] * stride_kc_block + slot[None, :] * stride_kc_slot
              + kv_head * stride_kc_head + offs_d[:, None])
    v_ptrs = (Value_cache + block[:, None] * stride_vc_block + slot[:, None] * stride_vc_slot
              + kv_head * stride_vc_head + offs_d[None, :])
    if MASK_SLOTS:
        k = tl.load(k_ptrs, mask=slot_ok[None, :] & dim_ok[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=slot_ok[:, None] & dim_ok[None, :], other=0.0)
    else:
        k = tl.load(k_ptrs, mask=dim_ok[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=dim_ok[None, :], other=0.0)
    return k, v


@device_function
def _allowed(pos, keys, key_end, window, causal):
    """``(BLOCK_M, BLOCK_N)``: may the query at ``pos`` (``(BLOCK_M, 1)``) read
    ``keys`` (``(1, BLOCK_N)``)?  Keys at or past ``key_end`` belong to the
    other phase (or to nobody).  ``window`` 0 is none; ``causal`` 0 or 1."""
    ok = (keys < key_end) & ((keys <= pos) | (causal == 0))
    # once causal has kept keys <= pos, |pos - k| is the causal distance pos - k
    return ok & ((tl.abs(pos - keys) < window) | (window == 0))


# Every integer argument: Triton would otherwise key a compile on each being 1
# or a multiple of 16.
DO_NOT_SPECIALIZE = [
    "block_size", "head_size", "window", "causal", "has_sinks", "group", "tokens_per_tile", "table_width",
    "stride_q_tok", "stride_q_head", "stride_k_tok", "stride_k_head", "stride_v_tok", "stride_v_head",
    "stride_kc_block", "stride_kc_slot", "stride_kc_head", "stride_vc_block", "stride_vc_slot", "stride_vc_head",
    "stride_table_seq", "stride_o_tok", "stride_o_head",
]


@triton.jit(do_not_specialize=DO_NOT_SPECIALIZE)
def _prefix_prefill_fwd(
    Q, K, V, Key_cache, Value_cache, K_scale, V_scale, Block_table, Seq_lens, Query_start_loc, Sinks, Out,
    scale, block_size, head_size, window, causal, has_sinks, group, tokens_per_tile, table_width,
    stride_q_tok, stride_q_head,
    stride_k_tok, stride_k_head,
    stride_v_tok, stride_v_head,
    stride_kc_block, stride_kc_slot, stride_kc_head,
    stride_vc_block, stride_vc_slot, stride_vc_head,
    stride_table_seq,
    stride_o_tok, stride_o_head,
    MASK_DEAD_SLOTS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, KV_QUANT: tl.constexpr,
):
    tl.static_assert(BLOCK_N >= 16, "tl.dot needs every dimension >= 16")
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)

    # -- this program's query tokens ------------------------------------------
    q_start = tl.load(Query_start_loc + seq)
    q_len = tl.load(Query_start_loc + seq + 1) - q_start
    q_start = q_start.to(tl.int64)
    seq_len = tl.load(Seq_lens + seq)
    ctx_len = seq_len - q_len
    first = tile * tokens_per_tile
    if first >= q_len:
        return  # query_len 0 (padding) or a shorter sequence than the grid's longest
    last = tl.minimum(first + tokens_per_tile, q_len) - 1

    rows = tl.arange(0, BLOCK_M)
    token = first + rows // group                              # (BLOCK_M,)
    head = kv_head * group + rows % group
    row_ok = (rows < tokens_per_tile * group) & (token < q_len)
    pos = ctx_len + token                                      # absolute positions
    offs_d = tl.arange(0, D_PAD)
    dim_ok = offs_d < head_size
    offs_n = tl.arange(0, BLOCK_N)

    q_ptrs = Q + (q_start + token[:, None]) * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)   # (BLOCK_M, D_PAD)

    # -- softmax state; a sink enters as a key of logit `sink` and no value -----
    # (without sinks, m = -inf and l = 0; ``Sinks`` is then a stand-in, never read)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    use_sink = (rows * 0 + has_sinks) != 0                     # (BLOCK_M,), all equal
    m_i = tl.load(Sinks + head, mask=use_sink, other=float("-inf")).to(tl.float32)
    l_i = use_sink.to(tl.float32)

    # -- keys any row of this program may read: [lo, hi) -------------------------
    # the first row reaches back furthest, the last row furthest ahead
    windowed = window > 0
    lo = tl.where(windowed, tl.maximum(ctx_len + first - window + 1, 0), 0)
    hi = tl.where(windowed, tl.minimum(seq_len, ctx_len + last + window), seq_len)
    hi = tl.where(causal != 0, ctx_len + last + 1, hi)

    # -- phase 1: context keys from the paged cache ----------------------------
    k_scale = 1.0
    v_scale = 1.0
    if KV_QUANT == 1:  # PER_TENSOR: codes x scale
        k_scale = tl.load(K_scale)
        v_scale = tl.load(V_scale)
    table_row = Block_table + seq.to(tl.int64) * stride_table_seq
    if MASK_DEAD_SLOTS:
        # tiles wholly below the window are never visited; when the window
        # lies past the context (long chunks, short windows), none is
        ctx_lo = tl.minimum(lo, ctx_len)
        ctx_start = tl.where(ctx_lo < ctx_len, ctx_lo // BLOCK_N * BLOCK_N, ctx_len)
    else:
        ctx_lo = 0
        ctx_start = 0
    for start_n in range(ctx_start, ctx_len, BLOCK_N):
        keys = start_n + offs_n
        if MASK_DEAD_SLOTS:
            slot_ok = (keys >= ctx_lo) & (keys < ctx_len)
            if (start_n < ctx_lo) | (start_n + BLOCK_N > ctx_len):   # straddles an edge
                k, v = _load_cache_tile(Key_cache, Value_cache, table_row, table_width, block_size, keys, slot_ok,
                                        kv_head, offs_d, dim_ok,
                                        stride_kc_block, stride_kc_slot, stride_kc_head,
                                        stride_vc_block, stride_vc_slot, stride_vc_head,
                                        True)
            else:
                k, v = _load_cache_tile(Key_cache, Value_cache, table_row, table_width, block_size, keys, slot_ok,
                                        kv_head, offs_d, dim_ok,
                                        stride_kc_block, stride_kc_slot, stride_kc_head,
                                        stride_vc_block, stride_vc_slot, stride_vc_head,
                                        False)
        else:  # every lane reads its slot; slot_ok is not consulted
            k, v = _load_cache_tile(Key_cache, Value_cache, table_row, table_width, block_size, keys, keys < ctx_len,
                                    kv_head, offs_d, dim_ok,
                                    stride_kc_block, stride_kc_slot, stride_kc_head,
                                    stride_vc_block, stride_vc_slot, stride_vc_head,
                                    False)
        if KV_QUANT == 1:
            k = (k.to(tl.float32) * k_scale).to(q.dtype)
            v = (v.to(tl.float32) * v_scale).to(q.dtype)
        # -- compute qk, mask the scores, fold the tile in --------------------
        # "ieee": fp32 caches keep fp32 accuracy; fp16/bf16 dots are unaffected
        qk = tl.dot(q, k, input_precision="ieee") * scale
        ok = _allowed(pos[:, None], keys[None, :], ctx_len, window, causal)
        qk = tl.where(ok, qk, float("-inf"))
        acc, l_i, m_i = softmax_step(acc, l_i, m_i, qk, v)

    # -- phase 2: the new tokens' keys from k/v ---------------------------------
    # Rows of k/v hold only this step's tokens, all live; the mask keeps the
    # last tile from reading the next sequence's rows or past the tensor.
    new_lo = tl.maximum(lo - ctx_len, 0)
    new_hi = tl.minimum(hi - ctx_len, q_len)
    for start_n in range(new_lo // BLOCK_N * BLOCK_N, new_hi, BLOCK_N):
        j = start_n + offs_n                                   # (BLOCK_N,) new-token index
        j_ok = j < q_len
        k_ptrs = K + (q_start + j[None, :]) * stride_k_tok + kv_head * stride_k_head + offs_d[:, None]
        v_ptrs = V + (q_start + j[:, None]) * stride_v_tok + kv_head * stride_v_head + offs_d[None, :]
        k = tl.load(k_ptrs, mask=j_ok[None, :] & dim_ok[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=j_ok[:, None] & dim_ok[None, :], other=0.0)
        qk = tl.dot(q, k, input_precision="ieee") * scale
        ok = _allowed(pos[:, None], ctx_len + j[None, :], seq_len, window, causal)
        qk = tl.where(ok, qk, float("-inf"))
        acc, l_i, m_i = softmax_step(acc, l_i, m_i, qk, v)

    # -- normalise and store ----------------------------------------------------
    l_i = tl.where(row_ok, l_i, 1.0)  # unstored rows may have no key at all: no 0 / 0
    out = acc / l_i[:, None]
    o_ptrs = Out + (q_start + token[:, None]) * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def specialisation(case: Case, variant: str) -> dict:
    """The constexpr arguments of a launch on ``case``'s batch (see ``_common``)."""
    g = case.geometry
    # GQA groups above BLOCK_M (none within CAPABILITIES) get a larger tile
    query_tile = BLOCK_M_INTERPRETED if INTERPRETED else BLOCK_M
    return dict(BLOCK_M=max(query_tile, dot_rows(g.queries_per_kv)),
                BLOCK_N=BLOCK_N_INTERPRETED if INTERPRETED else BLOCK_N,
                D_PAD=dot_rows(g.head_size), KV_QUANT=kv_quant(case), **VARIANTS[variant])


def prefix_prefill(batch: PagedBatch, out: torch.Tensor, *, variant: str) -> torch.Tensor:
    """Attention of every query token of ``batch`` into ``out`` ``[num_tokens, Hq, D]``."""
    case = batch.case
    g = case.geometry
    for name, t in (("q", batch.q), ("k", batch.k), ("v", batch.v), ("key_cache", batch.key_cache),
                    ("value_cache", batch.value_cache), ("out", out)):
        assert t.stride(-1) == 1, f"{name} must be contiguous in the head dimension"
    assert batch.block_table.stride(1) == 1, "block_table rows must be contiguous"
    # one sinks dtype, or each would be a compile of its own
    sinks = sinks_argument(batch)
    assert sinks.dtype == torch.float32, "sinks must be float32"
    max_query_len = case.max_query_len
    if max_query_len == 0:
        return out  # padding only: no output rows exist
    group = g.queries_per_kv
    constexprs = specialisation(case, variant)
    tokens_per_tile = constexprs["BLOCK_M"] // group
    grid = (len(case.sequences), g.num_kv_heads, triton.cdiv(max_query_len, tokens_per_tile))
    kc, vc = batch.key_cache, batch.value_cache
    k_scale, v_scale = scale_arguments(batch)
    _prefix_prefill_fwd[grid](
        batch.q, batch.k, batch.v, kc, vc, k_scale, v_scale, batch.block_table, batch.seq_lens, batch.query_start_loc,
        sinks, out,
        case.scale, g.block_size, g.head_size, case.sliding_window, int(case.causal),
        int(batch.sinks is not None), group, tokens_per_tile, case.table_width,
        batch.q.stride(0), batch.q.stride(1),
        batch.k.stride(0), batch.k.stride(1),
        batch.v.stride(0), batch.v.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2),
        vc.stride(0), vc.stride(1), vc.stride(2),
        batch.block_table.stride(0),
        out.stride(0), out.stride(1),
        **constexprs,
        num_warps=4,
    )
    return out


CAPABILITIES = Capabilities(causal=True, non_causal=True, sliding_window=True, sinks=True,
                            kv_cache_dtypes=PER_TENSOR_DTYPES, precision="ieee", specialisation_pool=GPU_POOL)

KERNELS = family_kernels("prefix_prefill", prefix_prefill, CAPABILITIES, {"unmasked": "caught", "masked": "pass"})
