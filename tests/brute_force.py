"""A per-query, per-head, loop-by-loop attention: the oracle's independent check.

A quantized cache is dequantized element by element on the way: torch's
decode of the code (its encoding's dtype) times the per-tensor scale, or
times the slot's entry in the per-token-head scale cache.
"""
from __future__ import annotations

import math

from nanfuzz.reference.batch import PagedBatch
from nanfuzz.reference.semantics import allowed


def _rows(batch: PagedBatch):
    """Every output row: ``(token, head, kv_head, [(block, offset) of each allowed key])``."""
    case = batch.case
    g = case.geometry
    token = 0
    for seq in case.sequences:
        for i in range(seq.query_len):
            position = seq.context_len + i
            keys = [(seq.block_table[k // g.block_size], k % g.block_size) for k in range(seq.seq_len)
                    if allowed(position, k, seq.seq_len, case.sliding_window, case.causal)]
            for h in range(g.num_q_heads):
                yield token, h, h // g.queries_per_kv, keys
            token += 1


def _by_token(batch: PagedBatch, row) -> list[list[list[float]]]:
    g = batch.case.geometry
    out = [[None] * g.num_q_heads for _ in range(batch.case.num_tokens)]
    for token, h, kv, keys in _rows(batch):
        out[token][h] = row(token, h, kv, keys)
    return out


def brute_force(batch: PagedBatch) -> list[list[list[float]]]:
    case = batch.case
    g = case.geometry

    def row(token, h, kv, keys):
        q = batch.q[token, h].double().tolist()
        scores, values = [], []
        for block, offset in keys:
            kvec = _dequantized(batch, "k", block, offset, kv)
            scores.append(case.scale * sum(a * b for a, b in zip(q, kvec)))
            values.append(_dequantized(batch, "v", block, offset, kv))
        top = max(scores)
        sink = float(batch.sinks[h]) if batch.sinks is not None else None
        if sink is not None:
            top = max(top, sink)
        weights = [math.exp(x - top) for x in scores]
        denom = sum(weights) + (math.exp(sink - top) if sink is not None else 0.0)
        return [sum(w * v[d] for w, v in zip(weights, values)) / denom for d in range(g.v_head_size)]

    return _by_token(batch, row)


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

    def operand(values):
        return arithmetic.operand(torch.tensor(values, dtype=torch.float64).to(f32))

    def row(token, h, kv, keys):
        q = arithmetic.operand(batch.q[token, h].to(f32))
        scores, values = [], []
        for block, offset in keys:
            scores.append(torch.dot(q, operand(_dequantized(batch, "k", block, offset, kv))) * case.scale)
            values.append(operand(_dequantized(batch, "v", block, offset, kv)))
        top = torch.stack(scores).max()
        sink = batch.sinks[h].to(f32) if batch.sinks is not None else None
        if sink is not None:
            top = torch.maximum(top, sink)
        denom = torch.zeros((), dtype=f32)
        acc = torch.zeros(g.head_size, dtype=f32)
        for s, v in zip(scores, values):
            w = torch.exp(s - top)
            denom = denom + w
            acc = acc + arithmetic.probabilities(w.reshape(1)) * v
        if sink is not None:
            denom = denom + torch.exp(sink - top)
        return arithmetic.output(acc / denom).double().tolist()

    return _by_token(batch, row)
