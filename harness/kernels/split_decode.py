"""Split-KV paged decode: long sequences cut into partitions, merged by a second kernel.

The shape of vLLM's 3D decode and AITER's pa_decode v2: a batch whose longest
sequence fits one partition (``PARTITION_KEYS``) runs the single-pass kernel
of ``paged_decode`` (its fixed variant); a longer one runs
``_partition_kernel``, one program per (partition, KV head) over the
partitions that hold an allowed key (partitions wholly below a sliding
window are never launched), each writing its unnormalised softmax state to
scratch, and ``_reduce_kernel``, one program per (sequence, KV head), folds
the partitions together.  The partitions pass the small tier's longest
sequence (512 keys), so only production-size batches take the split path.

Two variants, one constexpr switch (``DROP_LAST``):

- ``drops-last-partition``: the old reduction counts a sequence's partitions
  as ``seq_len // PARTITION_KEYS``: the last, partial partition (the newest
  keys, the query's own among them) is never merged.  Right whenever a long
  sequence's length is a multiple of the partition, and at every small size.
- ``masked``: the fix, ``cdiv(seq_len, PARTITION_KEYS)``.
"""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from nanfuzz.harness.kernels import paged_decode as single_pass
from nanfuzz.harness.kernels._common import (GPU_POOL, INTERPRETED, PER_TENSOR_DTYPES, dot_rows, family_kernels,
                                             kv_quant, scale_arguments, sinks_argument)
from nanfuzz.reference.batch import PagedBatch
from nanfuzz.reference.case import Case

VARIANTS = {
    "drops-last-partition": dict(DROP_LAST=True),
    "masked": dict(DROP_LAST=False),
}
# Keys per partition: AITER's v2 partition, past the small tier's longest sequence.
PARTITION_KEYS = 1024
# Keys per loop step.  The interpreter costs per tile operation, whatever the tile's size: there
# a tile is a whole partition (its two edges masked), on a GPU 32 keys.
TILE_SIZE = PARTITION_KEYS if INTERPRETED else 32

DO_NOT_SPECIALIZE = ["window", "queries_per_kv", "table_width"]


@triton.jit(do_not_specialize=DO_NOT_SPECIALIZE)
def _partition_kernel(
    Acc, MaxScore, Denominator, Q, KCache, VCache, KScale, VScale, BlockTable, SeqLens, QueryStartLoc,
    ItemSeq, ItemPart,
    scale, window, head_size, queries_per_kv, table_width,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    TILE_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, QUERY_ROWS: tl.constexpr,
    PARTITION: tl.constexpr, HAS_WINDOW: tl.constexpr, KV_QUANT: tl.constexpr,
):
    tl.static_assert(PARTITION % TILE_SIZE == 0, "a partition is whole tiles")
    item = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(ItemSeq + item)
    part = tl.load(ItemPart + item)
    token = tl.load(QueryStartLoc + seq).to(tl.int64)
    seq_len = tl.load(SeqLens + seq)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)

    # -- the query heads of this KV head: q : (QUERY_ROWS, HEAD_PAD) -----------
    q, rows, heads, row_ok, offs_d, dim_ok = single_pass._query_heads(Q, token, kv_head, head_size, queries_per_kv,
                                                                     stride_qt, stride_qh, HEAD_PAD, QUERY_ROWS)
    offs_t = tl.arange(0, TILE_SIZE)
    k_scale = 1.0
    v_scale = 1.0
    if KV_QUANT == 1:  # PER_TENSOR
        k_scale = tl.load(KScale)
        v_scale = tl.load(VScale)
    acc = tl.zeros([QUERY_ROWS, HEAD_PAD], dtype=tl.float32)
    m_i = tl.full([QUERY_ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([QUERY_ROWS], dtype=tl.float32)

    # -- this partition's allowed keys [start, end), tiles masked only at its two edges -------
    start = tl.maximum(part * PARTITION, lo)
    end = tl.minimum((part + 1) * PARTITION, seq_len)
    first = start // TILE_SIZE
    full_lo = tl.cdiv(start, TILE_SIZE)
    full_hi = end // TILE_SIZE
    tail = tl.maximum(full_hi, full_lo)
    num_tiles = tl.cdiv(end, TILE_SIZE)
    table_row = BlockTable + seq.to(tl.int64) * stride_bt
    k_head = KCache + kv_head * stride_kh
    v_head = VCache + kv_head * stride_vh
    acc, l_i, m_i = single_pass._attend_tiles(acc, l_i, m_i, q, k_head, v_head, table_row, start, end, scale, k_scale,
                                              v_scale, table_width, offs_t, offs_d, dim_ok, stride_kb, stride_ks,
                                              stride_vb, stride_vs, first, full_lo, full_hi, tail, num_tiles,
                                              TILE_SIZE, BLOCK_SIZE, 2, 2, KV_QUANT)

    # -- the partition's state: (QUERY_ROWS, HEAD_PAD), (QUERY_ROWS,), (QUERY_ROWS,) --------
    slot = (item * tl.num_programs(1) + kv_head).to(tl.int64)
    tl.store(Acc + slot * QUERY_ROWS * HEAD_PAD + rows[:, None] * HEAD_PAD + offs_d[None, :], acc)
    tl.store(MaxScore + slot * QUERY_ROWS + rows, m_i)
    tl.store(Denominator + slot * QUERY_ROWS + rows, l_i)


@triton.jit(do_not_specialize=["queries_per_kv"])
def _reduce_kernel(
    Out, Acc, MaxScore, Denominator, Sinks, SeqLens, QueryStartLoc, SeqItems, SeqFirstPart,
    head_size, queries_per_kv, stride_ot, stride_oh,
    HEAD_PAD: tl.constexpr, QUERY_ROWS: tl.constexpr, PARTITION: tl.constexpr, HAS_SINKS: tl.constexpr,
    DROP_LAST: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    num_kv_heads = tl.num_programs(1)
    token = tl.load(QueryStartLoc + seq)
    if tl.load(QueryStartLoc + seq + 1) == token:
        return
    token = token.to(tl.int64)
    seq_len = tl.load(SeqLens + seq)
    first_item = tl.load(SeqItems + seq)
    items = tl.load(SeqItems + seq + 1) - first_item
    if DROP_LAST:  # the old count: partitions seq_len // PARTITION, the partial last one left out
        items = tl.maximum(seq_len // PARTITION - tl.load(SeqFirstPart + seq), 0)

    rows = tl.arange(0, QUERY_ROWS)
    offs_d = tl.arange(0, HEAD_PAD)
    row_ok = rows < queries_per_kv
    heads = kv_head * queries_per_kv + rows
    acc = tl.zeros([QUERY_ROWS, HEAD_PAD], dtype=tl.float32)
    if HAS_SINKS:
        m = tl.load(Sinks + heads, mask=row_ok, other=float("-inf")).to(tl.float32)
        denominator = tl.where(row_ok, 1.0, 0.0)
    else:
        m = tl.full([QUERY_ROWS], float("-inf"), dtype=tl.float32)
        denominator = tl.zeros([QUERY_ROWS], dtype=tl.float32)
    for i in range(items):
        slot = ((first_item + i) * num_kv_heads + kv_head).to(tl.int64)
        m_p = tl.load(MaxScore + slot * QUERY_ROWS + rows)
        l_p = tl.load(Denominator + slot * QUERY_ROWS + rows)
        acc_p = tl.load(Acc + slot * QUERY_ROWS * HEAD_PAD + rows[:, None] * HEAD_PAD + offs_d[None, :])
        m_new = tl.maximum(m, m_p)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # exp(-inf - shift) is 0, never NaN
        keep, take = tl.exp(m - shift), tl.exp(m_p - shift)
        acc = acc * keep[:, None] + acc_p * take[:, None]
        denominator = denominator * keep + l_p * take
        m = m_new
    acc = acc / denominator[:, None]
    out_ptrs = Out + token * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=row_ok[:, None] & (offs_d < head_size)[None, :])


def _work_items(case: Case) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(item -> sequence, item -> partition, sequence -> its first item, sequence -> its first
    partition): every partition holding an allowed key, sequence by sequence."""
    seqs, parts, starts, firsts = [], [], [0], []
    for s, seq in enumerate(case.sequences):
        first = 0
        if seq.query_len:
            lo, hi = seq.live_range(case.sliding_window)
            first = lo // PARTITION_KEYS
            count = -(-hi // PARTITION_KEYS) - first
            seqs += [s] * count
            parts += range(first, first + count)
        starts.append(len(seqs))
        firsts.append(first)
    return (np.array(seqs, dtype=np.int32), np.array(parts, dtype=np.int32), np.array(starts, dtype=np.int32),
            np.array(firsts, dtype=np.int32))


def specialisation(case: Case, variant: str) -> dict:
    """The constexpr arguments of the split path's launches on ``case``'s batch (see ``_common``)."""
    g = case.geometry
    return dict(TILE_SIZE=TILE_SIZE, BLOCK_SIZE=g.block_size, HEAD_PAD=triton.next_power_of_2(g.head_size),
                QUERY_ROWS=dot_rows(g.queries_per_kv), PARTITION=PARTITION_KEYS, HAS_WINDOW=case.sliding_window > 0,
                KV_QUANT=kv_quant(case), HAS_SINKS=case.sinks, **VARIANTS[variant])


def split_decode(batch: PagedBatch, out: torch.Tensor, *, variant: str = "masked") -> torch.Tensor:
    """Decode attention of ``batch`` into ``out``: single pass up to one partition, else split-KV."""
    case = batch.case
    assert batch.max_query_len <= 1, f"split_decode is decode-only, got query_len {batch.max_query_len}"
    if case.max_seq_len <= PARTITION_KEYS:
        return single_pass.paged_decode(batch, out, variant="masked")
    g = case.geometry
    q, key_cache, value_cache, table = batch.q, batch.key_cache, batch.value_cache, batch.block_table
    device = q.device
    item_seq, item_part, seq_items, seq_first = (torch.from_numpy(a).to(device) for a in _work_items(case))
    constexprs = specialisation(case, variant)
    rows, pad = constexprs["QUERY_ROWS"], constexprs["HEAD_PAD"]
    items = item_seq.numel()
    scratch = torch.empty(items * g.num_kv_heads * rows * (pad + 2), dtype=torch.float32, device=device)
    acc, rest = scratch.split([items * g.num_kv_heads * rows * pad, items * g.num_kv_heads * rows * 2])
    max_score, denominator = rest.split(items * g.num_kv_heads * rows)
    k_scale, v_scale = scale_arguments(batch)
    if items:
        _partition_kernel[(items, g.num_kv_heads)](
            acc, max_score, denominator, q, key_cache, value_cache, k_scale, v_scale, table, batch.seq_lens,
            batch.query_start_loc, item_seq, item_part,
            batch.scale, case.sliding_window, g.head_size, g.queries_per_kv, table.shape[1],
            q.stride(0), q.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), table.stride(0),
            TILE_SIZE=constexprs["TILE_SIZE"], BLOCK_SIZE=constexprs["BLOCK_SIZE"], HEAD_PAD=pad, QUERY_ROWS=rows,
            PARTITION=PARTITION_KEYS, HAS_WINDOW=constexprs["HAS_WINDOW"], KV_QUANT=constexprs["KV_QUANT"])
    _reduce_kernel[(len(case.sequences), g.num_kv_heads)](
        out, acc, max_score, denominator, sinks_argument(batch), batch.seq_lens, batch.query_start_loc,
        seq_items, seq_first, g.head_size, g.queries_per_kv, out.stride(0), out.stride(1),
        HEAD_PAD=pad, QUERY_ROWS=rows, PARTITION=PARTITION_KEYS, HAS_SINKS=case.sinks,
        DROP_LAST=constexprs["DROP_LAST"])
    return out


# Its split kernels compile per block size, head size, group, window flag and cache: half
# paged_decode's pool covers them, and its short batches reuse paged_decode's binaries.
CAPABILITIES = single_pass.CAPABILITIES.restrict(specialisation_pool=8)

# Its split path is all it adds to paged_decode, and only production-size batches take it.
KERNELS = family_kernels("split_decode", split_decode, CAPABILITIES,
                         {"drops-last-partition": "caught", "masked": "pass"}, size="production")
