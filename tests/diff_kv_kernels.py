"""Plain-torch subjects over separate K and V caches of different head sizes (``Geometry.head_size_v``)."""
from __future__ import annotations

import torch

from nanfuzz.harness.kernel import Kernel
from tests.torch_kernels import CAPS, attention

# A V narrower than K (MiMo's 192 / 128 scaled down) and one wider, both cheap under the interpreter.
DIFF_KV_CAPS = CAPS.restrict(diff_kv=((64, 32), (32, 48)))


def _values_at_k_stride(batch) -> torch.Tensor:
    """The value cache as a kernel that steps through it with K's row length would read it: row r of
    (slot, KV head) starts at element r * head_size of the value cache's memory, not r * v_head_size.
    Past the cache's allocation it reads what lies there; wrapped around it, as memory has no end here."""
    g = batch.case.geometry
    base = batch.allocations["value_cache"].base.reshape(-1)
    start = batch.value_cache.storage_offset() - batch.allocations["value_cache"].base.storage_offset()
    rows = g.num_blocks * g.block_size * g.num_kv_heads
    index = start + torch.arange(rows)[:, None] * g.head_size + torch.arange(g.v_head_size)[None, :]
    return base[index % base.numel()].view(batch.value_cache.shape)


def diff_kv_attention(batch, out, *, bug: str | None = None):
    """``bug``: "v-at-k-stride" (V rows addressed with K's head size), or a bug of ``attention``."""
    if bug == "v-at-k-stride":
        view = type(batch)(**{**batch.__dict__, "value_cache": _values_at_k_stride(batch)})
        return attention(view, out)
    return attention(batch, out, bug=bug)


BUGS = (None, "v-at-k-stride", "mask-multiply", "head-map")


def _make(bug: str | None) -> Kernel:
    attr = "diff_kv_" + (bug or "correct").replace("-", "_")
    return Kernel(name=f"torch-diff-kv@{bug or 'correct'}", run=lambda b, o: diff_kv_attention(b, o, bug=bug),
                  capabilities=DIFF_KV_CAPS, expect="caught" if bug else "pass", spec=f"tests.diff_kv_kernels:{attr}")


globals().update({"diff_kv_" + (bug or "correct").replace("-", "_"): _make(bug) for bug in BUGS})
