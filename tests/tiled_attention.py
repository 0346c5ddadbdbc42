"""Correct attention computed the way Triton kernels compute it, in plain torch.

A Triton paged-attention kernel walks each row's keys a tile at a time with an
online softmax in float32: a running maximum, the running sums rescaled when it
moves, P rounded to the value dtype before ``P @ V``, the tiles of a split-KV
kernel merged by their log-sum-exp, the output rounded once.  This module does
exactly that, vectorised over every row of a batch, so that the error model of
harness/judge/tolerance.py can be held to account on the CPU at full
production lengths (128k keys in seconds, no Triton interpreter involved): a
correct kernel of this arithmetic must PASS every case, at every size.

The knobs are the choices real kernels make: the tile (16 to 256 keys), the
number of KV splits and whether a split's partial output is stored in the
output dtype (vLLM's v2 decode keeps it so), ``exp2`` with the softmax scale
folded into ``log2(e)`` (most Triton kernels), and TF32 operands for float32.
It reads the live keys through the oracle's gather: what is under test is
arithmetic, not addressing (the poisoning verdicts test addressing).
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import math
from dataclasses import dataclass

import torch

from nanfuzz.harness.judge.tolerance import RowErrors, row_errors
from nanfuzz.harness.kernel import Kernel
from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.materialize import TORCH_DTYPES, materialize, token_layout
from nanfuzz.reference.oracle import _gather, attend_and_measure
from nanfuzz.reference.precision import FLOAT64, round_to_tf32, same_precision
from nanfuzz.strategies.production import ProductionSize

# Production shapes a CPU judges in seconds: sequences to 128k keys and batches of up to 64
# sequences, within budgets of live keys and attention work, and no huge cache.
CPU_PRODUCTION = ProductionSize(max_sequences=64, max_seq_len=1 << 17, max_context=1 << 15, max_query_len=64,
                                max_kv_heads=2, max_q_heads=16, max_live_keys=1 << 18, max_tokens=1 << 9,
                                max_attention=1 << 26, max_table_entries=1 << 16, huge_cache_bytes=0)

_LOG2E = 1.4426950408889634
_NO_MAX = -1.0e30   # a running maximum before any allowed key: exp2 of anything minus it is 0, never NaN


@dataclass(frozen=True)
class Tiling:
    """How a kernel walks a row: ``tile`` keys a step; ``splits`` KV partitions merged at the end;
    ``round_partials``: each split's output stored in the output dtype before the merge;
    ``prescale``: q multiplied by the softmax scale and rounded to its dtype before the dot;
    ``dequantize_in_dtype``: a per-tensor-scaled cache's codes and scale multiplied in the
    compute dtype (else in float32, then rounded to it)."""

    tile: int = 16
    splits: int = 1
    round_partials: bool = False
    exp2: bool = True
    tf32: bool = False
    prescale: bool = False
    dequantize_in_dtype: bool = False


# Planted errors (``plant``), each a bug real kernels have had that NaN poisoning cannot see:
# the softmax scale off by 1%; every row's first allowed key skipped (an off-by-one at a tile
# or window edge); one row scaled by 1% (0.1% in float32).
PLANTS = ("scale", "drop-key", "row")


def tiled_attention(batch, out: torch.Tensor, tiling: Tiling = Tiling(), plant: str | None = None) -> torch.Tensor:
    case = batch.case
    g = case.geometry
    dtype = TORCH_DTYPES[g.dtype]
    seq_of, _ = token_layout(case)
    starts = case.query_start_loc()
    # sequences in chunks that keep the gathered float64 K and V near 2 GiB
    per_seq = max(1, case.max_seq_len) * g.num_kv_heads * g.head_size
    chunk = max(1, (1 << 27) // per_seq)
    for first in range(0, len(case.sequences), chunk):
        last = min(first + chunk, len(case.sequences))
        if starts[last] == starts[first]:
            continue
        live = _gather(batch, first, last, seq_of[starts[first]:starts[last]])
        if plant == "drop-key":
            live = _without_first_keys(live)
        rows = _attend(live, case, dtype, tiling, 1.01 if plant == "scale" else 1.0)  # [n, max_q, hkv, group, dv]
        rows = rows[live.tok_seq, live.tok_row]
        out[starts[first]:starts[last]] = rows.reshape(-1, g.num_q_heads, g.v_head_size).to(out.dtype)
    if plant == "row" and case.num_tokens:
        out[0, 0] = (out[0, 0].double() * (1.001 if g.dtype == "float32" else 1.01)).to(out.dtype)
    return out


def _without_first_keys(live):
    """Each row that may read several keys skips the first of them."""
    allowed = live.allowed.clone()
    several = allowed.sum(dim=-1) > 1
    first = allowed.int().argmax(dim=-1)
    n, max_q = several.nonzero(as_tuple=True)
    allowed[n, max_q, first[n, max_q]] = False
    return dataclasses.replace(live, allowed=allowed)


def _operands(x: torch.Tensor, dtype: torch.dtype, tiling: Tiling) -> torch.Tensor:
    """A value as the kernel holds it: the cache's (or a dequantized code's) float32, in the compute dtype."""
    x = x.to(torch.float32).to(dtype).to(torch.float32)
    return round_to_tf32(x) if tiling.tf32 and dtype == torch.float32 else x


def _dequantized(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Per-tensor codes (``x / scale``, exact) times the scale, both in ``dtype``, as float32."""
    codes = (x / scale).to(dtype)
    return (codes * torch.tensor(scale, dtype=torch.float32).to(dtype)).to(torch.float32)


def _attend(live, case, dtype: torch.dtype, tiling: Tiling, scale_factor: float = 1.0) -> torch.Tensor:
    scale = case.scale * scale_factor
    q = _operands(live.q, dtype, tiling)          # [n, max_q, hkv, group, d]
    k = _operands(live.k, dtype, tiling)          # [n, max_len, hkv, d]
    v = _operands(live.v, dtype, tiling)          # [n, max_len, hkv, dv]
    kv = case.kv_cache
    if tiling.dequantize_in_dtype and kv.quantized and not kv.token_head:
        k, v = _dequantized(live.k, kv.k_scale, dtype), _dequantized(live.v, kv.v_scale, dtype)
    if tiling.prescale:
        q = (q * scale * (_LOG2E if tiling.exp2 else 1.0)).to(dtype).to(torch.float32)
        scale = 1.0 / (_LOG2E if tiling.exp2 else 1.0)
    allowed = live.allowed                        # [n, max_q, max_len]
    n, max_q, max_len = allowed.shape
    tiles = math.ceil(max_len / tiling.tile)
    per_split = math.ceil(tiles / tiling.splits)
    # exp2 with the scale folded in: one float32 rounding of the scale, then of every product
    factor = torch.tensor(scale * (_LOG2E if tiling.exp2 else 1.0), dtype=torch.float32)
    exp = torch.exp2 if tiling.exp2 else torch.exp
    sink = None
    if live.sinks is not None:                    # [1, hkv, group, 1, 1] -> [1, 1, hkv, group]
        sink = live.sinks.to(torch.float32)[..., 0, 0][:, None] * (_LOG2E if tiling.exp2 else 1.0)
    partials = []
    for split in range(tiling.splits):
        shape = (n, max_q, *q.shape[2:4])
        m = torch.full(shape, _NO_MAX, dtype=torch.float32)
        l = torch.zeros(shape, dtype=torch.float32)
        if sink is not None and split == 0:       # the sink's term: m = sink, l = exp(sink - m) = 1
            m, l = sink.expand(shape).clone(), torch.ones(shape, dtype=torch.float32)
        acc = torch.zeros(*shape, v.shape[-1], dtype=torch.float32)
        for tile in range(split * per_split, min(tiles, (split + 1) * per_split)):
            keys = slice(tile * tiling.tile, min(max_len, (tile + 1) * tiling.tile))
            ok = allowed[:, :, keys]                                          # [n, max_q, t]
            if not bool(ok.any()):
                continue
            # -- scores (float32 dot, then the folded scale) ----------------------
            s = torch.einsum("sqhgd,sthd->sqhgt", q, k[:, keys]) * factor
            s = s.masked_fill(~ok[:, :, None, None, :], float("-inf"))
            # -- online softmax step ----------------------------------------------
            m_new = torch.maximum(m, s.amax(dim=-1))
            alpha = exp(m - m_new)
            p = exp(s - m_new[..., None])
            l = l * alpha + p.sum(dim=-1)
            p = p.to(dtype).to(torch.float32)
            if tiling.tf32 and dtype == torch.float32:
                p = round_to_tf32(p)
            acc = acc * alpha[..., None] + torch.einsum("sqhgt,sthe->sqhge", p, v[:, keys])
            m = m_new
        partials.append((acc, l, m))
    return _merge(partials, dtype, tiling, exp)


def _merge(partials, dtype: torch.dtype, tiling: Tiling, exp) -> torch.Tensor:
    """The splits' outputs weighed by their log-sum-exp, in float32; rounded once (or per split too)."""
    if len(partials) == 1:
        acc, l, _ = partials[0]
        return acc / l.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    m = torch.stack([m for _, _, m in partials]).amax(dim=0)
    total = torch.zeros_like(partials[0][0])
    weight = torch.zeros_like(partials[0][1])
    for acc, l, m_s in partials:
        share = torch.where(l > 0, exp(m_s - m), torch.zeros_like(l)) * l
        part = acc / l.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
        if tiling.round_partials:
            part = part.to(dtype).to(torch.float32)
        total = total + part * share[..., None]
        weight = weight + share
    return total / weight.clamp_min(torch.finfo(torch.float32).tiny)[..., None]


def tiled_kernel(tiling: Tiling = Tiling(), *, plant: str | None = None, dtypes=("float16", "bfloat16", "float32"),
                 spec: str | None = None, **capabilities) -> Kernel:
    """A kernel of ``tiling``'s arithmetic, correct unless ``plant`` (for campaigns: plain torch
    compiles nothing per case)."""
    caps = Capabilities(dtypes=dtypes, interpreter_dtypes=dtypes, non_causal=True, sinks=True,
                        kv_cache_dtypes=("auto", "fp8_e4m3fn", "fp8_e5m2"), token_head_dtypes=("fp8_e4m3fn", "int8"),
                        precision="tf32" if tiling.tf32 else "ieee", specialisation_pool=0, **capabilities)
    name = f"tiled@t{tiling.tile}s{tiling.splits}{'r' if tiling.round_partials else ''}{'-tf32' if tiling.tf32 else ''}"
    return Kernel(name=name + (f"-{plant}" if plant else ""), run=lambda b, o: tiled_attention(b, o, tiling, plant),
                  capabilities=caps, spec=spec, expect="caught" if plant else "pass")


# At import paths, so that a supervised worker can rebuild them.
tile16 = tiled_kernel(Tiling(tile=16), spec="tests.tiled_attention:tile16")
tile64_split8 = tiled_kernel(Tiling(tile=64, splits=8, round_partials=True, prescale=True, dequantize_in_dtype=True),
                             spec="tests.tiled_attention:tile64_split8")
tile128_exp = tiled_kernel(Tiling(tile=128, exp2=False), spec="tests.tiled_attention:tile128_exp")
tile16_tf32 = tiled_kernel(Tiling(tile=16, tf32=True), dtypes=("float32",), spec="tests.tiled_attention:tile16_tf32")
CORRECT = (tile16, tile64_split8, tile128_exp, tile16_tf32)
planted_scale = tiled_kernel(Tiling(tile=64, splits=4), plant="scale", spec="tests.tiled_attention:planted_scale")
planted_drop_key = tiled_kernel(Tiling(tile=64, splits=4), plant="drop-key", spec="tests.tiled_attention:planted_drop_key")
planted_row = tiled_kernel(Tiling(tile=64, splits=4), plant="row", spec="tests.tiled_attention:planted_row")
PLANTED = (planted_scale, planted_drop_key, planted_row)


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
_GLIBC_MMAP_THRESHOLD_MAX = 32 << 20  # where glibc's dynamic threshold settles once large blocks are freed


@contextlib.contextmanager
def heap_kept():
    """glibc keeps every allocation up to 2 GiB on its heap for the duration, where it otherwise
    maps and unmaps each temporary over its dynamic threshold: the tiled loop's tile-sized
    temporaries spent half their time in page faults (system time), and far more beside another
    busy process (a production test took 31 s alone, 180-220 s beside an xdist sibling)."""
    libc = ctypes.util.find_library("c")
    mallopt = getattr(ctypes.CDLL(libc), "mallopt", None) if libc else None  # glibc only; elsewhere nothing changes
    if mallopt is None or not mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(2**31 - 1)):
        yield
        return
    try:
        yield
    finally:
        mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(_GLIBC_MMAP_THRESHOLD_MAX))


# The oracle's references and summands of each (case, precision) judged in this process: several kernels
# are judged on the same drawn cases, whose float64 oracle took most of a production test's time.  A case
# materialises bit for bit the same every time, so its references do not change; they are per row, small.
_references: dict = {}


def _references_of(batch, precision: str):
    key = (batch.case, precision)
    if key not in _references:
        _references[key] = attend_and_measure(batch, (FLOAT64, same_precision(batch.case.geometry.dtype, precision)))
    return _references[key]


def judged(kernel: Kernel, case, rows: dict[int, torch.Tensor] | None = None) -> tuple[RowErrors, torch.Tensor]:
    """The check's MISMATCH judgement of ``kernel`` on ``case`` (the rows' errors) and the output judged,
    without the other verdicts' runs; ``rows`` replaces some output rows (token: ``[heads, head_size]``)."""
    batch = materialize(case)
    g = case.geometry
    out = torch.full((case.num_tokens, g.num_q_heads, g.v_head_size), float("nan"), dtype=TORCH_DTYPES[g.dtype])
    out = kernel(batch, out)
    for token, row in (rows or {}).items():
        out[token] = row
    precision = kernel.capabilities.precision
    (exact, reference), summands = _references_of(batch, precision)
    return row_errors(out.double(), exact, reference, summands, g.dtype, precision, case.kv_cache.quantized), out


def drawn_cases(kernel: Kernel, count: int, at: int = 0, tier: str = "production") -> list:
    """The first ``count`` cases a Hypothesis run seeded ``at`` draws for ``kernel`` at ``tier``
    (production: ``CPU_PRODUCTION``), as a GPU campaign draws them."""
    from hypothesis import HealthCheck, given, seed, settings

    from nanfuzz.strategies import paged_cases

    drawn = []

    @seed(at)
    @settings(max_examples=count, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(paged_cases(kernel.capabilities, interpreter=False, tier=tier, production=CPU_PRODUCTION))
    def collect(case):
        drawn.append(case)

    collect()
    return drawn
