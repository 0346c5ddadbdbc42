"""Test-only Triton decode kernels with planted memory bugs, for the GPU checks of the supervisor.

One decode source, two constexpr switches (and ``spins``, a program that never ends):
- ``FOLLOW_GARBAGE``: with a sliding window the kernel takes a dead slot's bits
  as a block id (a garbage table entry) and loads from it: an illegal address.
- ``OVERSHOOT``: the tile loop runs one tile past the block table's width,
  masking scores but not the K/V loads (0 * NaN).
Without either switch the loads are masked too, and the kernel is correct.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanfuzz.harness.kernel import Kernel
from nanfuzz.reference.capabilities import Capabilities


@triton.jit
def _decode(Q, K, V, VBITS, TABLE, SEQ_LENS, STARTS, OUT, scale, window, table_width, table_stride,
            stride_block, stride_slot, stride_head, q_per_kv,
            BLOCK: tl.constexpr, HEAD: tl.constexpr, FOLLOW_GARBAGE: tl.constexpr, OVERSHOOT: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // q_per_kv
    start = tl.load(STARTS + seq)
    if tl.load(STARTS + seq + 1) - start == 0:
        return
    seq_len = tl.load(SEQ_LENS + seq)
    pos = seq_len - 1
    dims = tl.arange(0, HEAD)
    offsets = tl.arange(0, BLOCK)
    q = tl.load(Q + (start * tl.num_programs(1) + head) * HEAD + dims).to(tl.float32)
    m = -float("inf")
    l = 0.0
    acc = tl.zeros([HEAD], dtype=tl.float32)
    tiles = tl.cdiv(seq_len, BLOCK)
    if OVERSHOOT:
        tiles = table_width + 1
    for j in range(0, tiles):
        block = tl.load(TABLE + seq * table_stride + j).to(tl.int64)
        if FOLLOW_GARBAGE:
            if window > 0:
                block = (tl.load(VBITS).to(tl.int64) + 1) << 24  # a dead slot's bits taken for a block id
        keys = j * BLOCK + offsets
        live = keys < seq_len
        if window > 0:
            live = live & (pos - keys < window)
        base = block * stride_block + offsets[:, None] * stride_slot + kv_head * stride_head + dims[None, :]
        if OVERSHOOT:  # the bug: loads that only the scores mask
            k = tl.load(K + base).to(tl.float32)
            v = tl.load(V + base).to(tl.float32)
        else:
            k = tl.load(K + base, mask=live[:, None], other=0.0).to(tl.float32)
            v = tl.load(V + base, mask=live[:, None], other=0.0).to(tl.float32)
        s = tl.where(live, tl.sum(k * q[None, :], 1) * scale, -float("inf"))
        m_new = tl.maximum(m, tl.max(s, 0))
        shift = tl.where(m_new == -float("inf"), 0.0, m_new)  # a tile with no live key yet: no NaN from -inf - -inf
        alpha = tl.exp(m - shift)
        p = tl.where(live, tl.exp(s - shift), 0.0)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        l = l * alpha + tl.sum(p, 0)
        m = m_new
    tl.store(OUT + (start * tl.num_programs(1) + head) * HEAD + dims, (acc / l).to(OUT.dtype.element_ty))


def _run(batch, out, follow_garbage: bool, overshoot: bool):
    case = batch.case
    g = case.geometry
    kc, vc = batch.key_cache, batch.value_cache
    _decode[(len(case.sequences), g.num_q_heads)](
        batch.q, kc, vc, vc.view(torch.int16 if vc.element_size() == 2 else torch.int32), batch.block_table,
        batch.seq_lens, batch.query_start_loc, out, case.scale, case.sliding_window, case.table_width,
        batch.block_table.stride(0), kc.stride(0), kc.stride(1), kc.stride(2), g.queries_per_kv,
        BLOCK=g.block_size, HEAD=g.head_size, FOLLOW_GARBAGE=follow_garbage, OVERSHOOT=overshoot)


CAPS = Capabilities(dtypes=("float16", "float32"), head_sizes=(32, 64), block_sizes=(16,), max_query_len=1,
                    non_causal=False, sinks=False)

follows_garbage_table_entry = Kernel("triton_subject@follows-garbage", lambda b, o: _run(b, o, True, False), CAPS,
                                     expect="caught", spec="tests.triton_subjects:follows_garbage_table_entry")
overshoots_the_table = Kernel("triton_subject@overshoot", lambda b, o: _run(b, o, False, True), CAPS,
                              expect="caught", spec="tests.triton_subjects:overshoots_the_table")
correct = Kernel("triton_subject@correct", lambda b, o: _run(b, o, False, False), CAPS,
                 spec="tests.triton_subjects:correct")


@triton.jit
def _spin(FLAG):
    flag = tl.load(FLAG, volatile=True)
    while flag == 0:  # nothing ever sets it: the program never ends
        flag = tl.load(FLAG, volatile=True)


def _spin_on_the_device(batch, out):
    """Launches and returns at once; the device spins until the process is killed."""
    _spin[(1,)](torch.zeros(1, dtype=torch.int32, device=out.device))
    return out


spins = Kernel("triton_subject@spins", _spin_on_the_device, CAPS, expect="caught", spec="tests.triton_subjects:spins")
