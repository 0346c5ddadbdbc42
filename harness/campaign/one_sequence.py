"""The shrunk failure cut down to one of its sequences, where that one alone fails the same way.

Hypothesis shrinks a batch's first sequence and its other sequences separately, so a failure
that needs one long sequence can stop at two: a first sequence of one key beside the long one.
To drop the short one the shrinker would have to lengthen the first while deleting the second,
a move it does not make.  Here each sequence of the shrunk case, longest first, is judged alone
(the same geometry, cache and poison, the other sequences' blocks now dead and poisoned); the
first that gives the same verdict becomes the repro.  A case alone that the kernel does not take,
or that passes, or is declined for memory, changes nothing: the shrunk failure stands.  Alone, a
sequence keeps its query key (``Case.query_keys``), so its queries keep their values: every number
the kernel reads for it is the one it read in the batch.
"""
from __future__ import annotations

from dataclasses import replace

from nanfuzz.harness.campaign.result import Campaign
from nanfuzz.harness.judge.check import Verdict
from nanfuzz.harness.kernel import Kernel
from nanfuzz.harness.launch.worker import Declined
from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.case import Case
from nanfuzz.reference.errors import NanfuzzError
from nanfuzz.reference.semantics import poison_dead_slots_only

# the longest sequences tried alone: each try is one more run of the kernel
MOST_TRIED = 4


def alone(case: Case, index: int) -> Case:
    """``case`` with sequence ``index`` alone, its queries' values kept, or NanfuzzError where that is no
    valid batch."""
    key = case.query_keys[index] if case.query_keys is not None else index
    single = replace(case, sequences=(case.sequences[index],), query_keys=(key,) if key else None)
    single = poison_dead_slots_only(single)
    return single.validate()


def cut_to_one_sequence(campaign: Campaign, caps: Capabilities, check, kernel: Kernel, interpreter: bool) -> bool:
    """Make ``campaign``'s failure the first of its case's sequences, longest first, that fails alone
    with the same verdict (``check``: the campaign's check of a case), and say so; else leave it as it is."""
    failure, case = campaign.failure, campaign.failing_case
    if failure is None or case is None or len(case.sequences) < 2 or failure.verdict is Verdict.HANG:
        return False  # a HANG's check costs a whole timeout
    longest_first = sorted(range(len(case.sequences)), key=lambda i: (-case.sequences[i].seq_len, i))
    tries = ((index, lambda index=index: alone(case, index)) for index in longest_first[:MOST_TRIED])
    index = first_failing_the_same(campaign, tries, caps, check, kernel, interpreter)
    if index is None:
        return False
    campaign.notes.append(f"{campaign.kernel}: the shrunk case's sequence {index} of {len(case.sequences)} "
                          f"fails alone with the same verdict: the repro is that sequence alone")
    return True


def first_failing_the_same(campaign: Campaign, tries, caps: Capabilities, check, kernel: Kernel, interpreter: bool):
    """Of ``tries`` (label, a function making a smaller case, NanfuzzError where it is no valid batch,
    or None where there is none), the first case the kernel takes that fails with the campaign's
    verdict (``check``: the campaign's check of a case) becomes the campaign's failure; its label,
    or None where none does.  A case tried before is not tried again."""
    tried = []
    for label, make in tries:
        try:
            smaller = make()
        except NanfuzzError:
            continue
        if smaller is None or smaller in tried:
            continue
        tried.append(smaller)
        if caps.unsupported(smaller, interpreter=interpreter) or kernel.declines(smaller):
            continue
        outcome = check(smaller)
        if isinstance(outcome, Declined) or outcome.verdict is not campaign.failure.verdict:
            continue
        campaign.failure, campaign.failing_case = outcome, smaller
        return label
    return None
