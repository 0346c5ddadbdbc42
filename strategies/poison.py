"""Poison: which dead slots get hostile values, and which values."""
from __future__ import annotations

import functools

from hypothesis import strategies as st

from nanfuzz.reference.case import (DATA_POISON_VALUES, POISON_PARTS, POISON_TENSORS, SCALE_POISON_VALUES, Case,
                                    Poison, PoisonSite)
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
    kv = case.kv_cache
    parts = pick(draw, POISON_PARTS) if kv.token_head else "data"
    values = poison_values(kv.dtype, parts)
    value = pick(draw, values, (FIRST_VALUE_WEIGHT,) + (1,) * (len(values) - 1))
    tensors = pick(draw, POISON_TENSORS, TENSOR_WEIGHTS)
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


@functools.lru_cache(maxsize=None)
def poison_values(kv_cache_dtype: str, parts: str) -> tuple[str, ...]:
    """The poison values a cache of ``kv_cache_dtype`` can hold in ``parts``, NaN first where it exists."""
    data = DATA_POISON_VALUES[kv_cache_dtype]
    if parts == "data":
        return data
    if parts == "scales":
        return SCALE_POISON_VALUES
    return tuple(v for v in SCALE_POISON_VALUES if v in data)
