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

from nanfuzz.reference.asymmetric import (dequantize_unsigned, dequantize_unsigned_rounded, operand_offsets,
                                         quantize_unsigned)
from nanfuzz.reference.packing import pack_codes, unpack_codes
from nanfuzz.reference.rotation import unrotate
from nanfuzz.reference.case import UNSIGNED_DTYPES, CacheSide, KVCache


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
    # unsigned codes (reference.asymmetric): a byte, or packed several to a byte (reference.packing)
    "uint8": Encoding(torch.uint8, 0xFF, 255.0, (), None),
    "uint4": Encoding(torch.uint8, 0xF, 15.0, (), None),
    "uint3": Encoding(torch.uint8, 0x7, 7.0, (), None),
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


def margin_code(kv_cache_dtype: str) -> int:
    """The byte a quantized cache's redzones (and a large case's unwritten blocks) hold: the
    encoding's first NaN code; int8, which has none, its largest code; unsigned codes all ones."""
    if kv_cache_dtype in UNSIGNED_DTYPES:
        return 0xFF
    enc = ENCODINGS[kv_cache_dtype]
    return (enc.nan_codes or (enc.max_code,))[0]


def hostile_unsigned(kind: str, bits: torch.Tensor, side: CacheSide) -> torch.Tensor:
    """uint8 rows ``[..., row_bytes]`` of unsigned codes for a poisoned dead slot, from int64 ``bits``
    ``[..., head_size]`` (one per code): max, every code at the largest; garbage, codes in the upper
    half; bits, any code (every nibble pattern, across a slot's codes)."""
    top = (1 << side.bits) - 1
    if kind == "max":
        codes = torch.full_like(bits, top)
    elif kind == "garbage":
        codes = (top + 1) // 2 + (bits & ((top + 1) // 2 - 1))
    else:
        assert kind == "bits", kind
        codes = bits & top
    return pack_codes(codes, side.bits, side.packing)


def live_rows(x: torch.Tensor, side: CacheSide, per_tensor_scale: float, query_dtype: torch.dtype):
    """What a quantized cache side stores for float64 rows ``x`` ``[n, heads, head_size]``:
    ``(uint8 codes [n, heads, row_bytes], scales [n, heads] or None, zero points [n, heads] or None)``."""
    if side.dtype in UNSIGNED_DTYPES:
        codes, scales, zeros = quantize_unsigned(x, side, query_dtype)
        return pack_codes(codes, side.bits, side.packing), scales, zeros
    if side.token_head:
        scales = token_head_scales(x, side.dtype)
        return quantize(x, scales.double()[..., None], side.dtype), scales, None
    return quantize(x, per_tensor_scale, side.dtype), None, None


def live_values(batch, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 K ``[len(slots), num_kv_heads, head_size]`` and V ``[..., v_head_size]`` of the flat
    cache slots ``block * block_size + offset``, as the model means them: ``stored_values`` with the
    cache's rotation undone."""
    kv = batch.case.kv_cache
    return tuple(unrotate(x, kv) for x in stored_values(batch, slots))


def stored_values(batch, slots: torch.Tensor, rounded: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 K and V (``live_values``' shapes) the caches hold at the flat slots, dequantized (a
    latent cache's V: the first ``latent_rank`` entries of K), in the cache's rotated frame where it
    has one (``rounded``: dequantized in the scales' own dtype, ``asymmetric.dequantize_unsigned_rounded``)."""
    case = batch.case
    kv: KVCache = case.kv_cache
    k = values_at(case, batch.key_cache, kv.k_scale, batch.k_scale_cache, slots,
                  which="k", zero_cache=batch.k_zero_cache, rounded=rounded)
    if case.geometry.latent:
        return k, k[..., :case.geometry.latent_rank]
    return k, values_at(case, batch.value_cache, kv.v_scale, batch.v_scale_cache, slots,
                        which="v", zero_cache=batch.v_zero_cache, rounded=rounded)


def offsets_at(batch, slots: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """float64 ``[len(slots), num_kv_heads]`` per side (K, V) of the flat cache slots: what the side's
    code x scale adds to each value it stores (``asymmetric.operand_offsets``); None for a side that
    is not of unsigned codes (its codes are centred: code x scale is the value).  A latent cache's V
    is K's first entries, and has K's offsets."""
    case = batch.case
    g = case.geometry

    def side_offsets(which: str, scale_cache, zero_cache) -> torch.Tensor | None:
        side = case.kv_cache.side(which)
        if side.dtype not in UNSIGNED_DTYPES:
            return None
        scales = scale_cache.reshape(-1, g.num_kv_heads)[slots]
        zeros = zero_cache.reshape(-1, g.num_kv_heads)[slots] if side.zero_cache else None
        return operand_offsets(scales, zeros, side)

    k = side_offsets("k", batch.k_scale_cache, batch.k_zero_cache)
    if g.latent:
        return k, k
    return k, side_offsets("v", batch.v_scale_cache, batch.v_zero_cache)


def values_at(case, cache: torch.Tensor, scale: float, scale_cache: torch.Tensor | None,
              slots: torch.Tensor, *, which: str = "k", zero_cache: torch.Tensor | None = None,
              rounded: bool = False) -> torch.Tensor:
    """float64 ``[len(slots), num_kv_heads, its head size]``: cache ``which``'s stored values at ``slots``
    (``scale``: its per-tensor scale; ``scale_cache`` and ``zero_cache``: its per-token-head scales and
    zero points), in the cache's rotated frame where it has one."""
    g = case.geometry
    side = case.kv_cache.side(which)
    head_size = g.cache_head_size(which)
    if not side.quantized:
        return cache.reshape(-1, g.num_kv_heads, head_size)[slots].double()
    codes = codes_of(cache).reshape(-1, g.num_kv_heads, side.row_bytes(head_size))[slots]
    if side.dtype in UNSIGNED_DTYPES:
        codes = unpack_codes(codes, side.bits, side.packing, head_size)
        scales = scale_cache.reshape(-1, g.num_kv_heads)[slots]
        zeros = zero_cache.reshape(-1, g.num_kv_heads)[slots] if side.zero_cache else None
        read = dequantize_unsigned_rounded if rounded else dequantize_unsigned
        return read(codes, scales, zeros, side)
    values = decode(codes, side.dtype)
    if side.token_head:
        return values * scale_cache.reshape(-1, g.num_kv_heads)[slots].double()[..., None]
    return values * scale
