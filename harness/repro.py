"""Repro artifacts: JSON (the record), a standalone script, a block-table picture."""
from __future__ import annotations

import datetime
import hashlib
import json
import platform
from pathlib import Path

from nanfuzz.harness.check import Outcome, Verdict
from nanfuzz.harness.picture import picture
from nanfuzz.reference.case import SCHEMA_VERSION, Case
from nanfuzz.reference.errors import NanfuzzError

SCHEMA = "nanfuzz-repro"


def environment(device: str) -> dict:
    import hypothesis
    import torch
    import triton

    if device == "cuda":
        name = torch.cuda.get_device_name()
        backend = "rocm " + str(torch.version.hip) if torch.version.hip else "cuda " + str(torch.version.cuda)
        where = f"{name} ({backend})"
    else:
        where = "cpu (Triton interpreter)"
    return {"device": device, "device_name": where, "torch": torch.__version__, "triton": triton.__version__,
            "hypothesis": hypothesis.__version__, "python": platform.python_version()}


def case_id(case: Case) -> str:
    return hashlib.sha256(case.to_json().encode()).hexdigest()[:10]


def repro_record(kernel_name: str, case: Case, outcome: Outcome, device: str) -> dict:
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "kernel": kernel_name,
        "case": case.to_dict(),
        **outcome.to_dict(),
        "environment": environment(device),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def write_repro(kernel_name: str, case: Case, outcome: Outcome, directory: str | Path, device: str) -> list[Path]:
    """Write ``<stem>.json``, ``<stem>.py`` and ``<stem>.txt``; return their paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    stem = f"{kernel_name.replace(':', '_').replace('@', '-').replace('/', '_')}-{outcome.verdict.value.lower()}-{case_id(case)}"
    record = repro_record(kernel_name, case, outcome, device)
    json_path = directory / f"{stem}.json"
    json_path.write_text(json.dumps(record, indent=1) + "\n")
    txt_path = directory / f"{stem}.txt"
    txt_path.write_text(f"{kernel_name}: {outcome.summary}\n\n{picture(case)}\n")
    py_path = directory / f"{stem}.py"
    py_path.write_text(standalone_script(kernel_name, case, outcome))
    return [json_path, py_path, txt_path]


def load_repro(path: str | Path) -> dict:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise NanfuzzError(f"cannot read repro {str(path)!r}: {exc.strerror}") from None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise NanfuzzError(f"{path}: not JSON ({exc.msg} at line {exc.lineno}); a repro is the .json nanfuzz wrote") from None
    if not isinstance(record, dict) or record.get("schema") != SCHEMA:
        raise NanfuzzError(f"{path}: not a nanfuzz repro (missing \"schema\": \"{SCHEMA}\")")
    if record.get("schema_version") != SCHEMA_VERSION:
        raise NanfuzzError(f"{path}: repro schema version {record.get('schema_version')!r}; this nanfuzz reads {SCHEMA_VERSION}")
    if "kernel" not in record or "case" not in record:
        raise NanfuzzError(f"{path}: repro lacks \"kernel\" or \"case\"")
    record["case"] = Case.from_dict(record["case"])
    record.setdefault("verdict", Verdict.PASS.value)
    return record


_SCRIPT = '''\
"""nanfuzz repro: {kernel} -> {verdict}

{summary}

Run it with nanfuzz installed: `python {{this file}}` (GPU when present,
Triton's interpreter otherwise).  It rebuilds the tensors from the case,
runs the kernel and asserts the output is finite and matches the float64
oracle; it exits non-zero while the bug is there.

{picture}
"""
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit import

from nanfuzz.harness.registry import resolve
from nanfuzz.harness.tolerance import allowed_error
from nanfuzz.reference.case import Case
from nanfuzz.reference.materialize import materialize
from nanfuzz.reference.oracle import oracle

CASE = Case.from_json({case_json!r})
KERNEL = {kernel!r}

device = "cuda" if torch.cuda.is_available() else "cpu"
batch = materialize(CASE, device)
g = CASE.geometry
print("q", tuple(batch.q.shape), "key_cache", tuple(batch.key_cache.shape), "block_table", batch.block_table.tolist())
out = torch.full((CASE.num_tokens, g.num_q_heads, g.head_size), float("nan"), dtype=batch.q.dtype, device=device)
result = resolve(KERNEL)(batch, out)
expected = oracle(batch)
bad = ~torch.isfinite(result.double()) & torch.isfinite(expected)
print("non-finite output rows:", bad.any(dim=-1).nonzero().tolist()[:16])
assert not bad.any(), f"{{int(bad.any(-1).sum())}} output rows are NaN/Inf where the oracle is finite"
error = (result.double() - expected).abs()
assert (error <= allowed_error(expected, g.dtype)).all(), f"max abs error {{float(error.max()):.3g}} beyond tolerance"
print("PASS: output finite and within tolerance of the oracle")
'''


def standalone_script(kernel_name: str, case: Case, outcome: Outcome) -> str:
    return _SCRIPT.format(kernel=kernel_name, verdict=outcome.verdict.value, summary=outcome.summary,
                          picture=picture(case), case_json=case.to_json())
