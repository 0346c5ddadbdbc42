"""The shrunk failure with the blocks wholly below its window dropped from the front of its sequences.

A windowed sequence's blocks below every query's window are dead, yet each is a key count
Hypothesis must shrink away, and a long batch's first sequence shrinks only to its floor
(``strategies.cases.LongBatches``: a thousand keys and more under the interpreter).  So a failure
met at the edge of a long sequence's window stops at a thousand keys, all but a few of them dead.
Here whole dead blocks are cut from the front of every windowed sequence of the shrunk case: its
table's later entries move up (padding fills the end), its length shrinks by the keys cut, and
every key left keeps its block, its slot and its distance to each query.  First every such block,
then every one but those holding a poison site (which move up, still below the window), then as
many as keep each position's offset within a tile's and a partition's keys (what a kernel counts
from position 0) (``CUTS``); the first cut that fails with the same verdict becomes the repro.
A cut the kernel does not take, or that passes, fails another way or is declined for memory,
changes nothing: the shrunk failure stands.
"""
from __future__ import annotations

import math
from dataclasses import replace

from nanfuzz.harness.campaign.one_sequence import first_failing_the_same
from nanfuzz.harness.campaign.result import Campaign
from nanfuzz.harness.judge.check import Verdict
from nanfuzz.harness.kernel import Kernel
from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.case import Case
from nanfuzz.reference.semantics import poison_dead_slots_only

# The cuts tried, in order: (keys whose multiple a cut keeps positions modulo, whether the dead blocks
# that hold poison sites stay): every dead block; every one but those the poison sits in (a kernel
# that loads them, moved up below the window); then a tile's and a split-KV partition's worth
CUTS = ((1, False), (1, True), (256, False), (1024, False))


def cut(case: Case, keys: int, keep_poisoned: bool = False) -> Case | None:
    """``case`` with each windowed sequence's leading dead blocks cut, a multiple of ``keys`` keys of
    them (``keep_poisoned``: all but those holding a poison site, which stay in order); None where
    nothing is cut (NanfuzzError where that is no valid batch)."""
    bs = case.geometry.block_size
    step = math.lcm(bs, keys) // bs
    poisoned = {site.block for site in case.poison.sites or ()} if keep_poisoned else set()
    sequences, dropped = [], 0
    for s in case.sequences:
        lo, _ = s.live_range(case.sliding_window)
        lead = (lo // bs) // step * step if case.sliding_window and s.query_len else 0
        kept = tuple(b for b in s.block_table[:lead] if b in poisoned)
        n = lead - len(kept)
        if n:
            s = replace(s, seq_len=s.seq_len - n * bs,
                        block_table=kept + s.block_table[lead:] + (case.padding_block,) * n)
        sequences.append(s)
        dropped += n
    if not dropped:
        return None
    return poison_dead_slots_only(replace(case, sequences=tuple(sequences))).validate()


def drop_expired_blocks(campaign: Campaign, caps: Capabilities, check, kernel: Kernel, interpreter: bool) -> bool:
    """Make ``campaign``'s failure the first cut (``CUTS``) that fails with the same verdict (``check``:
    the campaign's check of a case), and say so; else leave it as it is."""
    failure, case = campaign.failure, campaign.failing_case
    if failure is None or case is None or not case.sliding_window or failure.verdict is Verdict.HANG:
        return False  # a HANG's check costs a whole timeout
    tries = (((keys, keep), lambda keys=keys, keep=keep: cut(case, keys, keep)) for keys, keep in CUTS)
    if first_failing_the_same(campaign, tries, caps, check, kernel, interpreter) is None:
        return False
    before = sum(s.seq_len for s in case.sequences)
    after = sum(s.seq_len for s in campaign.failing_case.sequences)
    campaign.notes.append(f"{campaign.kernel}: the shrunk case fails the same with the blocks wholly below its "
                          f"window cut from the front of its sequences ({before} keys, {after} left): the repro "
                          "is that case")
    return True
