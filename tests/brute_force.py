"""A per-query, per-head, loop-by-loop attention: the oracle's independent check."""
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
                    block = seq.block_table[k // g.block_size]
                    kvec = batch.key_cache[block, k % g.block_size, kv].double().tolist()
                    scores.append(case.scale * sum(a * b for a, b in zip(q, kvec)))
                    values.append(batch.value_cache[block, k % g.block_size, kv].double().tolist())
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
