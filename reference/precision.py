"""The arithmetic a reference computes in: float64 for the oracle, or the kernel's own.

A paged-attention kernel reads q, K and V in its dtype, multiplies them in
``tl.dot`` with float32 accumulation, keeps the softmax state in float32,
rounds P to V's dtype before ``P @ V`` and rounds the output to its dtype.
For float32 inputs ``tl.dot`` runs as TF32 on GPU matrix units unless the
kernel asks for ``input_precision="ieee"``: the operands keep 10 mantissa
bits.  :func:`same_precision` is that recipe, computed plainly, and its
distance from the float64 oracle is the error a straightforward kernel in
that precision makes: the yardstick for MISMATCH (see harness/judge/tolerance.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from nanfuzz.reference.case import PRECISIONS
from nanfuzz.reference.materialize import TORCH_DTYPES


def round_to_tf32(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` rounded to 10 mantissa bits (nearest, ties to even), as float32.
    Finite inputs only: the references never see a dead slot."""
    bits = x.contiguous().view(torch.int32)
    bits = (bits + 0xFFF + ((bits >> 13) & 1)) & ~0x1FFF
    return bits.view(torch.float32)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


@dataclass(frozen=True)
class Arithmetic:
    """``name`` labels the yardstick in evidence ("bfloat16", "float32/tf32").
    ``accumulate`` is the dtype of every sum and of the softmax state;
    ``operand`` rounds a ``tl.dot`` operand (q, K, V and P, already in the
    accumulate dtype); ``probabilities`` rounds P before ``P @ V``; ``output``
    rounds the result."""

    name: str
    accumulate: torch.dtype
    operand: Callable[[torch.Tensor], torch.Tensor] = _identity
    probabilities: Callable[[torch.Tensor], torch.Tensor] = _identity
    output: Callable[[torch.Tensor], torch.Tensor] = _identity
    # A rotated cache (reference.rotation): what rounds q before and after its rotation, and the
    # output before and after the rotation is undone.
    rotation: Callable[[torch.Tensor], torch.Tensor] = _identity
    # Unsigned codes with half-precision scales are dequantized in the scales' dtype
    # (reference.asymmetric.dequantize_rounded), as a kernel multiplying by them does.
    dequantize_rounded: bool = False


FLOAT64 = Arithmetic("float64", torch.float64)


def _rounder(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    def round_(x: torch.Tensor) -> torch.Tensor:
        return x.to(dtype).to(torch.float32)
    return round_


def arithmetic_name(dtype: str, precision: str) -> str:
    """The yardstick's name: the dtype, and for float32 how products are taken."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not one of {PRECISIONS}")
    return f"float32/{precision}" if dtype == "float32" else dtype


def same_precision(dtype: str, precision: str, rotation_dtype: str | None = None) -> Arithmetic:
    """The arithmetic of a straightforward kernel reading ``dtype`` and multiplying
    float32 as ``precision`` says ("ieee" or "tf32"); a rotated cache's q and output
    are rotated in ``rotation_dtype`` (None: ``dtype``)."""
    name = arithmetic_name(dtype, precision)
    rotation = _rounder(TORCH_DTYPES[rotation_dtype or dtype]) if (rotation_dtype or dtype) != "float32" else _identity
    if dtype == "float32":
        rounding = round_to_tf32 if precision == "tf32" else _identity
        return Arithmetic(name, torch.float32, operand=rounding, probabilities=rounding, rotation=rotation,
                          dequantize_rounded=True)
    # fp16 x fp16 and bf16 x bf16 products are exact in float32: only P and the output round.
    to_dtype = _rounder(TORCH_DTYPES[dtype])
    return Arithmetic(name, torch.float32, operand=to_dtype, probabilities=to_dtype, output=to_dtype,
                      rotation=rotation, dequantize_rounded=True)
