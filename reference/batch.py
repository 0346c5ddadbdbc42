"""The canonical batch a kernel adapter receives."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from nanfuzz.reference.case import Case
from nanfuzz.reference.redzones import Allocation, clone_together, move_together


# Inputs only some cases have.
OPTIONAL_INPUTS = ("sinks", "k_scale", "v_scale", "k_scale_cache", "v_scale_cache", "k_zero_cache", "v_zero_cache")


@dataclass
class PagedBatch:
    """Device tensors of one case, in the harness's canonical layout.

    The cache already holds the new tokens (as vLLM writes them before
    attention); ``k``/``v`` repeat them for kernels that read new tokens from
    separate tensors.  Host-side lengths come from ``case`` so adapters never
    need a device sync to size a launch.

    A quantized cache (``case.kv_cache``) holds codes in its encoding's torch
    dtype (float8_e4m3fn, float8_e4m3fnuz, float8_e5m2 or int8) with
    per-tensor ``k_scale``/``v_scale`` or per-token-head ``k_scale_cache``/
    ``v_scale_cache``; ``k``/``v`` then hold the new tokens' dequantized
    values (code x scale) rounded to the query dtype, so a kernel that reads
    new tokens from them sees what the cache holds.

    ``v_head_size`` is ``head_size`` unless the case gives V a head size of its own
    (``Geometry.head_size_v``); the output then has that many columns too.

    Unsigned codes (``case.CacheSide``) sit in uint8 caches of
    ``[num_blocks, block_size, num_kv_heads, row_bytes]`` (packed codes take
    fewer bytes than the side's head size), with scale caches of their scale
    format's dtype and, where the zero points have a cache of their own,
    ``k_zero_cache``/``v_zero_cache`` of the same shape and dtype; each
    side of the cache by its own format.

    A latent (MLA) cache (``Geometry.latent_rank``) is one cache: ``key_cache``
    ``[num_blocks, block_size, 1, kv_lora_rank + rope_dim]``, and ``value_cache``
    the view of its first ``kv_lora_rank`` entries (no allocation of its own, no
    input of its own); ``v`` likewise holds the first entries of ``k``.
    """

    case: Case
    q: torch.Tensor             # [num_tokens, num_q_heads, head_size]
    k: torch.Tensor             # [num_tokens, num_kv_heads, head_size]
    v: torch.Tensor             # [num_tokens, num_kv_heads, v_head_size]
    key_cache: torch.Tensor     # [num_blocks, block_size, num_kv_heads, head_size]
    value_cache: torch.Tensor   # [num_blocks, block_size, num_kv_heads, v_head_size]
    block_table: torch.Tensor   # int32 [num_seqs, table_width]
    seq_lens: torch.Tensor      # int32 [num_seqs]
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    sinks: torch.Tensor | None  # float32 [num_q_heads], logits added to the denominator only
    # name -> the allocation each input is a view into (see reference.redzones); empty: no redzones
    allocations: dict[str, Allocation] = field(default_factory=dict, repr=False)
    # quantized caches: float32 [1] per-tensor scales, or float32 [num_blocks, block_size, num_kv_heads]
    # per-token-head scale caches; None where the case has none
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    k_scale_cache: torch.Tensor | None = None
    v_scale_cache: torch.Tensor | None = None
    # zero points of unsigned codes: [num_blocks, block_size, num_kv_heads] in the scale format's dtype
    k_zero_cache: torch.Tensor | None = None
    v_zero_cache: torch.Tensor | None = None

    @classmethod
    def from_allocations(cls, case: Case, allocations: dict[str, Allocation]) -> "PagedBatch":
        views = {name: a.view for name, a in allocations.items()}
        views.setdefault("sinks", None)
        if case.geometry.latent:
            views["value_cache"] = latent_values(case, views["key_cache"])
        return cls(case=case, allocations=allocations, **views)

    def clone(self) -> "PagedBatch":
        """A deep copy, redzones included, with the same views into the copied allocations."""
        if self.allocations:
            return PagedBatch.from_allocations(self.case, clone_together(self.allocations))
        tensors = {name: t.clone() for name, t in self.inputs().items()}
        tensors.setdefault("sinks", None)
        if self.case.geometry.latent:
            tensors["value_cache"] = latent_values(self.case, tensors["key_cache"])
        return PagedBatch(case=self.case, **tensors)

    def for_kernel(self) -> "PagedBatch":
        """A batch object of its own over the same tensors, for a kernel: whatever its adapter
        rebinds on it (``batch.q = batch.q.float()``, a cache in its own layout) stays there."""
        return replace(self, allocations=dict(self.allocations))

    def in_one_buffer(self, device: torch.device | str) -> "PagedBatch":
        """A copy on ``device`` whose allocations are views into one buffer (``redzones.move_together``):
        one copy to move it, one to clone it, one comparison to tell whether a kernel wrote into it."""
        return PagedBatch.from_allocations(self.case, move_together(self.allocations, torch.device(device)))

    def bases(self) -> dict[str, torch.Tensor]:
        """Every input's whole allocation (margins included) by name."""
        if self.allocations:
            return {name: a.base for name, a in self.allocations.items()}
        return self.inputs()

    @property
    def scale(self) -> float:
        return self.case.scale

    @property
    def sliding_window(self) -> int:
        return self.case.sliding_window

    @property
    def causal(self) -> bool:
        return self.case.causal

    @property
    def max_query_len(self) -> int:
        return self.case.max_query_len

    @property
    def max_seq_len(self) -> int:
        return self.case.max_seq_len

    @property
    def context_lens(self) -> torch.Tensor:
        return self.seq_lens - (self.query_start_loc[1:] - self.query_start_loc[:-1])

    def inputs(self) -> dict[str, torch.Tensor]:
        """Every input tensor by name (what a kernel must not write)."""
        named = {
            "q": self.q, "k": self.k, "v": self.v,
            "key_cache": self.key_cache, "value_cache": self.value_cache,
            "block_table": self.block_table, "seq_lens": self.seq_lens,
            "query_start_loc": self.query_start_loc,
        }
        if self.case.geometry.latent:
            del named["value_cache"]  # a view of key_cache: the one cache
        for name in OPTIONAL_INPUTS:
            if getattr(self, name) is not None:
                named[name] = getattr(self, name)
        return named


def latent_values(case: Case, key_cache: torch.Tensor) -> torch.Tensor:
    """V of a latent cache: the view of each row's first ``latent_rank`` entries."""
    return key_cache[..., :case.geometry.latent_rank]
