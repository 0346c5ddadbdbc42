"""Build a large case on its device: only the cache blocks it uses.

A production-size case (``Case.large``) has caches of gigabytes and queries
of millions of elements: built on the host and copied, it would cost seconds
and the whole cache each time.  Built here, on the device it runs on, it
costs what its live keys cost:

- the queries, the new tokens' k/v, the table and the lengths, inside their
  redzones, in one buffer (``small``), as the host build makes them;
- of each cache, only its *written blocks* (``written_blocks``): the blocks
  holding a live key, and the blocks its poison sites name, as a compact
  ``[len(ids), block_size, ...]`` tensor whose slots hold exactly what the
  host build puts there (``reference.values`` hashes on the device to the
  same bits): live values, and in their dead slots the poison or the finite
  garbage of the case's specification.

Every other block of a large case's caches, and their redzones, hold the
encoding's NaN (``background``) in every run, poisoned or not: a block
without a live key is dead through and through.  ``harness.judge.pool``
keeps a process's caches in that state and writes only ``ids``.

``oracle_batch`` views the compact build as a batch whose table points at
the compact blocks: what the oracle reads, never the caches a kernel saw.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from nanfuzz.reference import asymmetric, quantization, redzones, rotation, values
from nanfuzz.reference.batch import PagedBatch, latent_values
from nanfuzz.reference.case import Case
from nanfuzz.reference.features import poisoned_mask
from nanfuzz.reference.materialize import (PARAMETER_CACHES, TORCH_DTYPES, _derive, _fill_dead_codes,
                                           _fill_poison, _garbage, _margin_fill, _poison_values, _surround_small,
                                           cache_sides, new_tokens, per_tensor_scales, poison_columns, query_values,
                                           token_layout)
from nanfuzz.reference.semantics import liveness

# Elements generated per step: bounds the int64 temporaries of the hash (2^24 x 8 bytes each).
_CHUNK_ELEMENTS = 1 << 24
# The background of a cache, by what it holds: NaN's bits, or the encoding's first NaN code
# (int8 has none: its largest code).
_FLOAT_NAN_BITS = {"float16": (0x7E00, 2), "bfloat16": (0x7FC0, 2), "float32": (0x7FC00000, 4)}


def background(case: Case, name: str) -> tuple[int, int]:
    """(bit pattern, bytes) every unwritten element of cache ``name`` holds."""
    side = case.kv_cache.side("k" if name in ("key_cache", "k_scale_cache", "k_zero_cache") else "v")
    if name in PARAMETER_CACHES:
        dtype = asymmetric.storage_dtype(side, TORCH_DTYPES[case.geometry.dtype])
        return _FLOAT_NAN_BITS[str(dtype).removeprefix("torch.")]
    if not side.quantized:
        return _FLOAT_NAN_BITS[case.geometry.dtype]
    return quantization.margin_code(side.dtype), 1


def written_blocks(case: Case) -> np.ndarray:
    """Sorted physical ids of the blocks a large case writes: those holding a live key, and
    those its poison sites name."""
    held = liveness(case).any(axis=1)
    if case.poison.sites:
        held = held.copy()
        held[[site.block for site in case.poison.sites]] = True
    return np.flatnonzero(held)


@dataclass
class DeviceBuild:
    """A large case's tensors on its device (see the module notes)."""

    case: Case
    ids: torch.Tensor                     # int64 [T]: the written blocks, sorted
    small: dict[str, redzones.Allocation]  # q, k, v, table, lengths, sinks, scales: one buffer
    caches: dict[str, torch.Tensor]       # key_cache, value_cache [T, bs, hkv, d] (codes if quantized; a
                                          # latent cache: key_cache alone), k_scale_cache, v_scale_cache
                                          # [T, bs, hkv] (per-token-head)
    compact_table: torch.Tensor           # int32 [S, W]: each entry's index in ``ids`` (0 where none)
    dead: torch.Tensor = field(repr=False)  # bool [T * bs]: the dead slots of the written blocks

    def oracle_batch(self) -> PagedBatch:
        """The build as a batch over its compact blocks: pristine inputs for the oracle."""
        views = {name: a.view for name, a in self.small.items()}
        views["block_table"] = self.compact_table
        views.update(self.caches)
        views.setdefault("sinks", None)
        if self.case.geometry.latent:
            views["value_cache"] = latent_values(self.case, views["key_cache"])
        return PagedBatch(case=self.case, **views)


def build_on_device(case: Case, device: torch.device | str, *, garbage_seed: int = 0,
                    poisoned: bool = True) -> DeviceBuild:
    """A large case's tensors on ``device`` (see ``materialize.materialize`` for the arguments)."""
    device = torch.device(device)
    g = case.geometry
    bs = g.block_size
    ids_h = written_blocks(case)
    ids = torch.from_numpy(ids_h).to(device)
    live = torch.from_numpy(liveness(case)[ids_h].reshape(-1).copy()).to(device)
    poison = torch.from_numpy(poisoned_mask(case)[ids_h].reshape(-1).copy()).to(device) if poisoned else None
    physical = (ids[:, None] * bs + torch.arange(bs, device=device)).reshape(-1)  # each compact slot's own
    caches = _caches(case, physical, live, poison, garbage_seed)
    compact_table = _compact_table(case, ids_h, device)
    small = _small_inputs(case, device, caches, compact_table, garbage_seed, poisoned)
    return DeviceBuild(case, ids, small, caches, compact_table, ~live)


def refill(build: DeviceBuild, garbage_seed: int) -> DeviceBuild:
    """``build_on_device(case, garbage_seed=garbage_seed, poisoned=False)`` from ``build``: live
    slots and the new tokens copied, the dead slots of the written blocks and the redzones of the
    small inputs refilled with that seed's finite garbage."""
    case = build.case
    g = case.geometry
    dead = torch.nonzero(build.dead).flatten()
    bs = g.block_size
    physical = build.ids[dead // bs] * bs + dead % bs
    caches = {name: t.clone() for name, t in build.caches.items()}
    _write_dead(case, caches, dead, physical, None, garbage_seed)
    small = redzones.clone_together(build.small)
    margin = _margin_fill(case, garbage_seed, poisoned=False)
    for name, allocation in small.items():
        if allocation.base.is_floating_point():
            for _, where in allocation.sides():
                redzones._fill_rows(allocation.base, where[0] if len(where) == 1 else where, margin(f"redzone_{name}"))
    return DeviceBuild(case, build.ids, small, caches, build.compact_table, build.dead)


# -- the caches' written blocks ----------------------------------------------------------

def _element_index(slots: torch.Tensor, width: int) -> torch.Tensor:
    return slots[:, None] * width + torch.arange(width, device=slots.device, dtype=torch.int64)


def _chunks(rows: torch.Tensor, width: int):
    step = max(1, _CHUNK_ELEMENTS // width)
    for start in range(0, rows.numel(), step):
        yield slice(start, start + step)


def _caches(case: Case, physical: torch.Tensor, live: torch.Tensor, poison: torch.Tensor | None,
            garbage_seed: int) -> dict[str, torch.Tensor]:
    g = case.geometry
    kv = case.kv_cache
    device = physical.device
    rows = physical.numel()
    sides = (("k", "key_cache"), ("v", "value_cache"))[:len(cache_sides(case))]
    caches, widths = {}, {}
    for which, name in sides:
        side = kv.side(which)
        widths[name] = g.num_kv_heads * side.row_bytes(g.cache_head_size(which))
        caches[name] = torch.empty(rows, widths[name], dtype=torch.uint8 if side.quantized else TORCH_DTYPES[g.dtype],
                                   device=device)
        stored = asymmetric.storage_dtype(side, TORCH_DTYPES[g.dtype])
        if side.token_head:
            caches[f"{which}_scale_cache"] = torch.empty(rows, g.num_kv_heads, dtype=stored, device=device)
        if side.zero_cache:
            caches[f"{which}_zero_cache"] = torch.empty(rows, g.num_kv_heads, dtype=stored, device=device)
    live_rows = torch.nonzero(live).flatten()
    for which, name in sides:
        side = kv.side(which)
        head_size = g.cache_head_size(which)
        width = g.num_kv_heads * head_size
        for part in _chunks(live_rows, width):
            rows_here = live_rows[part]
            x = values.uniform(case.data_seed, f"cache_{which}", _element_index(physical[rows_here], width))
            if not side.quantized:
                caches[name][rows_here] = x.to(caches[name].dtype)
                continue
            x = rotation.rotate(x.view(-1, g.num_kv_heads, head_size), kv)
            codes, scales, zeros = quantization.live_rows(x, side, kv.k_scale if which == "k" else kv.v_scale,
                                                          TORCH_DTYPES[g.dtype])
            caches[name][rows_here] = codes.reshape(-1, widths[name])
            if scales is not None:
                caches[f"{which}_scale_cache"][rows_here] = scales
            if zeros is not None:
                caches[f"{which}_zero_cache"][rows_here] = zeros
    dead_rows = torch.nonzero(~live).flatten()
    _write_dead(case, caches, dead_rows, physical[dead_rows], None if poison is None else poison[dead_rows],
                garbage_seed)
    for which, name in sides:
        side = kv.side(which)
        shape = (rows // g.block_size, g.block_size, g.num_kv_heads, -1)
        caches[name] = (quantization.as_encoding(caches[name], side.dtype) if side.quantized else caches[name]).view(shape)
    for name in PARAMETER_CACHES:
        if name in caches:
            caches[name] = caches[name].view(rows // g.block_size, g.block_size, g.num_kv_heads)
    return caches


def _write_dead(case: Case, caches: dict[str, torch.Tensor], rows: torch.Tensor, physical: torch.Tensor,
                poisoned: torch.Tensor | None, garbage_seed: int) -> None:
    """The dead slots ``rows`` of the compact caches (whose own slots are ``physical``): the poison
    where ``poisoned`` says and the case poisons that tensor or part, else finite garbage."""
    g = case.geometry
    kv = case.kv_cache
    p = case.poison
    garbage = _derive(case.data_seed, 2, garbage_seed)
    for (which, hit), name in zip(cache_sides(case), ("key_cache", "value_cache")):
        side = kv.side(which)
        if not side.quantized:
            width = g.num_kv_heads * g.cache_head_size(which)
            codes_hit = poisoned if (poisoned is not None and hit and p.hits_data) else None
            _fill_dead(case, which, caches[name].reshape(-1, width), rows, physical, codes_hit, width, garbage)
            continue
        # every cache as [slots, row] views, whether still being built or already shaped
        width = g.num_kv_heads * side.row_bytes(g.cache_head_size(which))
        codes = quantization.codes_of(caches[name]).reshape(-1, width)
        scales, zeros = (caches[key].reshape(-1, g.num_kv_heads) if key in caches else None
                         for key in (f"{which}_scale_cache", f"{which}_zero_cache"))
        for part in _chunks(rows, codes.shape[1]):
            here, slots = rows[part], physical[part]
            _fill_dead_codes(case, which, codes, scales, zeros, slots, slots, slots, garbage_seed, rows=here)
            if poisoned is None or not hit:
                continue
            chosen = poisoned[part]
            hit_here, hit_slots = here[chosen], slots[chosen]
            kinds = {"poison": hit_slots} if p.hits_data else {}
            for name_part, has in (("scales", side.token_head), ("zeros", side.zero_points != "none")):
                if name_part in p.part_names() and has:
                    kinds[f"poison_{name_part}"] = hit_slots
            _fill_poison(case, which, codes, scales, zeros, kinds, rows=hit_here)


def _fill_dead(case, which, cache, rows, physical, poisoned, width, garbage_seed) -> None:
    """Dead slots of an unquantized cache: finite garbage, the poison where ``poisoned`` says."""
    columns = torch.zeros(width, dtype=torch.bool, device=cache.device)
    columns[poison_columns(case)] = True  # the entries of a poisoned slot the poison fills
    for part in _chunks(rows, width):
        here, index = rows[part], _element_index(physical[part], width)
        fill = _garbage(garbage_seed, f"garbage_{which}", index).to(cache.dtype)
        if poisoned is not None:
            bad = _poison_values(case, f"poison_{which}", index).to(cache.dtype)
            fill = torch.where(poisoned[part][:, None] & columns[None, :], bad, fill)
        cache[here] = fill


# -- the small inputs --------------------------------------------------------------------

def _compact_table(case: Case, ids: np.ndarray, device: torch.device) -> torch.Tensor:
    table = np.array([s.block_table for s in case.sequences], dtype=np.int64)
    index = np.searchsorted(ids, table)
    found = (index < len(ids)) & (ids[np.minimum(index, len(ids) - 1)] == table)
    return torch.from_numpy(np.where(found, index, 0).astype(np.int32)).to(device)


def _small_inputs(case: Case, device: torch.device, caches: dict[str, torch.Tensor], compact_table: torch.Tensor,
                  garbage_seed: int, poisoned: bool) -> dict[str, redzones.Allocation]:
    """q (hashed on the device), the new tokens' k/v (gathered from the compact caches), and the
    host-made table, lengths, sinks and scales, in their redzones, in one device buffer."""
    g = case.geometry
    seq_of, pos_of = token_layout(case)
    seq_t = torch.tensor(seq_of, dtype=torch.int64, device=device)
    pos_t = torch.tensor(pos_of, dtype=torch.int64, device=device)
    width = g.num_q_heads * g.head_size
    q = torch.empty(len(seq_of), width, dtype=TORCH_DTYPES[g.dtype], device=device)
    rows = torch.arange(len(seq_of), device=device)
    for part in _chunks(rows, width):
        q[part] = query_values(case, seq_t[part], pos_t[part])
    q = q.view(len(seq_of), g.num_q_heads, g.head_size)
    compact = compact_table.long()[seq_t, pos_t // g.block_size] if seq_of else seq_t
    slots = compact * g.block_size + pos_t % g.block_size
    k, v = new_tokens(case, caches["key_cache"], caches.get("value_cache"),
                      (caches.get("k_scale_cache"), caches.get("v_scale_cache")),
                      (caches.get("k_zero_cache"), caches.get("v_zero_cache")), slots, q.dtype)
    sinks = None
    if case.sinks:
        index = torch.arange(g.num_q_heads, dtype=torch.int64)
        sinks = (values.uniform(case.data_seed, "sinks", index) * 2.0).to(torch.float32)
    scales = per_tensor_scales(case, "cpu")
    table = torch.tensor([list(s.block_table) for s in case.sequences], dtype=torch.int32)
    margin = _margin_fill(case, garbage_seed, poisoned)
    allocations = _surround_small(
        case, margin, q=q, k=k, v=v, block_table=table,
        seq_lens=torch.tensor([s.seq_len for s in case.sequences], dtype=torch.int32),
        query_start_loc=torch.tensor(case.query_start_loc(), dtype=torch.int32), sinks=sinks, **scales)
    return redzones.pack_together(allocations, device)
