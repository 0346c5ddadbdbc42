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


@functools.lru_cache(maxsize=64)
def shapes(caps: Capabilities, *, interpreter: bool = False, max_kv_heads: int = 4):
    """Shrinks toward the first dtype, one KV head, MHA, the smallest head size, the first block size."""
    dtypes = caps.runnable_dtypes(interpreter)
    kv_heads = integers(1, caps.kv_head_limit(max_kv_heads))
    head_sizes = tuple(sorted(caps.head_sizes))

    @st.composite
    def shape(draw) -> Shape:
        dtype = pick(draw, dtypes)
        num_kv_heads = draw(kv_heads)
        # Query heads per KV head: any integer, so 5/1 and 6/2 (non-powers of two) occur.
        group = draw(integers(1, caps.max_q_heads // num_kv_heads))
        head_size = pick(draw, head_sizes)
        block_size = pick(draw, caps.block_sizes)
        return Shape(dtype, num_kv_heads * group, num_kv_heads, head_size, block_size)

    return shape()
