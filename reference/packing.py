"""Sub-byte codes: how a head's codes share the bytes of its cache row.

A (slot, head) row of ``head_size`` codes of ``bits`` bits each takes
``ceil(head_size x bits / 8)`` bytes (``case.CacheSide.row_bytes``):

- "interleaved": the codes as one little-endian bit string, code i in bits
  ``[i x bits, (i + 1) x bits)``; for 4 bits, byte j holds code 2j in its low
  nibble and code 2j + 1 in its high one (vLLM's INT4 cache, TurboQuant's
  values); for 3 bits a code may straddle two bytes;
- "halves" (4 bits): byte j holds code j in its low nibble and code
  j + head_size / 2 in its high one (lmdeploy's int4 cache).

Bits past the last code of a row (an odd head of 4-bit codes, most heads of
3-bit ones) are 0 in a live row.  8-bit codes are one a byte, unpacked.
"""
from __future__ import annotations

import torch


def row_bytes(head_size: int, bits: int) -> int:
    return -(-head_size * bits // 8)


def _positions(head_size: int, bits: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each code's byte and bit shift in an interleaved row."""
    offset = torch.arange(head_size, device=device, dtype=torch.int64) * bits
    return offset // 8, offset % 8


def pack_codes(codes: torch.Tensor, bits: int, packing: str) -> torch.Tensor:
    """uint8 ``[..., row_bytes]`` of int64 codes ``[..., head_size]`` in ``[0, 2**bits)``."""
    head_size = codes.shape[-1]
    codes = codes.to(torch.int64)
    if bits == 8:
        return codes.to(torch.uint8)
    if packing == "halves":
        assert bits == 4 and head_size % 2 == 0, (bits, head_size)
        half = head_size // 2
        return (codes[..., :half] | (codes[..., half:] << 4)).to(torch.uint8)
    byte, shift = _positions(head_size, bits, codes.device)
    width = row_bytes(head_size, bits)
    word = codes << shift                      # < 2**15: a code spills at most into the next byte
    out = torch.zeros(*codes.shape[:-1], width + 1, dtype=torch.int64, device=codes.device)
    out.index_add_(-1, byte, word & 0xFF)      # the codes' bit ranges do not overlap: adding is OR
    out.index_add_(-1, byte + 1, word >> 8)
    return out[..., :width].to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, packing: str, head_size: int) -> torch.Tensor:
    """int64 codes ``[..., head_size]`` of a uint8 row ``[..., row_bytes]``."""
    data = packed.to(torch.int64)
    if bits == 8:
        return data
    if packing == "halves":
        return torch.cat((data & 0xF, data >> 4), dim=-1)
    byte, shift = _positions(head_size, bits, data.device)
    padded = torch.nn.functional.pad(data, (0, 1))  # a code in the row's last byte reads one byte past it
    word = padded[..., byte] | (padded[..., byte + 1] << 8)
    return (word >> shift) & ((1 << bits) - 1)
