"""Writing the gate's reports: one function per file, so that each can change how it writes alone.

The gate and ``nanfuzz gate merge`` both write a Markdown summary, its JSON
twin and JUnit XML into their output folder, and append the Markdown to the
job's step summary on GitHub Actions.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from nanfuzz.harness.report.atomic import write_atomically


# Each is whole or absent: never a truncated file for CI to upload.
def write_summary(path: Path, text: str) -> None:
    write_atomically(path, text)


def write_summary_json(path: Path, data: dict) -> None:
    write_atomically(path, json.dumps(data, indent=1) + "\n")


def write_junit(path: Path, xml: bytes) -> None:
    write_atomically(path, xml)


def append_step_summary(text: str) -> None:
    """Append to ``$GITHUB_STEP_SUMMARY`` (the job's summary page on GitHub Actions) when it is set."""
    if os.environ.get("GITHUB_STEP_SUMMARY"):
        with open(os.environ["GITHUB_STEP_SUMMARY"], "a") as step_summary:
            step_summary.write(text)
