"""Poison: which dead slots get hostile values, and which values."""
from __future__ import annotations

from hypothesis import strategies as st

from nanfuzz.reference.case import POISON_TENSORS, POISON_VALUES, Case, Poison, PoisonSite
from nanfuzz.reference.features import POISON_CLASS_FLAGS
from nanfuzz.reference.semantics import Dead, dead_slots, slot_liveness, slot_reasons

# One slot first: shrinking moves toward the simplest repro.
SCOPES = ("slot", "slots", "blocks", "all")


@st.composite
def poisons(draw, case: Case, classes: tuple[str, ...] | None = None) -> Poison:
    """Shrinks toward NaN in V of one dead slot, the one a kernel likeliest reads.

    ``classes`` (names of ``reference.features.POISON_CLASS_FLAGS``) limits
    the poison to those dead-slot classes; every other dead slot keeps
    finite garbage.
    """
    value = draw(st.sampled_from(POISON_VALUES))
    tensors = draw(st.sampled_from(POISON_TENSORS))
    dead = dead_slots(case)
    if classes is not None:
        wanted = Dead(0)
        for name in classes:
            wanted |= POISON_CLASS_FLAGS[name]
        reasons = slot_reasons(case)
        dead = [(b, o) for b, o in dead if reasons[b][o] & wanted]
        if not dead:
            return Poison(value, tensors, ())
    scope = draw(st.sampled_from(SCOPES))
    if scope == "all":
        return Poison(value, tensors, None if classes is None else tuple(PoisonSite(b, o) for b, o in dead))
    if not dead:
        return Poison(value, tensors, None)
    if scope == "slot":
        block, offset = dead[draw(st.integers(0, len(dead) - 1))]
        return Poison(value, tensors, (PoisonSite(block, offset),))
    if scope == "blocks":
        live = slot_liveness(case)
        dead_set = set(dead)
        whole = sorted({b for b, _ in dead
                        if not any(live[b]) and all((b, o) in dead_set for o in range(case.geometry.block_size))})
        if whole:
            chosen = draw(st.lists(st.sampled_from(whole), min_size=1, max_size=4, unique=True))
            return Poison(value, tensors, tuple(PoisonSite(b) for b in sorted(chosen)))
    picks = draw(st.lists(st.integers(0, len(dead) - 1), min_size=1, max_size=8, unique=True))
    return Poison(value, tensors, tuple(PoisonSite(*dead[i]) for i in sorted(picks)))
