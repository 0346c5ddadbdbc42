"""Steering a campaign toward the production targets it has not met.

A campaign with production cases declares its targets (``strategies.targets``): each production
situation in each kind of batch the kernel takes, out of reach where its capabilities, the
campaign's size or its pool rule it out.  Hypothesis runs in chunks; before each, ``aims`` looks at
what the examples so far reached and aims the production draw (``strategies.aims``) at the targets
met fewer than ``QUOTA`` times, most production cases going to them; once every target within
reach is met that often, the draw still aims at them all at a steady share.  ``pool_growth_due``
says when a long campaign adds a few entries to its specialisation pool (``strategies.cases``).
"""
from __future__ import annotations

from typing import Mapping

from nanfuzz.harness.report.statistics import Statistics
from nanfuzz.strategies.aims import Aims
from nanfuzz.strategies.targets import Targets

# A campaign meets each target at least this often ("a few times") before it aims at it less.
QUOTA = 3
# A campaign grows its pool once it has drawn about this many examples per entry since the last
# growth, and after GROWTH_SECONDS of it (twice as long before each later growth): four new shapes
# compile in seconds on a GPU, a tenth or less of the time since, and a 15-minute gate grows its
# pool about twice, a two-hour nightly campaign about six times, never by hundreds of entries.
EXAMPLES_PER_ENTRY = 10
GROWTH_SECONDS = 120.0


# A target whose drawn cases the kernel's supports() declined this often, none of them met, is no
# longer aimed at: a kernel that declines caches past 2^31 elements (its int32 offsets on file)
# otherwise had most of its production draws steered there and declined.
DECLINED_QUOTA = 8


def declined(targets: Targets, statistics: Statistics, forgiven: Mapping[str, int] | None = None) -> list[str]:
    """The targets within reach that the kernel's supports() keeps declining (``DECLINED_QUOTA``),
    counting for each only the declines past ``forgiven`` (those before the pool took an entry
    the kernel takes for it: ``harness.campaign.accepted_entry``)."""
    forgiven = forgiven or {}
    return [name for name in targets.within_reach() if statistics.target_count(name) == 0
            and statistics.declined_targets[name] - forgiven.get(name, 0) >= DECLINED_QUOTA]


def _aimable(targets: Targets, statistics: Statistics, forgiven: Mapping[str, int] | None) -> list[str]:
    """The targets within reach but those the kernel declines."""
    given_up = set(declined(targets, statistics, forgiven))
    return [name for name in targets.within_reach() if name not in given_up]


def _below_quota(names: list[str], statistics: Statistics) -> list[str]:
    return [name for name in names if statistics.target_count(name) < QUOTA]


def unmet(targets: Targets, statistics: Statistics, forgiven: Mapping[str, int] | None = None) -> list[str]:
    """The targets within reach that fewer than ``QUOTA`` examples reached, less those declined."""
    return _below_quota(_aimable(targets, statistics, forgiven), statistics)


def aims(targets: Targets, statistics: Statistics, forgiven: Mapping[str, int] | None = None) -> Aims:
    """What the next chunk's production draw aims at: the unmet targets, urgently; else all of them
    but those the kernel declines."""
    aimable = _aimable(targets, statistics, forgiven)
    left = _below_quota(aimable, statistics)
    if left:
        return Aims(targets.aims(left), urgent=True)
    return Aims(targets.aims(aimable), urgent=False)


def pool_growth_due(examples_since: int, seconds_since: float, pool_entries: int, growths: int) -> bool:
    """Has the campaign drawn long enough from its pool (grown ``growths`` times) to grow it again?"""
    return (pool_entries > 0 and examples_since >= EXAMPLES_PER_ENTRY * pool_entries
            and seconds_since >= GROWTH_SECONDS * 2 ** growths)
