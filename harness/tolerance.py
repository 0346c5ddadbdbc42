"""How far a correct kernel's output may sit from the float64 oracle.

The oracle reads the same rounded inputs as the kernel, so the error is the
kernel's own arithmetic: P (in [0, 1]) rounded to the dtype before ``P @ V``
(vLLM's kernels and ours do this), fp32 accumulation, and the final rounding
of the output; V and the output lie in [-1, 1].  A fp32 ``tl.dot`` runs as
tf32 on NVIDIA and AMD matrix units (10-bit mantissa), so fp32 is held to a
tf32 bound, not to fp32 epsilon.

atol = 8 x unit roundoff of the rounding that dominates: 8 x 2**-11 (fp16),
8 x 2**-8 (bf16), 8 x 2**-11 (tf32); rtol = 2 x unit roundoff.  The factor 8
covers the two roundings of P and of the output plus the accumulated error of
scores that feed exp().  Checked against use: the built-in fixed kernels pass
10,000 GPU examples each (fp16, bf16, fp32) and every CPU campaign under it,
with largest errors near 3e-4 in fp16 and 2e-7 in fp32.  A semantic
bug (a key too many or too few, a wrong head) moves the output by about
|v - out| / n_keys, which on fuzz-sized batches is far above these bounds.
"""
from __future__ import annotations

import torch

ATOL = {"float16": 8 * 2.0**-11, "bfloat16": 8 * 2.0**-8, "float32": 8 * 2.0**-11}
RTOL = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-10}


def allowed_error(reference: torch.Tensor, dtype: str) -> torch.Tensor:
    return ATOL[dtype] + RTOL[dtype] * reference.abs()
