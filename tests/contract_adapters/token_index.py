"""A token-index decode kernel (page size 1), as SGLang's Triton backend lays out its KV cache.

The kernel sees the cache as ``[num_tokens, num_kv_heads, head_size]`` buffers and, per
request, a range of a flat index list: ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]`` holds
the token slots of its keys 0..seq_len-1.  Its window argument is ``sliding_window_size``,
the keys a query may read before its own, where 0 means no window: a window of one key
(W - 1 = 0) cannot be said, so the adapter declares ``min_window=2``.  The index buffer is
padded to a fixed capacity, as a CUDA graph's is, with entries that point at dead slots.
"""
from __future__ import annotations

import triton
import triton.language as tl

from nanfuzz import Capabilities, Kernel, token_indices, window_left

# A CUDA graph's index buffer holds this many entries past the batch's own.
SPARE_INDICES = 16


@triton.jit
def _decode(Q, KBuffer, VBuffer, Out, KvIndptr, KvIndices, sm_scale, sliding_window_size,
            stride_qb, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ob, stride_oh,
            kv_group_num, head_size, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    request = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // kv_group_num
    start = tl.load(KvIndptr + request)
    seq_len = tl.load(KvIndptr + request + 1) - start
    lo = 0
    if sliding_window_size > 0:
        lo = tl.maximum(seq_len - 1 - sliding_window_size, 0)

    offs_d = tl.arange(0, BLOCK_D)
    dim_ok = offs_d < head_size
    q = tl.load(Q + request * stride_qb + head * stride_qh + offs_d, mask=dim_ok, other=0.0).to(tl.float32)
    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for first in range(lo - lo % BLOCK_N, seq_len, BLOCK_N):
        offs_n = first + tl.arange(0, BLOCK_N)
        live = (offs_n >= lo) & (offs_n < seq_len)
        # -- token slots of keys [first, first + BLOCK_N), only the live ones loaded --------
        slots = tl.load(KvIndices + start + offs_n, mask=live, other=0).to(tl.int64)
        k = tl.load(KBuffer + slots[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :],
                    mask=live[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
        v = tl.load(VBuffer + slots[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                    mask=live[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
        s = tl.where(live, tl.sum(k * q[None, :], 1) * sm_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        l_i = l_i * alpha + tl.sum(p, 0)
        m_i = m_new
    tl.store(Out + request * stride_ob + head * stride_oh + offs_d, (acc / l_i).to(Out.dtype.element_ty),
             mask=dim_ok)


def decode_attention(q, k_buffer, v_buffer, out, kv_indptr, kv_indices, sm_scale: float,
                     sliding_window_size: int = 0) -> None:
    """The kernel's own API: ``q``/``out`` ``[num_requests, num_q_heads, head_size]``, one query each."""
    requests, heads, head_size = q.shape
    if requests == 0:
        return
    _decode[(requests, heads)](
        q, k_buffer, v_buffer, out, kv_indptr, kv_indices, sm_scale, sliding_window_size,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        out.stride(0), out.stride(1), heads // k_buffer.shape[1], head_size,
        BLOCK_N=64, BLOCK_D=triton.next_power_of_2(head_size))


CAPABILITIES = Capabilities(
    dtypes=("float16", "bfloat16", "float32"),
    max_query_len=1,     # a decode kernel: one query per request
    causal=True,
    non_causal=False,
    sliding_window=True,
    min_window=2,        # sliding_window_size = W - 1, and 0 means none
    sinks=False,
    precision="ieee",    # no tl.dot: every product is an IEEE float32 one
)


def run(batch, out):
    g = batch.case.geometry
    keys = sum(s.seq_len for s in batch.case.sequences if s.query_len)
    index = token_indices(batch, keys="all", capacity=keys + SPARE_INDICES)
    # page size 1: the cache is one row per token slot, a view (its dead slots and margins stay where they are)
    k_buffer = batch.key_cache.view(-1, g.num_kv_heads, g.head_size)
    v_buffer = batch.value_cache.view(-1, g.num_kv_heads, g.head_size)
    # a padding sequence owns no output row, so the requests' rows are the batch's rows in order
    decode_attention(batch.q, k_buffer, v_buffer, out, index.kv_indptr, index.kv_indices, batch.scale,
                     max(window_left(batch), 0))


kernel = Kernel("contract@token-index", run, CAPABILITIES, spec="tests.contract_adapters.token_index:kernel")
# The same adapter claiming the one-key window its kernel cannot say (sliding_window_size 0 means none).
claims_one_key_window = Kernel("contract@token-index-w1", run, CAPABILITIES.restrict(min_window=1),
                               spec="tests.contract_adapters.token_index:claims_one_key_window")
