"""Build a case's tensors on a device.

Live slots hold values that depend only on the data seed and the slot's
address; dead slots hold finite garbage (its own seed) except where the
poison specification puts NaN, Inf or other hostile bits.  Two calls with the
same arguments give bit-identical tensors on any device.

A batch is built on the host and reaches a GPU as one buffer, in one copy
(``PagedBatch.in_one_buffer``): hundreds of small elementwise ops cost
microseconds each on a CPU, but a launch each on a GPU that several
campaigns share.
"""
from __future__ import annotations

import math

import torch

from nanfuzz.reference import asymmetric, quantization, redzones, rotation, values
from nanfuzz.reference.batch import PagedBatch
from nanfuzz.reference.case import Case
from nanfuzz.reference.semantics import liveness

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
    return torch.from_numpy(liveness(case).copy()).to(device)


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
    # u is never -0.0 nor NaN, so copying its sign is ``where(u < 0, -m, m)`` in fewer passes
    return torch.pow(10.0, u.abs().mul_(_GARBAGE_DECADES)).copysign_(u)


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
    """Host tensors of one dtype on ``device``, moved in one copy that the host does not wait for."""
    if device.type == "cpu":
        return list(parts)
    moved = torch.cat([p.flatten() for p in parts]).pin_memory().to(device, non_blocking=True)
    return [chunk.view(p.shape) for chunk, p in zip(moved.split([p.numel() for p in parts]), parts)]


def _fill(cache: torch.Tensor, slots: torch.Tensor, make, columns: slice = slice(None)) -> None:
    """Write ``make(element index)`` into the given slots of a ``[slots, heads * head_size]`` cache
    (into ``columns`` of them only).

    A value depends only on its element index, so computing it for the slots
    that need it gives the same bits as computing it for the whole cache.
    """
    if slots.numel():
        cache[slots, columns] = make(_element_index(slots, cache.shape[1]))[:, columns].to(cache.dtype)


def poison_columns(case: Case) -> slice:
    """The entries of a poisoned slot that hold the poison: all of them, except in a latent cache,
    whose one row is both K and V: there poison in "v" is in the latent part (V, which K reads
    too), in "k" in the rotary part (what only K reads), in "kv" in both."""
    g = case.geometry
    if not g.latent or case.poison.tensors == "kv":
        return slice(None)
    return slice(0, g.latent_rank) if case.poison.tensors == "v" else slice(g.latent_rank, None)


def _cache(case: Case, which: str, slots: dict[str, torch.Tensor], garbage_seed: int):
    """One cache from the device-side slot numbers of its "live", "garbage" and (if any) "poison"
    slots: ``(cache, scale_cache, zero_cache)``, the second None unless that side has per-token-head
    scales, the third unless it has zero points in a cache of their own."""
    if case.kv_cache.side(which).quantized:
        return _quantized_cache(case, which, slots, garbage_seed)
    g = case.geometry
    shape = (g.num_blocks, g.block_size, g.num_kv_heads, g.cache_head_size(which))
    cache = torch.empty(g.num_blocks * g.block_size, g.num_kv_heads * shape[-1],
                        dtype=TORCH_DTYPES[g.dtype], device=slots["live"].device)
    _fill(cache, slots["live"], lambda index: values.uniform(case.data_seed, f"cache_{which}", index))
    _fill(cache, slots["garbage"],
          lambda index: _garbage(_derive(case.data_seed, 2, garbage_seed), f"garbage_{which}", index))
    if "poison" in slots:
        _fill(cache, slots["poison"], lambda index: _poison_values(case, f"poison_{which}", index), poison_columns(case))
    return cache.view(shape), None, None


def _quantized_cache(case: Case, which: str, slots: dict[str, torch.Tensor], garbage_seed: int):
    """Codes (uint8 while being filled), and per token-head the scale cache and any zero cache.

    Live slots hold the codes of the same seeded values an unquantized cache
    holds (rotated first where the cache is); dead slots hold finite garbage
    codes, scales and zero points, except that ``slots["poison"]`` gets
    hostile codes, ``slots["poison_scales"]`` hostile scales and
    ``slots["poison_zeros"]`` hostile zero points.
    """
    g = case.geometry
    kv = case.kv_cache
    side = kv.side(which)
    live = slots["live"]
    device = live.device
    head_size = g.cache_head_size(which)
    width = g.num_kv_heads * side.row_bytes(head_size)
    rows = g.num_blocks * g.block_size
    codes = torch.empty(rows, width, dtype=torch.uint8, device=device)
    scale_cache = zero_cache = None
    stored = asymmetric.storage_dtype(side, TORCH_DTYPES[g.dtype])
    if side.token_head:
        scale_cache = torch.empty(rows, g.num_kv_heads, dtype=stored, device=device)
    if side.zero_cache:
        zero_cache = torch.empty(rows, g.num_kv_heads, dtype=stored, device=device)
    if live.numel():
        x = values.uniform(case.data_seed, f"cache_{which}", _element_index(live, g.num_kv_heads * head_size))
        x = rotation.rotate(x.view(-1, g.num_kv_heads, head_size), kv)
        live_codes, scales, zeros = quantization.live_rows(x, side, kv.k_scale if which == "k" else kv.v_scale,
                                                           TORCH_DTYPES[g.dtype])
        codes[live] = live_codes.reshape(-1, width)
        if scales is not None:
            scale_cache[live] = scales
        if zeros is not None:
            zero_cache[live] = zeros
    _fill_dead_codes(case, which, codes, scale_cache, zero_cache, slots["garbage"], slots.get("garbage_scales"),
                     slots.get("garbage_zeros"), garbage_seed)
    _fill_poison(case, which, codes, scale_cache, zero_cache, slots)
    cache = quantization.as_encoding(codes, side.dtype).view(g.num_blocks, g.block_size, g.num_kv_heads, -1)
    if scale_cache is not None:
        scale_cache = scale_cache.view(g.num_blocks, g.block_size, g.num_kv_heads)
    if zero_cache is not None:
        zero_cache = zero_cache.view(g.num_blocks, g.block_size, g.num_kv_heads)
    return cache, scale_cache, zero_cache


def _fill_poison(case: Case, which: str, codes: torch.Tensor, scale_cache: torch.Tensor | None,
                 zero_cache: torch.Tensor | None, slots: dict[str, torch.Tensor],
                 rows: torch.Tensor | None = None) -> None:
    """The hostile codes, scales and zero points of the poisoned slots of one quantized cache
    (``slots["poison"]``, ``["poison_scales"]``, ``["poison_zeros"]``: flat slot numbers, which seed
    the values; ``rows``: where in the tensors each slot of those lists sits, when not at its number,
    the same slots in every list)."""
    g = case.geometry
    side = case.kv_cache.side(which)
    seed = _derive(case.data_seed, 1)
    value = case.poison.value
    if "poison" in slots and slots["poison"].numel():
        slots_hit = slots["poison"]
        at = slots_hit if rows is None else rows
        if side.dtype in quantization.UNSIGNED_DTYPES:  # one random stream per code, packed afterwards
            head_size = g.cache_head_size(which)
            index = _element_index(slots_hit, g.num_kv_heads * head_size)
            bits = values.random_bits(seed, f"poison_{which}", index).view(-1, g.num_kv_heads, head_size)
            codes[at] = quantization.hostile_unsigned(value, bits, side).reshape(len(slots_hit), -1)
        else:
            index = _element_index(slots_hit, codes.shape[1])
            bits, uniform = (values.random_bits(seed, f"poison_{which}", index),
                             values.uniform(seed, f"poison_{which}", index))
            codes[at] = quantization.hostile_codes(value, bits, uniform, side.dtype)
    for part, stream in (("scales", f"poison_scale_{which}"), ("zeros", f"poison_zero_{which}")):
        key = f"poison_{part}"
        if key not in slots or not slots[key].numel():
            continue
        index = _element_index(slots[key], g.num_kv_heads)
        bits, uniform = values.random_bits(seed, stream, index), values.uniform(seed, stream, index)
        hit = slots[key] if rows is None else rows
        if side.scale_format == "float32-zp4":  # one word: the scale's bits, or the zero point's
            words = scale_cache[hit]
            if part == "scales":
                scale_cache[hit] = asymmetric.with_zero(quantization.hostile_scales(value, bits, uniform),
                                                        asymmetric.word_fields(words)[1])
            else:
                scale_cache[hit] = asymmetric.with_zero(words, asymmetric.hostile_zp4(value, bits))
        elif part == "scales" and scale_cache.dtype == torch.float32:
            scale_cache[hit] = quantization.hostile_scales(value, bits, uniform)
        else:
            target = scale_cache if part == "scales" else zero_cache
            target[hit] = asymmetric.hostile_zeros(value, bits, uniform, target.dtype)


def _element_index(slots: torch.Tensor, width: int) -> torch.Tensor:
    """int64 ``[len(slots), width]``: the element numbers of whole slots of a ``[slots, width]`` cache."""
    return slots[:, None] * width + torch.arange(width, device=slots.device, dtype=torch.int64)


def _fill_dead_codes(case: Case, which: str, codes: torch.Tensor, scale_cache: torch.Tensor | None,
                     zero_cache: torch.Tensor | None, slots: torch.Tensor, scale_slots: torch.Tensor | None,
                     zero_slots: torch.Tensor | None, garbage_seed: int, rows: torch.Tensor | None = None) -> None:
    """Finite garbage codes in ``slots``, scales in ``scale_slots`` and zero points in ``zero_slots``
    (``codes``: uint8 ``[slots, heads * row_bytes]``), depending on ``garbage_seed``.  ``rows``: where
    in the tensors the slots sit when not at their numbers (then the three lists are the same slots)."""
    side = case.kv_cache.side(which)
    seed = _derive(case.data_seed, 2, garbage_seed)
    if slots.numel():
        codes[slots if rows is None else rows] = quantization.finite_codes(
            values.random_bits(seed, f"garbage_{which}", _element_index(slots, codes.shape[1])), side.dtype)
    if scale_cache is not None and scale_slots.numel():
        heads = scale_cache.shape[1]
        index = _element_index(scale_slots, heads)
        uniform = values.uniform(seed, f"garbage_scale_{which}", index)
        at = scale_slots if rows is None else rows
        if side.dtype in quantization.UNSIGNED_DTYPES:
            zero_bits = values.random_bits(seed, f"garbage_zero_{which}", index)
            scale_cache[at] = asymmetric.finite_parameters(uniform, zero_bits, side, TORCH_DTYPES[case.geometry.dtype],
                                                           "scales")
        else:
            scale_cache[at] = quantization.garbage_scales(uniform, side.dtype)
    if zero_cache is not None and zero_slots.numel():
        index = _element_index(zero_slots, zero_cache.shape[1])
        zero_cache[zero_slots if rows is None else rows] = asymmetric.finite_parameters(
            values.uniform(seed, f"garbage_zero_{which}", index), None, side, TORCH_DTYPES[case.geometry.dtype],
            "zeros")


def cache_sides(case: Case) -> tuple[tuple[str, bool], ...]:
    """The caches a case builds and whether its poison hits each: K and V, or a latent cache
    alone (its one cache holds whatever K or V poison there is, in ``poison_columns``)."""
    p = case.poison
    if case.geometry.latent:
        return (("k", p.hits_k or p.hits_v),)
    return (("k", p.hits_k), ("v", p.hits_v))


def query_values(case: Case, seq: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``[tokens, num_q_heads * head_size]`` in the case's dtype: the query values of the tokens at
    positions ``pos`` of the sequences ``seq`` (indices into the batch), hashed under each
    sequence's query key (``Case.query_keys``) on the tensors' device."""
    g = case.geometry
    keys = seq if case.query_keys is None else torch.tensor(case.query_keys, dtype=torch.int64, device=seq.device)[seq]
    width = g.num_q_heads * g.head_size
    heads = torch.arange(width, device=seq.device, dtype=torch.int64)
    index = ((keys << 24) + pos)[:, None] * width + heads[None, :]
    return (values.uniform(case.data_seed, "q", index) * _Q_SPREAD).to(TORCH_DTYPES[g.dtype])


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
    host = build_on_host(case, garbage_seed=garbage_seed, poisoned=poisoned)
    return host if torch.device(device).type == "cpu" else host.in_one_buffer(device)


def build_on_host(case: Case, *, garbage_seed: int = 0, poisoned: bool = True) -> PagedBatch:
    """``materialize(case, "cpu", ...)``: the batch every device gets a copy of."""
    g = case.geometry
    device = torch.device("cpu")
    live = live_mask(case, device)
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
    p = case.poison
    for which, hit in cache_sides(case):
        side = case.kv_cache.side(which)
        poisons = poison is not None and hit
        codes_hit = poisons and p.hits_data
        if codes_hit and g.latent:  # the poison fills some columns of its slots, garbage the rest
            host[f"{which}.garbage"] = _slots(~live)
            host[f"{which}.poison"] = _slots(poison)
        elif codes_hit:
            host[f"{which}.garbage"] = _slots(~live & ~poison)
            host[f"{which}.poison"] = _slots(poison)
        else:
            host[f"{which}.garbage"] = _slots(~live)
        # zp4 zero points live in the scale words: their garbage comes with the scales'
        for part, has in (("scales", side.token_head), ("zeros", side.zero_points != "none")):
            if poisons and part in p.part_names() and has:
                host[f"{which}.garbage_{part}"] = _slots(~live & ~poison)
                host[f"{which}.poison_{part}"] = _slots(poison)
            elif has:
                host[f"{which}.garbage_{part}"] = _slots(~live)
        if side.scale_format == "float32-zp4":
            host[f"{which}.garbage_scales"] = _slots(~live)

    def cache(which: str):
        kinds = {kind: host[f"{which}.{kind}"] for kind in ("garbage", "poison", "garbage_scales", "poison_scales",
                                                            "garbage_zeros", "poison_zeros")
                 if f"{which}.{kind}" in host}
        return _cache(case, which, {"live": host["live"], **kinds}, garbage_seed)

    key_cache, k_scale_cache, k_zero_cache = cache("k")
    value_cache, v_scale_cache, v_zero_cache = cache("v") if not g.latent else (None, None, None)

    seq_t, pos_t = host["seq"], host["pos"]
    q = query_values(case, seq_t, pos_t).view(len(seq_of), g.num_q_heads, g.head_size)

    block_table = host["table"].to(torch.int32)
    blocks = block_table.long()[seq_t, pos_t // g.block_size] if seq_of else seq_t
    slots = blocks * g.block_size + pos_t % g.block_size
    kv = case.kv_cache
    k, v = new_tokens(case, key_cache, value_cache, (k_scale_cache, v_scale_cache), (k_zero_cache, v_zero_cache),
                      slots, q.dtype)

    sinks = None
    if case.sinks:
        index = torch.arange(g.num_q_heads, device=device, dtype=torch.int64)
        sinks = (values.uniform(case.data_seed, "sinks", index) * 2.0).to(torch.float32)
    scales = per_tensor_scales(case, device)
    for name, tensor in (("k_scale_cache", k_scale_cache), ("v_scale_cache", v_scale_cache),
                         ("k_zero_cache", k_zero_cache), ("v_zero_cache", v_zero_cache)):
        if tensor is not None:
            scales[name] = tensor

    margin = _margin_fill(case, garbage_seed, poisoned)
    caches = {"key_cache": key_cache} if g.latent else {"key_cache": key_cache, "value_cache": value_cache}
    allocations = _surround(case, margin, _cache_margins(case, margin, garbage_seed, poisoned), q=q, k=k, v=v,
                            **caches, block_table=block_table, seq_lens=host["seq_lens"].to(torch.int32),
                            query_start_loc=host["starts"].to(torch.int32), sinks=sinks, **scales)
    # in one host buffer: copying the batch (to a device, or for the LEAK run) is then one copy
    return PagedBatch.from_allocations(case, redzones.move_together(allocations, device))


def per_tensor_scales(case: Case, device) -> dict[str, torch.Tensor]:
    """``k_scale`` / ``v_scale`` (float32 ``[1]``) of the sides quantized with per-tensor scales."""
    kv = case.kv_cache
    found = {}
    for which, name, value in (("k", "k_scale", kv.k_scale), ("v", "v_scale", kv.v_scale)):
        side = kv.side(which)
        if side.quantized and not side.token_head:
            found[name] = torch.tensor([value], dtype=torch.float32, device=device)
    return found


def new_tokens(case: Case, key_cache, value_cache, scale_caches, zero_caches, slots: torch.Tensor,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The new tokens' k and v as the caches hold them at ``slots``: dequantized, unrotated,
    rounded to ``dtype`` (a latent cache's v: the first ``latent_rank`` entries of k)."""
    kv = case.kv_cache
    k = rotation.unrotate(quantization.values_at(case, key_cache, kv.k_scale, scale_caches[0], slots,
                                                 which="k", zero_cache=zero_caches[0]), kv).to(dtype)
    if case.geometry.latent:
        return k, k[..., :case.geometry.latent_rank].contiguous()
    v = rotation.unrotate(quantization.values_at(case, value_cache, kv.v_scale, scale_caches[1], slots,
                                                 which="v", zero_cache=zero_caches[1]), kv).to(dtype)
    return k, v


def _cache_margins(case: Case, margin, garbage_seed: int, poisoned: bool):
    """What each cache's redzones hold, by cache name: codes for a quantized side, else ``margin``'s floats."""
    kv = case.kv_cache
    return {name: (_code_margin(case, which, garbage_seed, poisoned) if kv.side(which).quantized else margin)
            for which, name in (("k", "key_cache"), ("v", "value_cache"))}


def _margin_fill(case: Case, garbage_seed: int, poisoned: bool):
    """What float redzones hold: NaN in the poisoned run, seeded finite garbage otherwise
    (so a kernel that reads past a tensor also changes its output between the LEAK runs)."""
    seed = _derive(case.data_seed, 3, garbage_seed)
    made: dict[str, torch.Tensor] = {}  # per stream, the longest run of values computed so far

    def garbage(stream: str):
        if poisoned:
            return float("nan")

        def make(shape):
            # a margin's values depend on the element's number alone, so a cache's margin before
            # its first block holds the first values of the (longer) margin after its last
            count = math.prod(shape)
            if stream not in made or made[stream].numel() < count:
                made[stream] = _garbage(seed, stream, torch.arange(count, dtype=torch.int64))
            return made[stream][:count].view(shape)
        return make

    return garbage


def _code_margin(case: Case, which: str, garbage_seed: int, poisoned: bool):
    """What the redzones of a quantized cache hold: a NaN code (int8, which has
    none: its largest code; unsigned codes, all ones) in the poisoned run, seeded
    finite garbage codes otherwise."""
    kv_dtype = case.kv_cache.side(which).dtype
    seed = _derive(case.data_seed, 3, garbage_seed)

    def margin(stream: str):
        def make(shape):
            count = math.prod(shape)
            if poisoned:
                codes = torch.full((count,), quantization.margin_code(kv_dtype), dtype=torch.uint8)
            else:
                codes = quantization.finite_codes(values.random_bits(seed, stream, torch.arange(count)), kv_dtype)
            return quantization.as_encoding(codes, kv_dtype).view(shape)
        return make

    return margin


# Per-(slot, head) tables beside the caches: scales and zero points, in redzones of their own.
PARAMETER_CACHES = ("k_scale_cache", "v_scale_cache", "k_zero_cache", "v_zero_cache")
INPUT_ORDER = ("q", "k", "v", "key_cache", "value_cache", "block_table", "seq_lens", "query_start_loc", "sinks",
               "k_scale", "v_scale", *PARAMETER_CACHES)


def _surround(case: Case, margin, cache_margins, **tensors) -> dict[str, redzones.Allocation]:
    z = redzones
    caches = {name: tensors.pop(name) for name in ("key_cache", "value_cache", *PARAMETER_CACHES) if name in tensors}
    made = _surround_small(case, margin, **tensors)
    for name in ("key_cache", "value_cache"):
        if name in caches:  # a latent cache is key_cache alone
            made[name] = z.surround(caches[name], z.CACHE_BLOCKS_BEFORE, z.CACHE_BLOCKS_AFTER,
                                    cache_margins[name](f"redzone_{name}"))
    for name in PARAMETER_CACHES:
        if name in caches:
            made[name] = z.surround(caches[name], z.CACHE_BLOCKS_BEFORE, z.CACHE_BLOCKS_AFTER, margin(f"redzone_{name}"))
    return {name: made[name] for name in INPUT_ORDER if name in made}


def _surround_small(case: Case, margin, **tensors) -> dict[str, redzones.Allocation]:
    """Every input but the caches in its redzones (on the tensors' own device)."""
    z = redzones
    g = case.geometry
    trap = g.num_blocks  # the first block past the cache: a redzone block, NaN in the poisoned run
    reach = (case.table_width + z.TABLE_EXTRA_COLUMNS) * g.block_size
    made = {
        "q": z.surround(tensors["q"], 0, z.TOKEN_ROWS_AFTER, margin("redzone_q")),
        "k": z.surround(tensors["k"], 0, z.TOKEN_ROWS_AFTER, margin("redzone_k")),
        "v": z.surround(tensors["v"], 0, z.TOKEN_ROWS_AFTER, margin("redzone_v")),
        "block_table": z.table(tensors["block_table"], trap),
        "seq_lens": z.surround(tensors["seq_lens"], 0, z.LENGTHS_AFTER, reach),
        "query_start_loc": z.surround(tensors["query_start_loc"], 0, z.LENGTHS_AFTER,
                                      case.num_tokens + z.OUT_GUARD_ROWS),
    }
    if tensors.get("sinks") is not None:
        made["sinks"] = z.surround(tensors["sinks"], 0, z.SINKS_AFTER, margin("redzone_sinks"))
    for name in ("k_scale", "v_scale"):
        if name in tensors:
            made[name] = z.surround(tensors[name], 0, z.SCALES_AFTER, margin(f"redzone_{name}"))
    return made


def refill_dead_slots(batch: PagedBatch, garbage_seed: int) -> PagedBatch:
    """A copy of the host ``batch`` with the finite garbage of ``garbage_seed`` in every dead slot and redzone.

    For a freshly built ``batch`` this is bit-identical to
    ``build_on_host(batch.case, garbage_seed=garbage_seed, poisoned=False)``
    (live slots and the new tokens are copied, not recomputed), so the LEAK
    check's second batch costs a copy plus the garbage.
    """
    case = batch.case
    g = case.geometry
    copy = batch.clone()
    dead = _slots(~live_mask(case, "cpu"))
    seed = _derive(case.data_seed, 2, garbage_seed)
    sides = (("k", copy.key_cache, copy.k_scale_cache, copy.k_zero_cache),
             ("v", copy.value_cache, copy.v_scale_cache, copy.v_zero_cache))
    for which, cache, scale_cache, zero_cache in sides[:len(cache_sides(case))]:
        if case.kv_cache.side(which).quantized:
            codes = quantization.codes_of(cache).reshape(cache.shape[0] * cache.shape[1], -1)
            scales = None if scale_cache is None else scale_cache.reshape(-1, g.num_kv_heads)
            zeros = None if zero_cache is None else zero_cache.reshape(-1, g.num_kv_heads)
            _fill_dead_codes(case, which, codes, scales, zeros, dead, dead, dead, garbage_seed)
        else:
            flat = cache.flatten(0, 1).flatten(1)
            _fill(flat, dead, lambda index: _garbage(seed, f"garbage_{which}", index))
    margin = _margin_fill(case, garbage_seed, poisoned=False)
    cache_margins = _cache_margins(case, margin, garbage_seed, poisoned=False)
    for name, allocation in copy.allocations.items():
        if allocation.base.is_floating_point() or name in cache_margins:
            fill = cache_margins.get(name, margin)(f"redzone_{name}")
            for _, where in reversed(allocation.sides()):  # the longest margin first (``_margin_fill``)
                redzones._fill_rows(allocation.base, where[0] if len(where) == 1 else where, fill)
    return copy
