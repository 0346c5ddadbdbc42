"""``nanfuzz export --markdown``: a bug report for the kernel's author, in Markdown.

The verdict and its evidence, the picture of the block table, the versions
the finding was made with, the case and the call as the standalone script
holds them, and how to run that script.
"""
from __future__ import annotations

import json

from nanfuzz.harness.kernel import Kernel
from nanfuzz.harness.report.export.parts import kernel_part
from nanfuzz.harness.report.export.script import case_literal, needs, poison_literal
from nanfuzz.harness.report.picture import picture


def bug_report(record: dict, kernel: Kernel, import_path: str, script_name: str) -> str:
    case = record["case"]
    part = kernel_part(kernel, import_path)
    environment = record.get("environment", {})
    versions = ", ".join([environment.get("device_name", "an unrecorded device")] +
                         [f"{key} {environment[key]}" for key in ("torch", "triton", "python") if key in environment])
    evidence = {k: v for k, v in record.get("evidence", {}).items() if k != "reachable_poison"}
    return "\n".join([
        f"# {record['kernel_name']}: {record.get('verdict', '?')}", "",
        record.get("summary", ""), "",
        f"Found by nanfuzz, a NaN-poisoning fuzzer for paged-attention kernels, on {versions}.",
        "", "## The batch", "",
        "Slots the kernel must never read (the tail past `seq_len`, keys outside the window, table padding, blocks "
        "no live key maps to) hold NaN, Inf or garbage; the float64 reference reads live keys alone.", "",
        "```text", picture(case), "```", "",
        "```python", f"case = {case_literal(case)}", poison_literal(case).rstrip(), "```", "",
        "## The call", "",
        "```python", "def run_kernel(batch, out):", f"    {part.call}", "```", "",
        "## Evidence", "",
        "```json", json.dumps(evidence, indent=1), "```", "",
        "## Reproduce", "",
        f"`{script_name}` needs {needs(part)}, not nanfuzz; it exits 1 while the kernel shows a finding, 0 once "
        "it passes and 2 when it cannot be loaded or run here (`nanfuzz export --pytest` writes the same as a "
        "regression test)." + (f" {part.stand_in_note}" if part.stand_in_note else ""), "",
        "```bash", f"python {script_name}", "```", ""])
