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
