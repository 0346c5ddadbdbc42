"""What a production case can be aimed at: one kind of batch, with some production situations.

The situations are those ``reference.features`` names for a case (``size_features``), and the
kernel's largest head size.  An ``Aim`` asks ``strategies.production`` for a case of one batch kind
(``reference.features.BATCH_KINDS``) that reaches its situations where the kernel and the size
allow: the compile-time ones through the shape or the pool entry drawn, the others through the
lengths, the number of sequences and the placement of blocks.  ``strategies.targets`` says which
situations a kernel declares for each batch kind; a campaign aims at those it has not met yet.
"""
from __future__ import annotations

from dataclasses import dataclass

# The situations, as ``reference.features.size_features`` names them.
WIDE_GROUP = "gqa-group>16"
HUGE_OFFSETS = "offsets>2^31"
LONG_SEQUENCE = "seq-len>=32768"
MANY_SEQUENCES = "sequences>=128"
FAR_WINDOW = "far-window"
# The kernel's largest head size (a target names it: ``head-size=256``).
LARGEST_HEAD = "largest-head-size"

SITUATIONS = (WIDE_GROUP, LARGEST_HEAD, HUGE_OFFSETS, LONG_SEQUENCE, MANY_SEQUENCES, FAR_WINDOW)
# The situations a pool entry (the compile-time part of a case) decides.
COMPILE_TIME = (WIDE_GROUP, LARGEST_HEAD, FAR_WINDOW)
# What each asks of the lengths: the first sequence of at least this many keys.
LONG_KEYS = 32768
# ... and of the batch: at least this many sequences.
MANY = 128
# A floor is kept whole or cut to a share of it in these steps: shrinking cuts it step by step.
FLOOR_STEPS = 1024


@dataclass(frozen=True)
class Aim:
    """A case of batch kind ``kind`` reaching ``situations`` (``SITUATIONS``).

    A drawn case's aim (``strategies.production.draw_aim``) may hold less than the aim it was drawn
    for: the situations whose bends shrinking dropped, and the share of each floor it keeps, in
    ``FLOOR_STEPS`` (``length_share``: of the first sequence's fewest keys, ``count_share``: of
    the fewest sequences)."""

    kind: str
    situations: frozenset[str] = frozenset()
    length_share: int = FLOOR_STEPS
    count_share: int = FLOOR_STEPS
    spread: int = 0  # a drawn number that spreads aimed cases over the pool entries that serve them

    def __contains__(self, situation: str) -> bool:
        return situation in self.situations


@dataclass(frozen=True)
class Aims:
    """What a production draw aims at, and how hard: with ``urgent`` (targets left to meet) each
    aim weighs ``URGENT_WEIGHT`` against one for a free draw, so most production cases go to the
    targets; without, the aims together weigh as much as a free draw (a steady half).  A free draw
    comes first: shrinking moves toward it."""

    aims: tuple[Aim, ...] = ()
    urgent: bool = True

    def __bool__(self) -> bool:
        return bool(self.aims)

    def weights(self) -> tuple[int, ...]:
        """The weights of (a free draw, *aims)."""
        if self.urgent:
            return (1, *(URGENT_WEIGHT,) * len(self.aims))
        return (len(self.aims), *(1,) * len(self.aims))


# With targets left to meet, three production cases in four or more are aimed at them: the rest
# still explore freely (a free draw finds what no aim names).
URGENT_WEIGHT = 3
