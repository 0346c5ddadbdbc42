"""SGLang's Triton attention kernels as nanfuzz kernels, called as ``triton_backend.py`` calls them.

SGLang indexes KV tokens, not blocks: a request's keys are the flat slots
``kv_indices[kv_indptr[i]:kv_indptr[i + 1]]`` of the token pool, the cache viewed as
``[num_blocks * block_size, num_kv_heads, head_size]``.  The adapters build them from
the block table (``nanfuzz.token_indices``), and hand them in a buffer longer than the
batch's keys whose entries past the last request hold slots of the padding block, dead
and poisoned, as the preallocated CUDA-graph buffers of SGLang's backend hold stale
entries.  With a sliding window the backend lists only the window's keys (its
``window_kv_indptr``/``window_kv_indices``), and so do the adapters.  The kernels take
``page_size`` for their address arithmetic (the indices stay token slots): 1, or the
block size (a paged token pool); the adapters choose by the case's data seed (odd:
the block size), and ``@page1`` / ``@paged`` pin the choice.

``sglang:decode``
    ``decode_attention_fwd``: one query per request, its MHA kernel (one KV head per
    query head) or its grouped kernel (GQA), split-KV partitions merged by a second
    kernel.  Each request gets its own split count (``num_kv_splits``, from 1 to the
    backend's default ``max_kv_splits`` of 8), drawn from the data seed; the split scratch
    starts as NaN.  Sinks as the backend passes them.  ``@mla`` hands the grouped kernel
    an MLA latent cache (``has_mla``: V is the K tile it loaded).

``sglang:extend``
    ``extend_attention_fwd``: new tokens (prefill, chunked prefill, or one token) over a
    prefix of cached keys, causal or not, with a sliding window, sinks, and the new
    tokens' K/V handed apart (``k_extend``/``v_extend``, also in the cache).  The
    prefix is each request's live context keys; the window goes in as
    ``sliding_window_size = W - 1`` (SGLang's exclusive window: keys ``q - k <= W - 1``),
    which cannot say W = 1.  ``@custom-mask`` hands the allowed set as SGLang's speculative
    verify does, a ``custom_mask`` of ``[query_len, seq_len]`` per request with
    ``mask_indptr`` and ``window_kv_offsets``.
"""
from __future__ import annotations

import functools
import inspect
import random

import torch

from nanfuzz.harness.adapters import sglang_loader
from nanfuzz.harness.kernel import Kernel
from nanfuzz.reference.batch import PagedBatch
from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.case import Case
from nanfuzz.reference.errors import NanfuzzError
from nanfuzz.reference.layouts import scheduled, token_indices
from nanfuzz.reference.semantics import allowed_mask
from nanfuzz.reference.windows import window_left

DECODE, EXTEND = "sglang:decode", "sglang:extend"
KERNEL_NAMES = (DECODE, EXTEND)
PAGES = ("page1", "paged")
VARIANTS = (*(f"{DECODE}@{v}" for v in (*PAGES, "mla")), *(f"{EXTEND}@{v}" for v in (*PAGES, "custom-mask")))
# The backend's default --triton-attention-num-kv-splits: split scratch has this many partitions.
MAX_KV_SPLITS = 8
# Both kernels compile per head count, head and block size (PAGE_SIZE), window, causality,
# sinks and (decode) MLA (tl.constexpr): a GPU campaign covers this many.
POOL = 16
# head sizes with a power-of-two tile (the rest padded and masked), and 80 for a padded one
HEAD_SIZES = (64, 128, 80, 256)

DECODE_CAPABILITIES = Capabilities(
    head_sizes=HEAD_SIZES,
    max_query_len=1,
    causal=True,
    sliding_window=True,   # the backend lists the window's keys
    sinks=True,
    specialisation_pool=POOL,
)
# The grouped kernel splits a latent row as 512 + 64 or 256 + 32 only (BLOCK_DMODEL / BLOCK_DPE):
# other widths tile V past its rank, which its P @ V cannot take.
MLA_CAPABILITIES = DECODE_CAPABILITIES.restrict(mla=((512, 64), (256, 32)), sliding_window=False, sinks=False,
                                                dtypes=("float16", "bfloat16"))
EXTEND_CAPABILITIES = Capabilities(
    head_sizes=HEAD_SIZES,
    causal=True,
    non_causal=True,
    sliding_window=True,
    non_causal_window=True,
    min_window=2,          # sliding_window_size = W - 1, and 0 means none
    sinks=True,
    specialisation_pool=POOL,
)


# What ``nanfuzz list`` says each entry point leaves out.
DECODE_NOTES = ("the Lean (persistent, work-stealing) decode ROCm takes for long sequences: not driven (it needs "
                "the backend's lean_* buffers and seqlen gate)",)
EXTEND_NOTES = ("extend_attention_fwd_unified and the dense fp8 prefill (dense_prefill_attention_fwd): not driven",)


def page_size(case: Case, page: str | None) -> int:
    """The ``page_size`` the kernels get: 1, the block size, or (None) by the case's data seed."""
    if page is None:
        page = "paged" if case.data_seed % 2 else "page1"
    return case.geometry.block_size if page == "paged" else 1


def capacity(batch: PagedBatch) -> int:
    """The index buffer's length: every scheduled request's whole table, as a CUDA-graph buffer
    sized for the longest context holds, so entries past the batch's keys are dead."""
    case = batch.case
    requests = sum(1 for s in case.sequences if s.query_len)
    return requests * case.table_width * case.geometry.block_size


def split_counts(case: Case, requests: int, device) -> torch.Tensor:
    """int32 ``[requests]``: each request's ``num_kv_splits``, from the data seed."""
    rng = random.Random(f"nanfuzz-sglang-splits:{case.data_seed}")
    return torch.tensor([rng.randint(1, MAX_KV_SPLITS) for _ in range(requests)], dtype=torch.int32, device=device)


def _token_pool(cache: torch.Tensor) -> torch.Tensor:
    """``[blocks, block_size, heads, d]`` (a view of its allocation) as the token pool ``[slots, heads, d]``."""
    return cache.flatten(0, 1)


def _keywords(function, **wanted) -> dict:
    """The ``wanted`` keywords the function takes (an earlier release lacks some; ``kernel`` declares
    no more than its entry point takes)."""
    taken = inspect.signature(function).parameters
    return {name: value for name, value in wanted.items() if name in taken}


def _declared(caps: Capabilities, entry, name: str, page: str | None) -> Capabilities:
    """``caps`` within what ``entry`` (this tree's entry point) takes: no sinks without ``sinks``;
    a paged token pool needs ``page_size``."""
    taken = inspect.signature(entry).parameters
    if page == "paged" and "page_size" not in taken:
        raise NanfuzzError(f"{name}: this SGLang's {entry.__name__}() takes no page_size (nanfuzz drives "
                           f"SGLang {sglang_loader.TESTED_VERSION}'s); use the kernel without @paged")
    return caps if "sinks" in taken else caps.restrict(sinks=False)


# -- sglang:decode ------------------------------------------------------------------

def run_decode(batch: PagedBatch, out: torch.Tensor, *, page: str | None = None, mla: bool = False,
               source: str | None = None) -> torch.Tensor:
    case = batch.case
    g = case.geometry
    loaded = sglang_loader.load("decode", source)
    entry = loaded["decode_attention"].decode_attention_fwd
    kept = scheduled(batch)
    if not kept:
        return out
    index = token_indices(batch, keys="live", capacity=capacity(batch))
    device = batch.q.device
    k_buffer = _token_pool(batch.key_cache)
    v_buffer = k_buffer[..., :g.latent_rank] if mla else _token_pool(batch.value_cache)
    scratch = (len(kept), g.num_q_heads, MAX_KV_SPLITS)
    # Stale scratch is what the backend hands it (reused across layers): NaN shows a split merged unwritten.
    attn_logits = torch.full((*scratch, g.v_head_size), float("nan"), dtype=torch.float32, device=device)
    attn_lse = torch.full(scratch, float("nan"), dtype=torch.float32, device=device)
    options = _keywords(entry, k_scale=1.0, v_scale=1.0, sinks=batch.sinks, has_mla=mla,
                        page_size=page_size(case, page))
    with loaded.active():
        entry(batch.q, k_buffer, v_buffer, out, index.kv_indptr, index.kv_indices.long(), attn_logits, attn_lse,
              split_counts(case, len(kept), device), MAX_KV_SPLITS, case.scale, **options)
    return out


# -- sglang:extend ------------------------------------------------------------------

def custom_mask(case: Case, device) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's ``custom_mask`` (int8, each request's ``[query_len, seq_len]`` allowed set, flat) and
    ``mask_indptr``, over the scheduled requests; built on ``device`` (a prefill of 1k queries over
    128k keys is 2^27 entries)."""
    parts, starts = [], [0]
    for seq in (s for s in case.sequences if s.query_len):
        positions = torch.arange(seq.context_len, seq.seq_len, device=device)[:, None]
        keys = torch.arange(seq.seq_len, device=device)[None, :]
        parts.append(allowed_mask(positions, keys, seq.seq_len, case.sliding_window, case.causal).flatten())
        starts.append(starts[-1] + parts[-1].numel())
    mask = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.bool, device=device)
    return mask.to(torch.int8), torch.tensor(starts, dtype=torch.int32, device=device)


def run_extend(batch: PagedBatch, out: torch.Tensor, *, page: str | None = None, mask: bool = False,
               source: str | None = None) -> torch.Tensor:
    case = batch.case
    loaded = sglang_loader.load("extend", source)
    entry = loaded["extend_attention"].extend_attention_fwd
    kept = scheduled(batch)
    if not kept:
        return out
    prefix = token_indices(batch, keys="context", capacity=capacity(batch))
    device = batch.q.device
    k_buffer, v_buffer = _token_pool(batch.key_cache), _token_pool(batch.value_cache)
    masks = custom_mask(case, device) if mask else (None, None)
    options = _keywords(
        entry, k_scale=1.0, v_scale=1.0, sm_scale=case.scale, sliding_window_size=window_left(case),
        sinks=batch.sinks, window_kv_offsets=prefix.kv_start, page_size=page_size(case, page),
        extend_seq_lens_cpu=[s.query_len for s in case.sequences if s.query_len])
    with loaded.active():
        entry(batch.q, batch.k, batch.v, out, k_buffer, v_buffer, kept.query_start_loc, prefix.kv_indptr,
              prefix.kv_indices.long(), masks[0], case.causal, masks[1], kept.max_query_len, **options)
    return out


# -- registry entry -------------------------------------------------------------------

def kernel(name: str, source: str | None = None) -> Kernel:
    """The Kernel for an ``sglang:*`` name, with SGLang's kernel files from ``source`` (a source tree
    or unpacked wheel; None: the installed sglang).  The files are loaded here, so a missing or
    unusable tree is a configuration error now rather than a crash of the first case."""
    base, _, variant = name.partition("@")
    if base not in KERNEL_NAMES or (variant and name not in VARIANTS):
        raise NanfuzzError(f"unknown SGLang kernel {name!r}; known: {', '.join((*KERNEL_NAMES, *VARIANTS))}")
    page = variant if variant in PAGES else None
    if base == DECODE:
        entry = sglang_loader.load("decode", source)["decode_attention"].decode_attention_fwd
        mla = variant == "mla"
        run = functools.partial(run_decode, page=page, mla=mla, source=source)
        caps = MLA_CAPABILITIES if mla else DECODE_CAPABILITIES
        notes = DECODE_NOTES
    else:
        entry = sglang_loader.load("extend", source)["extend_attention"].extend_attention_fwd
        run = functools.partial(run_extend, page=page, mask=variant == "custom-mask", source=source)
        caps = EXTEND_CAPABILITIES
        notes = EXTEND_NOTES
    return Kernel(name=name, run=run, capabilities=_declared(caps, entry, name, page), source=source, notes=notes)
