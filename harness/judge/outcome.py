"""A check's result: the verdict, its one-line summary and its evidence."""
from __future__ import annotations

import enum
import os
import re
import traceback
from dataclasses import dataclass, field
from pathlib import Path


class Verdict(str, enum.Enum):
    """In order of severity; a check reports the first that applies."""

    CRASH = "CRASH"
    HANG = "HANG"
    NONFINITE = "NONFINITE"
    NONDETERMINISTIC = "NONDETERMINISTIC"
    LEAK = "LEAK"
    CLOBBER = "CLOBBER"  # above MISMATCH: a kernel that writes its KV cache corrupts every later step
    MISMATCH = "MISMATCH"
    # only with --strict-reads: nothing above, but the kernel's loads addressed dead slots
    # (traced under Triton's interpreter, harness.judge.reads)
    DEAD_READ = "DEAD_READ"
    PASS = "PASS"


@dataclass
class Outcome:
    verdict: Verdict
    summary: str
    evidence: dict = field(default_factory=dict)
    output_sha256: str | None = None
    timings: dict = field(default_factory=dict)
    cpu_seconds: float = 0.0  # CPU time of the process that judged it (a worker, or the caller's)
    # a supervised GPU worker's own Triton compiles (and cache loads) during the check, its waits
    # for other processes' compiles left out (those are the "compile" timing)
    compiled_seconds: float = 0.0
    # a CRASH that left the device context unusable (sticky CUDA/HIP error): the worker must be replaced
    fatal: bool = False
    # the Triton kernels the poisoned run launched: name -> its specialisations (``judge.paths``)
    paths: dict = field(default_factory=dict)
    # the dead slots the poisoned run's loads addressed (``harness.judge.reads.Reads.to_dict()``);
    # None where the run was not traced (a GPU, or a launch that raised)
    reads: dict | None = None
    # the dead-slot classes the index buffers the adapter made for the poisoned run point at
    # (``reference.layouts.recording``); empty for a kernel handed the block table alone
    layout: list = field(default_factory=list)
    # seconds the check waited for device memory before it built anything (``harness.judge.memory``)
    memory_waited: float = 0.0
    # its waits by what stood in the way when each began (``harness.judge.memory.HELD_BY_OTHERS``...)
    memory_wait_causes: dict = field(default_factory=dict)
    # wall seconds of the whole check in the process that judged it: its phases (``timings``), the
    # memory wait and what none of them counts (admission, the memory ledger, clean-up); 0 where
    # no check ran to the end (an outcome the supervisor made of a dead or hung worker)
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return self.verdict is not Verdict.PASS

    @property
    def may_be_the_machine_s(self) -> bool:
        """A failure the machine can cause on its own, told from the kernel's by replays: a HANG (a
        launch held up by a busy device or host), or a worker that died with the fork server it came
        from (killed from outside)."""
        return self.verdict is Verdict.HANG or (self.verdict is Verdict.CRASH
                                                and bool(self.evidence.get("fork_server_died")))

    def to_dict(self) -> dict:
        return {"verdict": self.verdict.value, "summary": self.summary, "evidence": self.evidence,
                "output_sha256": self.output_sha256}


# Driver errors after which a CUDA or HIP context is dead for the rest of the process.
_FATAL_SIGNS = ("illegal memory access", "illegal address", "misaligned address", "unspecified launch failure",
                "device-side assert", "an illegal instruction", "hipErrorIllegalAddress", "hipErrorLaunchFailure",
                "memory access fault", "CUDA error: launch failure", "context is destroyed")


def device_fault(exc: BaseException) -> bool:
    """Whether ``exc`` reports a fault that leaves the device context unusable."""
    text = f"{type(exc).__name__}: {exc}".lower()
    return any(sign.lower() in text for sign in _FATAL_SIGNS)


# Triton's CompilationError: "at LINE:COL:", the kernel's source up to that line, a caret, then what went wrong
_SOURCE_POSITION = re.compile(r"at \d+:\d+:?")


def one_line(exc: BaseException, limit: int = 300) -> str:
    """``Type: message`` in one line.  A Triton compile error's first line is only where in the
    kernel it stopped; its cause is the last line, and the kernel's line stands above the caret."""
    lines = [line.rstrip() for line in str(exc).strip().splitlines()]
    if not lines:
        return type(exc).__name__
    text = lines[0]
    if len(lines) > 1 and _SOURCE_POSITION.fullmatch(lines[0].strip()):
        caret = next((i for i in range(len(lines) - 1, 0, -1) if lines[i].strip() == "^"), None)
        cause = next((line.strip() for line in reversed(lines) if line.strip() not in ("", "^")), "")
        source = lines[caret - 1].strip() if caret else ""
        text = f"{lines[0].strip().rstrip(':')}" + (f" in `{source}`" if source else "") + f": {cause}"
    return f"{type(exc).__name__}: {text}"[:limit]


# A traceback's file, as a repro (a file a user commits and shares) names it
_TRACEBACK_FILE = re.compile(r'File "([^"]+)"')
_NANFUZZ_ROOT = str(Path(__file__).resolve().parents[2]) + os.sep


def portable_path(path: str) -> str:
    """``path`` without what is this machine's: nanfuzz's own files from its root
    (``harness/judge/runs.py``), installed packages from ``site-packages/``, the rest of the
    home folder as ``~/``."""
    if path.startswith(_NANFUZZ_ROOT):
        return path[len(_NANFUZZ_ROOT):]
    marker = f"site-packages{os.sep}"
    if marker in path:
        return marker + path.split(marker, 1)[1]
    home = os.path.expanduser("~")
    if home not in ("", os.sep, "~") and path.startswith(home + os.sep):
        return "~" + path[len(home):]
    return path


def crash(exc: BaseException, when: str) -> Outcome:
    """The CRASH of a launch that raised ``exc``; one whose allocation failed says so."""
    from nanfuzz.harness.judge.memory import out_of_memory

    frames = [_TRACEBACK_FILE.sub(lambda m: f'File "{portable_path(m.group(1))}"', frame)
              for frame in traceback.format_exception(type(exc), exc, exc.__traceback__)]
    message = one_line(exc)
    fatal = device_fault(exc)
    evidence = {"error": message, "traceback": "".join(frames[-6:])[-4000:], "device_fault": fatal}
    if out_of_memory(exc):
        evidence["out_of_memory"] = True
        return Outcome(Verdict.CRASH, f"CRASH {when}: the kernel ran out of device memory during its launch "
                                      f"({message})", evidence, fatal=fatal)
    return Outcome(Verdict.CRASH, f"CRASH {when}: {message}", evidence, fatal=fatal)
