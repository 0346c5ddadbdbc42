"""vLLM's MLA decode as a nanfuzz kernel: ``vllm:triton_mla``.

``decode_attention_fwd`` (``vllm/v1/attention/ops/triton_decode_attention.py``) is the
kernel behind the TRITON_MLA backend, which serves DeepSeek-style models on ROCm.  Its
cache is the latent cache of the case model (``Geometry.latent_rank``): one row of
kv_lora_rank + rope_dim entries per token, one KV head for every query head.  The
backend hands it that cache with a head dimension of one as K, the view of each row's
first kv_lora_rank entries as V, the block table as ``req_to_token`` with ``PAGE_SIZE``
the block size, the sequence lengths, and split-KV scratch of ``NUM_KV_SPLITS``
partitions; ``is_mla=True`` makes the grouped kernel use the K tile it loaded as V.

``vllm:triton_mla@page1`` hands the same cache viewed as one token per page with a
``req_to_token`` of flat slots (as SGLang, where the kernel came from, lays it out): each
row's entries past its sequence point at slots of the padding block, dead and poisoned.
"""
from __future__ import annotations

import functools

import torch

from nanfuzz.harness.adapters import vllm_loader
from nanfuzz.harness.kernel import Kernel
from nanfuzz.reference.batch import PagedBatch
from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.layouts import req_to_token, scheduled

NAME = "vllm:triton_mla"
VARIANTS = (f"{NAME}@page1",)
# The split count vLLM's TRITON_MLA backend used before it sized splits by the device
# (``num_kv_splits = 4``); a constexpr of the kernel, so one compile per shape.
NUM_KV_SPLITS = 4
# The backend takes any multiple of 16 (MultipleOf(16)); 48 stands for the non-powers of two.
BLOCK_SIZES = (16, 32, 64, 48)
# (kv_lora_rank, rope_dim): DeepSeek-V2/V3's 512 + 64 and MiniCPM3's 256 + 32, the two widths the
# kernel tiles as latent + rope (576, 288), and 64 + 16, which takes its generic tiling (cheap
# under the interpreter).
LATENT_SHAPES = ((64, 16), (256, 32), (512, 64))
# One compile per head count, latent shape, block size and dtype: a GPU campaign covers this many.
POOL = 16

CAPABILITIES = Capabilities(
    dtypes=("float16", "bfloat16"),  # TritonMLABackend.supported_dtypes
    block_sizes=BLOCK_SIZES,
    max_query_len=1,                 # the decode path
    causal=True,
    sliding_window=False,            # TritonMLAImpl refuses sliding_window
    sinks=False,
    mla=LATENT_SHAPES,
    specialisation_pool=POOL,
)


def run_triton_mla(batch: PagedBatch, out: torch.Tensor, *, page: str = "block", source: str | None = None
                   ) -> torch.Tensor:
    case = batch.case
    g = case.geometry
    module = vllm_loader.load("triton_mla", source)
    kept = scheduled(batch)  # one decode query per scheduled sequence, in order
    if not kept:
        return out
    cache = batch.key_cache  # [num_blocks, block_size, 1, kv_lora_rank + rope_dim]: the one cache
    if page == "token":
        cache = cache.view(-1, 1, 1, g.head_size)
        table, page_size = req_to_token(batch), 1
    else:
        table, page_size = kept.block_table, g.block_size
    device = batch.q.device
    rows = (len(kept), g.num_q_heads)
    # Stale scratch is what vLLM hands it (a shared workspace): NaN shows a split merged unwritten.
    attn_logits = torch.full((*rows, NUM_KV_SPLITS, g.latent_rank + 1), float("nan"), dtype=torch.float32,
                             device=device)
    lse = torch.zeros(rows, dtype=torch.float32, device=device)
    with module.active():
        module["triton_decode_attention"].decode_attention_fwd(
            batch.q, cache, cache[..., :g.latent_rank], out, lse, table, kept.seq_lens, attn_logits,
            NUM_KV_SPLITS, case.scale, page_size, is_mla=True)
    return out


def kernel(name: str, source: str | None = None) -> Kernel:
    """``vllm:triton_mla`` (or ``@page1``), with vLLM's kernel files from ``source``."""
    vllm_loader.load("triton_mla", source)
    page = "token" if name.endswith("@page1") else "block"
    return Kernel(name=name, run=functools.partial(run_triton_mla, page=page, source=source),
                  capabilities=CAPABILITIES, source=source)
