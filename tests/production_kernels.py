"""Plain-torch kernels vectorised for production-size batches, with bugs that only large batches meet.

``attention`` reads each sequence's keys through its block table, one
sequence at a time, all heads and queries at once.  Its bugs:

- "int32-offsets": a key's element offset ``block * block_stride + slot * slot_stride``
  in int32, which wraps past 2^31 elements (a cache of gigabytes): the key is
  read from far away, from the NaN around the blocks the case uses;
- "drops-long-tail": a sequence longer than 1024 keys loses its keys past the
  last multiple of 1024 (a split-KV reduction that forgets its last partition);
- "late-sequences": a sequence at index 4 or later reads its keys through the
  block table of sequence 3 (a per-sequence index kept in two bits).
"""
from __future__ import annotations

import torch

from nanfuzz.harness.kernel import Kernel
from nanfuzz.reference.capabilities import Capabilities

CAPS = Capabilities(non_causal=True, sinks=True, interpreter_dtypes=("float16", "bfloat16", "float32"),
                    precision="ieee", head_sizes=(32, 64, 128, 256))


def attention(batch, out, *, bug: str | None = None):
    case = batch.case
    g = case.geometry
    hkv, d, bs = g.num_kv_heads, g.head_size, g.block_size
    keys_k = batch.key_cache.reshape(-1, hkv, d)
    keys_v = batch.value_cache.reshape(-1, hkv, d)
    device = batch.q.device
    start = 0
    for s, seq in enumerate(case.sequences):
        if not seq.query_len:
            continue
        length = seq.seq_len
        if bug == "drops-long-tail" and length > 1024:
            length -= length % 1024
        keys = torch.arange(length, device=device)
        row = min(s, 3) if bug == "late-sequences" else s
        blocks = batch.block_table[row].long()[keys // bs]
        if bug == "int32-offsets":
            offsets = (blocks.to(torch.int32) * (bs * hkv * d) + (keys % bs).to(torch.int32) * (hkv * d))
            slots = torch.div(offsets.to(torch.int64), hkv * d, rounding_mode="floor")
        else:
            slots = blocks * bs + keys % bs
        positions = torch.arange(seq.context_len, seq.seq_len, device=device)
        ok = keys[None, :] < seq.seq_len
        if case.causal:
            ok = ok & (keys[None, :] <= positions[:, None])
        if case.sliding_window:
            distance = positions[:, None] - keys[None, :]
            ok = ok & ((distance if case.causal else distance.abs()) < case.sliding_window)
        live = ok.any(0)
        k = torch.where(live[:, None, None], keys_k[slots].float(), 0.0)
        v = torch.where(live[:, None, None], keys_v[slots].float(), 0.0)
        q = batch.q[start:start + seq.query_len].float().view(seq.query_len, hkv, g.queries_per_kv, d)
        scores = torch.einsum("qhgd,khd->hgqk", q, k) * case.scale
        scores = scores.masked_fill(~ok[None, None], float("-inf"))
        m = scores.amax(-1, keepdim=True)
        if batch.sinks is not None:
            m = torch.maximum(m, batch.sinks.view(hkv, g.queries_per_kv, 1, 1))
        p = torch.exp(scores - m)
        denominator = p.sum(-1, keepdim=True)
        if batch.sinks is not None:
            denominator = denominator + torch.exp(batch.sinks.view(hkv, g.queries_per_kv, 1, 1) - m)
        result = torch.einsum("hgqk,khd->qhgd", p, v) / denominator.permute(2, 0, 1, 3)
        out[start:start + seq.query_len] = result.reshape(seq.query_len, g.num_q_heads, d).to(out.dtype)
        start += seq.query_len
    return out


def _make(bug: str | None) -> Kernel:
    attr = (bug or "correct").replace("-", "_")
    return Kernel(name=f"torch-long@{bug or 'correct'}", run=lambda b, o: attention(b, o, bug=bug), capabilities=CAPS,
                  expect="caught" if bug else "pass", spec=f"tests.production_kernels:{attr}", size="production")


correct = _make(None)
int32_offsets = _make("int32-offsets")
drops_long_tail = _make("drops-long-tail")
late_sequences = _make("late-sequences")
