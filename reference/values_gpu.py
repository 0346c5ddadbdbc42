"""``values.uniform`` for indices on a GPU, in one Triton kernel instead of sixteen torch operations.

The same splitmix64 finaliser and float conversion as ``reference.values``,
in uint64 arithmetic (wrapping products, logical shifts), to the same bits;
the kernel stops at the float64 value, whose rounding to a cache's dtype
stays torch's.  A large case hashes hundreds of millions of elements per
cache: this is most of what building it on the device costs.  Imported only
once an index is on a GPU (Triton reads ``TRITON_INTERPRET`` at import).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit(do_not_specialize=["n", "base"])
def _uniform_kernel(Out, Index, n, base, GOLDEN: tl.constexpr, MUL1: tl.constexpr, MUL2: tl.constexpr,
                    BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offsets < n
    x = tl.load(Index + offsets, mask=ok, other=0).to(tl.uint64, bitcast=True)
    # index * golden + base, then the finaliser: x += golden; x ^= x >> 30; x *= mul1; x ^= x >> 27; ...
    x = x * GOLDEN + base.to(tl.int64).to(tl.uint64, bitcast=True)
    x = x + GOLDEN
    x = x ^ (x >> 30)
    x = x * MUL1
    x = x ^ (x >> 27)
    x = x * MUL2
    x = x ^ (x >> 31)
    top53 = (x >> 11).to(tl.float64)
    tl.store(Out + offsets, top53 * (2.0 ** -52) - 1.0, mask=ok)


def uniform(base: int, index: torch.Tensor, golden: int, mul1: int, mul2: int) -> torch.Tensor:
    """float64 uniform on [-1, 1) of int64 ``index`` on a GPU: ``base`` is the stream's seed-derived
    64-bit constant, ``golden``, ``mul1`` and ``mul2`` the finaliser's (``reference.values``)."""
    flat = index.contiguous().view(-1)
    out = torch.empty(flat.shape, dtype=torch.float64, device=index.device)
    if flat.numel():
        signed = base - (1 << 64) if base >= 1 << 63 else base
        _uniform_kernel[(triton.cdiv(flat.numel(), _BLOCK),)](out, flat, flat.numel(), signed,
                                                              GOLDEN=golden, MUL1=mul1, MUL2=mul2, BLOCK=_BLOCK)
    return out.view(index.shape)
