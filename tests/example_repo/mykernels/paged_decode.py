"""Paged-attention decode in Triton: one query token per sequence, keys read through a block table.

The KV cache is ``[num_blocks, block_size, num_kv_heads, head_size]``; key k
of sequence s lives in block ``block_table[s, k // block_size]`` at offset
``k % block_size``.  With a sliding window of W keys (0: none) the query at
position ``seq_len - 1`` reads keys ``[max(seq_len - W, 0), seq_len)``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_kernel(
    Out, Q, KCache, VCache, BlockTable, SeqLens, QueryStartLoc,
    scale, window, queries_per_kv,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    MASK_V: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    # -- a sequence without a query this step has no output row --------------
    token = tl.load(QueryStartLoc + seq)
    if tl.load(QueryStartLoc + seq + 1) == token:
        return
    seq_len = tl.load(SeqLens + seq)
    lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    kv_head = head // queries_per_kv

    offs_d = tl.arange(0, HEAD_PAD)
    offs_s = tl.arange(0, BLOCK_SIZE)
    dim_ok = offs_d < HEAD_SIZE
    q = tl.load(Q + token * stride_qt + head * stride_qh + offs_d, mask=dim_ok, other=0.0).to(tl.float32)

    # -- online softmax over the blocks that hold keys [lo, seq_len) ----------
    m_i = tl.full([1], float("-inf"), tl.float32)
    l_i = tl.zeros([1], tl.float32)
    acc = tl.zeros([HEAD_PAD], tl.float32)
    for j in range(lo // BLOCK_SIZE, tl.cdiv(seq_len, BLOCK_SIZE)):
        block = tl.load(BlockTable + seq * stride_bt + j).to(tl.int64)
        keys = j * BLOCK_SIZE + offs_s
        live = (keys >= lo) & (keys < seq_len)
        # dead slots (the tail past seq_len, keys below the window) are never
        # loaded: a masked score alone would still multiply their V by 0
        k = tl.load(KCache + block * stride_kb + offs_s[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
                    mask=live[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
        v_ptrs = VCache + block * stride_vb + offs_s[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :]
        if MASK_V:
            v = tl.load(v_ptrs, mask=live[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
        else:
            v = tl.load(v_ptrs, mask=dim_ok[None, :], other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], 1) * scale
        s = tl.where(live, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        m_i = m_new
    tl.store(Out + token * stride_ot + head * stride_oh + offs_d, (acc / l_i).to(Out.dtype.element_ty), mask=dim_ok)


def paged_decode(out: torch.Tensor, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, *,
                 scale: float, window: int = 0, mask_v: bool = True) -> torch.Tensor:
    """Decode attention into ``out`` ``[num_tokens, num_q_heads, head_size]``.

    ``mask_v=False`` is the classic bug: V of dead slots is loaded and
    meets a softmax weight of 0, and 0 * NaN = NaN.
    """
    num_tokens, num_q_heads, head_size = q.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    if num_tokens == 0:
        return out
    _decode_kernel[(block_table.shape[0], num_q_heads)](
        out, q, key_cache, value_cache, block_table, seq_lens, query_start_loc,
        scale, window, num_q_heads // num_kv_heads,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_table.stride(0),
        HEAD_SIZE=head_size, HEAD_PAD=triton.next_power_of_2(head_size), BLOCK_SIZE=block_size,
        MASK_V=mask_v,
    )
    return out
