"""Plain-torch attention reading the paged cache through a flat list of page ids.

FlashInfer's paged layout: request i's keys are the pages ``kv_indices[kv_indptr[i]:kv_indptr[i + 1]]``
of the cache viewed as ``[num_pages, page_size, num_kv_heads, head_size]``, the last page holding
``kv_last_page_len[i]`` keys, and the window comes as ``window_size = (left, right)``.  Any query
length, causal or not, windows, sinks.  The kernel gathers each request's keys from its pages and
keeps only the keys each query may read before any arithmetic, so no dead slot meets a product.
"""
from __future__ import annotations

import torch

from nanfuzz import Capabilities, Kernel, scheduled, token_indices, window_size


def paged_attention(q, key_pages, value_pages, out, query_start_loc, kv_indptr, kv_indices, kv_last_page_len,
                    sm_scale: float, causal: bool, window: tuple[int, int], sinks=None) -> None:
    """The kernel's own API; ``query_start_loc`` gives each request's rows of ``q`` and ``out``."""
    page_size, kv_heads = key_pages.shape[1], key_pages.shape[2]
    groups = q.shape[1] // kv_heads
    left, right = window
    for i in range(kv_indptr.numel() - 1):
        pages = kv_indices[kv_indptr[i]:kv_indptr[i + 1]].long()
        seq_len = (pages.numel() - 1) * page_size + int(kv_last_page_len[i]) if pages.numel() else 0
        k = key_pages[pages].flatten(0, 1)[:seq_len].float()     # (seq_len, kv_heads, head_size)
        v = value_pages[pages].flatten(0, 1)[:seq_len].float()
        rows = slice(int(query_start_loc[i]), int(query_start_loc[i + 1]))
        query = q[rows].float()
        positions = torch.arange(seq_len - query.shape[0], seq_len, device=q.device)
        keys = torch.arange(seq_len, device=q.device)
        distance = positions[:, None] - keys[None, :]
        allowed = torch.ones_like(distance, dtype=torch.bool)
        if causal:
            allowed &= distance >= 0
        if left >= 0:
            allowed &= distance <= left
        if right >= 0:
            allowed &= -distance <= right
        for t in range(query.shape[0]):
            chosen = allowed[t].nonzero().flatten()  # gather the allowed keys: never mask-and-multiply
            for h in range(q.shape[1]):
                kv = h // groups
                scores = (k[chosen, kv] @ query[t, h]) * sm_scale
                top = scores.max()
                if sinks is not None:
                    top = torch.maximum(top, sinks[h])
                weights = torch.exp(scores - top)
                total = weights.sum() + (torch.exp(sinks[h] - top) if sinks is not None else 0.0)
                out[rows.start + t, h] = ((weights @ v[chosen, kv]) / total).to(out.dtype)


CAPABILITIES = Capabilities(
    dtypes=("float16", "bfloat16", "float32"),
    interpreter_dtypes=("float16", "bfloat16", "float32"),  # plain torch: no Triton arithmetic to lack bfloat16
    causal=True,
    non_causal=True,
    sliding_window=True,
    sinks=True,
    precision="ieee",
    specialisation_pool=0,  # nothing compiles per case
)


def run(batch, out):
    g = batch.case.geometry
    index = token_indices(batch, page_size=g.block_size, keys="all")  # one page per block
    key_pages = batch.key_cache.view(-1, g.block_size, g.num_kv_heads, g.head_size)
    value_pages = batch.value_cache.view(-1, g.block_size, g.num_kv_heads, g.head_size)
    paged_attention(batch.q, key_pages, value_pages, out, scheduled(batch).query_start_loc, index.kv_indptr,
                    index.kv_indices, index.kv_last_page_len, batch.scale, batch.causal, window_size(batch),
                    batch.sinks)
    return out


kernel = Kernel("contract@flat-pages", run, CAPABILITIES, spec="tests.contract_adapters.flat_pages:kernel")
