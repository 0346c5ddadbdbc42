"""Test-only Triton decode kernels for read coverage: what their loads address differs, not their output.

One source, one block per tile, switched by ``MODE``:
- ``MASKED``: K and V loads masked to the allowed keys; its loads address no dead slot.
- ``ZEROED``: V of the whole block is loaded and its product zeroed with ``tl.where`` (a NaN
  there never reaches the output): it passes, yet addresses every dead slot of its blocks.
- ``MOSTLY_DEAD``: K of the whole block is loaded (its scores masked, harmless) and V masked,
  except that a block with at most ``FEW_LIVE`` allowed keys takes a path that loads V unmasked:
  a dead slot reaches ``p @ V`` only in that rare geometry, which needs a large block.
"""
from __future__ import annotations

import triton
import triton.language as tl

from nanfuzz import Capabilities, Kernel

MASKED, ZEROED, MOSTLY_DEAD = 0, 1, 2
# MOSTLY_DEAD's unmasked path: blocks of 64 slots (one drawn block size in five)
# whose allowed keys are no more than this many.
FEW_LIVE = 1
BIG_BLOCK = 64


@triton.jit
def _decode(Q, K, V, TABLE, SEQ_LENS, STARTS, OUT, scale, window, table_stride,
            stride_block, stride_slot, stride_head, q_per_kv, head_size,
            BLOCK: tl.constexpr, BLOCK_PAD: tl.constexpr, HEAD_PAD: tl.constexpr, MODE: tl.constexpr,
            FEW: tl.constexpr, BIG: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // q_per_kv
    start = tl.load(STARTS + seq)
    if tl.load(STARTS + seq + 1) == start:
        return
    seq_len = tl.load(SEQ_LENS + seq)
    lo = 0
    if window > 0:
        lo = tl.maximum(seq_len - window, 0)
    dims = tl.arange(0, HEAD_PAD)
    slots = tl.arange(0, BLOCK_PAD)
    dim_ok = dims < head_size
    in_block = slots < BLOCK
    q = tl.load(Q + (start * tl.num_programs(1) + head) * head_size + dims, mask=dim_ok, other=0.0).to(tl.float32)
    m = -float("inf")
    l = 0.0
    acc = tl.zeros([HEAD_PAD], dtype=tl.float32)
    for j in range(lo // BLOCK, tl.cdiv(seq_len, BLOCK)):
        block = tl.load(TABLE + seq * table_stride + j).to(tl.int64)
        keys = j * BLOCK + slots
        live = in_block & (keys >= lo) & (keys < seq_len)
        base = block * stride_block + slots[:, None] * stride_slot + kv_head * stride_head + dims[None, :]
        whole = in_block[:, None] & dim_ok[None, :]
        exact = live[:, None] & dim_ok[None, :]
        if MODE == 0:
            k = tl.load(K + base, mask=exact, other=0.0).to(tl.float32)
            v = tl.load(V + base, mask=exact, other=0.0).to(tl.float32)
        elif MODE == 1:
            k = tl.load(K + base, mask=exact, other=0.0).to(tl.float32)
            v = tl.load(V + base, mask=whole, other=0.0).to(tl.float32)
        else:
            k = tl.load(K + base, mask=whole, other=0.0).to(tl.float32)
            few = (BLOCK >= BIG) & (tl.sum(live.to(tl.int32), 0) <= FEW)
            v = tl.load(V + base, mask=exact | (few & whole), other=0.0).to(tl.float32)
        s = tl.where(live, tl.sum(k * q[None, :], 1) * scale, -float("inf"))
        m_new = tl.maximum(m, tl.max(s, 0))
        shift = tl.where(m_new == -float("inf"), 0.0, m_new)
        alpha = tl.exp(m - shift)
        p = tl.where(live, tl.exp(s - shift), 0.0)
        if MODE == 1:
            acc = acc * alpha + tl.sum(tl.where(live[:, None], p[:, None] * v, 0.0), 0)  # 0 * NaN zeroed away
        else:
            acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        l = l * alpha + tl.sum(p, 0)
        m = m_new
    tl.store(OUT + (start * tl.num_programs(1) + head) * head_size + dims, (acc / l).to(OUT.dtype.element_ty),
             mask=dim_ok)


def _run(batch, out, mode: int, convert=None):
    """``convert`` makes the caches the kernel is launched on (a layout conversion's copy)."""
    case = batch.case
    g = case.geometry
    kc, vc = batch.key_cache, batch.value_cache
    if convert is not None:
        kc, vc = convert(kc), convert(vc)
    _decode[(len(case.sequences), g.num_q_heads)](
        batch.q, kc, vc, batch.block_table, batch.seq_lens, batch.query_start_loc, out, case.scale,
        case.sliding_window, batch.block_table.stride(0), kc.stride(0), kc.stride(1), kc.stride(2),
        g.queries_per_kv, g.head_size, BLOCK=g.block_size, BLOCK_PAD=triton.next_power_of_2(g.block_size),
        HEAD_PAD=triton.next_power_of_2(g.head_size), MODE=mode, FEW=FEW_LIVE, BIG=BIG_BLOCK)


# Few heads and small head sizes: the interpreter's time per example goes with the programs and tiles.
CAPS = Capabilities(dtypes=("float16", "float32"), head_sizes=(32, 64), max_q_heads=4, max_query_len=1,
                    non_causal=False, sinks=False, precision="ieee")

masked = Kernel("read_subject@masked", lambda b, o: _run(b, o, MASKED), CAPS, spec="tests.read_subjects:masked")
zeroed = Kernel("read_subject@zeroed", lambda b, o: _run(b, o, ZEROED), CAPS, spec="tests.read_subjects:zeroed")
mostly_dead = Kernel("read_subject@mostly-dead", lambda b, o: _run(b, o, MOSTLY_DEAD), CAPS, expect="caught",
                     spec="tests.read_subjects:mostly_dead")


def _heads_outside(cache):
    """The cache in a ``[blocks, heads, slots, head_size]`` layout, viewed back in the canonical order."""
    return cache.transpose(1, 2).contiguous().transpose(1, 2)


# The same kernel on copies: one in another layout (its bytes the cache's), one converted to float32.
zeroed_on_a_copy = Kernel("read_subject@zeroed-copy", lambda b, o: _run(b, o, ZEROED, _heads_outside), CAPS,
                          spec="tests.read_subjects:zeroed_on_a_copy")
zeroed_on_float32 = Kernel("read_subject@zeroed-fp32", lambda b, o: _run(b, o, ZEROED, lambda c: c.float()), CAPS,
                           spec="tests.read_subjects:zeroed_on_float32")
