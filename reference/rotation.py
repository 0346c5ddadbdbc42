"""Rotated caches: a Hadamard rotation applied to each (slot, head) row before quantization.

A cache with ``KVCache.rotation`` "hadamard" holds ``R x`` for a row ``x``:
in each run of b entries (b the largest power of two dividing head_size),
``H_b (s * x)``, with H_b the unnormalised Sylvester Hadamard matrix
(``H_b H_b^T = b I``) and s a +-1 sign vector of length b, the same for
every run (``rotation_signs``).  Hence ``(R q) . (R k) = b (q . k)`` and
``R^-1 y = s * (H_b y) / b``: a kernel rotates q the same way and divides
its scores by b, or undoes the rotation of what it reads.
"""
from __future__ import annotations

import functools

import torch

from nanfuzz.reference.case import KVCache


def rotation_block(head_size: int) -> int:
    """b: the largest power of two dividing ``head_size``."""
    return head_size & -head_size


@functools.lru_cache(maxsize=64)
def _signs(length: int, seed: int | None) -> torch.Tensor:
    if seed is None:
        return torch.ones(length, dtype=torch.float64)
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    draw = torch.bernoulli(torch.full((length,), 0.5, device="cpu"), generator=generator)
    return (2.0 * draw - 1.0).to(torch.float64)


def rotation_signs(length: int, seed: int | None) -> torch.Tensor:
    """The +-1 signs s (float64): all +1 without a seed; else torch's CPU generator seeded with ``seed``
    draws ``bernoulli(0.5)`` over ``length`` float32 entries, as 2 x draw - 1."""
    return _signs(length, seed).clone()


@functools.lru_cache(maxsize=16)
def _hadamard(b: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < b:
        h = torch.cat((torch.cat((h, h), dim=1), torch.cat((h, -h), dim=1)), dim=0)
    return h


def _blocks(x: torch.Tensor, b: int) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // b, b)


def rotate(x: torch.Tensor, kv: KVCache) -> torch.Tensor:
    """``R x`` of rows ``[..., head_size]``, in float64 (``x`` itself without a rotation)."""
    if kv.rotation == "none":
        return x
    x = x.double()
    b = rotation_block(x.shape[-1])
    s = _signs(b, kv.rotation_seed).to(x.device)
    h = _hadamard(b).to(x.device)
    return ((_blocks(x, b) * s) @ h.T).reshape(x.shape)


def unrotate(y: torch.Tensor, kv: KVCache) -> torch.Tensor:
    """``R^-1 y`` of rows ``[..., head_size]``, in float64 (``y`` itself without a rotation)."""
    if kv.rotation == "none":
        return y
    y = y.double()
    b = rotation_block(y.shape[-1])
    s = _signs(b, kv.rotation_seed).to(y.device)
    h = _hadamard(b).to(y.device)
    return ((_blocks(y, b) @ h.T) * s / b).reshape(y.shape)


def rotation_norm(kv: KVCache, head_size: int) -> int:
    """What a rotation multiplies a dot product by: b, or 1 without one."""
    return 1 if kv.rotation == "none" else rotation_block(head_size)
