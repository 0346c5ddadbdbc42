"""``nanfuzz perf``: is kernel A slower than baseline B on realistic shapes?

A fix for the dead-slot bug class must not cost decode speed (a mask on every
tile once cost vLLM 1.33x), so a PR gate times the fixed kernel against the
old one.  A and B run on the same batch in one process, interleaved round by
round, so that drift of the clock or of the machine hits both alike and the
ratio A/B is taken within one run.  On a GPU each round is one
``triton.testing.do_bench`` median; on the CPU (Triton's interpreter, tiny
shapes) a wall-clock time of one launch.  Only the launch is timed: the batch
and the output are built once, and a kernel's ``prepare`` (an adapter's
cache-layout conversion) runs outside the timing.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from nanfuzz.harness.kernel import Kernel
from nanfuzz.reference.batch import PagedBatch
from nanfuzz.reference.case import Case, Geometry, Sequence
from nanfuzz.reference.errors import NanfuzzError
from nanfuzz.reference.materialize import TORCH_DTYPES, token_layout
from nanfuzz.reference.semantics import live_key_range

# H200 HBM3e peak bandwidth: the bound below is bytes / this.
HBM_BYTES_PER_SECOND = 4.8e12
DEFAULT_THRESHOLD = 0.03
DEFAULT_RUNS = 20
# do_bench per round: warm-up and measuring time in milliseconds.
_DO_BENCH_WARMUP_MS = 5
_DO_BENCH_REP_MS = 20


@dataclass(frozen=True)
class Shape:
    """One timed batch: ``num_seqs`` sequences of ``seq_len`` keys, the last ``query_len`` new."""

    name: str
    kind: str  # "decode" or "prefill"
    num_seqs: int
    query_len: int
    seq_len: int
    window: int  # 0 = none
    num_q_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: str


def _shapes(num_seqs_decode, seq_len_decode, num_seqs_prefill, query_len, seq_len_prefill, window,
            hq, hkv, head, dtype) -> tuple[Shape, ...]:
    common = dict(num_q_heads=hq, num_kv_heads=hkv, head_size=head, block_size=16, dtype=dtype)
    return (
        Shape("decode-window", "decode", num_seqs_decode, 1, seq_len_decode, window, **common),
        Shape("decode", "decode", num_seqs_decode, 1, seq_len_decode, 0, **common),
        Shape("prefill-window", "prefill", num_seqs_prefill, query_len, seq_len_prefill, window, **common),
        Shape("prefill", "prefill", num_seqs_prefill, query_len, seq_len_prefill, 0, **common),
    )


# Decode: 64 sequences of 8192 keys; prefill: 4 sequences of 2048 new tokens
# after 2048 of context; window 2048; Llama-3-8B-like heads (32 query heads,
# 8 KV heads, head size 128); block size 16; bf16.
GPU_SHAPES = _shapes(64, 8192, 4, 2048, 4096, 2048, 32, 8, 128, "bfloat16")
# The same shapes, tiny, for Triton's interpreter (fp16: it has no bf16 arithmetic).
CPU_SHAPES = _shapes(4, 64, 2, 16, 32, 16, 4, 1, 32, "float16")


def shapes_for(device: str, which: str = "all") -> tuple[Shape, ...]:
    if which not in ("decode", "prefill", "all"):
        raise NanfuzzError(f"--shape {which!r} is not one of decode, prefill, all")
    shapes = GPU_SHAPES if device == "cuda" else CPU_SHAPES
    return tuple(s for s in shapes if which in ("all", s.kind))


def perf_case(shape: Shape, seed: int = 0) -> Case:
    """The shape as a valid case: every sequence's table holds distinct blocks, scattered; block 0 stays null."""
    bs = shape.block_size
    per_seq = -(-shape.seq_len // bs)
    num_blocks = 1 + shape.num_seqs * per_seq
    order = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(seed)) + 1
    rows = order.view(shape.num_seqs, per_seq).tolist()
    geometry = Geometry(shape.num_q_heads, shape.num_kv_heads, shape.head_size, bs, num_blocks, shape.dtype)
    sequences = tuple(Sequence(shape.query_len, shape.seq_len, tuple(row)) for row in rows)
    return Case(geometry, sequences, sliding_window=shape.window, causal=True).validate()


def perf_batch(case: Case, device: str | torch.device, seed: int = 0) -> PagedBatch:
    """Random live data for timing (seeded), built on the device; the new tokens' K/V are the cache's."""
    g = case.geometry
    device = torch.device(device)
    dtype = TORCH_DTYPES[g.dtype]
    generator = torch.Generator(device=device).manual_seed(seed)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=generator, device=device, dtype=dtype)

    key_cache = randn(g.num_blocks, g.block_size, g.num_kv_heads, g.head_size)
    value_cache = randn(g.num_blocks, g.block_size, g.num_kv_heads, g.head_size)
    q = randn(case.num_tokens, g.num_q_heads, g.head_size)
    block_table = torch.tensor([s.block_table for s in case.sequences], dtype=torch.int32).to(device)
    seq_of, pos_of = token_layout(case)
    seq_t = torch.tensor(seq_of, dtype=torch.int64).to(device)
    pos_t = torch.tensor(pos_of, dtype=torch.int64).to(device)
    blocks = block_table.long()[seq_t, pos_t // g.block_size]
    offsets = pos_t % g.block_size
    return PagedBatch(
        case=case, q=q, k=key_cache[blocks, offsets], v=value_cache[blocks, offsets],
        key_cache=key_cache, value_cache=value_cache, block_table=block_table,
        seq_lens=torch.tensor([s.seq_len for s in case.sequences], dtype=torch.int32).to(device),
        query_start_loc=torch.tensor(case.query_start_loc(), dtype=torch.int32).to(device),
        sinks=None,
    )


def kv_bytes(case: Case) -> int:
    """Bytes of K and V some query must read: each allowed key once (the window's keys, with one)."""
    g = case.geometry
    keys = sum(hi - lo for lo, hi in (live_key_range(case, s) for s in case.sequences))
    return 2 * keys * g.num_kv_heads * g.head_size * TORCH_DTYPES[g.dtype].itemsize


def _unsupported(kernel: Kernel, case: Case, interpreter: bool) -> str | None:
    # max_q_heads bounds what the fuzzer generates, not what a kernel can run.
    caps = kernel.capabilities.restrict(max_q_heads=max(kernel.capabilities.max_q_heads, case.geometry.num_q_heads))
    reason = caps.unsupported(case, interpreter=interpreter)
    return f"{kernel.name} does not support {reason}" if reason else None


def _launcher(kernel: Kernel, batch: PagedBatch, out: torch.Tensor) -> Callable[[], object]:
    if kernel.prepare is not None:
        return kernel.prepare(batch, out)
    return lambda: kernel(batch, out)


def _timer(device: str) -> Callable[[Callable[[], object]], float]:
    if device == "cuda":
        from triton.testing import do_bench

        return lambda launch: do_bench(launch, warmup=_DO_BENCH_WARMUP_MS, rep=_DO_BENCH_REP_MS,
                                       return_mode="median") * 1e-3

    def wall(launch: Callable[[], object]) -> float:
        start = time.perf_counter()
        launch()
        return time.perf_counter() - start

    return wall


def time_pair(launch_a: Callable[[], object], launch_b: Callable[[], object], device: str,
              runs: int) -> tuple[list[float], list[float]]:
    """Seconds per round for A and for B, interleaved (A first on even rounds, B first on odd)."""
    launch_a()
    launch_b()  # first launches compile: not timed
    if device == "cuda":
        torch.cuda.synchronize()
    measure = _timer(device)
    a, b = [], []
    for round_ in range(runs):
        order = ((a, launch_a), (b, launch_b)) if round_ % 2 == 0 else ((b, launch_b), (a, launch_a))
        for times, launch in order:
            times.append(measure(launch))
    return a, b


def perf(kernel: Kernel, baseline: Kernel, *, device: str, which: str = "all",
         threshold: float = DEFAULT_THRESHOLD, runs: int = DEFAULT_RUNS,
         progress: Callable[[str], None] | None = None) -> dict:
    """Time A against B on each shape both support; the report says which shapes A is slower on."""
    if runs < 1:
        raise NanfuzzError(f"--runs={runs} must be >= 1")
    if threshold < 0:
        raise NanfuzzError(f"--threshold={threshold} must be >= 0 (0.03 allows A to be 3% slower)")
    interpreter = device == "cpu"
    rows, skipped = [], []
    for shape in shapes_for(device, which):
        case = perf_case(shape)
        reason = _unsupported(kernel, case, interpreter) or _unsupported(baseline, case, interpreter)
        if reason:
            skipped.append({"shape": shape.name, "reason": reason})
            continue
        batch = perf_batch(case, device)
        out = torch.full(batch.q.shape, float("nan"), dtype=batch.q.dtype, device=batch.q.device)
        try:
            a, b = time_pair(_launcher(kernel, batch, out), _launcher(baseline, batch, out), device, runs)
        except Exception as exc:  # a kernel's own failure, reported in one line
            first_line = (str(exc).strip().splitlines() or [""])[0][:200]
            raise NanfuzzError(f"perf: a kernel failed on shape {shape.name}: {type(exc).__name__}: {first_line}") from None
        a_s, b_s = statistics.median(a), statistics.median(b)
        bound = kv_bytes(case) / HBM_BYTES_PER_SECOND
        row = {**asdict(shape), "kernel_s": a_s, "baseline_s": b_s, "ratio": a_s / b_s,
               "slower": a_s / b_s > 1 + threshold, "kernel_runs_s": a, "baseline_runs_s": b,
               "kv_bytes": kv_bytes(case), "hbm_bound_s": bound,
               "kernel_x_bound": a_s / bound, "baseline_x_bound": b_s / bound}
        rows.append(row)
        if progress is not None:
            progress(f"  {shape.name}: {kernel.name} {a_s * 1e3:.3f} ms, {baseline.name} {b_s * 1e3:.3f} ms, "
                     f"ratio {a_s / b_s:.3f}")
        del batch, out
    if not rows:
        raise NanfuzzError("perf: no shape both kernels support (" + "; ".join(
            f"{s['shape']}: {s['reason']}" for s in skipped) + ")")
    slower = [r["name"] for r in rows if r["slower"]]
    return {
        "device": device, "kernel": kernel.name, "baseline": baseline.name, "threshold": threshold, "runs": runs,
        "timer": ("triton.testing.do_bench median per round, median over rounds" if device == "cuda"
                  else "wall clock per launch under Triton's interpreter, median over rounds"),
        "hbm_bytes_per_second": HBM_BYTES_PER_SECOND,
        "shapes": rows, "skipped": skipped, "slower": slower, "exit_code": 1 if slower else 0,
    }


def table_rows(result: dict) -> list[tuple]:
    rows = [("shape", "seqs x (query/keys)", "window", "dtype", f"{result['kernel']} ms", f"{result['baseline']} ms",
             "ratio", "K/V bound ms", "A x bound", "B x bound", "result")]
    for r in result["shapes"]:
        rows.append((r["name"], f"{r['num_seqs']} x ({r['query_len']}/{r['seq_len']})", r["window"] or "-", r["dtype"],
                     f"{r['kernel_s'] * 1e3:.4g}", f"{r['baseline_s'] * 1e3:.4g}", f"{r['ratio']:.3f}",
                     f"{r['hbm_bound_s'] * 1e3:.4g}", f"{r['kernel_x_bound']:.3g}", f"{r['baseline_x_bound']:.3g}",
                     "SLOWER" if r["slower"] else "ok"))
    for s in result["skipped"]:
        rows.append((s["shape"], "", "", "", "", "", "", "", "", "", "skipped: " + s["reason"]))
    return rows
