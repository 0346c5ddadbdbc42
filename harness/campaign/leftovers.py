"""Cases that campaigns which died unobserved left in flight, replayed before anything else.

A campaign journals its case before the subject sees it (``harness.campaign.journal``),
so a campaign process killed outright (``kill -9``) leaves its case behind.
A leftover that fails again, whatever its verdict, is the campaign's failure
(a campaign killed while it shrank a MISMATCH leaves that MISMATCH); one that
passes is a note, never a verdict (the process may have died of a signal from
outside).
"""
from __future__ import annotations

from nanfuzz.harness.campaign.journal import leftovers
from nanfuzz.harness.campaign.result import Campaign
from nanfuzz.harness.campaign.settings import Settings
from nanfuzz.harness.kernel import Kernel
from nanfuzz.harness.launch.subjects import make_subject
from nanfuzz.harness.launch.worker import judged


def recover_leftovers(kernel: Kernel, settings: Settings, subject=None) -> tuple[Campaign | None, list[str]]:
    """The failure a leftover case gives again, if any, and a note per leftover.  Without a
    ``subject``, one is started only if there is a leftover to replay."""
    cases = leftovers(settings.state_dir, kernel.name)
    if cases and subject is None:
        subject = make_subject(kernel, settings)
        try:
            return _replay(kernel, settings, subject, cases)
        finally:
            subject.close()
    return _replay(kernel, settings, subject, cases)


def _replay(kernel, settings, subject, cases) -> tuple[Campaign | None, list[str]]:
    notes: list[str] = []
    for case in cases:
        refused = kernel.capabilities.unsupported(case, interpreter=settings.device == "cpu") or kernel.declines(case)
        if refused:  # the kernel's capabilities or supports() changed since
            notes.append(f"{kernel.name}: a campaign process died while running a case earlier, which the kernel no "
                         f"longer takes ({refused}); not replayed")
            continue
        outcome = judged(subject.check(case, digest=True))
        if outcome.failed:
            notes.append(f"{kernel.name}: a campaign process died while running this case earlier; "
                         f"replayed in a fresh worker it gives {outcome.verdict.value}")
            return Campaign(kernel=kernel.name, device=settings.device, failure=outcome, failing_case=case,
                            recovered_crash=True, notes=notes), notes
        notes.append(f"{kernel.name}: a campaign process died while running a case earlier; replayed in a fresh "
                     f"worker it gives {outcome.verdict.value}, so the death was not this kernel's doing (no verdict)")
    return None, notes
