"""A pool entry the kernel takes, for a target it keeps declining.

A target such as ``mixed:gqa-group>16`` can be decided by the specialisation pool: only an entry
with a group past 16 reaches it, and the draws aimed at any target go to the entries that serve
it.  When those entries are ones the kernel's supports() declines (AITER's unified_attention past
its findings takes no float32 at head 256, and a seed's one wide entry may be just that), the
target would stay out of the campaign's reach for its whole life.  ``entry_it_takes`` looks for
another entry whose drawn cases reaching the target include one the kernel takes; the campaign
adds it to its pool and aims at the target again.  A kernel that declines the situation itself
(caches past 2^31 elements on int32 offsets) takes none of the candidates, and the target stays
declined, with nothing compiled for it.
"""
from __future__ import annotations

from typing import Callable

from hypothesis.errors import HypothesisException

from nanfuzz.harness.campaign.scope import campaign_production_size, campaign_strategy
from nanfuzz.harness.campaign.settings import Settings
from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.case import Case
from nanfuzz.reference.features import case_features
from nanfuzz.strategies.aims import Aim, Aims
from nanfuzz.strategies.production import entry_provides, wide_entries
from nanfuzz.strategies.steady import drawn
from nanfuzz.strategies.targets import Targets, situation_of

CANDIDATES = 8  # entries with the situation tried, in the order a seeded draw gives them
DRAWS = 3        # cases of each drawn aimed at the target: one the kernel takes is enough


def entry_it_takes(target: str, targets: Targets, caps: Capabilities, settings: Settings, pool: tuple,
                   key: str, takes: Callable[[Case], bool], tried_first: tuple = ()):
    """An entry, not in ``pool`` unless among ``tried_first`` (entries added for other targets,
    tried before fresh ones), whose drawn cases reach ``target`` and include one that ``takes``;
    None when no candidate is taken."""
    kind, situation = target.partition(":")[0], situation_of(target)
    size = campaign_production_size(settings)
    bound = size.bound(caps)
    fresh = wide_entries(caps, 8 * CANDIDATES, key, interpreter=settings.device == "cpu", known=pool)
    candidates = [e for e in (*tried_first, *fresh) if entry_provides(e, situation, bound, size, kind)]
    aims = Aims((Aim(kind, frozenset({situation})),), urgent=True)
    for entry in candidates[:CANDIDATES]:
        try:
            cases = drawn(campaign_strategy(caps, settings, (entry,), "production", aims), DRAWS)
        except HypothesisException:  # no valid case of it aimed so (Unsatisfiable): the next one
            continue
        if any(target in targets.met(case_features(case), case.geometry.head_size) and takes(case) for case in cases):
            return entry
    return None
