"""Re-run a repro in a fresh worker process and say whether the bug is still there, bit for bit."""
from __future__ import annotations

from dataclasses import dataclass

from nanfuzz.harness.judge.check import Outcome
from nanfuzz.harness.launch.import_probe import load_kernel
from nanfuzz.harness.launch.worker import judged
from nanfuzz.harness.report.repro import environment, load_repro
from nanfuzz.harness.campaign.settings import Settings


@dataclass
class Replay:
    kernel: str
    recorded_verdict: str
    outcome: Outcome
    same_environment: bool
    identical_output: bool | None  # None when the environment differs (bits are not comparable)

    @property
    def still_fails(self) -> bool:
        return self.outcome.failed

    def line(self) -> str:
        if not self.outcome.failed:
            return f"{self.kernel}: PASS (recorded {self.recorded_verdict}): the finding no longer reproduces"
        bits = ""
        if self.outcome.verdict.value != self.recorded_verdict:
            pass  # another verdict: its bits say nothing about the recording's
        elif self.identical_output is True:
            bits = "; output bits identical to the recording"
        elif self.identical_output is False:
            bits = "; output bits DIFFER from the recording on the same device and versions"
        return (f"{self.kernel}: {self.outcome.verdict.value} (recorded {self.recorded_verdict}){bits}\n"
                f"  {self.outcome.summary}")


def replay(path: str, *, kernel_name: str | None = None, settings: Settings | None = None,
           device: str | None = None) -> Replay:
    from nanfuzz.harness.launch.subjects import make_subject

    settings = settings or Settings(device=device or "cpu")
    record = load_repro(path)
    kernel = load_kernel(kernel_name or record["kernel"], settings)
    subject = make_subject(kernel, settings)
    try:
        outcome = judged(subject.check(record["case"], digest=True))
    finally:
        subject.close()
    recorded_env = record.get("environment", {})
    now_env = environment(settings.device)
    same = all(recorded_env.get(k) == now_env.get(k) for k in ("device_name", "torch", "triton"))
    identical = None
    if same and kernel_name is None and record.get("output_sha256"):
        identical = outcome.output_sha256 == record["output_sha256"]
    return Replay(kernel.name, record.get("verdict", "?"), outcome, same, identical)
