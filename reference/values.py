"""Counter-based pseudo-random values: the same bits on every device.

A value is a hash of (data seed, stream, index) computed in int64 integer
arithmetic, which CPU and GPU evaluate identically; the float conversion is
exact and the final cast rounds to nearest even everywhere.  So a slot's
content depends only on the seed and the slot, never on the device, the
batch around it or the poison.
"""
from __future__ import annotations

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


def random_bits(seed: int, stream: str, index: torch.Tensor) -> torch.Tensor:
    """64 pseudo-random bits (as int64) for each element of the int64 ``index``."""
    base = _mix_int(_mix_int(seed & _MASK64) ^ STREAMS[stream])
    return _mix(index * _signed(_GOLDEN) + _signed(base))


def uniform(seed: int, stream: str, index: torch.Tensor) -> torch.Tensor:
    """float64 uniform on [-1, 1), 53 bits, exactly reproducible."""
    top53 = _shr(random_bits(seed, stream, index), 11).to(torch.float64)
    return top53 * (2.0 ** -52) - 1.0
