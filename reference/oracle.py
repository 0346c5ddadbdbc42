"""The float64 oracle: attention computed from the allowed keys alone.

Keys are *gathered* from the live slots into a zero-initialised buffer, so a
dead slot's bits never enter a single floating-point operation here, whatever
poison it holds; a quantized cache's live codes are dequantized (code x
scale, or with their zero points) on the way, its dead codes, scales and zero
points never read.  A rotated cache is attended in its rotated frame: q
rotated alike, the scores divided by the rotation's norm, the output rotated
back (reference.rotation), exact in float64.  Vectorised over sequences, queries and heads; sequences are
processed in chunks so that the gathered K/V stay within a memory budget.

:func:`attend_in` computes the same attention in several arithmetics (the
oracle's float64 and a kernel's own precision, reference/precision.py) from
one gather per chunk; :func:`computed_in` is that for one arithmetic.  Asked
to, its float64 pass also measures what each row sums (:class:`Summands`),
which bounds how far a correct kernel's rounding may move the row
(harness/judge/tolerance.py).
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from nanfuzz.reference.batch import PagedBatch
from nanfuzz.reference.case import UNSIGNED_DTYPES, Case
from nanfuzz.reference.materialize import host_to_device, token_layout
from nanfuzz.reference.precision import FLOAT64, Arithmetic
from nanfuzz.reference.quantization import offsets_at, stored_values
from nanfuzz.reference.rotation import rotate, rotation_norm, unrotate
from nanfuzz.reference.semantics import allowed_mask, live_key_range

# What one chunk of sequences holds at once, in float64 elements (2**28 x 8 B = 2 GiB): its gathered
# K and V, its queries padded to the longest query, and its allowed mask (a byte an entry).
_CHUNK_ELEMENTS = 1 << 28
# Scores per step of query rows, in elements (2**26 x 8 B = 512 MiB, twice: the scores and P):
# a production prefill of 2048 queries over 64k keys and 32 heads takes many steps.
_SCORE_ELEMENTS = 1 << 26


def oracle(batch: PagedBatch) -> torch.Tensor:
    """float64 ``[num_tokens, num_q_heads, v_head_size]`` on the batch's device (``v_head_size`` is
    V's head size: ``head_size`` unless ``head_size_v`` says otherwise, or for a latent cache, whose
    V is its first ``latent_rank`` entries)."""
    return computed_in(batch, FLOAT64)


def computed_in(batch: PagedBatch, arithmetic: Arithmetic) -> torch.Tensor:
    """The oracle's attention computed in ``arithmetic``, returned as float64."""
    return attend_in(batch, (arithmetic,))[0]


@dataclass(frozen=True)
class Summands:
    """What each output row is a sum of, measured from the live keys alone.

    A row is ``o = sum_k p_k v_k`` over its allowed keys, ``p`` the softmax weights
    (summing to 1).  A kernel rounds the terms of that sum, not the sum: each figure
    here is the size of one kind of rounding's effect on the row, per element of the
    head dimension (``[tokens, q_heads, v_head_size]``) unless said otherwise, for the
    error model of harness/judge/tolerance.py:

    - ``weighted_abs``: ``sum_k p_k |v_k|``, the row's magnitude before cancellation (``|o|``
      can be far smaller, a mean of signed values): a relative rounding of the running sums
      moves the row by that much;
    - ``rounded_spread``: ``sqrt(sum p_k^2 v_k^2)`` over every key but the row's largest
      weight: independent relative roundings of P (``exp(s - max)`` is exactly 1 for the
      largest) move the row by about that much;
    - ``value_spread``: the same over every key: independent roundings of V's values;
    - ``score_spread``: ``sqrt(sum p_k^2 (v_k - o)^2)``: an independent change ``e`` of each
      score moves each weight by ``p_k e`` and the row by about that much times ``e``;
    - ``offset_share`` ``[tokens, q_heads]``: ``sum_k p_k |z_k|``, ``z_k`` what V's dotted operand,
      code x scale, adds to key k's values in a cache of unsigned codes (zero x scale, or -offset;
      ``asymmetric.operand_offsets``), 0 for any other cache: a kernel that multiplies P by the raw
      codes and subtracts the zero points' share afterwards rounds terms of ``v_k + z_k``, and a
      rounding of the same sign in every one of them moves the row by that share times the unit;
    - ``keys`` ``[tokens, q_heads]``: how many keys the row sums;
    - ``score_scale`` ``[tokens, q_heads]``: ``scale x |q|_2 x max|k|``, what a score's relative
      rounding scales with (for unsigned codes ``max(|k| + |z|)``, the operand dotted: code x scale);
    - ``products`` ``[tokens, q_heads]``: how many products a score sums (the head size).

    The spreads come from float32 products: they size an allowance, they are not compared.
    """

    weighted_abs: torch.Tensor
    rounded_spread: torch.Tensor
    value_spread: torch.Tensor
    score_spread: torch.Tensor
    offset_share: torch.Tensor
    keys: torch.Tensor
    score_scale: torch.Tensor
    products: torch.Tensor

    @classmethod
    def empty(cls, tokens: int, heads: int, v_head_size: int, device) -> "Summands":
        def rows() -> torch.Tensor:
            return torch.empty(tokens, heads, v_head_size, dtype=torch.float64, device=device)

        def per_row() -> torch.Tensor:
            return torch.empty(tokens, heads, dtype=torch.float64, device=device)

        return cls(rows(), rows(), rows(), rows(), per_row(), per_row(), per_row(), per_row())

    def fill(self, at: slice, part: "Summands") -> None:
        for name in self.__dataclass_fields__:
            getattr(self, name)[at] = getattr(part, name)


def attend_in(batch: PagedBatch, arithmetics: Sequence[Arithmetic],
              lap: Callable[[int], None] | None = None) -> tuple[torch.Tensor, ...]:
    """The oracle's attention in each of ``arithmetics`` (float64 ``[num_tokens,
    num_q_heads, v_head_size]`` each), from one gather of each chunk of sequences.

    Each result is bit-identical to :func:`computed_in` in its arithmetic alone.
    ``lap(i)`` is called when arithmetic ``i`` is done with a chunk: the work
    since the previous call (a chunk's gather, for the first) was its own.
    """
    return _attend(batch, arithmetics, lap, False)


def attend_and_measure(batch: PagedBatch, arithmetics: Sequence[Arithmetic],
                       lap: Callable[[int], None] | None = None) -> tuple[tuple[torch.Tensor, ...], Summands]:
    """:func:`attend_in`, and each row's :class:`Summands`, measured in the first arithmetic's
    pass (the oracle's float64, where the judges ask for it) and timed with it."""
    return _attend(batch, arithmetics, lap, True)


def _attend(batch: PagedBatch, arithmetics: Sequence[Arithmetic], lap, measure: bool):
    """Each arithmetic's rows, and with ``measure`` the :class:`Summands` too.  A batch of one chunk,
    as most are, keeps its chunk's tensors (on a GPU each copy into a whole-batch buffer is a launch);
    the chunks of a bigger one are written into buffers of the whole batch as they come."""
    case = batch.case
    g = case.geometry
    device = batch.q.device
    starts = case.query_start_loc()
    chunk = chunk_sequences(case) if case.num_tokens else 1
    chunks = [(first, min(first + chunk, len(case.sequences))) for first in range(0, len(case.sequences), chunk)]
    chunks = [(first, last) for first, last in chunks if starts[last] > starts[first]]
    seq_of = token_layout(case)[0] if chunks else []
    if len(chunks) == 1:
        outs, summands = _attend_chunk(_gather(batch, *chunks[0], seq_of), arithmetics, lap, measure)
        return (outs, summands) if measure else outs
    outs = tuple(torch.empty(case.num_tokens, g.num_q_heads, g.v_head_size, dtype=torch.float64, device=device)
                 for _ in arithmetics)
    summands = Summands.empty(case.num_tokens, g.num_q_heads, g.v_head_size, device) if measure else None
    for first, last in chunks:
        rows = slice(starts[first], starts[last])
        parts, measured = _attend_chunk(_gather(batch, first, last, seq_of[rows]), arithmetics, lap, measure)
        for out, part in zip(outs, parts):
            out[rows] = part
        if measured is not None:
            summands.fill(rows, measured)
    return (outs, summands) if measure else outs


def _attend_chunk(live: "_Gathered", arithmetics: Sequence[Arithmetic], lap,
                  measure: bool) -> tuple[tuple[torch.Tensor, ...], "Summands | None"]:
    """One chunk's rows in each arithmetic, and its summands measured in the first (with ``measure``)."""
    outs, summands = [], None
    for i, arithmetic in enumerate(arithmetics):
        out, measured = live.attend(arithmetic, measure and i == 0)
        outs.append(out)
        summands = measured if measured is not None else summands
        if lap is not None:
            lap(i)
    return tuple(outs), summands


def chunk_sequences(case: Case) -> int:
    """How many sequences the oracle gathers at once: as many as ``_CHUNK_ELEMENTS`` holds at the
    case's longest sequence and longest query (a prefill's padded queries, output rows and allowed
    mask grow with its new tokens, a decode's do not)."""
    g = case.geometry
    keys, queries = max(1, case.max_seq_len), max(1, case.max_query_len)
    per_seq = (_gathered_elements(case) + _ROWS_PER_GATHER * queries * g.num_q_heads * g.v_head_size
               + -(-queries * keys // 8))
    return max(1, _CHUNK_ELEMENTS // per_seq)


def _gathered_elements(case: Case) -> int:
    """A sequence's share of a chunk's gather, padded to the case's longest: its keys and values in
    every KV head, and its queries in every query head."""
    g = case.geometry
    keys, queries = max(1, case.max_seq_len), max(1, case.max_query_len)
    return keys * g.num_kv_heads * (g.head_size + g.v_head_size) + queries * g.num_q_heads * g.head_size


def padded_products(case: Case) -> int:
    """The multiply-adds of one arithmetic's pass over ``case`` as the oracle pads it: each sequence's
    queries (up to the longest) against its keys (up to the longest), in every query head, over K's
    and V's head sizes."""
    g = case.geometry
    return (len(case.sequences) * case.max_query_len * case.max_seq_len * g.num_q_heads
            * (g.head_size + g.v_head_size))


# What the oracle holds at its peak, per byte of a chunk's float64 gather and of a step's scores:
# measured on the CPU (resident bytes, every tensor freed as it dies) over decodes and prefills,
# 1 to 64 sequences, fp8 and unsigned caches; the largest seen were 2.6x the gather with scaled
# or no codes, 4.5x with unsigned codes (dequantized and rounded copies, offsets, a rotation),
# and 3.8x a step's scores.
_GATHER_COPIES, _UNSIGNED_GATHER_COPIES, _SCORE_COPIES = 3, 5, 4
# Per float64 row of ``v_head_size`` (a query token's in one head): a chunk's padded rows at the
# peak of its measured pass (its steps' output and four spreads, their concatenation, their stack
# and pick), measured on the CPU at up to 7x for prefills of many short sequences and wide heads;
# the whole batch's rows that a chunked pass keeps (two outputs, four spreads); and those the
# judges hold after it (those six, the kernel's output in float64, its errors).
_PADDED_ROW_COPIES, _KEPT_ROW_COPIES, _JUDGED_ROW_COPIES = 10, 6, 10
# A chunk's padded rows, counted against its gather's budget as the copies of each outnumber the
# gather's: without it, a prefill of one long query beside many short ones (each padded to the
# long one) filled a chunk of 12 sequences in 128 heads of 256, its rows estimated at 15 GiB.
_ROWS_PER_GATHER = _PADDED_ROW_COPIES // _GATHER_COPIES
# Per entry of a chunk's allowed mask ``[n, max_q, max_len]`` while it is built: the mask and the
# comparisons' bools, and with a window the int64 distances too.  Beyond the gather's and scores'
# share, a windowed prefill of 40 sequences of 21,536 keys took 0.8 B an entry on the CPU, and a
# prefill of 131 such sequences in one head (prefix_prefill, on an H100) about 4 B.
_MASK_BYTES = (6, 14)  # without a window, with one
# What a GPU's caching allocator reserves beyond a chunked oracle's allocations, per byte of its
# estimated chunk.  On an H200 it reserved 0.43 of the chunk beyond the peak allocated for 164 short
# prefills in 3 chunks (2.8 GiB beside 10.4), 0.31 for 131 sequences in 11 chunks, 0.04 for 254 in
# 64.  Only the first one's estimate was tight (the others' were 1.6 and 2x what they allocated): this
# share and the governor's slack cover it, at 0.3 with 10% to spare.
_CHUNKED_REUSE_SHARE = 0.3
_ORACLE_FLOOR = 16 << 20  # index tensors and the allocator's own granules


def _score_rows(sequences: int, q_heads: int, keys: int) -> int:
    """Query rows a step of scores holds, within ``_SCORE_ELEMENTS``."""
    return max(1, _SCORE_ELEMENTS // max(1, sequences * q_heads * keys))


def oracle_bytes(case: Case) -> int:
    """About the most the oracle and the same-precision reference hold at once while judging ``case``
    (:func:`attend_and_measure` in two arithmetics, and the rows the judges compare after it): a
    chunk's working set (:func:`_chunk_bytes`) and rows of the whole batch (the outputs and summands
    kept beside a chunk, the kernel's output in float64 and its errors), each bounded by its budget
    above but the rows, which grow with the batch's query tokens."""
    return oracle_footprint(case)[0]


def oracle_footprint(case: Case) -> tuple[int, int]:
    """:func:`oracle_bytes` of ``case``, and what a caching allocator (a GPU's) keeps beyond what the
    oracle allocates where it gathers ``case`` in chunks (blocks one chunk's steps freed that the next
    one's tensors do not fit; 0 in one chunk): its chunk worked out once."""
    g = case.geometry
    n = min(chunk_sequences(case), len(case.sequences))
    chunked = n < len(case.sequences)
    chunk = _chunk_bytes(case, n)
    batch_rows = 8 * case.num_tokens * g.num_q_heads * g.v_head_size
    kept = _KEPT_ROW_COPIES * batch_rows if chunked else 0  # whole-batch buffers beside a chunk
    oracle = max(chunk + kept, _JUDGED_ROW_COPIES * batch_rows) + _ORACLE_FLOOR
    return oracle, int(_CHUNKED_REUSE_SHARE * chunk) if chunked else 0


def _chunk_bytes(case: Case, n: int) -> int:
    """A chunk of ``n`` sequences: its gather and working copies, one step's scores and softmax weights,
    its rows padded to the longest query (each arithmetic's output and the measured summands, as
    computed, concatenated and picked out) and its allowed mask as it is built."""
    g = case.geometry
    keys, queries = max(1, case.max_seq_len), max(1, case.max_query_len)
    gather = 8 * n * _gathered_elements(case)
    rows = min(queries, _score_rows(n, g.num_q_heads, keys))
    scores = 8 * n * g.num_q_heads * rows * keys
    padded_rows = 8 * n * queries * g.num_q_heads * g.v_head_size
    kv = case.kv_cache
    unsigned = any(kv.side(which).dtype in UNSIGNED_DTYPES for which in "kv") or kv.rotation != "none"
    copies = _UNSIGNED_GATHER_COPIES if unsigned else _GATHER_COPIES
    mask = _MASK_BYTES[case.sliding_window > 0] * n * queries * keys
    return copies * gather + _SCORE_COPIES * scores + _PADDED_ROW_COPIES * padded_rows + mask


@dataclass(frozen=True)
class _Gathered:
    """One chunk's queries, live keys and values (float64, zero-padded), its allowed set,
    and where each of its tokens sits in the padding."""

    case: Case
    q: torch.Tensor             # [n, max_q, hkv, group, d]
    k: torch.Tensor             # [n, max_len, hkv, d]: as stored (in a rotated cache's frame)
    v: torch.Tensor             # [n, max_len, hkv, dv]
    allowed: torch.Tensor       # bool [n, max_q, max_len]
    sinks: torch.Tensor | None  # [1, hkv, group, 1, 1]
    tok_seq: torch.Tensor       # [chunk tokens]: its sequence in the chunk
    tok_row: torch.Tensor       # [chunk tokens]: its query row in the sequence
    # k and v dequantized in their scales' dtype, where that is a half-precision one; else None
    rounded: tuple[torch.Tensor, torch.Tensor] | None = None
    # |what code x scale adds to each value| [n, max_len, hkv] of K and of V, each where it is of unsigned codes
    offsets: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)

    def attend(self, arithmetic: Arithmetic, measure: bool = False) -> tuple[torch.Tensor, Summands | None]:
        """float64 ``[chunk tokens, num_q_heads, v_head_size]`` in ``arithmetic``, a step of query rows
        at a time (each row's softmax is its own), and with ``measure`` the rows' :class:`Summands`
        from the same weights."""
        g = self.case.geometry
        kv = self.case.kv_cache
        n, max_q, max_len = self.allowed.shape
        rows = _score_rows(n, g.num_q_heads, max_len)
        k, v = self.rounded if (arithmetic.dequantize_rounded and self.rounded) else (self.k, self.v)
        q, scale = self.q, self.case.scale
        if kv.rotation != "none":  # q into the cache's frame, rounded as the arithmetic rotates it
            q = arithmetic.rotation(rotate(arithmetic.rotation(q), kv))
            scale = scale / rotation_norm(kv, g.head_size)
        with _ieee_float32_matmuls():
            steps = [_softmax_pv(q[:, r:r + rows], k, v, self.allowed[:, r:r + rows], scale,
                                 self.sinks, arithmetic, measure, self.offsets[1]) for r in range(0, max_q, rows)]
        out, *measured = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1) for parts in zip(*steps))
        if kv.rotation != "none":  # and the output back out of it (the summands stay in the cache's frame)
            out = arithmetic.output(arithmetic.rotation(unrotate(arithmetic.rotation(out.double()), kv)))
        out = out[self.tok_seq, self.tok_row].reshape(len(self.tok_seq), g.num_q_heads, g.v_head_size).double()
        return out, (self.measure(measured, q, scale) if measure else None)

    def measure(self, part: tuple[torch.Tensor, ...], q: torch.Tensor, scale: float) -> Summands:
        """The chunk's rows' :class:`Summands`, from the per-row figures of its float64 pass
        (``[n, max_q, hkv, group, ...]``), the queries and scale it attended with and the gathered keys."""
        g = self.case.geometry
        key_max = self.k.abs().amax(dim=3)                                                     # [n, max_len, hkv]
        if self.offsets[0] is not None:  # the kernel dots code x scale: the value and its offset
            key_max = key_max + self.offsets[0]
        key_max = key_max.amax(dim=1)[:, None, :, None]                                        # [n, 1, hkv, 1]
        score_scale = scale * q.norm(dim=-1) * key_max                                         # [n, q, hkv, g]
        keys = self.allowed.sum(dim=-1).double()[:, :, None, None].expand_as(score_scale)
        # the figures of like shape stacked, so that each step below is one operation for them all
        tokens, heads = len(self.tok_seq), g.num_q_heads
        spreads = torch.stack(part[:4])[:, self.tok_seq, self.tok_row]                       # [4, tokens, hkv, g, dv]
        spreads = spreads.reshape(4, tokens, heads, spreads.shape[-1]).double().unbind()
        per_row = torch.stack((part[4].double(), keys, score_scale))[:, self.tok_seq, self.tok_row]
        share, keys, score_scale = per_row.reshape(3, tokens, heads).unbind()
        products = torch.full((tokens, heads), float(q.shape[-1]), dtype=torch.float64, device=q.device)
        return Summands(*spreads, share, keys, score_scale, products)


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
    k[seq_idx, key_idx], v[seq_idx, key_idx] = stored_values(batch, slot)
    rounded, offsets = None, (None, None)
    if any(batch.case.kv_cache.side(w).dtype in UNSIGNED_DTYPES for w in ("k", "v")):
        rounded = (torch.zeros_like(k), torch.zeros_like(v))
        rounded[0][seq_idx, key_idx], rounded[1][seq_idx, key_idx] = stored_values(batch, slot, rounded=True)
        offsets = tuple(None if live is None else _padded(live.abs(), seq_idx, key_idx, (n, max_len, hkv))
                        for live in offsets_at(batch, slot))

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
    return _Gathered(case, q, k, v, allowed, sinks, tok_seq, tok_row, rounded, offsets)


def _padded(live: torch.Tensor, seq_idx: torch.Tensor, key_idx: torch.Tensor, shape) -> torch.Tensor:
    """The live keys' figures ``[live keys, ...]`` in a zero-padded float64 ``shape`` ``[n, max_len, ...]``."""
    padded = torch.zeros(shape, dtype=torch.float64, device=live.device)
    padded[seq_idx, key_idx] = live
    return padded


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


def _softmax_weights(q, k, allowed, scale, sinks, acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``p = exp(score - max)`` over the allowed keys ``[n, hkv, group, max_q, max_len]`` and its
    denominator ``[n, hkv, group, max_q, 1]`` (the sink's term included), in ``acc``."""
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
    return p, denom


def _softmax_pv(q, k, v, allowed, scale, sinks, arithmetic: Arithmetic, measure: bool = False,
                v_offsets: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """softmax(scale * q.k) v over the allowed keys, in ``arithmetic``: ``([n, max_q, hkv, group, dv],)``;
    with ``measure``, also the rows' summands from the same weights (:func:`_spreads`) and their
    offset shares from V's ``|offsets|`` ``[n, max_len, hkv]`` (None: V's codes have none)."""
    acc = arithmetic.accumulate
    q, k, v = (arithmetic.operand(x.to(acc)) for x in (q, k, v))
    p, denom = _softmax_weights(q, k, allowed, scale, sinks, acc)
    per_row = denom.permute(0, 3, 1, 2, 4)                                     # [n, max_q, hkv, group, 1]
    out = torch.einsum("shgql,slhe->sqhge", arithmetic.probabilities(p), v) / per_row
    if not measure:
        return (arithmetic.output(out),)
    weights = p / denom
    return (arithmetic.output(out), *_spreads(weights, v, out), _offset_share(weights, v_offsets))


def _offset_share(p: torch.Tensor, offsets: torch.Tensor | None) -> torch.Tensor:
    """``sum_k p_k |z_k|`` ``[n, max_q, hkv, group]`` from normalised weights ``p`` ``[n, hkv, group,
    max_q, max_len]`` and V's ``|offsets|`` ``[n, max_len, hkv]`` (None: zero)."""
    if offsets is None:
        return p.new_zeros(p.shape[0], p.shape[3], p.shape[1], p.shape[2], dtype=torch.float32)
    return torch.einsum("shgql,slh->sqhg", p.float(), offsets.float())


def _spreads(p: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """From normalised weights ``p`` ``[n, hkv, group, max_q, max_len]``, values ``v`` and the rows
    ``out``: ``sum p|v|``, and the spreads of :class:`Summands` (``[n, max_q, hkv, group, dv]`` each)."""
    p32, v32 = p.float(), v.float()
    squared = p32 * p32
    weighted_abs = torch.einsum("shgql,slhe->sqhge", p32, v32.abs())
    square_sum = torch.einsum("shgql,slhe->sqhge", squared, v32 * v32)       # sum p^2 v^2
    first_sum = torch.einsum("shgql,slhe->sqhge", squared, v32)               # sum p^2 v
    weight_sum = squared.sum(dim=-1).permute(0, 3, 1, 2)[..., None]          # sum p^2
    largest, at = p32.max(dim=-1)                                             # [n, hkv, group, max_q]
    n, max_len, hkv, dv = v.shape
    rows = at.permute(0, 3, 1, 2)                                             # [n, max_q, hkv, group]
    v_at = v32[torch.arange(n, device=v.device)[:, None, None, None], rows,
               torch.arange(hkv, device=v.device)[None, None, :, None]]       # [n, max_q, hkv, group, dv]
    top = (largest.permute(0, 3, 1, 2)[..., None] * v_at) ** 2
    o = out.float()
    rounded = (square_sum - top).clamp_min(0).sqrt()
    around = (square_sum - 2 * o * first_sum + o * o * weight_sum).clamp_min(0).sqrt()
    return weighted_abs, rounded, square_sum.sqrt(), around
