"""Counter-based pseudo-random values: the same bits on every machine.

A value is a hash of (data seed, stream, index): splitmix64's finaliser in
wrapping 64-bit integer arithmetic, then an exact float conversion, and the
final cast rounds to nearest even.  Host indices hash in numpy; indices on a
device hash there, in torch's int64 arithmetic, to the same bits (a
production-size case builds its caches on the device).  Batches are built on the host and every
device gets a copy (``reference.materialize``), so a slot's content depends
only on the seed and the slot, never on the device, the batch around it or
the poison.
"""
from __future__ import annotations

import numpy as np
import torch

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB

STREAMS = {name: i for i, name in enumerate(
    ("q", "cache_k", "cache_v", "garbage_k", "garbage_v", "poison_k", "poison_v", "sinks",
     "redzone_q", "redzone_k", "redzone_v", "redzone_key_cache", "redzone_value_cache", "redzone_sinks",
     # quantized caches (appended: the streams above keep their numbers, so their values)
     "garbage_scale_k", "garbage_scale_v", "poison_scale_k", "poison_scale_v",
     "redzone_k_scale", "redzone_v_scale", "redzone_k_scale_cache", "redzone_v_scale_cache",
     # zero points of unsigned codes
     "garbage_zero_k", "garbage_zero_v", "poison_zero_k", "poison_zero_v",
     "redzone_k_zero_cache", "redzone_v_zero_cache"))}


def _mix_int(x: int) -> int:
    """splitmix64's finaliser on a Python int (exact, modulo 2**64)."""
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * _MUL1) & _MASK64
    x = ((x ^ (x >> 27)) * _MUL2) & _MASK64
    return x ^ (x >> 31)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser in place on uint64, where a shift is logical and a product wraps."""
    with np.errstate(over="ignore"):
        x += np.uint64(_GOLDEN)
        x ^= x >> np.uint64(30)
        x *= np.uint64(_MUL1)
        x ^= x >> np.uint64(27)
        x *= np.uint64(_MUL2)
        x ^= x >> np.uint64(31)
    return x


def _signed(x: int) -> int:
    """A 64-bit pattern as the int64 that holds it."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """A logical shift of int64 ``x``: torch's ``>>`` on int64 is arithmetic."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix_tensor(x: torch.Tensor) -> torch.Tensor:
    """``_mix`` in int64 torch arithmetic, which wraps as uint64 does, on any device."""
    x = x + _signed(_GOLDEN)
    x = x ^ _shift_right(x, 30)
    x = x * _signed(_MUL1)
    x = x ^ _shift_right(x, 27)
    x = x * _signed(_MUL2)
    return x ^ _shift_right(x, 31)


def _stream_base(seed: int, stream: str) -> int:
    return _mix_int(_mix_int(seed & _MASK64) ^ STREAMS[stream])


def _bits_tensor(seed: int, stream: str, index: torch.Tensor) -> torch.Tensor:
    """``_bits`` as int64 on ``index``'s device: the same 64 bits."""
    return _mix_tensor(index * _signed(_GOLDEN) + _signed(_stream_base(seed, stream)))


def _bits(seed: int, stream: str, index: torch.Tensor) -> np.ndarray:
    """uint64 hashes of the host int64 ``index`` in ``stream`` under ``seed``."""
    base = _stream_base(seed, stream)
    x = index.numpy().astype(np.uint64)
    with np.errstate(over="ignore"):
        x *= np.uint64(_GOLDEN)
        x += np.uint64(base)
    return _mix(x)


def random_bits(seed: int, stream: str, index: torch.Tensor) -> torch.Tensor:
    """64 pseudo-random bits (as int64) for each element of the int64 ``index``, on its device."""
    if index.device.type != "cpu":
        return _bits_tensor(seed, stream, index)
    return torch.from_numpy(_bits(seed, stream, index).view(np.int64))


_kernel_works = True  # until the GPU kernel fails to build once (``values_gpu``)


def uniform(seed: int, stream: str, index: torch.Tensor) -> torch.Tensor:
    """float64 uniform on [-1, 1), 53 bits, exactly reproducible (``index``: int64, on its device)."""
    global _kernel_works
    if index.device.type == "cuda" and _kernel_works:
        try:
            from nanfuzz.reference import values_gpu

            return values_gpu.uniform(_stream_base(seed, stream), index, _GOLDEN, _MUL1, _MUL2)
        except Exception:  # a Triton that cannot build the kernel: torch's operations give the same bits
            _kernel_works = False
    if index.device.type != "cpu":
        top53 = _shift_right(_bits_tensor(seed, stream, index), 11).to(torch.float64)
        return top53 * (2.0 ** -52) - 1.0
    bits = _bits(seed, stream, index)
    bits >>= np.uint64(11)
    u = bits.astype(np.float64)  # the top 53 bits, exactly; then scaled and shifted in place
    u *= 2.0 ** -52
    u -= 1.0
    return torch.from_numpy(u)
