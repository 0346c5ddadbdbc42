"""Repro artifacts: JSON (the record), a standalone script, a block-table picture."""
from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import platform
import re
from pathlib import Path

from nanfuzz.harness.judge.check import Outcome, Verdict
from nanfuzz.harness.kernel import Kernel
from nanfuzz.harness.report.atomic import write_atomically
from nanfuzz.harness.report.picture import picture
from nanfuzz.reference.case import READABLE_SCHEMA_VERSIONS, SCHEMA_VERSION, Case
from nanfuzz.reference.errors import NanfuzzError

SCHEMA = "nanfuzz-repro"
# What a repro may be before it is even parsed.  The largest case the strategies draw at
# production size (256 sequences of 128k keys in blocks of 16) writes 26 MB of JSON; the
# deepest repro nanfuzz writes nests 6 levels (evidence, its per-sequence spans).
MAX_REPRO_BYTES = 64 << 20
MAX_REPRO_DEPTH = 32
_JSON_NESTING = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')  # strings (skipped whole) and brackets


def environment(device: str) -> dict:
    import hypothesis
    import torch
    import triton

    if device == "cuda":
        backend = "rocm " + str(torch.version.hip) if torch.version.hip else "cuda " + str(torch.version.cuda)
        try:
            name = torch.cuda.get_device_name()
        except Exception as exc:  # a device too busy to tell: the finding is written all the same
            name = f"GPU (name unavailable: {type(exc).__name__})"
        where = f"{name} ({backend})"
    else:
        where = "cpu (Triton interpreter)"
    return {"device": device, "device_name": where, "torch": torch.__version__, "triton": triton.__version__,
            "hypothesis": hypothesis.__version__, "python": platform.python_version()}


def case_id(case: Case) -> str:
    return hashlib.sha256(case.to_json().encode()).hexdigest()[:10]


def _names(kernel: Kernel | str) -> tuple[str, str]:
    """(import path, display name) of a Kernel, or of a kernel known by its display name."""
    from nanfuzz.harness.registry import import_path

    return (import_path(kernel), kernel.name) if isinstance(kernel, Kernel) else (kernel, kernel)


def repro_record(kernel: Kernel | str, case: Case, outcome: Outcome, device: str) -> dict:
    """The JSON record.  ``kernel`` is what resolves the kernel again (its import path
    for a user's own kernel), ``kernel_name`` the name it reports itself by."""
    path, name = _names(kernel)
    record = {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "kernel": path,
        "kernel_name": name,
        "case": case.to_dict(),
        **outcome.to_dict(),
        "environment": environment(device),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    origin = _adapter_origin(path)
    if origin is not None:
        record["kernel_module"] = origin  # where its adapter module was found, for a replay from elsewhere
    return record


def _adapter_origin(path: str) -> dict | None:
    """A user kernel's adapter module: its file and import root relative to its repository."""
    from nanfuzz.harness.import_path import module_origin
    from nanfuzz.harness.registry import library_of

    module, colon, _ = path.partition(":")
    if not colon or "@" in path or library_of(path):
        return None
    return module_origin(module)


def repro_stem(kernel_name: str, case: Case, outcome: Outcome) -> str:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", kernel_name.replace("@", "-")).strip("._")[:80] or "kernel"
    return f"{name}-{outcome.verdict.value.lower()}-{case_id(case)}"


def write_repro(kernel: Kernel | str, case: Case, outcome: Outcome, directory: str | Path, device: str) -> list[Path]:
    """Write ``<stem>.json``, ``<stem>.py`` and ``<stem>.txt``; return their paths.

    Pass the Kernel itself where there is one: a repro must record the import
    path that resolves it, and a display name alone only finds one that was
    resolved in this process.
    """
    _, name = _names(kernel)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    stem = repro_stem(name, case, outcome)
    files = [(directory / f"{stem}.json", json.dumps(repro_record(kernel, case, outcome, device), indent=1) + "\n"),
             (directory / f"{stem}.py", standalone_script(kernel, case, outcome)),
             # a kernel's error message may hold anything, lone surrogates included
             (directory / f"{stem}.txt", f"{name}: {outcome.summary}\n\n{picture(case)}\n")]
    written = []
    try:
        for path, text in files:
            written.append(write_atomically(path, text, errors="backslashreplace"))
    except BaseException:  # all three or none: a repro half written is no repro
        for path in written:
            with contextlib.suppress(OSError):
                path.unlink()
        raise
    return written


def load_repro(path: str | Path) -> dict:
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_REPRO_BYTES + 1)
    except OSError as exc:
        raise NanfuzzError(f"cannot read repro {str(path)!r}: {exc.strerror}") from None
    if len(raw) > MAX_REPRO_BYTES:
        raise NanfuzzError(f"{path}: over {MAX_REPRO_BYTES >> 20} MiB, more than any repro nanfuzz writes; "
                           "a repro is the .json nanfuzz wrote")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise NanfuzzError(f"{path}: not UTF-8 text (byte {exc.start}); a repro is the .json nanfuzz wrote") from None
    return repro_from_json(text, str(path))


def repro_from_json(text: str, path: str = "repro") -> dict:
    """A repro's record from its JSON text (``path`` names it in messages)."""
    if len(text) > MAX_REPRO_BYTES:
        raise NanfuzzError(f"{path}: over {MAX_REPRO_BYTES >> 20} MiB, more than any repro nanfuzz writes; "
                           "a repro is the .json nanfuzz wrote")
    if _nested_deeper(text, MAX_REPRO_DEPTH):
        raise NanfuzzError(f"{path}: nested more than {MAX_REPRO_DEPTH} levels deep, deeper than any repro nanfuzz "
                           "writes; a repro is the .json nanfuzz wrote")
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise NanfuzzError(f"{path}: not JSON ({exc.msg} at line {exc.lineno}); a repro is the .json nanfuzz wrote") from None
    if not isinstance(record, dict) or record.get("schema") != SCHEMA:
        raise NanfuzzError(f"{path}: not a nanfuzz repro (missing \"schema\": \"{SCHEMA}\")")
    version = record.get("schema_version")
    if type(version) is not int or version not in READABLE_SCHEMA_VERSIONS:
        readable = ", ".join(map(str, READABLE_SCHEMA_VERSIONS))
        raise NanfuzzError(f"{path}: repro schema version {version!r}; this nanfuzz reads {readable}")
    if not isinstance(record.get("kernel"), str) or "case" not in record:
        raise NanfuzzError(f"{path}: repro lacks \"kernel\" (a string) or \"case\"")
    record["case"] = Case.from_dict(record["case"])
    record.setdefault("verdict", Verdict.PASS.value)
    record.setdefault("kernel_name", record["kernel"])  # repros before kernel_name: one name for both
    return record


def _nested_deeper(text: str, limit: int) -> bool:
    """Do the brackets of JSON ``text`` nest deeper than ``limit``?  Counted before parsing:
    Python's parser meets a deep enough nesting as a RecursionError."""
    depth = 0
    for token in _JSON_NESTING.finditer(text):
        bracket = token.group()
        if bracket in "[{":
            depth += 1
            if depth > limit:
                return True
        elif bracket in "]}":
            depth -= 1
    return False


# What each verdict means, for the repro script's last line.
VERDICT_MEANINGS = {
    Verdict.CRASH: "the kernel raised, or its launch failed",
    Verdict.NONFINITE: "output rows hold NaN/Inf where the oracle is finite",
    Verdict.LEAK: "the output changes when only dead-slot contents change",
    Verdict.MISMATCH: "a finite output row is off the float64 oracle by more than the bound times what a correct kernel of its arithmetic may be off (a same-precision reference's error plus a rounding allowance)",
    Verdict.CLOBBER: "the kernel wrote outside its output rows or into its inputs",
    Verdict.DEAD_READ: "the kernel's loads addressed dead slots, though their values never reached the output "
                       "(a finding under --strict-reads)",
    Verdict.PASS: "output finite, within the bound of the oracle, no dead slot read, nothing clobbered",
}

# Only static text here: every value from the run (names, summary, picture,
# case) goes in below as a Python literal written by ascii(), so no text a
# kernel produced can end a string early or be run as code.
_SCRIPT_HEAD = '''\
#!/usr/bin/env python3
# A nanfuzz repro.  Run it from your repository root, with nanfuzz installed:
#
#     python path/to/this_file.py [--device cpu|cuda]
#
# It rebuilds the case's tensors, runs the kernel through the same verdict as
# `nanfuzz replay`, prints the verdict and exits 1 while the bug is there, 0 once
# the kernel passes (2: the kernel cannot be loaded or cannot take this case).
# Without a GPU the kernel runs under Triton's interpreter.
import argparse
import os
import sys

'''

_SCRIPT_BODY = '''

def main(argv=None):
    parser = argparse.ArgumentParser(description="Re-run a nanfuzz repro of " + KERNEL_NAME + ".")
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: the GPU if present, else the interpreter")
    args = parser.parse_args(argv)
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")

    from nanfuzz.harness.launch.backend import choose_backend
    from nanfuzz.reference.errors import NanfuzzError

    try:
        device = choose_backend(args.device)  # sets TRITON_INTERPRET before any @triton.jit import
        from nanfuzz.harness.judge.check import check
        from nanfuzz.harness.import_path import cwd_first_on_path
        from nanfuzz.harness.registry import resolve
        from nanfuzz.harness.report.repro import VERDICT_MEANINGS
        from nanfuzz.reference.case import Case
        from nanfuzz.reference.materialize import materialize

        cwd_first_on_path()  # a user's adapter imports from the repository root, as under python -m
        case = Case.from_json(CASE_JSON)
        # where library kernels (vllm:*, aiter:*, fa_amd:*, sglang:*, lmdeploy:*) load their files from
        kernel = resolve(KERNEL, vllm_src=os.environ.get("NANFUZZ_VLLM_SRC"),
                         aiter_src=os.environ.get("NANFUZZ_AITER_SRC"), fa_src=os.environ.get("NANFUZZ_FA_SRC"),
                         sglang_src=os.environ.get("NANFUZZ_SGLANG_SRC"),
                         lmdeploy_src=os.environ.get("NANFUZZ_LMDEPLOY_SRC"))
        print("recorded: " + KERNEL_NAME + ": " + SUMMARY)
        print(PICTURE)
        batch = materialize(case, device)
        print("tensors: " + ", ".join(f"{name} {list(t.shape)} {str(t.dtype).replace('torch.', '')}"
                                      for name, t in batch.inputs().items()))
        outcome = check(kernel, case, device, strict_reads=RECORDED_VERDICT == "DEAD_READ")
    except NanfuzzError as exc:
        print(f"nanfuzz: {exc}", file=sys.stderr)
        return 2
    print(f"now: {outcome.summary}")
    meaning = VERDICT_MEANINGS.get(outcome.verdict, "")
    if outcome.failed:
        print(f"FAIL {outcome.verdict.value} (recorded {RECORDED_VERDICT}): {meaning}", file=sys.stderr)
        return 1
    print(f"PASS (recorded {RECORDED_VERDICT}): {meaning}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''


def _text_literal(text: str) -> str:
    """``text`` as a Python expression: one ascii() literal a line, joined by newlines."""
    lines = text.split("\n")
    if len(lines) == 1:
        return ascii(text)
    return '"\\n".join([\n' + "".join(f"    {ascii(line)},\n" for line in lines) + "])"


def standalone_script(kernel: Kernel | str, case: Case, outcome: Outcome) -> str:
    """A Python script that re-runs ``case`` on ``kernel`` and exits 1 while it fails."""
    path, name = _names(kernel)
    constants = [
        ("KERNEL", ascii(path), "what resolves the kernel (from the current directory)"),
        ("KERNEL_NAME", ascii(name), None),
        ("RECORDED_VERDICT", ascii(outcome.verdict.value), None),
        ("SUMMARY", _text_literal(outcome.summary), None),
        ("PICTURE", _text_literal(picture(case)), None),
        ("CASE_JSON", ascii(case.to_json()), None),
    ]
    lines = [f"{key} = {value}" + (f"  # {why}" if why else "") for key, value, why in constants]
    return _SCRIPT_HEAD + "\n".join(lines) + "\n" + _SCRIPT_BODY
