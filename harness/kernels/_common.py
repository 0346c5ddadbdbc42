"""Pieces the built-in kernel families share, and the interface each family module offers.

``softmax_step`` is the online-softmax update every family's tile loop calls;
``dot_rows`` pads a row count to what ``tl.dot`` accepts; ``INTERPRETED``
says whether Triton's interpreter runs them; ``device_function`` marks the
helpers kernels call; ``sinks_argument`` fills the sinks pointer of a batch
without sinks; ``kv_quant`` and ``scale_arguments`` say how a quantized cache
is read (the ``KV_QUANT`` constexpr) and fill its scale pointers;
``family_kernels`` registers a family's variants.

Every family module (``harness.kernels.<family>``) defines

- ``VARIANTS``: variant name -> the constexpr switches that make it;
- ``DO_NOT_SPECIALIZE``: the integer arguments its ``@triton.jit`` leaves
  unspecialised (Triton would otherwise compile once more for each being 1 or
  a multiple of 16);
- ``specialisation(case, variant) -> dict``: the constexpr arguments of a
  launch on ``case``'s batch, variant switches included.  With the case's
  dtype (and the launch options) they are what Triton keys a compile on
  (see ``harness.launch.compiles``), so batches with equal values share a compile;
- ``CAPABILITIES`` and ``KERNELS``.
"""
from __future__ import annotations

import functools
import os
from typing import Callable

import torch
import triton
import triton.language as tl

from nanfuzz.harness.kernel import Kernel
from nanfuzz.reference.batch import PagedBatch
from nanfuzz.reference.capabilities import Capabilities

# Every constexpr combination is a compile on a GPU (block size, padded head size, query
# rows, window, sinks, cache encoding, dtype: hundreds of them): GPU campaigns draw
# them from a pool of this many (see strategies.specialisations), compiled ahead by
# harness.launch.farm.
GPU_POOL = 16
# tl.dot wants at least 16 along each dimension on current GPUs.
MIN_DOT_SIZE = 16
# Fixed before any kernel module is imported, as Triton itself reads it.  The
# interpreter runs every program in Python, tens of microseconds per tile
# operation whatever the tile's size: there, taller query tiles and wider
# key tiles cost far less.  The masks are per key, so they are the same code
# at any tile size; the GPU tiles are what GPU runs test.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def device_function(fn):
    """``@triton.jit`` for a helper that kernels call, or ``fn`` itself under the interpreter.

    The interpreter runs a kernel as Python with ``triton.language`` patched
    for the whole launch, so a plain function works there, and it skips the
    re-patching the interpreter does on every call of a jitted helper
    (3-7% of a launch of these kernels).  Helpers must not rely on what the
    interpreter rewrites in jitted code: no chained comparisons.
    """
    return fn if INTERPRETED else triton.jit(fn)


def dot_rows(n: int) -> int:
    """``n`` rounded up to a power of two, and to at least ``MIN_DOT_SIZE``."""
    return max(MIN_DOT_SIZE, triton.next_power_of_2(n))


@functools.cache
def _no_sinks(device: torch.device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.float32, device=device)


def sinks_argument(batch: PagedBatch) -> torch.Tensor:
    """``batch.sinks``, or without sinks a float32 stand-in the kernel never reads:
    the presence of sinks is then a runtime flag, not a compile of its own."""
    return _no_sinks(batch.q.device) if batch.sinks is None else batch.sinks


# KV_QUANT: how a kernel reads its cache.  PER_TENSOR: codes x k_scale / v_scale
# (loaded once per program); PER_TOKEN_HEAD: codes x the slot's entry in a
# [num_blocks, block_size, num_kv_heads] scale cache.
NO_QUANT, PER_TENSOR, PER_TOKEN_HEAD = 0, 1, 2
# The caches every family reads with per-tensor scales, unquantized first.
PER_TENSOR_DTYPES = ("auto", "fp8_e4m3fn", "fp8_e5m2", "fp8_e4m3fnuz")
# Those a family with per-token-head scales reads that way.
TOKEN_HEAD_DTYPES = ("fp8_e4m3fn", "int8", "fp8_e5m2", "fp8_e4m3fnuz")


def kv_quant(case) -> int:
    """The KV_QUANT constexpr for ``case``'s cache."""
    kv = case.kv_cache
    return NO_QUANT if not kv.quantized else (PER_TOKEN_HEAD if kv.token_head else PER_TENSOR)


def scale_arguments(batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-tensor (k_scale, v_scale) pointers; without them float32 stand-ins the kernel
    never reads (as for sinks, so that a batch without them is no compile of its own)."""
    if batch.k_scale is None:
        stand_in = _no_sinks(batch.q.device)
        return stand_in, stand_in
    return batch.k_scale, batch.v_scale


def family_kernels(family: str, launch: Callable, capabilities: Capabilities, expect: dict[str, str],
                   size: str | None = None) -> list[Kernel]:
    """``family@variant`` for each variant in ``expect`` ("caught": an old, buggy
    variant; "pass": a fixed one), each launching ``launch(batch, out, variant=...)`` on the caches
    in place; ``size``: the size tier their campaigns draw (``Kernel.size``)."""
    return [Kernel(f"{family}@{variant}", functools.partial(launch, variant=variant), capabilities, expect=verdict,
                   size=size, copies_caches=False)
            for variant, verdict in expect.items()]


@device_function
def softmax_step(acc, l_i, m_i, qk, v):
    """Fold one tile of keys into the running softmax state; returns ``(acc, l_i, m_i)``.

    qk : (M, N) float32 scores, already scaled, -inf where a key is not allowed
    v  : (N, D) the tile's values, in the cache dtype
    acc: (M, D) float32 running numerator; l_i, m_i: (M,) float32 running
    denominator and maximum.  Start from (0, 0, -inf), or, for a sink,
    m_i = sink and l_i = 1 (its exp(sink - m) term).

    Every row of ``v`` meets the dot, with weight exactly 0 where qk is -inf:
    a NaN or Inf there still poisons the output (0 * NaN = NaN), so dead
    slots must be kept out of ``v`` by the caller's load masks.  The caller
    divides ``acc`` by ``l_i`` after the last tile.  Float32 values use an
    IEEE dot (not TF32), so fp32 caches keep fp32 accuracy.
    """
    # -- new running maximum (m_new : (M,)) -----------------------------------
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # rows with no allowed key yet keep m = -inf; shift them by 0 so that
    # exp(-inf - shift) is 0 instead of exp(-inf + inf) = NaN
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    # -- rescale the old state, add the tile ----------------------------------
    alpha = tl.exp(m_i - shift)
    p = tl.exp(qk - shift[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return acc, l_i, m_new
