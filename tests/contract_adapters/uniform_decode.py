"""A paged decode kernel that takes one query length for the whole batch.

Speculative decoding verifies the same number of draft tokens in every request: the
kernel's API is ``q [num_requests, query_len, num_q_heads, head_size]`` with a single
``query_len``, the last ``query_len`` positions of each request, causal, over a vLLM-style
block table and vLLM's window (W keys; 0 = none).  The adapter declares
``uniform_query_len`` and hands the kernel the scheduled requests alone: a padding
sequence has no query, so it owns no row of ``q`` and no place in the launch.
"""
from __future__ import annotations

import triton
import triton.language as tl

from nanfuzz import Capabilities, Kernel, scheduled, sliding_window


@triton.jit
def _decode(Q, KCache, VCache, Out, BlockTable, SeqLens, sm_scale, window, query_len,
            stride_qr, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            stride_or, stride_ot, stride_oh, stride_bt, queries_per_kv, head_size,
            BLOCK_SIZE: tl.constexpr, BLOCK_PAD: tl.constexpr, QUERY_PAD: tl.constexpr, HEAD_PAD: tl.constexpr):
    request = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // queries_per_kv
    seq_len = tl.load(SeqLens + request)
    rows = tl.arange(0, QUERY_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    offs_s = tl.arange(0, BLOCK_PAD)
    row_ok = rows < query_len
    dim_ok = offs_d < head_size
    # -- q : (QUERY_PAD, HEAD_PAD), row r at position seq_len - query_len + r ---------------
    q = tl.load(Q + request * stride_qr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
    positions = seq_len - query_len + rows
    lo = 0
    if window > 0:
        lo = tl.maximum(seq_len - query_len - window + 1, 0)  # the first query's first key
    m_i = tl.full([QUERY_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([QUERY_PAD], dtype=tl.float32)
    acc = tl.zeros([QUERY_PAD, HEAD_PAD], dtype=tl.float32)
    for j in range(lo // BLOCK_SIZE, tl.cdiv(seq_len, BLOCK_SIZE)):
        block = tl.load(BlockTable + request * stride_bt + j).to(tl.int64)
        keys = j * BLOCK_SIZE + offs_s
        live = (offs_s < BLOCK_SIZE) & (keys >= lo) & (keys < seq_len)
        k = tl.load(KCache + block * stride_kb + offs_s[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
                    mask=live[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
        v = tl.load(VCache + block * stride_vb + offs_s[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
                    mask=live[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
        # -- scores : (QUERY_PAD, BLOCK_PAD), each query its own causal window ------------------
        allowed = live[None, :] & (keys[None, :] <= positions[:, None])
        if window > 0:
            allowed = allowed & (positions[:, None] - keys[None, :] < window)
        s = tl.sum(q[:, None, :] * k[None, :, :], 2) * sm_scale
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: no -inf - -inf
        alpha = tl.exp(m_i - shift)
        p = tl.exp(s - shift[:, None])
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], 1)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(Out + request * stride_or + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def speculative_decode(q, key_cache, value_cache, out, block_table, seq_lens, query_len: int, sm_scale: float,
                       window: int = 0) -> None:
    """The kernel's own API: ``q``/``out`` ``[num_requests, query_len, num_q_heads, head_size]``."""
    requests, _, heads, head_size = q.shape
    if requests == 0:
        return
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    _decode[(requests, heads)](
        q, key_cache, value_cache, out, block_table, seq_lens, sm_scale, window, query_len,
        q.stride(0), q.stride(1), q.stride(2), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        out.stride(0), out.stride(1), out.stride(2), block_table.stride(0), heads // kv_heads, head_size,
        BLOCK_SIZE=block_size, BLOCK_PAD=triton.next_power_of_2(block_size), QUERY_PAD=triton.next_power_of_2(query_len),
        HEAD_PAD=triton.next_power_of_2(head_size))


CAPABILITIES = Capabilities(
    dtypes=("float16", "bfloat16", "float32"),
    max_query_len=4,          # the target token and up to three draft tokens
    uniform_query_len=True,   # one query_len for the whole batch
    causal=True,
    non_causal=False,
    sliding_window=True,
    sinks=False,
    precision="ieee",         # no tl.dot
)


def run(batch, out):
    requests = scheduled(batch)
    if not len(requests):
        return out
    query_len = requests.max_query_len  # every scheduled request has this many (uniform_query_len)
    g = batch.case.geometry
    shape = (len(requests), query_len, g.num_q_heads, g.head_size)
    speculative_decode(batch.q.view(shape), batch.key_cache, batch.value_cache, out.view(shape),
                       requests.block_table, requests.seq_lens, query_len, batch.scale, sliding_window(batch))
    return out


kernel = Kernel("contract@uniform-decode", run, CAPABILITIES, spec="tests.contract_adapters.uniform_decode:kernel")
