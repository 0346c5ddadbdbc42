"""A per-query, per-head, loop-by-loop attention: the oracle's independent check.

A quantized cache is dequantized element by element on the way: torch's
decode of the code (its encoding's dtype) times the per-tensor scale, or
times the slot's entry in the per-token-head scale cache.
"""
from __future__ import annotations

import math

from nanfuzz.reference.batch import PagedBatch
from nanfuzz.reference.semantics import allowed


def brute_force(batch: PagedBatch) -> list[list[list[float]]]:
    case = batch.case
    g = case.geometry
    out = []
    token = 0
    for s, seq in enumerate(case.sequences):
        for i in range(seq.query_len):
            position = seq.context_len + i
            keys = [k for k in range(seq.seq_len) if allowed(position, k, seq.seq_len, case.sliding_window, case.causal)]
            rows = []
            for h in range(g.num_q_heads):
                kv = h // g.queries_per_kv
                q = batch.q[token, h].double().tolist()
                scores = []
                values = []
                for k in keys:
                    block, offset = seq.block_table[k // g.block_size], k % g.block_size
                    kvec = _dequantized(batch, "k", block, offset, kv)
                    scores.append(case.scale * sum(a * b for a, b in zip(q, kvec)))
                    values.append(_dequantized(batch, "v", block, offset, kv))
                top = max(scores)
                sink = float(batch.sinks[h]) if batch.sinks is not None else None
                if sink is not None:
                    top = max(top, sink)
                weights = [math.exp(x - top) for x in scores]
                denom = sum(weights) + (math.exp(sink - top) if sink is not None else 0.0)
                rows.append([sum(w * v[d] for w, v in zip(weights, values)) / denom for d in range(g.head_size)])
            out.append(rows)
            token += 1
    return out


def _dequantized(batch: PagedBatch, which: str, block: int, offset: int, kv_head: int) -> list[float]:
    cache = batch.key_cache if which == "k" else batch.value_cache
    codes = [float(x) for x in cache[block, offset, kv_head].double().tolist()]
    kv = batch.case.kv_cache
    if not kv.quantized:
        return codes
    if kv.token_head:
        scales = batch.k_scale_cache if which == "k" else batch.v_scale_cache
        scale = float(scales[block, offset, kv_head])
    else:
        scale = float((batch.k_scale if which == "k" else batch.v_scale)[0])
    return [c * scale for c in codes]


def brute_force_in(batch: PagedBatch, arithmetic) -> list[list[list[float]]]:
    """The same loops in ``arithmetic`` (reference/precision.py): float32 scalars summed one
    key at a time, operands, P and the output rounded as the arithmetic says."""
    import torch

    case = batch.case
    g = case.geometry
    f32 = torch.float32

    def operand(x):
        return arithmetic.operand(x.to(f32))

    out = []
    token = 0
    for seq in case.sequences:
        for i in range(seq.query_len):
            position = seq.context_len + i
            keys = [k for k in range(seq.seq_len) if allowed(position, k, seq.seq_len, case.sliding_window, case.causal)]
            rows = []
            for h in range(g.num_q_heads):
                kv = h // g.queries_per_kv
                q = operand(batch.q[token, h])
                scores, values = [], []
                for k in keys:
                    block = seq.block_table[k // g.block_size]
                    kvec = operand(batch.key_cache[block, k % g.block_size, kv])
                    scores.append(torch.dot(q, kvec) * case.scale)
                    values.append(operand(batch.value_cache[block, k % g.block_size, kv]))
                top = torch.stack(scores).max()
                sink = batch.sinks[h].to(f32) if batch.sinks is not None else None
                if sink is not None:
                    top = torch.maximum(top, sink)
                weights = [torch.exp(s - top) for s in scores]
                denom = torch.zeros((), dtype=f32)
                acc = torch.zeros(g.head_size, dtype=f32)
                for w, v in zip(weights, values):
                    denom = denom + w
                    acc = acc + arithmetic.probabilities(w.reshape(1)) * v
                if sink is not None:
                    denom = denom + torch.exp(sink - top)
                rows.append(arithmetic.output(acc / denom).double().tolist())
            out.append(rows)
            token += 1
    return out
