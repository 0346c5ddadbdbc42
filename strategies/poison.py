"""Poison: which dead slots get hostile values, and which values."""
from __future__ import annotations

import functools

from hypothesis import strategies as st

from nanfuzz.reference.case import (DATA_POISON_VALUES, POISON_PARTS, POISON_TENSORS, SCALE_POISON_VALUES, Case,
                                    KVCache, Poison, PoisonSite, poison_landings, poison_values_for)
from nanfuzz.reference.features import POISON_CLASS_FLAGS
from nanfuzz.reference.semantics import Dead, dead_slots, slot_reasons
from nanfuzz.strategies.draws import integers, pick

# One slot first: shrinking moves toward the simplest repro.
SCOPES = ("slot", "slots", "blocks", "all")

# Generation favours the values and tensors that expose the most bugs per
# example: NaN (what 0 * x turns into a NaN row whatever the kernel's
# arithmetic) and both K and V (a kernel may mask one and not the other).
# Every other choice keeps a share of its own, and shrinking still moves
# toward NaN in V alone (the first of each option list).
TENSOR_WEIGHTS = (1, 1, 2)  # v, k, kv
FIRST_VALUE_WEIGHT = 2  # NaN where the cache dtype holds it; each other value weighs 1


def draw_poison(draw, case: Case, classes: tuple[str, ...] | None = None) -> Poison:
    """Poison for ``case``, drawn with ``draw`` (a composite strategy's).

    Shrinks toward NaN in V of one dead slot, the one a kernel likeliest reads;
    generated, it favours NaN, in K and V both (``TENSOR_WEIGHTS``, ``FIRST_VALUE_WEIGHT``).

    ``classes`` (names of ``reference.features.POISON_CLASS_FLAGS``) limits
    the poison to those dead-slot classes; every other dead slot keeps
    finite garbage.  A quantized cache gets the hostile values its dtype can
    hold; with per-token-head scales the poison goes into the slots' codes,
    their scales or both (shrinking toward the codes).
    """
    value, tensors, parts = draw_poison_kind(draw, case.kv_cache)
    if classes is None:
        scope = pick(draw, SCOPES)
        if scope == "all":  # every dead slot: no need to list them
            return Poison(value, tensors, None, parts)
        dead = dead_slots(case)
    else:
        wanted = Dead(0)
        for name in classes:
            wanted |= POISON_CLASS_FLAGS[name]
        reasons = slot_reasons(case)
        dead = [(b, o) for b, o in dead_slots(case) if reasons[b][o] & wanted]
        if not dead:
            return Poison(value, tensors, (), parts)
        scope = pick(draw, SCOPES)
        if scope == "all":
            return Poison(value, tensors, tuple(PoisonSite(b, o) for b, o in dead), parts)
    if not dead:
        return Poison(value, tensors, None, parts)
    if scope == "slot":
        block, offset = dead[draw(integers(0, len(dead) - 1))]
        return Poison(value, tensors, (PoisonSite(block, offset),), parts)
    if scope == "blocks":
        whole = _whole_blocks(case, dead)
        if whole:
            chosen = draw(_block_picks(whole))
            return Poison(value, tensors, tuple(PoisonSite(b) for b in sorted(chosen)), parts)
    picks = draw(_slot_picks(len(dead)))
    return Poison(value, tensors, tuple(PoisonSite(*dead[i]) for i in sorted(picks)), parts)


def _whole_blocks(case: Case, dead: list[tuple[int, int]]) -> tuple[int, ...]:
    """The blocks all of whose slots are in ``dead`` (dead slots are never live, so none of them is)."""
    counts: dict[int, int] = {}
    for b, _ in dead:
        counts[b] = counts.get(b, 0) + 1
    return tuple(sorted(b for b, n in counts.items() if n == case.geometry.block_size))


@functools.lru_cache(maxsize=256)
def _block_picks(whole: tuple[int, ...]):
    return st.lists(st.sampled_from(whole), min_size=1, max_size=4, unique=True)


@functools.lru_cache(maxsize=1024)
def _slot_picks(count: int):
    return st.lists(integers(0, count - 1), min_size=1, max_size=8, unique=True)


def draw_poison_kind(draw, kv: KVCache) -> tuple[str, str, str]:
    """(value, tensors, parts) of a poison for a cache ``kv``.

    For fp8 and int8 caches: the parts (codes, scales or both, with per-token-head
    scales), a value all of them hold, then the tensors.  An extended cache (zero
    points, unsigned or packed codes, V's own format) draws the tensors first, then
    a value some part of their caches can hold (NaN first and favoured, as ever),
    then parts that all hold it: NaN stays as likely in a cache of 4-bit codes,
    which hold none, as elsewhere, there in the scales and zero points.
    """
    weights = lambda values: (FIRST_VALUE_WEIGHT,) + (1,) * (len(values) - 1)  # noqa: E731
    if not kv.extended:
        parts = pick(draw, POISON_PARTS[:3]) if kv.token_head else "data"
        values = poison_values(kv.dtype, parts)
        value = pick(draw, values, weights(values))
        return value, pick(draw, POISON_TENSORS, TENSOR_WEIGHTS), parts
    tensors = pick(draw, POISON_TENSORS, TENSOR_WEIGHTS)
    values = tuple(v for v in SCALE_POISON_VALUES
                   if any(v in landing_values(kv, tensors, parts) for parts in poison_parts(kv, tensors)))
    value = pick(draw, values, weights(values))
    return value, tensors, pick(draw, tuple(parts for parts in poison_parts(kv, tensors)
                                           if value in landing_values(kv, tensors, parts)))


@functools.lru_cache(maxsize=256)
def poison_parts(kv: KVCache, tensors: str) -> tuple[str, ...]:
    """The parts (``case.POISON_PARTS``, codes first) a poison in ``tensors`` of cache ``kv`` can fill."""
    return tuple(parts for parts in POISON_PARTS if landing_values(kv, tensors, parts))


@functools.lru_cache(maxsize=1024)
def landing_values(kv: KVCache, tensors: str, parts: str) -> tuple[str, ...]:
    """The values every (cache, part) a poison fills can hold, NaN first where they all do; empty when
    a part it names is in none of its caches, or no value fits them all."""
    poison = Poison("nan", tensors, None, parts)
    landings = poison_landings(kv, poison)
    if {part for _, part in landings} != set(poison.part_names()):
        return ()
    order = SCALE_POISON_VALUES
    return tuple(v for v in order if all(v in poison_values_for(kv, which, part) for which, part in landings))


@functools.lru_cache(maxsize=None)
def poison_values(kv_cache_dtype: str, parts: str) -> tuple[str, ...]:
    """The poison values a cache of ``kv_cache_dtype`` can hold in ``parts``, NaN first where it exists."""
    data = DATA_POISON_VALUES[kv_cache_dtype]
    if parts == "data":
        return data
    if parts == "scales":
        return SCALE_POISON_VALUES
    return tuple(v for v in SCALE_POISON_VALUES if v in data)
