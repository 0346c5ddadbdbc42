"""Quantized KV caches: unquantized, fp8 with per-tensor scales, per-token-head scales, or a kernel's
own formats (zero points, packed codes, rotations)."""
from __future__ import annotations

import functools

from hypothesis import strategies as st

from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.case import KVCache

# Per-tensor scales: 1 (vLLM's default when a checkpoint brings none), or any
# float32 from "calibrated" (the largest |value| near the largest code) to a
# few times 1 (most values land on small codes and subnormals).
DRAWN_SCALE_RANGE = (2.0 ** -10, 4.0)


@functools.lru_cache(maxsize=1)
def per_tensor_scales():
    """Shrinks toward 1."""
    return st.one_of(st.just(1.0), st.floats(*DRAWN_SCALE_RANGE, width=32))


def kv_cache_options(caps: Capabilities) -> list[tuple[str, bool] | KVCache]:
    """Every cache ``caps`` takes, in shrinking order: (cache dtype, per-token-head?) for
    unquantized, then per-tensor, then per-token-head scales; then each of ``cache_formats``
    (zero points, packed codes, rotations: the cache itself)."""
    options: list = [(d, False) for d in caps.kv_cache_dtypes if d == "auto"]
    options += [(d, False) for d in caps.kv_cache_dtypes if d != "auto"]
    options += [(d, True) for d in caps.token_head_dtypes]
    return options + list(caps.cache_formats)


@functools.lru_cache(maxsize=256)
def kv_caches(caps: Capabilities, fixed: tuple[str, bool] | KVCache | None = None):
    """A cache ``caps`` takes (or the ``fixed`` dtype and scale mode, drawing only its scales).

    Shrinks toward no quantization, then per-tensor scales (the first dtype,
    scales of 1), then per-token-head scales, then the kernel's other formats
    in its order (a format is drawn whole: its scales and zero points are the
    seeded data's).  The scales are drawn whatever the cache, so that a shrink
    from one cache to a simpler one changes a single choice.
    """
    options = [fixed] if fixed is not None else kv_cache_options(caps)
    assert options, "a kernel must take some KV cache (Capabilities.kv_cache_dtypes / token_head_dtypes / cache_formats)"
    if options == [("auto", False)]:
        return st.just(KVCache())
    if len(options) == 1 and isinstance(options[0], KVCache):
        return st.just(options[0])
    return st.builds(_cache, st.sampled_from(options), per_tensor_scales(), per_tensor_scales())


def _cache(option: tuple[str, bool] | KVCache, k_scale: float, v_scale: float) -> KVCache:
    if isinstance(option, KVCache):
        return option
    dtype, token_head = option
    if dtype == "auto":
        return KVCache()
    return KVCache(dtype, "token-head") if token_head else KVCache(dtype, "tensor", k_scale, v_scale)
