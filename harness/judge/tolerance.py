"""How far a correct kernel's output may sit from the float64 oracle, row by row.

The yardstick is a second reference computed in the kernel's own precision
(reference/precision.py): the same gather of live keys, products and sums in
float32 (TF32 operands where the kernel declares them), P rounded to V's
dtype, the output rounded to the kernel's dtype.  Its distance from the
oracle is the error a straightforward kernel in that precision makes on this
very row; a kernel may make a small multiple of it.  For each (token, head)
row, with errors taken as the largest over the head dimension:

    ratio = |out - oracle| / (|reference - oracle| + FLOOR x u x max|oracle|)

where u is the unit roundoff of the row's last rounding (the output dtype's,
or TF32's when float32 products are TF32, or that of the dtype a kernel un-rotates
a rotated cache's output in where it is coarser: vLLM's INT4 cache, bfloat16).  The floor keeps rows that the
reference happens to get exactly (a single live key) from a division by zero
and keeps a kernel that lands one rounding away on such a row within bounds.
A row is MISMATCH when its ratio exceeds BOUND for its arithmetic.

BOUND and FLOOR were chosen from measurement; see CALIBRATION below.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nanfuzz.reference.precision import arithmetic_name

UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32/ieee": 2.0**-24, "float32/tf32": 2.0**-11}

# CALIBRATION.  `python ci/tolerance_survey.py` (ci/README.md) on one H200 (torch 2.11,
# Triton 3.6), with the bound switched off so the whole distribution shows: the worst
# row ratio of every passing example, FLOOR = 0.5, campaigns of --pool 2 x 14 jobs
# (paged_decode fp16: the kernel's own pool of 16).
#
#   arithmetic     kernel (examples)                                      worst ratio
#   float16        paged_decode (10,000) 1.20, unified 1.35, prefix_prefill 1.38,
#                  vllm:triton_attn causal 1.46, vllm:rocm_attn no window (2,000) 1.40
#   bfloat16       paged_decode 1.30, unified 1.36, prefix_prefill 1.46,
#                  vllm:triton_attn 1.52, vllm:rocm_attn (2,000) 1.29
#   float32/ieee   paged_decode 5.24, unified 4.80, prefix_prefill 5.45
#   float32/tf32   vllm:triton_attn 4.62, vllm:rocm_attn (2,000) 4.49
#
# 99.9% of examples stay at or below 1.42 (fp16, bf16) and 4.0 (fp32; 4.5 and 5.2 in rocm_attn's
# 2,000 and paged_decode's).  Under Triton's interpreter (2-core CPU, 60 examples per kernel) the worst seen
# is lower: 0.8 (fp16) and 3.3 (fp32).  fp32 ratios are larger because the reference's
# float32 error is a few units of 2**-24 that exp() and summation order shift by several;
# the fp32 errors a bound must catch sit at 1e3x and more, so those bounds are about
# twice the worst seen.  fp16/bf16 trade margin for sensitivity: one row x 1.01 in bf16
# (2.6 units of 2**-8) is 4-6x on a row of one key but 1.9-3.3x on rows of many, so
# their bound sits at 1.6x the worst seen rather than 2x.
BOUND = {"float16": 2.5, "bfloat16": 2.5, "float32/ieee": 12.0, "float32/tf32": 10.0}
FLOOR = 0.5
# A rotated cache's row un-rotated through a coarser dtype (vLLM's INT4 cache: bfloat16 on GPUs) carries
# a rounding of that dtype in each entry and, through the inverse rotation, a sum of the roundings of
# the rotated output's: the reference's row is a sample of the same errors, as often small by chance as
# the kernel's is large, so the floor takes one whole rounding of that dtype.  A plain-torch kernel
# with INT4's GPU arithmetic against the float16 reference (3,103 rows; tests/quantized_subjects.py's
# "bf16-rotations") came to 1.76x at worst with this floor, 2.42x with FLOOR's half.
ROTATION_FLOOR = 1.0


@dataclass(frozen=True)
class RowErrors:
    """Per (token, head) row, all ``[num_tokens, num_q_heads]`` float64: the kernel's
    error, the same-precision reference's error, the ratio's denominator (the
    reference's error plus the floor) and the ratio itself (inf where the output
    is not finite)."""

    arithmetic: str
    kernel: torch.Tensor
    reference: torch.Tensor
    denominator: torch.Tensor
    ratio: torch.Tensor

    @property
    def bound(self) -> float:
        return BOUND[self.arithmetic]

    def off(self) -> torch.Tensor:
        """Rows beyond the bound."""
        return self.ratio > self.bound

    def allowed_change(self) -> torch.Tensor:
        """How far two launches' rows may differ when each is within the bound (twice the
        bound's width, by the triangle inequality), ``[tokens, heads, 1]``."""
        return (2 * self.bound * self.denominator)[..., None]


def effective_precision(precision: str, interpreter: bool) -> str:
    """Triton's interpreter multiplies float32 in plain IEEE whatever the kernel asks for."""
    return "ieee" if interpreter else precision


def row_errors(result: torch.Tensor, oracle: torch.Tensor, reference: torch.Tensor,
               dtype: str, precision: str, rotation_dtype: str | None = None) -> RowErrors:
    """``result``, ``oracle`` and ``reference`` are float64 ``[tokens, heads, head_size]``;
    ``rotation_dtype``: what a rotated cache's output is un-rotated in, where the case has one."""
    name = arithmetic_name(dtype, precision)
    kernel_error = (result - oracle).abs().nan_to_num(float("inf")).amax(dim=-1)
    reference_error = (reference - oracle).abs().amax(dim=-1)
    scale = oracle.abs().amax(dim=-1)
    floor = FLOOR * UNIT_ROUNDOFF[name]
    if rotation_dtype:
        floor = max(floor, ROTATION_FLOOR * UNIT_ROUNDOFF[rotation_dtype])
    denominator = reference_error + floor * scale
    denominator = denominator.clamp_min(torch.finfo(torch.float64).tiny)
    return RowErrors(name, kernel_error, reference_error, denominator, kernel_error / denominator)
