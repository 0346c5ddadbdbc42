"""How an exported repro runs its case: load the kernel, judge it, and give the exit status a gate reads.

``nanfuzz export`` copies this module into every script it writes, after
``runtime.py``.  The status is 0 when the kernel passes, 1 for a finding and
nothing else, and 2, with one line naming what is missing, when the kernel
cannot be loaded or run here: its adapter or its package does not import, a
module its launch needs is not installed (numpy, for Triton's interpreter), a
library's kernel files are not where the script looked (``LibraryMissing`` is
an ImportError).  None of these says anything about the kernel.

The pytest file judges the case in a fresh process that runs the file itself
(``in_a_fresh_process``): the mode Triton runs in and the modules the adapter
imports stay in that process, away from the session's other tests.
"""
from __future__ import annotations

import faulthandler
import json
import os
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass, field

from nanfuzz.harness.report.export.runtime import Finding, judge

# The status of a run that found nothing, found something, or could not load or run the kernel.
PASSED, FOUND, CANNOT_RUN = 0, 1, 2
# Lines of a child's output a failure message quotes.
QUOTED_LINES = 20
# How faulthandler's dump after a timeout begins ("Timeout (0:05:00)!").
HANG_DUMP = "Timeout ("


@dataclass
class Reproduction:
    """What one run of the case showed: its exit status, the report to print, and the findings."""

    status: int
    report: str
    findings: list[Finding] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps({"status": self.status, "report": self.report,
                           "findings": [[f.verdict, f.message] for f in self.findings]})

    @classmethod
    def from_json(cls, text: str) -> Reproduction:
        data = json.loads(text)
        return cls(data["status"], data["report"], [Finding(v, m) for v, m in data["findings"]])


def cannot_load(exc: BaseException) -> str:
    """One line naming what is missing, from what loading the kernel raised."""
    said = " ".join(str(exc).split())
    line = said if isinstance(exc, ImportError) and said else ": ".join(filter(None, (type(exc).__name__, said)))
    top = (exc.name or "").partition(".")[0] if isinstance(exc, ImportError) else ""
    if top == "nanfuzz" and _stands_in_for_nanfuzz():
        return (line + "; nanfuzz is not installed, and this script stands in for it with the kernel contract and "
                "its helpers alone: install nanfuzz for the rest")
    if isinstance(exc, ModuleNotFoundError) and top == "numpy":
        return "no module named 'numpy' (Triton's interpreter needs it: pip install numpy)"
    if isinstance(exc, ModuleNotFoundError) and top:
        return f"no module named {exc.name!r} (install {top}, or run this from the folder it is imported from)"
    return line


def _stands_in_for_nanfuzz() -> bool:
    return getattr(sys.modules.get("nanfuzz"), "__stand_in__", False)


def reproduce(run_kernel, case, poison: dict, device: str, *, load=None, announce: str = "",
              hang_seconds: float | None = None, **judging) -> Reproduction:
    """Load the kernel (``load``: what imports it, if anything must), print ``announce``, and judge
    ``case``; launches that outlast ``hang_seconds`` end the process with every thread's stack (a
    HANG, exit status 1)."""
    if load is not None:
        try:
            load()
        except (Exception, SystemExit) as exc:  # whatever its import raised, the kernel is not loaded: no finding
            return Reproduction(CANNOT_RUN, f"cannot load the kernel: {cannot_load(exc)}")
    if announce:
        print(announce, flush=True)
    if hang_seconds is not None:
        faulthandler.dump_traceback_later(hang_seconds, exit=True)
    try:
        verdicts = judge(run_kernel, case, poison, device, **judging)
    except ImportError as exc:  # what the first launch imports: numpy for Triton's interpreter, a library's files
        return Reproduction(CANNOT_RUN, f"cannot load the kernel: {cannot_load(exc)}")
    except (Exception, SystemExit) as exc:  # the kernel raised, or exited: a CRASH
        shown = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return Reproduction(FOUND, f"{shown}FAIL CRASH: the kernel raised",
                            [Finding("CRASH", " ".join(f"{type(exc).__name__}: {exc}".split()))])
    finally:
        faulthandler.cancel_dump_traceback_later()
    invalid = [f for f in verdicts.findings if f.verdict == "ERROR"]
    if invalid:
        return Reproduction(CANNOT_RUN, f"cannot judge the case: {invalid[0].message}")
    return Reproduction(FOUND if verdicts.failed else PASSED, verdicts.report(), verdicts.findings)


def in_a_fresh_process(script: str, device: str, timeout: float) -> Reproduction:
    """The reproduction of ``python script --json PATH``, run under Triton's interpreter when ``device``
    is the CPU, in the current folder (a user's adapter is imported from it).  A process that dies
    or outlasts ``timeout`` seconds is a finding (CRASH, HANG) as the script's own run would be."""
    env = dict(os.environ, **({"TRITON_INTERPRET": "1"} if device == "cpu" else {}))
    with tempfile.TemporaryDirectory(prefix="nanfuzz-repro-") as folder:
        path = os.path.join(folder, "reproduction.json")
        try:
            proc = subprocess.run([sys.executable, script, "--json", path], env=env, capture_output=True,
                                  text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            return Reproduction(FOUND, f"HANG: the run of the case did not end within {timeout:g} s",
                                [Finding("HANG", f"no end within {timeout:g} s\n{_tail(exc.stderr)}")])
        if os.path.exists(path):
            with open(path, encoding="utf-8") as saved:
                return Reproduction.from_json(saved.read())
    output = _tail(proc.stderr) or _tail(proc.stdout)
    if proc.returncode == CANNOT_RUN:
        return Reproduction(CANNOT_RUN, output.splitlines()[-1] if output else f"{script} exited with status 2")
    if proc.returncode == 1 and HANG_DUMP in proc.stderr:  # the launch outlasted its time (``reproduce``)
        message = f"a launch did not return in time; where every thread was:\n{output}"
        return Reproduction(FOUND, f"HANG: {message}", [Finding("HANG", message)])
    how = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit status {proc.returncode}"
    message = f"the process running the case died ({how}) before its verdicts\n{output}"
    return Reproduction(FOUND, f"CRASH: {message}", [Finding("CRASH", message)])


def _tail(text) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return "\n".join((text or "").rstrip().splitlines()[-QUOTED_LINES:])
