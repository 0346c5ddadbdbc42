"""Poison: which dead slots get hostile values, and which values."""
from __future__ import annotations

from hypothesis import strategies as st

from reference.case import POISON_TENSORS, POISON_VALUES, Case, Poison, PoisonSite
from reference.semantics import dead_slots, slot_liveness

# One slot first: shrinking moves toward the simplest repro.
SCOPES = ("slot", "slots", "blocks", "all")


@st.composite
def poisons(draw, case: Case) -> Poison:
    """Shrinks toward NaN in V of one dead slot, the one a kernel likeliest reads."""
    value = draw(st.sampled_from(POISON_VALUES))
    tensors = draw(st.sampled_from(POISON_TENSORS))
    dead = dead_slots(case)
    scope = draw(st.sampled_from(SCOPES))
    if not dead or scope == "all":
        return Poison(value, tensors, None)
    if scope == "slot":
        block, offset = dead[draw(st.integers(0, len(dead) - 1))]
        return Poison(value, tensors, (PoisonSite(block, offset),))
    if scope == "blocks":
        live = slot_liveness(case)
        whole = sorted({b for b, _ in dead if not any(live[b])})
        if whole:
            chosen = draw(st.lists(st.sampled_from(whole), min_size=1, max_size=4, unique=True))
            return Poison(value, tensors, tuple(PoisonSite(b) for b in sorted(chosen)))
    picks = draw(st.lists(st.integers(0, len(dead) - 1), min_size=1, max_size=8, unique=True))
    return Poison(value, tensors, tuple(PoisonSite(*dead[i]) for i in sorted(picks)))
