"""Plain-torch MLA decode subjects over a latent cache: one cache, K the whole row, V its first
``kv_lora_rank`` entries.  Each reads only ``batch.key_cache``, as vLLM's TRITON_MLA backend does."""
from __future__ import annotations

import torch

from nanfuzz.harness.kernel import Kernel
from nanfuzz.reference.capabilities import Capabilities
from tests.torch_kernels import attention

# Small latent rows (rank + rope) keep interpreter cases cheap; 512 + 64 is DeepSeek's.
MLA_CAPS = Capabilities(mla=((32, 16), (64, 16), (512, 64)), non_causal=True, sinks=True,
                        interpreter_dtypes=("float16", "bfloat16", "float32"), precision="ieee", specialisation_pool=0)


def latent_attention(batch, out, *, bug: str | None = None):
    """``bug``: "mask-multiply" (p = 0 times V of every slot: NaN in a dead latent part leaks),
    "no-rope" (scores from the latent part alone), "v-from-rope" (V read from the row's last
    entries), "writes-cache" (writes the rope part of a slot it read)."""
    rank = batch.case.geometry.latent_rank
    cache = batch.key_cache
    if bug == "no-rope":
        cache = torch.cat([cache[..., :rank], torch.zeros_like(cache[..., rank:])], dim=-1)
    values = cache[..., -rank:] if bug == "v-from-rope" else cache[..., :rank]
    view = type(batch)(**{**batch.__dict__, "key_cache": cache, "value_cache": values})
    attention(view, out, bug="mask-multiply" if bug == "mask-multiply" else None)
    if bug == "writes-cache":
        batch.key_cache[batch.block_table[0, 0], 0, 0, rank:] = 0.0
    return out


def _make(bug: str | None) -> Kernel:
    attr = "mla_" + (bug or "correct").replace("-", "_")
    return Kernel(name=f"torch-mla@{bug or 'correct'}", run=lambda b, o: latent_attention(b, o, bug=bug),
                  capabilities=MLA_CAPS, spec=f"tests.latent_kernels:{attr}")


BUGS = (None, "mask-multiply", "no-rope", "v-from-rope", "writes-cache")
globals().update({"mla_" + (bug or "correct").replace("-", "_"): _make(bug) for bug in BUGS})
