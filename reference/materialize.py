"""Build a case's tensors on a device.

Live slots hold values that depend only on the data seed and the slot's
address; dead slots hold finite garbage (its own seed) except where the
poison specification puts NaN, Inf or other hostile bits.  Two calls with the
same arguments give bit-identical tensors on any device.
"""
from __future__ import annotations

import torch

from nanfuzz.reference import redzones, values
from nanfuzz.reference.batch import PagedBatch
from nanfuzz.reference.case import Case
from nanfuzz.reference.semantics import slot_liveness

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_BITS_VIEW = {"float16": torch.int16, "bfloat16": torch.int16, "float32": torch.int32}

# Live data: K and V uniform on [-1, 1); Q three times wider so that the
# softmax is peaked enough for a wrong window edge to move the output.
_Q_SPREAD = 3.0
# Finite garbage in unpoisoned dead slots: magnitudes log-uniform in [1, 1e4]
# (below fp16's 65504), so a kernel that lets a dead slot reach its output
# with a non-zero weight changes the result visibly (the LEAK verdict).
_GARBAGE_DECADES = 4.0


def _derive(*parts: int) -> int:
    seed = 0
    for part in parts:
        seed = values._mix_int(seed ^ (part & values._MASK64))
    return seed


def live_mask(case: Case, device: torch.device | str) -> torch.Tensor:
    """bool ``[num_blocks, block_size]``: may some query read this slot?"""
    return torch.tensor(slot_liveness(case), dtype=torch.bool, device=device)


def poison_mask(case: Case, live: torch.Tensor) -> torch.Tensor:
    """bool ``[num_blocks, block_size]``: the slots the poison specification names."""
    sites = case.poison.sites
    if sites is None:
        return ~live
    mask = torch.zeros_like(live)
    for site in sites:
        if site.offset is None:
            mask[site.block] = True
        else:
            mask[site.block, site.offset] = True
    return mask & ~live


def _garbage(seed: int, stream: str, index: torch.Tensor) -> torch.Tensor:
    u = values.uniform(seed, stream, index)
    magnitude = torch.pow(10.0, u.abs() * _GARBAGE_DECADES)
    return torch.where(u < 0, -magnitude, magnitude)


def _poison_values(case: Case, stream: str, index: torch.Tensor) -> torch.Tensor:
    dtype_name = case.geometry.dtype
    dtype = TORCH_DTYPES[dtype_name]
    kind = case.poison.value
    shape = index.shape
    device = index.device
    if kind == "nan":
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    if kind == "inf":
        return torch.full(shape, float("inf"), dtype=dtype, device=device)
    if kind == "-inf":
        return torch.full(shape, float("-inf"), dtype=dtype, device=device)
    finfo = torch.finfo(dtype)
    if kind == "max":
        return torch.full(shape, finfo.max, dtype=dtype, device=device)
    seed = _derive(case.data_seed, 1)
    if kind == "garbage":
        # large but finite: half to all of the dtype's range, either sign
        u = values.uniform(seed, stream, index)
        return (torch.sign(u) * finfo.max * (0.5 + 0.5 * u.abs())).clamp(-finfo.max, finfo.max).to(dtype)
    assert kind == "bits", kind
    bits = values.random_bits(seed, stream, index)
    view = _BITS_VIEW[dtype_name]
    width = 16 if view == torch.int16 else 32
    low = bits & ((1 << width) - 1)
    low = torch.where(low >= 1 << (width - 1), low - (1 << width), low)
    return low.to(view).view(dtype)


def _slots(mask: torch.Tensor) -> torch.Tensor:
    """Flat slot numbers (block * block_size + offset) where the host-side ``mask`` holds."""
    return mask.flatten().nonzero().flatten()


def host_to_device(device: torch.device, *parts: torch.Tensor) -> list[torch.Tensor]:
    """Host int64 tensors on ``device``, moved in one copy: one host-device sync, not one each."""
    if device.type == "cpu":
        return list(parts)
    moved = torch.cat([p.flatten() for p in parts]).to(device)
    return [chunk.view(p.shape) for chunk, p in zip(moved.split([p.numel() for p in parts]), parts)]


def _fill(cache: torch.Tensor, slots: torch.Tensor, make) -> None:
    """Write ``make(element index)`` into the given slots of a ``[slots, heads * head_size]`` cache.

    A value depends only on its element index, so computing it for the slots
    that need it gives the same bits as computing it for the whole cache.
    """
    if slots.numel():
        width = cache.shape[1]
        index = slots[:, None] * width + torch.arange(width, device=cache.device, dtype=torch.int64)
        cache[slots] = make(index).to(cache.dtype)


def _cache(case: Case, which: str, slots: dict[str, torch.Tensor], garbage_seed: int) -> torch.Tensor:
    """One cache from the device-side slot numbers of its "live", "garbage" and (if any) "poison" slots."""
    g = case.geometry
    shape = (g.num_blocks, g.block_size, g.num_kv_heads, g.head_size)
    cache = torch.empty(g.num_blocks * g.block_size, g.num_kv_heads * g.head_size,
                        dtype=TORCH_DTYPES[g.dtype], device=slots["live"].device)
    _fill(cache, slots["live"], lambda index: values.uniform(case.data_seed, f"cache_{which}", index))
    _fill(cache, slots["garbage"],
          lambda index: _garbage(_derive(case.data_seed, 2, garbage_seed), f"garbage_{which}", index))
    if "poison" in slots:
        _fill(cache, slots["poison"], lambda index: _poison_values(case, f"poison_{which}", index))
    return cache.view(shape)


def token_layout(case: Case) -> tuple[list[int], list[int]]:
    """For each query token in order: its sequence and its absolute position."""
    seq_of, pos_of = [], []
    for s, seq in enumerate(case.sequences):
        seq_of += [s] * seq.query_len
        pos_of += range(seq.context_len, seq.seq_len)
    return seq_of, pos_of


def materialize(case: Case, device: torch.device | str = "cpu", *,
                garbage_seed: int = 0, poisoned: bool = True) -> PagedBatch:
    """The case's tensors on ``device``.

    ``garbage_seed`` changes the finite garbage in every unpoisoned dead slot
    and nothing else; ``poisoned=False`` leaves the poison out (every dead
    slot finite), which is how the LEAK check compares two runs.
    """
    g = case.geometry
    device = torch.device(device)
    # Slot lists and index tensors are built on the host and moved in one copy.
    live = live_mask(case, "cpu")
    poison = poison_mask(case, live) if poisoned else None
    seq_of, pos_of = token_layout(case)
    host = {
        "live": _slots(live),
        "seq": torch.tensor(seq_of, dtype=torch.int64),
        "pos": torch.tensor(pos_of, dtype=torch.int64),
        "table": torch.tensor([list(s.block_table) for s in case.sequences], dtype=torch.int64),
        "seq_lens": torch.tensor([s.seq_len for s in case.sequences], dtype=torch.int64),
        "starts": torch.tensor(case.query_start_loc(), dtype=torch.int64),
    }
    for which, hit in (("k", case.poison.hits_k), ("v", case.poison.hits_v)):
        if poison is not None and hit:
            host[f"{which}.garbage"] = _slots(~live & ~poison)
            host[f"{which}.poison"] = _slots(poison)
        else:
            host[f"{which}.garbage"] = _slots(~live)
    on_device = dict(zip(host, host_to_device(device, *host.values())))

    def cache(which: str) -> torch.Tensor:
        kinds = {kind: on_device[f"{which}.{kind}"] for kind in ("garbage", "poison") if f"{which}.{kind}" in on_device}
        return _cache(case, which, {"live": on_device["live"], **kinds}, garbage_seed)

    key_cache, value_cache = cache("k"), cache("v")

    seq_t, pos_t = on_device["seq"], on_device["pos"]
    heads = torch.arange(g.num_q_heads * g.head_size, device=device, dtype=torch.int64)
    q_index = ((seq_t << 24) + pos_t)[:, None] * (g.num_q_heads * g.head_size) + heads[None, :]
    q = (values.uniform(case.data_seed, "q", q_index) * _Q_SPREAD).to(TORCH_DTYPES[g.dtype])
    q = q.view(len(seq_of), g.num_q_heads, g.head_size)

    block_table = on_device["table"].to(torch.int32)
    blocks = block_table.long()[seq_t, pos_t // g.block_size] if seq_of else seq_t
    offsets = pos_t % g.block_size
    k = key_cache[blocks, offsets]
    v = value_cache[blocks, offsets]

    sinks = None
    if case.sinks:
        index = torch.arange(g.num_q_heads, device=device, dtype=torch.int64)
        sinks = (values.uniform(case.data_seed, "sinks", index) * 2.0).to(torch.float32)

    margin = _margin_fill(case, garbage_seed, poisoned)
    allocations = _surround(case, margin, q=q, k=k, v=v, key_cache=key_cache, value_cache=value_cache,
                            block_table=block_table, seq_lens=on_device["seq_lens"].to(torch.int32),
                            query_start_loc=on_device["starts"].to(torch.int32), sinks=sinks)
    return PagedBatch.from_allocations(case, allocations)


def _margin_fill(case: Case, garbage_seed: int, poisoned: bool):
    """What float redzones hold: NaN in the poisoned run, seeded finite garbage otherwise
    (so a kernel that reads past a tensor also changes its output between the LEAK runs)."""
    if poisoned:
        return lambda stream: float("nan")
    seed = _derive(case.data_seed, 3, garbage_seed)

    def garbage(stream: str):
        def make(shape):
            count = 1
            for n in shape:
                count *= n
            return _garbage(seed, stream, torch.arange(count, dtype=torch.int64)).view(shape)
        return make

    return garbage


def _surround(case: Case, margin, **tensors) -> dict[str, redzones.Allocation]:
    g = case.geometry
    z = redzones
    trap = g.num_blocks  # the first block past the cache: a redzone block, NaN in the poisoned run
    reach = (case.table_width + z.TABLE_EXTRA_COLUMNS) * g.block_size
    made = {
        "q": z.surround(tensors["q"], 0, z.TOKEN_ROWS_AFTER, margin("redzone_q")),
        "k": z.surround(tensors["k"], 0, z.TOKEN_ROWS_AFTER, margin("redzone_k")),
        "v": z.surround(tensors["v"], 0, z.TOKEN_ROWS_AFTER, margin("redzone_v")),
        "key_cache": z.surround(tensors["key_cache"], z.CACHE_BLOCKS_BEFORE, z.CACHE_BLOCKS_AFTER,
                                margin("redzone_key_cache")),
        "value_cache": z.surround(tensors["value_cache"], z.CACHE_BLOCKS_BEFORE, z.CACHE_BLOCKS_AFTER,
                                  margin("redzone_value_cache")),
        "block_table": z.table(tensors["block_table"], trap),
        "seq_lens": z.surround(tensors["seq_lens"], 0, z.LENGTHS_AFTER, reach),
        "query_start_loc": z.surround(tensors["query_start_loc"], 0, z.LENGTHS_AFTER,
                                      case.num_tokens + z.OUT_GUARD_ROWS),
    }
    if tensors["sinks"] is not None:
        made["sinks"] = z.surround(tensors["sinks"], 0, z.SINKS_AFTER, margin("redzone_sinks"))
    return made


def refill_dead_slots(batch: PagedBatch, garbage_seed: int) -> PagedBatch:
    """A copy of ``batch`` with the finite garbage of ``garbage_seed`` in every dead slot and redzone.

    For a freshly materialised ``batch`` this is bit-identical to
    ``materialize(batch.case, device, garbage_seed=garbage_seed, poisoned=False)``
    (live slots and the new tokens are copied, not recomputed), so the LEAK
    check's second batch costs a copy plus the garbage.
    """
    case = batch.case
    device = batch.key_cache.device
    copy = batch.clone()
    (dead,) = host_to_device(device, _slots(~live_mask(case, "cpu")))
    seed = _derive(case.data_seed, 2, garbage_seed)
    for which, cache in (("k", copy.key_cache), ("v", copy.value_cache)):
        flat = cache.flatten(0, 1).flatten(1)
        _fill(flat, dead, lambda index: _garbage(seed, f"garbage_{which}", index))
    margin = _margin_fill(case, garbage_seed, poisoned=False)
    for name, allocation in copy.allocations.items():
        if allocation.base.is_floating_point():
            for _, where in allocation.sides():
                redzones._fill_rows(allocation.base, where[0] if len(where) == 1 else where,
                                    margin(f"redzone_{name}"))
    return copy
