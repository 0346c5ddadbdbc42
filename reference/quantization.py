"""Quantized KV caches: the encodings, their hostile bytes, and dequantization.

A quantized cache holds codes; the value of a code is code x scale, with
one scale per tensor or one per (slot, KV head) in a paged scale cache
(``reference.case.KVCache``).  The specification lives here:

- which codes each encoding has: e4m3fn has no Inf and two NaN codes (0x7F,
  0xFF); e4m3fnuz (MI300-class GPUs) has no Inf and one NaN, 0x80, the bit
  pattern of negative zero elsewhere; e5m2 has +-Inf (0x7C, 0xFC) and six
  NaN codes; int8 has neither;
- how a live value becomes a code (deterministic, saturating, round to
  nearest even) and what a dead slot may hold instead;
- ``live_values``: the float64 K and V of given slots, dequantized, which
  is all the oracle (and any other reference) reads of a cache.

Every function works on any device and gives the same bits on each.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nanfuzz.reference.case import KVCache


@dataclass(frozen=True)
class Encoding:
    torch_dtype: torch.dtype
    max_code: int            # the largest finite positive code
    max_value: float         # its value
    nan_codes: tuple[int, ...]
    inf_codes: tuple[int, int] | None  # (+Inf, -Inf)

    @property
    def is_float(self) -> bool:
        return self.torch_dtype.is_floating_point


ENCODINGS = {
    "fp8_e4m3fn": Encoding(torch.float8_e4m3fn, 0x7E, 448.0, (0x7F, 0xFF), None),
    "fp8_e4m3fnuz": Encoding(torch.float8_e4m3fnuz, 0x7F, 240.0, (0x80,), None),
    "fp8_e5m2": Encoding(torch.float8_e5m2, 0x7B, 57344.0, (0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF), (0x7C, 0xFC)),
    "int8": Encoding(torch.int8, 0x7F, 127.0, (), None),
}

# A per-token-head scale is the slot's largest |value| over the head over
# this much of the code range: headroom, so that rounding never saturates.
_TOKEN_HEAD_RANGE = 1.0
# A slot whose values are all tiny still gets a normal float32 scale.
_SMALLEST_SCALE = 2.0 ** -30


def torch_dtype(kv_cache_dtype: str) -> torch.dtype:
    return ENCODINGS[kv_cache_dtype].torch_dtype


def codes_of(cache: torch.Tensor) -> torch.Tensor:
    """The cache's codes as uint8, a view (indexing works on it on every device)."""
    return cache.view(torch.uint8)


def as_encoding(codes: torch.Tensor, kv_cache_dtype: str) -> torch.Tensor:
    """uint8 codes viewed as the encoding's torch dtype."""
    return codes.view(torch_dtype(kv_cache_dtype))


def quantize(values: torch.Tensor, scale: torch.Tensor | float, kv_cache_dtype: str) -> torch.Tensor:
    """uint8 codes of float64 ``values / scale``, saturated to the encoding's range,
    rounded to nearest even (through float32, as torch and the GPUs convert)."""
    enc = ENCODINGS[kv_cache_dtype]
    scaled = (values / scale).clamp(-enc.max_value, enc.max_value)
    if enc.is_float:
        return scaled.to(torch.float32).to(enc.torch_dtype).view(torch.uint8)
    return torch.round(scaled).to(torch.int8).view(torch.uint8)


def decode(codes: torch.Tensor, kv_cache_dtype: str) -> torch.Tensor:
    """float64 values of uint8 codes (NaN and Inf codes included)."""
    return as_encoding(codes, kv_cache_dtype).to(torch.float64)


def token_head_scales(values: torch.Tensor, kv_cache_dtype: str) -> torch.Tensor:
    """float32 ``[..., heads]`` scales of float64 ``[..., heads, head_size]`` values:
    the largest magnitude over the head maps to the encoding's largest code."""
    enc = ENCODINGS[kv_cache_dtype]
    amax = values.abs().amax(dim=-1) / (enc.max_value * _TOKEN_HEAD_RANGE)
    return amax.clamp_min(_SMALLEST_SCALE).to(torch.float32)


def _pick(bits: torch.Tensor, choices: tuple[int, ...]) -> torch.Tensor:
    table = torch.tensor(choices, dtype=torch.int64, device=bits.device)
    return table[(bits & 0x7FFFFFFF) % len(choices)]


def finite_codes(bits: torch.Tensor, kv_cache_dtype: str) -> torch.Tensor:
    """uint8 finite garbage codes from random int64 ``bits``: any code but NaN and Inf."""
    code = (bits & 0xFF).to(torch.uint8)  # the low byte; the rest in bytes, in place
    if kv_cache_dtype == "fp8_e4m3fn":
        code ^= ((code & 0x7F) == 0x7F).to(torch.uint8)             # NaN -> +-448
    elif kv_cache_dtype == "fp8_e4m3fnuz":
        code.masked_fill_(code == 0x80, 0)                          # NaN -> 0
    elif kv_cache_dtype == "fp8_e5m2":
        code ^= ((code & 0x7C) == 0x7C).to(torch.uint8) << 2        # Inf, NaN -> finite
    return code


def hostile_codes(kind: str, bits: torch.Tensor, uniform: torch.Tensor, kv_cache_dtype: str) -> torch.Tensor:
    """uint8 codes for a poisoned dead slot (``case.DATA_POISON_VALUES``):

    nan: each of the encoding's NaN codes, picked per element; inf / -inf;
    max: the largest finite code; garbage: large finite codes, half to all of
    the range, either sign; bits: any code.  ``bits`` (int64) and
    ``uniform`` (float64 in [-1, 1)) are per-element random streams.
    """
    enc = ENCODINGS[kv_cache_dtype]
    if kind == "nan":
        code = _pick(bits, enc.nan_codes)
    elif kind in ("inf", "-inf"):
        assert enc.inf_codes is not None, kv_cache_dtype
        code = torch.full_like(bits, enc.inf_codes[kind == "-inf"])
    elif kind == "max":
        code = torch.full_like(bits, enc.max_code)
    elif kind == "garbage":
        return quantize(torch.sign(uniform) * enc.max_value * (0.5 + 0.5 * uniform.abs()), 1.0, kv_cache_dtype)
    else:
        assert kind == "bits", kind
        code = bits & 0xFF
    return code.to(torch.uint8)


def garbage_scales(uniform: torch.Tensor, kv_cache_dtype: str) -> torch.Tensor:
    """float32 finite garbage scales for dead slots: positive, log-uniform over
    four decades above what a live slot gets, so a dead slot read with a
    non-zero weight changes the output."""
    return (torch.pow(10.0, uniform.abs() * 4.0) / ENCODINGS[kv_cache_dtype].max_value).to(torch.float32)


def hostile_scales(kind: str, bits: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """float32 scales for a poisoned dead slot (``case.SCALE_POISON_VALUES``):
    NaN, +-Inf, huge (float32 max; garbage: half to all of it, either sign),
    zero, or any 32 bits."""
    big = torch.finfo(torch.float32).max
    fixed = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "max": big, "zero": 0.0}
    if kind in fixed:
        return torch.full(bits.shape, fixed[kind], dtype=torch.float32, device=bits.device)
    if kind == "garbage":
        return (torch.sign(uniform) * big * (0.5 + 0.5 * uniform.abs())).clamp(-big, big).to(torch.float32)
    assert kind == "bits", kind
    low = bits & 0xFFFFFFFF
    return torch.where(low >= 1 << 31, low - (1 << 32), low).to(torch.int32).view(torch.float32)


def live_values(batch, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 K and V ``[len(slots), num_kv_heads, head_size]`` of the flat cache
    slots ``block * block_size + offset``: the codes times their scales (a latent
    cache's V: the first ``latent_rank`` entries of K).

    Only the given slots are read, codes and scale-cache entries alike; a
    caller that passes live slots alone never touches a dead slot's bits.
    """
    kv: KVCache = batch.case.kv_cache
    k = values_at(batch.case, batch.key_cache, kv.k_scale, batch.k_scale_cache, slots)
    if batch.case.geometry.latent:
        return k, k[..., :batch.case.geometry.latent_rank]
    return k, values_at(batch.case, batch.value_cache, kv.v_scale, batch.v_scale_cache, slots)


def values_at(case, cache: torch.Tensor, scale: float, scale_cache: torch.Tensor | None,
              slots: torch.Tensor) -> torch.Tensor:
    """float64 ``[len(slots), num_kv_heads, head_size]``: one cache's values at ``slots``
    (``scale``: its per-tensor scale; ``scale_cache``: its per-token-head scales)."""
    g = case.geometry
    kv: KVCache = case.kv_cache
    if not kv.quantized:
        return cache.reshape(-1, g.num_kv_heads, g.head_size)[slots].double()
    codes = codes_of(cache).reshape(-1, g.num_kv_heads, g.head_size)[slots]
    values = decode(codes, kv.dtype)
    if kv.token_head:
        return values * scale_cache.reshape(-1, g.num_kv_heads)[slots].double()[..., None]
    return values * scale
