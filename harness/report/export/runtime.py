"""The half of an exported repro that builds a case's tensors, runs the kernel and judges it.

``nanfuzz export`` copies this module into every script it writes, with the
parts of nanfuzz it imports (the case model, the float64 oracle, the
tolerance, the quantized encodings), so the script runs with torch and
Triton alone.  Live keys, values and queries come from a torch generator
seeded with the case's data seed; dead slots hold finite garbage, except the
poisoned ones listed in the script, which hold the poison; every tensor sits
in a larger allocation whose margins hold NaN (poisoned run) or garbage.

The verdicts are nanfuzz's, checked in its order: CRASH (the launch raised),
NONFINITE, NONDETERMINISTIC, LEAK, CLOBBER, MISMATCH.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from nanfuzz.harness.judge.tolerance import effective_precision, row_errors
from nanfuzz.reference.batch import PagedBatch
from nanfuzz.reference.case import Case
from nanfuzz.reference.materialize import TORCH_DTYPES
from nanfuzz.reference.oracle import attend_and_measure
from nanfuzz.reference.precision import FLOAT64, same_precision
from nanfuzz.reference.redzones import CACHE_BLOCKS_AFTER, CACHE_BLOCKS_BEFORE, TABLE_EXTRA_COLUMNS, TOKEN_ROWS_AFTER
from nanfuzz.reference.quantization import (ENCODINGS, finite_codes, garbage_scales, hostile_codes, hostile_scales,
                                            quantize, token_head_scales)

# Margins around every tensor, as nanfuzz's own batches have (reference/redzones.py): cache blocks
# before and after (the first after is the trap block table padding points past), rows past the last token.
MARGIN_BLOCKS = (CACHE_BLOCKS_BEFORE, CACHE_BLOCKS_AFTER)
GUARD_ROWS = TOKEN_ROWS_AFTER
# Q three times wider than K and V, so that the softmax is peaked enough for a wrong window edge to show.
Q_SPREAD = 3.0
# Finite garbage in dead slots: magnitudes log-uniform in [1, 1e4] (below fp16's largest, 65504).
GARBAGE_DECADES = 4.0
# Rows of a finding printed in full.
SHOWN_ROWS = 4


class Batch(PagedBatch):
    """nanfuzz's canonical batch (the inputs as ``PagedBatch`` names them) with ``bases``, the whole
    allocation each input is a view into, margins included."""

    def __init__(self, bases: dict[str, torch.Tensor], **views):
        views.setdefault("sinks", None)
        super().__init__(**views)
        self.bases = bases


def live_slots(case: Case) -> torch.Tensor:
    """bool ``[num_blocks, block_size]``: the slots some query of the batch may read."""
    g = case.geometry
    live = torch.zeros(g.num_blocks, g.block_size, dtype=torch.bool)
    for seq in case.sequences:
        lo, hi = seq.live_range(case.sliding_window)
        for key in range(lo, hi):
            live[seq.block_table[key // g.block_size], key % g.block_size] = True
    return live


class _Streams:
    """Seeded random numbers: one generator for live data, one per garbage seed for dead slots."""

    def __init__(self, seed: int, garbage_seed: int):
        self.live = torch.Generator().manual_seed(seed)
        self.dead = torch.Generator().manual_seed(seed * 1_000_003 + 7 + garbage_seed)

    @staticmethod
    def uniform(generator: torch.Generator, shape) -> torch.Tensor:
        """float64 in [-1, 1)."""
        return torch.rand(shape, generator=generator, dtype=torch.float64) * 2 - 1

    def bits(self, shape) -> torch.Tensor:
        return torch.randint(0, 1 << 62, shape, generator=self.dead, dtype=torch.int64)

    def garbage(self, shape) -> torch.Tensor:
        u = self.uniform(self.dead, shape)
        return torch.sign(u) * torch.pow(10.0, u.abs() * GARBAGE_DECADES)


def _poison(kind: str, shape, dtype: torch.dtype, streams: _Streams) -> torch.Tensor:
    """Hostile values of an unquantized cache: NaN, +-Inf, the dtype's largest, large garbage, random bits."""
    finfo = torch.finfo(dtype)
    fixed = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "max": finfo.max}
    if kind in fixed:
        return torch.full(shape, fixed[kind], dtype=dtype)
    if kind == "garbage":
        u = streams.uniform(streams.dead, shape)
        return (torch.sign(u) * finfo.max * (0.5 + 0.5 * u.abs())).clamp(-finfo.max, finfo.max).to(dtype)
    assert kind == "bits", kind
    view = torch.int16 if dtype.itemsize == 2 else torch.int32
    width = 8 * dtype.itemsize
    low = streams.bits(shape) & ((1 << width) - 1)
    return torch.where(low >= 1 << (width - 1), low - (1 << width), low).to(view).view(dtype)


def _cache(case: Case, which: str, values: torch.Tensor, live: torch.Tensor, poisoned: torch.Tensor,
           poison: dict, streams: _Streams):
    """One cache ``[num_blocks, block_size, heads, its head size]`` from float64 live ``values``,
    and its per-token-head scale cache (else None)."""
    g = case.geometry
    kv = case.kv_cache
    shape = values.shape
    hits = poisoned if which in poison["tensors"] else torch.zeros_like(poisoned)
    if not kv.quantized:
        dtype = TORCH_DTYPES[g.dtype]
        cache = torch.where(live[..., None, None], values, streams.garbage(shape)).to(dtype)
        cache[hits] = _poison(poison["value"], cache[hits].shape, dtype, streams)
        return cache, None
    enc = ENCODINGS[kv.dtype]
    scale_cache = None
    if kv.token_head:
        scale_cache = token_head_scales(values, kv.dtype)
        codes = quantize(values, scale_cache.double()[..., None], kv.dtype)
        dead_scales = garbage_scales(streams.uniform(streams.dead, scale_cache.shape), kv.dtype)
        scale_cache = torch.where(live[..., None], scale_cache, dead_scales)
        if "scales" in poison["parts"]:
            scale_hits = hits[..., None].expand_as(scale_cache)
            scale_cache[scale_hits] = hostile_scales(poison["value"], streams.bits(scale_cache.shape),
                                                     streams.uniform(streams.dead, scale_cache.shape))[scale_hits]
    else:
        codes = quantize(values, kv.k_scale if which == "k" else kv.v_scale, kv.dtype)
    codes = torch.where(live[..., None, None], codes, finite_codes(streams.bits(shape), kv.dtype))
    if "data" in poison["parts"]:
        hostile = hostile_codes(poison["value"], streams.bits(shape), streams.uniform(streams.dead, shape), kv.dtype)
        codes[hits] = hostile[hits]
    return codes.view(enc.torch_dtype), scale_cache


def _surround(tensor: torch.Tensor, before: int, after: int, fill) -> tuple[torch.Tensor, torch.Tensor]:
    """(allocation, view): ``tensor`` with ``before`` and ``after`` rows of ``fill`` around it."""
    base = torch.empty((before + tensor.shape[0] + after, *tensor.shape[1:]), dtype=tensor.dtype)
    if tensor.element_size() == 1:  # a quantized cache: ``fill`` is a code
        base.view(torch.uint8).fill_(fill)
        base.view(torch.uint8)[before:before + tensor.shape[0]] = tensor.view(torch.uint8)
    else:
        base.fill_(fill)
        base[before:before + tensor.shape[0]] = tensor
    return base, base[before:before + tensor.shape[0]]


def build_batch(case: Case, poison: dict, device: str, *, garbage_seed: int = 0, poisoned: bool = True) -> Batch:
    """The case's tensors on ``device``.  ``poison``: ``value``, ``tensors`` ("k", "v", "kv"), ``parts``
    (a per-token-head cache's "data", "scales" or both) and ``slots``, the (block, offset) pairs it fills.
    ``garbage_seed`` changes the finite garbage of dead slots and margins, nothing else; unpoisoned,
    the poisoned slots hold garbage too."""
    g = case.geometry
    dtype = TORCH_DTYPES[g.dtype]
    streams = _Streams(case.data_seed, garbage_seed)
    live = live_slots(case)
    hit = torch.zeros_like(live)
    if poisoned:
        for block, offset in poison["slots"]:
            hit[block, offset] = not live[block, offset]
    slots = (g.num_blocks, g.block_size, g.num_kv_heads)
    k_values = streams.uniform(streams.live, (*slots, g.head_size))
    v_values = streams.uniform(streams.live, (*slots, g.v_head_size))
    q = (streams.uniform(streams.live, (case.num_tokens, g.num_q_heads, g.head_size)) * Q_SPREAD).to(dtype)
    sinks = (streams.uniform(streams.live, (g.num_q_heads,)) * 2.0).to(torch.float32) if case.sinks else None
    key_cache, k_scale_cache = _cache(case, "k", k_values, live, hit, poison, streams)
    value_cache, v_scale_cache = _cache(case, "v", v_values, live, hit, poison, streams)

    # -- the new tokens' K and V, as the cache holds them (dequantized to the query dtype) ----
    slots = [seq.block_table[pos // g.block_size] * g.block_size + pos % g.block_size
             for seq in case.sequences for pos in range(seq.context_len, seq.seq_len)]
    kv = case.kv_cache
    new = []
    for cache, scales, scale in ((key_cache, k_scale_cache, kv.k_scale), (value_cache, v_scale_cache, kv.v_scale)):
        rows = cache.view(-1, g.num_kv_heads, cache.shape[-1])[slots].to(torch.float64)
        if scales is not None:
            rows = rows * scales.view(-1, g.num_kv_heads)[slots].double()[..., None]
        elif kv.quantized:
            rows = rows * scale
        new.append(rows.to(dtype))

    nan = float("nan") if poisoned else None
    trap = g.num_blocks  # the first block past the cache, inside its margin
    table = torch.tensor([list(s.block_table) for s in case.sequences], dtype=torch.int32).view(len(case.sequences), -1)
    table = torch.cat([table, torch.full((table.shape[0], TABLE_EXTRA_COLUMNS), trap, dtype=torch.int32)], dim=1)
    starts = torch.tensor(case.query_start_loc(), dtype=torch.int32)
    tensors = {
        "q": (q, 0, GUARD_ROWS), "k": (new[0], 0, GUARD_ROWS), "v": (new[1], 0, GUARD_ROWS),
        "key_cache": (key_cache, *MARGIN_BLOCKS), "value_cache": (value_cache, *MARGIN_BLOCKS),
        "block_table": (table, 0, 1),
        "seq_lens": (torch.tensor([s.seq_len for s in case.sequences], dtype=torch.int32), 0, GUARD_ROWS),
        "query_start_loc": (starts, 0, GUARD_ROWS),
    }
    if sinks is not None:
        tensors["sinks"] = (sinks, 0, GUARD_ROWS)
    if k_scale_cache is not None:
        tensors["k_scale_cache"], tensors["v_scale_cache"] = (k_scale_cache, *MARGIN_BLOCKS), (v_scale_cache, *MARGIN_BLOCKS)
    elif kv.quantized:
        tensors["k_scale"] = (torch.tensor([kv.k_scale], dtype=torch.float32), 0, GUARD_ROWS)
        tensors["v_scale"] = (torch.tensor([kv.v_scale], dtype=torch.float32), 0, GUARD_ROWS)
    bases, views = {}, {}
    for name, (tensor, before, after) in tensors.items():
        base, _ = _surround(tensor, before, after, _margin(name, tensor, case, streams, nan))
        bases[name] = base.to(device)
        views[name] = bases[name][before:before + tensor.shape[0]]
    views["block_table"] = views["block_table"][:, :case.table_width]  # its trap columns beside it, as nanfuzz's
    return Batch(case=case, bases=bases, **views)


def _margin(name: str, tensor: torch.Tensor, case: Case, streams: _Streams, nan):
    """What a tensor's margin holds: NaN (a NaN code for a quantized cache) in the poisoned run,
    finite garbage otherwise; past the lengths, values that point past the cache and the output."""
    if name == "block_table":
        return case.geometry.num_blocks
    if name == "seq_lens":
        return (case.table_width + TABLE_EXTRA_COLUMNS) * case.geometry.block_size
    if name == "query_start_loc":
        return case.num_tokens + GUARD_ROWS
    if tensor.element_size() == 1:
        enc = ENCODINGS[case.kv_cache.dtype]
        return (enc.nan_codes or (enc.max_code,))[0] if nan is not None else enc.max_code >> 1
    return nan if nan is not None else float(streams.garbage(()))


# -- running and judging ---------------------------------------------------------------

@dataclass
class Finding:
    verdict: str
    message: str


# What a PASS checked, each run judged once, in the verdicts' order.
CHECKS = ("the output is finite wherever the float64 reference is",
          "a second launch on identical inputs gave the same bits",
          "launches with other finite garbage in the dead slots and margins gave the same bits",
          "the kernel wrote nothing outside its output rows",
          "every output row is within the MISMATCH bound of the float64 reference")
NOT_TRACED = ("the kernel's loads are not traced here, so a read of a dead slot that leaves the output "
              "unchanged is not seen")


@dataclass
class Verdicts:
    """What the runs of one case showed: the findings (most severe first), the poisoned run's output,
    and whether identical launches were compared (not for a kernel declared nondeterministic)."""

    findings: list[Finding]
    output: torch.Tensor | None = None
    oracle: torch.Tensor | None = None
    compared_repeats: bool = True

    @property
    def failed(self) -> bool:
        return bool(self.findings)

    def verdict(self) -> str:
        return self.findings[0].verdict if self.findings else "PASS"

    def report(self) -> str:
        if not self.findings:
            checked = [c for c in CHECKS if self.compared_repeats or c != CHECKS[1]]
            skipped = "" if self.compared_repeats else "; identical launches not compared (declared nondeterministic)"
            return f"PASS: {'; '.join(checked)}{skipped} ({NOT_TRACED})"
        return "\n".join(f"{f.verdict}: {f.message}" for f in self.findings)


def launch(run_kernel, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(output rows, the output's allocation): ``out`` is pre-filled with NaN, rows past it are guard rows."""
    g = batch.case.geometry
    base = torch.full((batch.case.num_tokens + GUARD_ROWS, g.num_q_heads, g.v_head_size), float("nan"),
                      dtype=TORCH_DTYPES[g.dtype], device=batch.q.device)
    out = base[:batch.case.num_tokens]
    result = run_kernel(batch, out)
    if result is not None and result is not out:
        out.copy_(result)
    if out.is_cuda:
        torch.cuda.synchronize()
    return out, base


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8).cpu()


def _shown_rows(mask: torch.Tensor, out: torch.Tensor, reference: torch.Tensor, case: Case) -> str:
    """Where ``mask`` (tokens x heads) holds: the first rows, the kernel's values beside the reference's."""
    where = mask.nonzero().tolist()
    starts = case.query_start_loc()
    lines = []
    for token, head in where[:SHOWN_ROWS]:
        seq = max(s for s in range(len(case.sequences)) if starts[s] <= token)
        got = ", ".join(f"{x:.4g}" for x in out[token, head, :6].double().tolist())
        want = ", ".join(f"{x:.4g}" for x in reference[token, head, :6].tolist())
        lines.append(f"    token {token} (sequence {seq}) head {head}: kernel [{got}, ...] reference [{want}, ...]")
    more = f"\n    ... and {len(where) - SHOWN_ROWS} more rows" if len(where) > SHOWN_ROWS else ""
    return "\n".join(lines) + more


def judge(run_kernel, case: Case, poison: dict, device: str, *, precision: str = "tf32",
          deterministic: bool = True) -> Verdicts:
    """Run the kernel on the poisoned case, again on identical inputs, and twice on other finite
    garbage; compare with the float64 oracle and with the bound of a same-precision reference."""
    g = case.geometry
    poisoned = build_batch(case, poison, device)
    pristine = {name: base.clone() for name, base in poisoned.bases.items()}
    reference = build_batch(case, poison, device)  # the judges read this copy, never what the kernel was handed
    out, out_base = launch(run_kernel, poisoned)
    interpreter = out.device.type == "cpu"
    arithmetic = same_precision(g.dtype, effective_precision(precision, interpreter))
    (oracle, same), summands = attend_and_measure(reference, (FLOAT64, arithmetic))
    result = out.double()
    findings = []
    oracle_finite = torch.isfinite(oracle).all(dim=-1)
    nonfinite = ~torch.isfinite(result).all(dim=-1) & oracle_finite
    if nonfinite.any():
        findings.append(Finding("NONFINITE", f"{int(nonfinite.sum())}/{nonfinite.numel()} output rows hold NaN/Inf "
                                             f"where the float64 reference is finite\n"
                                             + _shown_rows(nonfinite, out, oracle, case)))
    if deterministic:
        again, _ = launch(run_kernel, build_batch(case, poison, device))
        if not torch.equal(_bits(again), _bits(out)):
            findings.append(Finding("NONDETERMINISTIC", "two launches on identical inputs gave different bits"))
    first, _ = launch(run_kernel, build_batch(case, poison, device, garbage_seed=1, poisoned=False))
    second, _ = launch(run_kernel, build_batch(case, poison, device, garbage_seed=2, poisoned=False))
    if not torch.equal(_bits(first), _bits(second)):
        changed = (_bits(first) != _bits(second)).view(*first.shape, -1).any(dim=-1).any(dim=-1)
        findings.append(Finding("LEAK", f"the output changes when only dead-slot contents change (other finite "
                                        f"garbage): {int(changed.sum())} token(s)"))
    written = [name for name, base in poisoned.bases.items() if not torch.equal(_bits(base), _bits(pristine[name]))]
    if not torch.equal(_bits(out_base[case.num_tokens:]), _bits(torch.full_like(out_base[case.num_tokens:],
                                                                                 float("nan")))):
        written.append("the output's guard rows")
    if written:
        findings.append(Finding("CLOBBER", "the kernel wrote outside its output rows: " + ", ".join(written)))
    errors = row_errors(result, oracle, same, summands, g.dtype,
                        effective_precision(precision, interpreter), case.kv_cache.quantized)
    off = errors.off() & torch.isfinite(result).all(dim=-1) & oracle_finite
    if off.any():
        worst = float(errors.ratio[off].max())
        findings.append(Finding("MISMATCH", f"{int(off.sum())} finite output row(s) off the float64 reference by up "
                                            f"to {worst:.3g}x what a correct {errors.arithmetic} kernel may be off (bound "
                                            f"{errors.bound:g}x)\n" + _shown_rows(off, out, oracle, case)))
    if not math.isfinite(float(oracle.abs().sum())):
        findings.append(Finding("ERROR", "the float64 reference itself is not finite: the case is not valid"))
    return Verdicts(findings, out, oracle, compared_repeats=deterministic)
