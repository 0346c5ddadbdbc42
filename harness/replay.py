"""Re-run a repro in a fresh worker process and say whether the bug is still there, bit for bit."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from nanfuzz.harness.judge.check import Outcome, Verdict
from nanfuzz.harness.import_path import find_import_root
from nanfuzz.harness.launch.import_probe import load_kernel
from nanfuzz.harness.report.repro import environment, load_repro
from nanfuzz.harness.campaign.settings import Settings
from nanfuzz.reference.errors import NanfuzzError


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


def _resolve_recorded(name: str, record: dict, path: str, settings: Settings):
    """The kernel, and the settings its worker needs: a user's adapter module that does not import
    from here is looked for where the repro says it was found, in any folder above this one or
    above the repro (the same repository), and imported from there."""
    try:
        return load_kernel(name, settings), settings
    except NanfuzzError as exc:
        origin = record.get("kernel_module")
        if name != record["kernel"] or not isinstance(origin, dict) or "cannot import module" not in str(exc):
            raise
        try:
            root = find_import_root(origin, [Path.cwd(), Path(path).parent])
        except (KeyError, TypeError):
            raise exc from None
        if root is None:
            hint = Path(origin["repository"]) / origin["import_root"]
            raise NanfuzzError(f"{exc}; the repro found it at {origin['file']} in the repository {origin['repository']}, "
                               f"and no folder above {Path.cwd()} or the repro holds that file: replay from inside "
                               f"that repository, or add {hint.resolve()} to PYTHONPATH") from None
        settings = settings.replace(import_root=root)
        return load_kernel(name, settings), settings


def replay(path: str, *, kernel_name: str | None = None, settings: Settings | None = None,
           device: str | None = None) -> Replay:
    from nanfuzz.harness.launch.subjects import check_once

    settings = settings or Settings(device=device or "cpu")
    record = load_repro(path)
    if record.get("verdict") == Verdict.DEAD_READ.value:
        settings = settings.replace(strict_reads=True)  # the finding exists only under --strict-reads
    kernel, settings = _resolve_recorded(kernel_name or record["kernel"], record, path, settings)
    outcome = check_once(kernel, settings, record["case"], digest=True, patience=settings.shrink_budget)
    recorded_env = record.get("environment", {})
    now_env = environment(settings.device)
    same = all(recorded_env.get(k) == now_env.get(k) for k in ("device_name", "torch", "triton"))
    identical = None
    if same and kernel_name is None and record.get("output_sha256"):
        identical = outcome.output_sha256 == record["output_sha256"]
    return Replay(kernel.name, record.get("verdict", "?"), outcome, same, identical)
