"""Counter-based pseudo-random values: the same bits on every device.

A value is a hash of (data seed, stream, index) computed in int64 integer
arithmetic, which CPU and GPU evaluate identically; the float conversion is
exact and the final cast rounds to nearest even everywhere.  So a slot's
content depends only on the seed and the slot, never on the device, the
batch around it or the poison.
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
     "redzone_k_scale", "redzone_v_scale", "redzone_k_scale_cache", "redzone_v_scale_cache"))}


def _signed(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def _mix_int(x: int) -> int:
    """splitmix64's finaliser on a Python int (exact, modulo 2**64)."""
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * _MUL1) & _MASK64
    x = ((x ^ (x >> 27)) * _MUL2) & _MASK64
    return x ^ (x >> 31)


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x + _signed(_GOLDEN)
    x = (x ^ _shr(x, 30)) * _signed(_MUL1)
    x = (x ^ _shr(x, 27)) * _signed(_MUL2)
    return x ^ _shr(x, 31)


def _mix_on_host(x: np.ndarray) -> np.ndarray:
    """``_mix`` in place on uint64, where a shift is logical and a product wraps: the same bits
    in fewer, cheaper operations (batches are built on the host)."""
    with np.errstate(over="ignore"):
        x += np.uint64(_GOLDEN)
        x ^= x >> np.uint64(30)
        x *= np.uint64(_MUL1)
        x ^= x >> np.uint64(27)
        x *= np.uint64(_MUL2)
        x ^= x >> np.uint64(31)
    return x


def _bits_on_host(base: int, index: torch.Tensor) -> np.ndarray:
    x = index.numpy().astype(np.uint64)
    with np.errstate(over="ignore"):
        x *= np.uint64(_GOLDEN)
        x += np.uint64(base)
    return _mix_on_host(x)


def random_bits(seed: int, stream: str, index: torch.Tensor) -> torch.Tensor:
    """64 pseudo-random bits (as int64) for each element of the int64 ``index``."""
    base = _mix_int(_mix_int(seed & _MASK64) ^ STREAMS[stream])
    if index.device.type == "cpu":
        return torch.from_numpy(_bits_on_host(base, index).view(np.int64))
    return _mix(index * _signed(_GOLDEN) + _signed(base))


def uniform(seed: int, stream: str, index: torch.Tensor) -> torch.Tensor:
    """float64 uniform on [-1, 1), 53 bits, exactly reproducible."""
    if index.device.type == "cpu":
        base = _mix_int(_mix_int(seed & _MASK64) ^ STREAMS[stream])
        top53 = (_bits_on_host(base, index) >> np.uint64(11)).astype(np.float64)
        return torch.from_numpy(top53 * (2.0 ** -52) - 1.0)
    top53 = _shr(random_bits(seed, stream, index), 11).to(torch.float64)
    return top53 * (2.0 ** -52) - 1.0
