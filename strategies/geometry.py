"""Head, block and dtype geometry: the shapes that break index arithmetic."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from hypothesis import strategies as st

from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.strategies.draws import integers, pick


@dataclass(frozen=True)
class Shape:
    dtype: str
    num_q_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    head_size_v: int = 0  # V's head size where it differs from K's (Geometry.head_size_v)


def head_sizes(pair: tuple[int, int]) -> dict[str, int]:
    """A (K, V) head-size pair as Shape's ``head_size`` and ``head_size_v`` (0 when V is as wide as K)."""
    k, v = pair
    return {"head_size": k, "head_size_v": 0 if v == k else v}


@functools.lru_cache(maxsize=64)
def shapes(caps: Capabilities, *, interpreter: bool = False, max_kv_heads: int = 4):
    """Shrinks toward the first dtype, one KV head, MHA, the smallest head size with V as wide as K,
    the first block size."""
    dtypes = caps.runnable_dtypes(interpreter)
    kv_heads = integers(1, caps.kv_head_limit(max_kv_heads))
    pairs = caps.head_size_pairs()

    @st.composite
    def shape(draw) -> Shape:
        dtype = pick(draw, dtypes)
        num_kv_heads = draw(kv_heads)
        # Query heads per KV head: any integer, so 5/1 and 6/2 (non-powers of two) occur.
        group = draw(integers(1, caps.max_q_heads // num_kv_heads))
        heads = head_sizes(pick(draw, pairs))
        block_size = pick(draw, caps.block_sizes)
        return Shape(dtype, num_kv_heads * group, num_kv_heads, block_size=block_size, **heads)

    return shape()
