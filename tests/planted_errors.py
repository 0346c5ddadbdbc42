"""Plain-torch kernels that are exact up to rounding, then plant a small error.

The exact part is the float64 oracle's own gather of live keys, rounded to
the case's dtype: a perfect kernel.  Each planted error is one a real kernel
could make and that NaN poisoning cannot see; MISMATCH must catch each one
(tests/test_tolerance.py).  Every kernel sits at an import path so that a
supervised worker can rebuild it.
"""
from __future__ import annotations

import torch

from nanfuzz.harness.kernel import Kernel
from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.oracle import oracle
from tests.torch_kernels import attention

ALL = ("float16", "bfloat16", "float32")


def _caps(*dtypes: str) -> Capabilities:
    # plain torch compiles nothing per case: a GPU campaign draws freely (specialisation_pool=0)
    return Capabilities(dtypes=dtypes, interpreter_dtypes=dtypes, non_causal=True, sinks=True, precision="ieee",
                        specialisation_pool=0)


def _exact(batch, out, factor=None, rows=None, noise=None):
    exact = oracle(batch)
    if noise is not None and exact.numel():
        generator = torch.Generator().manual_seed(batch.case.data_seed)
        exact = exact * (1 + noise * torch.randn(exact.shape, generator=generator, dtype=torch.float64).to(exact.device))
    if factor is not None:
        if rows is None:
            exact = exact * factor
        elif exact.numel():
            exact[rows] *= factor
    out.copy_(exact.to(out.dtype))
    return out


# Rows of sequences this long are off by 1%, shorter rows by 1% x length / LONG_ROW: an error that grows
# with the row, as a sum kept in bfloat16 does.  Under the interpreter only the longest sequences of
# 64-slot blocks (5 blocks) are this long; 1% is some 3 to 6 times the bfloat16 reference's error.
LONG_ROW = 320


def _long_rows(batch, out):
    """Exact but for the error on long rows (``LONG_ROW``)."""
    exact = oracle(batch)
    lengths = torch.tensor([s.seq_len for s in batch.case.sequences for _ in range(s.query_len)],
                           dtype=torch.float64, device=exact.device)
    error = 0.01 * (lengths / LONG_ROW).clamp(max=1.0)
    out.copy_((exact * (1 + error)[:, None, None]).to(out.dtype))
    return out


def _kernel(attr: str, run, dtypes=ALL) -> Kernel:
    return Kernel(name=f"planted@{attr.replace('_', '-')}", run=run, capabilities=_caps(*dtypes),
                  expect="pass" if attr == "exact" else "caught", spec=f"tests.planted_errors:{attr}")


exact = _kernel("exact", lambda b, o: _exact(b, o))
fp32_noise = _kernel("fp32_noise", lambda b, o: _exact(b, o, noise=1e-3), ("float32",))
bf16_row = _kernel("bf16_row", lambda b, o: _exact(b, o, factor=1.01, rows=(0, 0)), ("bfloat16",))
fp16_row = _kernel("fp16_row", lambda b, o: _exact(b, o, factor=1.01, rows=(0, 0)), ("float16",))
fp32_scaled = _kernel("fp32_scaled", lambda b, o: _exact(b, o, factor=1.004), ("float32",))
bf16_long_rows = _kernel("bf16_long_rows", _long_rows, ("bfloat16",))
softmax_scale = _kernel("softmax_scale", lambda b, o: attention(b, o, scale_factor=1.01))
dropped_key = _kernel("dropped_key", lambda b, o: attention(b, o, bug="drop-key"))

PLANTED = (fp32_noise, bf16_row, fp16_row, fp32_scaled, softmax_scale, dropped_key)
