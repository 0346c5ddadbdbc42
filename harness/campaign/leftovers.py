"""Cases that campaigns which died unobserved left in flight, replayed before anything else.

A campaign journals its case before the subject sees it (``harness.campaign.journal``),
so a campaign process killed outright (``kill -9``, or a kernel that signals the
campaign's own process group where it runs there: ``--no-isolation``) leaves its
case behind.  A leftover is replayed in a fresh worker wherever another process
can rebuild the kernel, whatever the campaign's own isolation, so that a kernel
that took the campaign down is a verdict of the next run and not a second death.
A leftover that fails again, whatever its verdict, is the campaign's failure (a
campaign killed while it shrank a MISMATCH leaves that MISMATCH); one that
passes is a note, never a verdict (the process may have died of a signal from
outside).  A kernel that only runs in the campaign's process and dies again
replaying its leftover has killed it twice on one case: a CRASH, without a third
death.  A leftover whose memory does not come free is left for a later run.
"""
from __future__ import annotations

from nanfuzz.harness.campaign.journal import Journal, Leftover, leftovers, put_back
from nanfuzz.harness.campaign.result import Campaign
from nanfuzz.harness.campaign.settings import Settings
from nanfuzz.harness.judge.outcome import Outcome, Verdict
from nanfuzz.harness.kernel import Kernel
from nanfuzz.harness.launch.subjects import make_subject, worker_spec
from nanfuzz.harness.launch.worker import Declined, Supervised


def recover_leftovers(kernel: Kernel, settings: Settings, subject=None, journal: Journal | None = None,
                      patience: float | None = None) -> tuple[Campaign | None, list[str]]:
    """The failure a leftover case gives again, if any, and a note per leftover.  ``subject``: the
    campaign's, used where it is a supervised worker; otherwise a worker is started for the
    replays (in this process only where none can rebuild the kernel, its replays ``journal``ed).
    ``patience``: how long a replay waits for its device memory."""
    found = leftovers(settings.state_dir, kernel.name)
    if not found:
        return None, []
    own = None
    if not isinstance(subject, Supervised):
        spec = worker_spec(kernel, settings)
        if spec is not None:
            subject = own = Supervised(spec, launch_timeout=settings.timeout)
        elif subject is None:
            subject = own = make_subject(kernel, settings)
    try:
        return _Replays(kernel, settings, subject, journal, patience).run(found)
    finally:
        if own is not None:
            own.close()


class _Replays:
    def __init__(self, kernel, settings, subject, journal, patience):
        self.kernel, self.settings, self.subject = kernel, settings, subject
        self.journal, self.patience = journal, patience
        self.in_process = not isinstance(subject, Supervised)
        self.notes: list[str] = []

    def run(self, found: list[Leftover]) -> tuple[Campaign | None, list[str]]:
        kernel, settings = self.kernel, self.settings
        where = "in the campaign's process" if self.in_process else "in a fresh worker"
        for leftover in found:
            case = leftover.case
            refused = kernel.capabilities.unsupported(case, interpreter=settings.device == "cpu") or kernel.declines(case)
            if refused:  # the kernel's capabilities or supports() changed since
                self.notes.append(f"{kernel.name}: a campaign process died while running a case earlier, which the "
                                  f"kernel no longer takes ({refused}); not replayed")
                continue
            twice = leftover.died_replaying and self.in_process
            outcome = self._died_twice() if twice else self._replay(leftover)
            if outcome is None:
                continue
            if outcome.failed:
                self.notes.append(f"{kernel.name}: a campaign process died while running this case earlier; "
                                  + ("it died again replaying it there" if twice else
                                     f"replayed {where} it gives {outcome.verdict.value}"))
                return Campaign(kernel=kernel.name, device=settings.device, failure=outcome, failing_case=case,
                                recovered_crash=True, notes=self.notes), self.notes
            self.notes.append(f"{kernel.name}: a campaign process died while running a case earlier; replayed {where} "
                              f"it gives {outcome.verdict.value}, so the death was not this kernel's doing (no verdict)")
        return None, self.notes

    def _replay(self, leftover: Leftover) -> Outcome | None:
        if self.journal is not None:
            self.journal.record(leftover.case, replaying=True)
        answer = self.subject.check(leftover.case, digest=True, patience=self.patience)
        if self.journal is not None:
            self.journal.clear()
        if isinstance(answer, Declined):
            put_back(self.settings.state_dir, self.kernel.name, leftover)
            self.notes.append(f"{self.kernel.name}: a campaign process died while running a case earlier, which "
                              f"could not be replayed now ({answer.reason}); it is left for the next run")
            return None
        return answer

    @staticmethod
    def _died_twice() -> Outcome:
        why = ("the campaign's process died running this case, and died again replaying it there (the kernel runs "
               "in the campaign's own process: --no-isolation, or a Kernel no other process can rebuild)")
        return Outcome(Verdict.CRASH, f"CRASH: {why}", {"error": why, "during_launch": None})
