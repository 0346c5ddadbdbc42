"""Unsigned codes with a zero point: how a live row is quantized, how a stored row reads back.

A cache side of unsigned codes (``case.UNSIGNED_DTYPES``) keeps, per (slot,
KV head), a scale and a zero point beside the row's codes, stored as its
``scale_format`` says (``case.SCALE_FORMATS``):

- zero points "code": value = (code - zero) x scale, the zero in code units
  (a float, or with "float32-zp4" an integer 0..15 in the scale word's 4 low
  mantissa bits, the scale being the word with those bits cleared);
- zero points "offset": value = code x scale + zero, the zero in value units.

A live row is quantized as a writer of that format does it (min-max over
the row: scale = (max - min) / largest code; zero = -min / scale in code
units, or min itself as an offset; codes rounded to nearest even and
clamped), with the scale and zero stored first and the codes computed from
the stored ones, so the stored triple reads back exactly to what the oracle
uses.  ``dequantize_unsigned`` is that reading, in float64; ``dequantize_unsigned_rounded`` the
same arithmetic in the scale's own dtype (a kernel that dequantizes with
half-precision scales does that).
"""
from __future__ import annotations

import torch

from nanfuzz.reference.case import CacheSide

# A row whose entries are all equal still gets a normal scale (fp16's smallest normal is 2^-14).
SMALLEST_SCALE = 2.0 ** -14
# zp4 words: the zero point's bits and the scale's.
ZERO_BITS = 0xF
_FLOATS = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "float32-zp4": torch.float32}


def largest_code(side: CacheSide) -> int:
    return (1 << side.bits) - 1


def storage_dtype(side: CacheSide, query_dtype: torch.dtype) -> torch.dtype:
    """The dtype a side's scales (and zero points) are stored in."""
    return query_dtype if side.scale_format == "dtype" else _FLOATS[side.scale_format]


def _words(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """float32 zp4 words of float32 scales (their 4 low bits are cleared) and integer zeros 0..15."""
    bits = scale.to(torch.float32).view(torch.int32) & ~ZERO_BITS
    return (bits | zero.to(torch.int32)).view(torch.float32)


def word_fields(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 scales, int64 zero points) of float32 zp4 words."""
    bits = words.view(torch.int32)
    return (bits & ~ZERO_BITS).view(torch.float32).double(), (bits & ZERO_BITS).to(torch.int64)


def quantize_unsigned(x: torch.Tensor, side: CacheSide, query_dtype: torch.dtype):
    """Codes and stored parameters of float64 rows ``x`` ``[..., heads, head_size]``:
    ``(int64 codes [..., heads, head_size], scales [..., heads], zeros [..., heads] or None)``,
    scales and zeros in the storage dtype (zp4: the words in the scales, zeros None)."""
    top = largest_code(side)
    dtype = storage_dtype(side, query_dtype)
    lo, hi = x.amin(dim=-1), x.amax(dim=-1)
    step = ((hi - lo) / top).clamp_min(SMALLEST_SCALE)
    if side.scale_format == "float32-zp4":
        words = _words(step.to(torch.float32), torch.zeros_like(lo, dtype=torch.int32))
        scale, _ = word_fields(words)
        zero = torch.round(-lo / scale).clamp(0, 15)
        codes = torch.round(x / scale[..., None] + zero[..., None]).clamp(0, top)
        return codes.to(torch.int64), _words(scale, zero), None
    scale = step.to(dtype)
    if side.zero_points == "code":
        zero = (-lo / scale.double()).to(dtype)
        codes = torch.round(x / scale.double()[..., None] + zero.double()[..., None])
    else:
        zero = lo.to(dtype)
        codes = torch.round((x - zero.double()[..., None]) / scale.double()[..., None])
    return codes.clamp(0, top).to(torch.int64), scale, zero


def dequantize_unsigned(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
               side: CacheSide) -> torch.Tensor:
    """float64 values of int64 codes ``[..., head_size]`` with their stored scales and zeros ``[...]``."""
    if side.scale_format == "float32-zp4":
        scale, zero = word_fields(scales)
        return (codes - zero[..., None]).double() * scale[..., None]
    scale, zero = scales.double()[..., None], zeros.double()[..., None]
    if side.zero_points == "code":
        return (codes.double() - zero) * scale
    return codes.double() * scale + zero


def operand_offsets(scales: torch.Tensor, zeros: torch.Tensor | None, side: CacheSide) -> torch.Tensor:
    """float64 ``[...]``: what a stored row's dotted operand, code x scale, adds to each of its values
    (``dequantize_unsigned``'s), per stored scale and zero ``[...]``: zero x scale for zero points in code
    units, -zero for an offset.  A kernel that multiplies the raw codes and subtracts the zero point's
    share afterwards rounds operands of this much more magnitude than the values."""
    if side.scale_format == "float32-zp4":
        scale, zero = word_fields(scales)
        return zero.double() * scale
    if side.zero_points == "code":
        return zeros.double() * scales.double()
    return -zeros.double()


def dequantize_unsigned_rounded(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                       side: CacheSide) -> torch.Tensor:
    """``dequantize_unsigned`` with each operation rounded to the scales' dtype where it is a half-precision one:
    (code - zero), then x scale; or code x scale, then + zero.  Exact (float64) otherwise."""
    dtype = scales.dtype
    if side.scale_format == "float32-zp4" or dtype == torch.float32:
        return dequantize_unsigned(codes, scales, zeros, side)
    scale, zero = scales[..., None], zeros[..., None]
    if side.zero_points == "code":
        return ((codes.to(dtype) - zero) * scale).double()
    return (codes.to(dtype) * scale + zero).double()


# -- dead slots ---------------------------------------------------------------------------

def finite_parameters(uniform: torch.Tensor, bits: torch.Tensor, side: CacheSide, query_dtype: torch.dtype,
                      what: str) -> torch.Tensor:
    """Finite garbage for dead slots' scales (``what`` "scales") or zero points ("zeros"), in the
    storage dtype, from per-entry random streams: scales positive, log-uniform over four decades
    above a live row's (so a dead slot read with a weight moves the output); zeros of either sign
    and up to 10^4; zp4 words a garbage scale with a random zero point."""
    dtype = storage_dtype(side, query_dtype)
    magnitude = torch.pow(10.0, uniform.abs() * 4.0)
    if what == "scales":
        scale = (magnitude / largest_code(side)).to(torch.float32 if side.scale_format == "float32-zp4" else dtype)
        if side.scale_format == "float32-zp4":
            return _words(scale, bits & ZERO_BITS)
        return scale
    return torch.where(uniform < 0, -magnitude, magnitude).to(dtype)


def hostile_zeros(kind: str, bits: torch.Tensor, uniform: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Zero points for poisoned dead slots stored as floats of ``dtype``
    (``case.ZERO_POISON_VALUES``): NaN, +-Inf, the dtype's largest, half to
    all of it either sign, or any bits."""
    big = torch.finfo(dtype).max
    fixed = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "max": big, "zero": 0.0}
    if kind in fixed:
        return torch.full(bits.shape, fixed[kind], dtype=dtype, device=bits.device)
    if kind == "garbage":
        return (torch.sign(uniform) * big * (0.5 + 0.5 * uniform.abs())).clamp(-big, big).to(dtype)
    assert kind == "bits", kind
    width = 8 * dtype.itemsize
    low = bits & ((1 << width) - 1)
    low = torch.where(low >= 1 << (width - 1), low - (1 << width), low)
    return low.to(torch.int16 if width == 16 else torch.int32).view(dtype)


def hostile_zp4(kind: str, bits: torch.Tensor) -> torch.Tensor:
    """4-bit zero points for poisoned dead slots (``case.ZP4_POISON_VALUES``): 15, 8..15, any, or 0."""
    code = {"max": torch.full_like(bits, 15), "garbage": 8 | (bits & 7), "bits": bits & ZERO_BITS,
            "zero": torch.zeros_like(bits)}[kind]
    return code.to(torch.int32)


def with_zero(words: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """zp4 ``words`` with their zero points replaced by int ``zeros`` (0..15), their scales kept."""
    return ((words.view(torch.int32) & ~ZERO_BITS) | zeros.to(torch.int32)).view(torch.float32)
