"""The Triton kernels earlier campaigns of a kernel reached, kept in the state folder.

A kernel's code paths (``harness.judge.paths``) are chosen by the batch: a
campaign that never drew a long enough sequence never ran the split-KV path.
Each campaign adds the paths it reached to ``STATE/paths/<kernel>.json`` and
says which ones earlier campaigns reached that it did not, so a PASS that
lost a path since the last run says so.
"""
from __future__ import annotations

import json
from pathlib import Path

from nanfuzz.harness.campaign.journal import safe_name
from nanfuzz.harness.report.atomic import write_atomically


def _file(state_dir: Path, kernel_name: str) -> Path:
    return Path(state_dir) / "paths" / f"{safe_name(kernel_name)}.json"


def remember(state_dir: Path, kernel_name: str, reached: list[str]) -> list[str]:
    """Add ``reached`` to what earlier campaigns reached; returns those they reached and it did not.
    A state folder that cannot be read or written remembers nothing (and misses nothing)."""
    path = _file(state_dir, kernel_name)
    try:
        earlier = set(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        earlier = set()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps(sorted(earlier | set(reached))))
    except OSError:
        pass
    return sorted(earlier - set(reached))
