"""Poison: which dead slots get hostile values, and which values."""
from __future__ import annotations

from hypothesis import strategies as st

from nanfuzz.reference.case import (DATA_POISON_VALUES, POISON_PARTS, POISON_TENSORS, SCALE_POISON_VALUES, Case,
                                    Poison, PoisonSite)
from nanfuzz.reference.features import POISON_CLASS_FLAGS
from nanfuzz.reference.semantics import Dead, dead_slots, slot_liveness, slot_reasons

# One slot first: shrinking moves toward the simplest repro.
SCOPES = ("slot", "slots", "blocks", "all")


@st.composite
def poisons(draw, case: Case, classes: tuple[str, ...] | None = None) -> Poison:
    """Shrinks toward NaN in V of one dead slot, the one a kernel likeliest reads.

    ``classes`` (names of ``reference.features.POISON_CLASS_FLAGS``) limits
    the poison to those dead-slot classes; every other dead slot keeps
    finite garbage.  A quantized cache gets the hostile values its dtype can
    hold; with per-token-head scales the poison goes into the slots' codes,
    their scales or both (shrinking toward the codes).
    """
    kv = case.kv_cache
    parts = draw(st.sampled_from(POISON_PARTS)) if kv.token_head else "data"
    value = draw(st.sampled_from(poison_values(kv.dtype, parts)))
    tensors = draw(st.sampled_from(POISON_TENSORS))
    dead = dead_slots(case)
    if classes is not None:
        wanted = Dead(0)
        for name in classes:
            wanted |= POISON_CLASS_FLAGS[name]
        reasons = slot_reasons(case)
        dead = [(b, o) for b, o in dead if reasons[b][o] & wanted]
        if not dead:
            return Poison(value, tensors, (), parts)
    scope = draw(st.sampled_from(SCOPES))
    if scope == "all":
        return Poison(value, tensors, None if classes is None else tuple(PoisonSite(b, o) for b, o in dead), parts)
    if not dead:
        return Poison(value, tensors, None, parts)
    if scope == "slot":
        block, offset = dead[draw(st.integers(0, len(dead) - 1))]
        return Poison(value, tensors, (PoisonSite(block, offset),), parts)
    if scope == "blocks":
        live = slot_liveness(case)
        dead_set = set(dead)
        whole = sorted({b for b, _ in dead
                        if not any(live[b]) and all((b, o) in dead_set for o in range(case.geometry.block_size))})
        if whole:
            chosen = draw(st.lists(st.sampled_from(whole), min_size=1, max_size=4, unique=True))
            return Poison(value, tensors, tuple(PoisonSite(b) for b in sorted(chosen)), parts)
    picks = draw(st.lists(st.integers(0, len(dead) - 1), min_size=1, max_size=8, unique=True))
    return Poison(value, tensors, tuple(PoisonSite(*dead[i]) for i in sorted(picks)), parts)


def poison_values(kv_cache_dtype: str, parts: str) -> tuple[str, ...]:
    """The poison values a cache of ``kv_cache_dtype`` can hold in ``parts``, NaN first where it exists."""
    data = DATA_POISON_VALUES[kv_cache_dtype]
    if parts == "data":
        return data
    if parts == "scales":
        return SCALE_POISON_VALUES
    return tuple(v for v in SCALE_POISON_VALUES if v in data)
