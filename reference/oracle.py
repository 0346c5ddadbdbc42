"""The float64 oracle: attention computed from the allowed keys alone.

Keys are *gathered* from the live slots into a zero-initialised buffer, so a
dead slot's bits never enter a single floating-point operation here, whatever
poison it holds; a quantized cache's live codes are dequantized (code x
scale) on the way, its dead codes and scales never read.  Vectorised over sequences, queries and heads; sequences are
processed in chunks so that the gathered K/V stay within a memory budget.

:func:`attend_in` computes the same attention in several arithmetics (the
oracle's float64 and a kernel's own precision, reference/precision.py) from
one gather per chunk; :func:`computed_in` is that for one arithmetic.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from nanfuzz.reference.batch import PagedBatch
from nanfuzz.reference.case import Case
from nanfuzz.reference.materialize import host_to_device, token_layout
from nanfuzz.reference.precision import FLOAT64, Arithmetic
from nanfuzz.reference.quantization import live_values
from nanfuzz.reference.semantics import allowed_mask, live_key_range

# What one chunk of sequences holds at once, in float64 elements (2**28 x 8 B = 2 GiB): its gathered
# K and V, its queries padded to the longest query, and its allowed mask (a byte an entry).
_CHUNK_ELEMENTS = 1 << 28
# Scores per step of query rows, in elements (2**26 x 8 B = 512 MiB, twice: the scores and P):
# a production prefill of 2048 queries over 64k keys and 32 heads takes many steps.
_SCORE_ELEMENTS = 1 << 26


def oracle(batch: PagedBatch) -> torch.Tensor:
    """float64 ``[num_tokens, num_q_heads, v_head_size]`` on the batch's device (``v_head_size`` is
    ``head_size`` but for a latent cache, whose V is its first ``latent_rank`` entries)."""
    return computed_in(batch, FLOAT64)


def computed_in(batch: PagedBatch, arithmetic: Arithmetic) -> torch.Tensor:
    """The oracle's attention computed in ``arithmetic``, returned as float64."""
    return attend_in(batch, (arithmetic,))[0]


def attend_in(batch: PagedBatch, arithmetics: Sequence[Arithmetic],
              lap: Callable[[int], None] | None = None) -> tuple[torch.Tensor, ...]:
    """The oracle's attention in each of ``arithmetics`` (float64 ``[num_tokens,
    num_q_heads, v_head_size]`` each), from one gather of each chunk of sequences.

    Each result is bit-identical to :func:`computed_in` in its arithmetic alone.
    ``lap(i)`` is called when arithmetic ``i`` is done with a chunk: the work
    since the previous call (a chunk's gather, for the first) was its own.
    """
    case = batch.case
    g = case.geometry
    device = batch.q.device
    outs = tuple(torch.empty(case.num_tokens, g.num_q_heads, g.v_head_size, dtype=torch.float64, device=device)
                 for _ in arithmetics)
    if case.num_tokens == 0:
        return outs
    seq_of, _ = token_layout(case)
    chunk = chunk_sequences(case)
    starts = case.query_start_loc()
    for first in range(0, len(case.sequences), chunk):
        last = min(first + chunk, len(case.sequences))
        if starts[last] == starts[first]:
            continue
        live = _gather(batch, first, last, seq_of[starts[first]:starts[last]])
        for i, (arithmetic, out) in enumerate(zip(arithmetics, outs)):
            out[starts[first]:starts[last]] = live.attend(arithmetic)
            if lap is not None:
                lap(i)
    return outs


def chunk_sequences(case: Case) -> int:
    """How many sequences the oracle gathers at once: as many as ``_CHUNK_ELEMENTS`` holds at the
    case's longest sequence and longest query (a prefill's padded queries and allowed mask grow
    with its new tokens, a decode's do not)."""
    g = case.geometry
    keys, queries = max(1, case.max_seq_len), max(1, case.max_query_len)
    per_seq = (keys * g.num_kv_heads * (g.head_size + g.v_head_size) + queries * g.num_q_heads * g.head_size
               + -(-queries * keys // 8))
    return max(1, _CHUNK_ELEMENTS // per_seq)


@dataclass(frozen=True)
class _Gathered:
    """One chunk's queries, live keys and values (float64, zero-padded), its allowed set,
    and where each of its tokens sits in the padding."""

    case: Case
    q: torch.Tensor             # [n, max_q, hkv, group, d]
    k: torch.Tensor             # [n, max_len, hkv, d]
    v: torch.Tensor             # [n, max_len, hkv, dv]
    allowed: torch.Tensor       # bool [n, max_q, max_len]
    sinks: torch.Tensor | None  # [1, hkv, group, 1, 1]
    tok_seq: torch.Tensor       # [chunk tokens]: its sequence in the chunk
    tok_row: torch.Tensor       # [chunk tokens]: its query row in the sequence

    def attend(self, arithmetic: Arithmetic) -> torch.Tensor:
        """float64 ``[chunk tokens, num_q_heads, v_head_size]`` in ``arithmetic``, a step of query rows
        at a time (each row's softmax is its own)."""
        g = self.case.geometry
        n, max_q, max_len = self.allowed.shape
        rows = max(1, _SCORE_ELEMENTS // max(1, n * g.num_q_heads * max_len))
        with _ieee_float32_matmuls():
            steps = [_softmax_pv(self.q[:, r:r + rows], self.k, self.v, self.allowed[:, r:r + rows], self.case.scale,
                                 self.sinks, arithmetic) for r in range(0, max_q, rows)]
        out = steps[0] if len(steps) == 1 else torch.cat(steps, dim=1)
        return out[self.tok_seq, self.tok_row].reshape(len(self.tok_seq), g.num_q_heads, g.v_head_size).double()


def _gather(batch: PagedBatch, first: int, last: int, seq_of: list[int]) -> _Gathered:
    case = batch.case
    g = case.geometry
    device = batch.q.device
    seqs = case.sequences[first:last]
    n = len(seqs)
    max_len = max(s.seq_len for s in seqs)
    max_q = max(s.query_len for s in seqs)
    hkv, group, d, bs = g.num_kv_heads, g.queries_per_kv, g.head_size, g.block_size

    # -- index arithmetic on the host, moved to the device in one copy --------
    ranges = [live_key_range(case, s) for s in seqs]
    lo_h = torch.tensor([r[0] for r in ranges], dtype=torch.int64)
    hi_h = torch.tensor([r[1] for r in ranges], dtype=torch.int64)
    keys_h = torch.arange(max_len)
    live_h = (keys_h[None, :] >= lo_h[:, None]) & (keys_h[None, :] < hi_h[:, None])      # [n, max_len]
    seq_idx_h, key_idx_h = live_h.nonzero(as_tuple=True)
    starts = case.query_start_loc()
    tok_seq_h = torch.tensor(seq_of, dtype=torch.int64) - first
    tok_global_h = torch.arange(len(seq_of)) + starts[first]
    tok_row_h = tok_global_h - torch.tensor(starts[first:last], dtype=torch.int64)[tok_seq_h]
    seq_len, query_len, seq_idx, key_idx, tok_seq, tok_row, tok_global = host_to_device(
        torch.device(device),
        torch.tensor([s.seq_len for s in seqs], dtype=torch.int64),
        torch.tensor([s.query_len for s in seqs], dtype=torch.int64),
        seq_idx_h, key_idx_h, tok_seq_h, tok_row_h, tok_global_h)
    context = seq_len - query_len

    # -- gather the live keys (dequantized, for a quantized cache) ----------------
    keys = torch.arange(max_len, device=device)
    table = batch.block_table[first:last].long()
    slot = table[seq_idx, key_idx // bs] * bs + key_idx % bs
    k = torch.zeros(n, max_len, hkv, d, dtype=torch.float64, device=device)
    v = torch.zeros(n, max_len, hkv, g.v_head_size, dtype=torch.float64, device=device)
    k[seq_idx, key_idx], v[seq_idx, key_idx] = live_values(batch, slot)

    # -- the queries, padded to [n, max_q] -----------------------------------
    q = torch.zeros(n, max_q, hkv, group, d, dtype=torch.float64, device=device)
    q[tok_seq, tok_row] = batch.q[tok_global].double().view(-1, hkv, group, d)

    # -- the allowed set -----------------------------------------------------
    rows = torch.arange(max_q, device=device)
    position = context[:, None] + rows[None, :]                                # [n, max_q]
    key = keys[None, None, :]
    pos = position[:, :, None]
    allowed = (rows[None, :, None] < query_len[:, None, None]) & allowed_mask(
        pos, key, seq_len[:, None, None], case.sliding_window, case.causal)

    sinks = batch.sinks.view(1, hkv, group, 1, 1) if batch.sinks is not None else None
    return _Gathered(case, q, k, v, allowed, sinks, tok_seq, tok_row)


class _IeeeMatmuls:
    """float32 products in full precision even where the process allows TF32
    (``torch.set_float32_matmul_precision``): TF32, where wanted, is the arithmetic's own rounding.

    The flag is the process's, and several threads may compute at once (a worker warms the
    oracle beside its first check): the first one in turns TF32 off, the last one out puts
    back what it found."""

    def __init__(self):
        self._lock = threading.Lock()
        self._users = 0
        self._saved = False

    @contextlib.contextmanager
    def __call__(self):
        matmul = torch.backends.cuda.matmul
        with self._lock:
            if self._users == 0:
                self._saved = matmul.allow_tf32
                matmul.allow_tf32 = False
            self._users += 1
        try:
            yield
        finally:
            with self._lock:
                self._users -= 1
                if self._users == 0:
                    matmul.allow_tf32 = self._saved


_ieee_float32_matmuls = _IeeeMatmuls()


def _softmax_pv(q, k, v, allowed, scale, sinks, arithmetic: Arithmetic) -> torch.Tensor:
    """softmax(scale * q.k) v over the allowed keys, in ``arithmetic``: ``[n, max_q, hkv, group, dv]``."""
    acc = arithmetic.accumulate
    q, k, v = (arithmetic.operand(x.to(acc)) for x in (q, k, v))
    scores = torch.einsum("sqhgd,slhd->shgql", q, k) * scale                   # [n, hkv, group, max_q, max_len]
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    m = scores.amax(dim=-1, keepdim=True)
    sink = None
    if sinks is not None:
        sink = sinks.to(acc)
        m = torch.maximum(m, sink)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))                 # rows with no query
    p = torch.exp(scores - m)
    denom = p.sum(dim=-1, keepdim=True)
    if sink is not None:
        denom = denom + torch.exp(sink - m)
    out = torch.einsum("shgql,slhe->sqhge", arithmetic.probabilities(p), v) / denom.permute(0, 3, 1, 2, 4)
    return arithmetic.output(out)
