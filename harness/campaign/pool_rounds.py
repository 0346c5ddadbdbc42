"""Which round of its specialisation pool a kernel's next run fuzzes, kept in the state folder.

A pool is a function of its seed (``strategies.cases.campaign_pool``); its round adds a few
entries of their own, different from one round to the next.  A run that pins nothing (no
``--seed``: an everyday ``nanfuzz fuzz``, each shard of the gate, whose state folder travels
between CI runs) takes the next round from ``STATE/pools/<kernel>.json``, so every run meets some
compile-time shapes the last ones did not, while the seed's own entries (and their compiles in
Triton's cache) stay.  A state folder that cannot be read or written gives round 0, as before.
"""
from __future__ import annotations

import json
from pathlib import Path

from nanfuzz.harness.campaign.journal import safe_name
from nanfuzz.harness.report.atomic import write_atomically


def _file(state_dir: Path, kernel_name: str) -> Path:
    return Path(state_dir) / "pools" / f"{safe_name(kernel_name)}.json"


def take(state_dir: Path, kernel_name: str) -> int:
    """This run's round for ``kernel_name``'s pool; the next run gets the one after it."""
    path = _file(state_dir, kernel_name)
    try:
        taken = int(json.loads(path.read_text())["next_round"])
    except (OSError, ValueError, TypeError, KeyError):
        taken = 0
    taken = max(0, taken)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps({"next_round": taken + 1}))
    except OSError:
        return 0
    return taken
