"""nanfuzz's sliding window in the conventions kernels take it.

nanfuzz's window is W keys, the query's own position included (``Case.sliding_window``;
0 = none): causal, the query at position p reads keys k with ``p - W < k <= p``;
non-causal, ``|p - k| < W``.  Each helper takes a ``Case`` or a ``PagedBatch``.
"""
from __future__ import annotations


def sliding_window(case) -> int:
    """W itself, 0 for none: vLLM's ROCM_ATTN and AITER's ``pa_prefill`` (``sliding_window=W``)."""
    return case.sliding_window


def window_size(case) -> tuple[int, int]:
    """``(left, right)`` keys beside the query: ``(W - 1, 0)`` causal, ``(W - 1, W - 1)`` non-causal,
    ``(-1, -1)`` for none (``unified_attention``'s and FlashAttention's ``window_size``)."""
    w = case.sliding_window
    if w == 0:
        return (-1, -1)
    return (w - 1, 0) if case.causal else (w - 1, w - 1)


def window_left(case) -> int:
    """``W - 1``, the keys a query reads before its own, -1 for none (FlashInfer's ``window_left``,
    a kernel's ``sliding_window_size``).  A kernel whose 0 means "no window" cannot express W = 1:
    declare ``Capabilities(min_window=2)``."""
    return case.sliding_window - 1 if case.sliding_window else -1
