"""Head, block and dtype geometry: the shapes that break index arithmetic."""
from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from nanfuzz.reference.capabilities import Capabilities


@dataclass(frozen=True)
class Shape:
    dtype: str
    num_q_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int


@st.composite
def shapes(draw, caps: Capabilities, *, interpreter: bool = False, max_kv_heads: int = 4) -> Shape:
    """Shrinks toward the first dtype, one KV head, MHA, the smallest head size, the first block size."""
    dtypes = caps.runnable_dtypes(interpreter)
    dtype = draw(st.sampled_from(dtypes))
    num_kv_heads = draw(st.integers(1, min(max_kv_heads, caps.max_q_heads)))
    # Query heads per KV head: any integer, so 5/1 and 6/2 (non-powers of two) occur.
    group = draw(st.integers(1, caps.max_q_heads // num_kv_heads))
    head_size = draw(st.sampled_from(sorted(caps.head_sizes)))
    block_size = draw(st.sampled_from(caps.block_sizes))
    return Shape(dtype, num_kv_heads * group, num_kv_heads, head_size, block_size)
