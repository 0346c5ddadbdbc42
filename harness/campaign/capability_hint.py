"""Which declared capability a finding hangs on: the same case without a window, sinks or non-causal attention.

An adapter that leaves ``Capabilities(sliding_window=True)`` (the default) for
a kernel without windows gets windowed cases and a MISMATCH on each, which
looks like a bug of the kernel.  When the shrunk failing case has one of
these features and the same case without it passes, the evidence names the
capability field, so that its author can tell a wrong declaration from a bug.
On a kernel expected to be caught (the self-check's old variants) the note
explains what the variant gets wrong instead: its declaration is right, and
hiding the feature would hide the bug.
"""
from __future__ import annotations

from dataclasses import replace

from nanfuzz.harness.campaign.result import Campaign
from nanfuzz.harness.judge.check import Verdict
from nanfuzz.harness.kernel import Kernel
from nanfuzz.harness.launch.worker import Declined
from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.errors import NanfuzzError
from nanfuzz.reference.semantics import poison_dead_slots_only

# (capability field, does the case use it, the case without it, what it is)
FEATURES = (
    ("sliding_window", lambda case: case.sliding_window > 0, lambda case: replace(case, sliding_window=0),
     "sliding windows"),
    ("sinks", lambda case: case.sinks, lambda case: replace(case, sinks=False), "attention sinks"),
    ("non_causal", lambda case: not case.causal, lambda case: replace(case, causal=True), "non-causal attention"),
)


def name_the_capability(campaign: Campaign, caps: Capabilities, check, kernel: Kernel, interpreter: bool, *,
                        expected: bool = False) -> None:
    """Judge the failing case once without each declared feature it has (``check``: the campaign's
    check of a case); note the first whose absence passes (``expected``: the finding is the one the
    kernel is kept to show).  A case without the feature that the kernel does not take (its
    capabilities or its ``supports()``), or that is declined for memory, says nothing either way:
    the next feature is tried, and the failure stands."""
    failure, case = campaign.failure, campaign.failing_case
    if failure is None or failure.verdict is Verdict.HANG:  # a HANG's check costs a whole timeout
        return
    for field, uses, without, what in FEATURES:
        if not (uses(case) and getattr(caps, field)):
            continue
        try:
            other = poison_dead_slots_only(without(case))
            other.validate()
        except NanfuzzError:
            continue  # the feature is what makes the case a valid batch (a live key in the null block without it)
        if caps.unsupported(other, interpreter=interpreter) or kernel.declines(other):
            continue
        outcome = check(other)
        if isinstance(outcome, Declined) or outcome.failed:
            continue
        if expected:
            note = (f"fails only with {what}: the same case without them passes, so what this variant gets wrong "
                    f"is its handling of {what} (the finding it is expected to show)")
        else:
            note = (f"fails only with {what}: the same case without them passes; if the kernel does not take "
                    f"{what}, declare Capabilities({field}=False)")
        failure.evidence = {**failure.evidence, "capability": field, "capability_note": note}
        campaign.notes.append(f"{campaign.kernel}: {note}")
        return


