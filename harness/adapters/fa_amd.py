"""FlashAttention's AMD Triton backend as nanfuzz kernels: ``fa_amd:kvcache`` and its variant.

``flash_attn_with_kvcache`` (``flash_attn_interface.py``) is FlashAttention's KV-cache
entry point; on ROCm with ``FLASH_ATTENTION_TRITON_AMD_ENABLE=TRUE`` it calls
``interface_fa.fwd_kvcache`` of the AMD Triton backend, which runs the split-K decode
kernel of ``fwd_decode.py`` (``_fwd_kernel_splitK`` and ``_splitK_reduce``) for every
query length.  The adapters make the call ``flash_attn_with_kvcache`` makes (its
arguments in its order; no new k/v to append, no rotary embedding), on the scheduled
sequences: one query length for the batch (``q`` is ``[batch, seqlen_q, heads, d]``),
``cache_seqlens`` the sequence lengths, the window as ``window_size`` (left, right) and
causal attention aligned to the bottom right, as FlashAttention's API defines them.

``fa_amd:kvcache``
    A paged cache: ``k_cache``/``v_cache`` the canonical ``[num_blocks, block_size,
    heads, d]`` caches and ``block_table`` the table, with ``page_block_size`` 256 (the
    API requires a multiple of 256).

``fa_amd:kvcache@contiguous``
    A cache of ``[batch, seqlen_cache, heads, d]``, no table: each sequence's blocks
    gathered in table order, padding entries and dead slots included (so their poison
    survives), any block size.

The capabilities are the API's (windows, causal or not, a paged block of 256): in
2.8.3.post2 ``fwd_kvcache`` hands neither ``block_table`` nor the window to its kernel,
which addresses the cache as ``[batch, seqlen]``, and the kernel's key mask forgets the
tile's start; those findings are on file in ``tests/regressions/``.

The backend's ``varlen_fwd`` takes a ``block_table_`` too but never reads it, and its
``check_args`` asserts that ``k`` has the query's three dimensions, so a paged cache
never reaches a kernel there: it has no adapter.
"""
from __future__ import annotations

import functools

import torch

from nanfuzz.harness.adapters import fa_loader
from nanfuzz.harness.kernel import Kernel
from nanfuzz.reference.batch import PagedBatch
from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.errors import NanfuzzError
from nanfuzz.reference.layouts import scheduled
from nanfuzz.reference.windows import window_size

NAME = "fa_amd:kvcache"
KERNEL_NAMES = (NAME,)
VARIANTS = (f"{NAME}@contiguous",)
# flash_attn_with_kvcache: "page_block_size must be a multiple of 256"
PAGED_BLOCK_SIZES = (256,)
# The decode kernel pads head sizes to a power of two (get_padded_headsize); FlashAttention takes up to 256.
HEAD_SIZES = (32, 64, 80, 96, 128, 256)
# One compile per head count, head size, causality and query length (tl.constexpr): a GPU campaign covers this many.
POOL = 16
VARLEN_NOTE = ("varlen_fwd: no kernel; it never reads block_table_, and its check_args asserts that k has the "
               "query's three dimensions, so a paged cache never reaches a kernel")

CAPABILITIES = Capabilities(
    dtypes=("float16", "bfloat16"),  # FlashAttention's
    head_sizes=HEAD_SIZES,
    block_sizes=PAGED_BLOCK_SIZES,
    causal=True,
    non_causal=True,
    sliding_window=True,             # the API's window_size: (W - 1, 0) causal, (W - 1, W - 1) not
    non_causal_window=True,
    uniform_query_len=True,          # q is [batch, seqlen_q, heads, d]
    specialisation_pool=POOL,
)
CONTIGUOUS_CAPABILITIES = CAPABILITIES.restrict(block_sizes=Capabilities().block_sizes)


def contiguous_cache(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``[blocks, B, H, D]`` and an int32 table ``[n, width]`` -> ``[n, width * B, H, D]``: each row's
    blocks in table order, copied whole (dead slots and padding entries included).

    The copy is a view into a NaN allocation one block of slots wider per row and one row longer,
    as every tensor nanfuzz hands a kernel is (``reference.redzones``): a kernel that reads past a
    row reads NaN on every run, not whatever memory follows the copy."""
    blocks, block_size, heads, head_size = cache.shape
    rows, width = table.shape
    base = torch.full((rows + 1, (width + 1) * block_size, heads, head_size), float("nan"), dtype=cache.dtype,
                      device=cache.device)
    view = base[:rows, :width * block_size]
    view.copy_(cache[table.long()].reshape(rows, width * block_size, heads, head_size))
    return view


def run_kvcache(batch: PagedBatch, out: torch.Tensor, *, paged: bool = True, source: str | None = None
                ) -> torch.Tensor:
    case = batch.case
    g = case.geometry
    loaded = fa_loader.load("kvcache", source)
    fwd_kvcache = loaded["interface_fa"].fwd_kvcache
    kept = scheduled(batch)
    if not kept:
        return out
    batch_size, seqlen_q = len(kept), kept.max_query_len
    q = batch.q.view(batch_size, seqlen_q, g.num_q_heads, g.head_size)
    o = out.view(batch_size, seqlen_q, g.num_q_heads, g.head_size)
    if paged:
        k_cache, v_cache, block_table = batch.key_cache, batch.value_cache, kept.block_table
    else:
        k_cache = contiguous_cache(batch.key_cache, kept.block_table)
        v_cache = contiguous_cache(batch.value_cache, kept.block_table)
        block_table = None
    left, right = window_size(case)
    with loaded.active():
        # flash_attn_with_kvcache's call: q, k_cache, v_cache, k, v, cache_seqlens, rotary_cos, rotary_sin,
        # cache_batch_idx, cache_leftpad, block_table, alibi_slopes, out, softmax_scale, causal,
        # window_size_left, window_size_right, softcap, rotary_interleaved, num_splits
        fwd_kvcache(q, k_cache, v_cache, None, None, kept.seq_lens, None, None, None, None, block_table, None, o,
                    case.scale, case.causal, left, right, 0.0, False, 0)
    return out


def notes(loaded) -> tuple[str, ...]:
    """What ``nanfuzz list`` says beside the capabilities: modules replaced here, and the varlen path."""
    left_out = tuple(f"{name}: a placeholder, it does not import here ({why})" for name, why in loaded.left_out.items())
    return (*left_out, VARLEN_NOTE)


def kernel(name: str, source: str | None = None) -> Kernel:
    """``fa_amd:kvcache`` (or ``@contiguous``), with the backend's files from ``source`` (an unpacked
    flash-attn source distribution or checkout; None: the installed flash_attn)."""
    if name not in (*KERNEL_NAMES, *VARIANTS):
        raise NanfuzzError(f"unknown FlashAttention kernel {name!r}; known: {', '.join((*KERNEL_NAMES, *VARIANTS))}")
    loaded = fa_loader.load("kvcache", source)
    paged = name == NAME
    return Kernel(name=name, run=functools.partial(run_kvcache, paged=paged, source=source),
                  capabilities=CAPABILITIES if paged else CONTIGUOUS_CAPABILITIES, source=source, notes=notes(loaded))
