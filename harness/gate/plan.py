"""The gate's plan (written by ``gate.py``, read by every worker) and the shard records.

A shard is one kernel's campaign on one worker slot.  Its record is a JSON
file that the worker writes twice: ``running`` before the campaign starts
(with the worker's id and environment) and ``done`` or ``error`` after it.
A record still ``running`` when pytest has finished means the worker died
inside that shard: the gate then recovers the case from the slot's pending
file.  Records are the gate's source of truth; pytest's reports only confirm.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

PLAN_ENV = "NANFUZZ_GATE_PLAN"
SLOT_ENV = "NANFUZZ_GATE_SLOT"
PLAN_VERSION = 4


def file_stem(kernel: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", kernel)


@dataclass(frozen=True)
class Plan:
    device: str                    # "cuda" or "cpu"
    profile: str
    kernels: list[str]
    slots: list[str]               # slot names, in shard order: slot i runs shard i of every kernel
    deadline: float                # time.time() by which every campaign should have ended
    max_examples: int | None       # per shard, on top of the time bound
    state_dir: str                 # holds examples/ (the shared database) and workers/<slot>/
    work_dir: str                  # records/ and repros/<slot>/ of this run
    example_db: str | None = None  # --example-db: a shared store behind examples/, or another folder
    shard: int = 1                 # this runner is shard `shard` of `shards` (--shard I/N), counted from 1
    shards: int = 1
    runner: str = ""               # this runner's name in a fleet's merged report
    size: str | None = None        # --size: the size tier every shard draws (None: each kernel's default)
    window_only: bool = False      # --window-only: every shard draws only cases with a sliding window
    version: int = PLAN_VERSION

    # -- paths -------------------------------------------------------------------
    @property
    def examples_dir(self) -> Path:
        return Path(self.state_dir) / "examples"

    def slot_state_dir(self, slot: str) -> Path:
        return Path(self.state_dir) / "workers" / slot


    def record_file(self, kernel: str, slot: str) -> Path:
        return Path(self.work_dir) / "records" / f"{file_stem(kernel)}--{slot}.json"

    def shard_repro_dir(self, slot: str) -> Path:
        return Path(self.work_dir) / "repros" / slot

    def pool_seed(self, slot: str) -> int:
        """The specialisation pool this slot fuzzes: a different one on every slot of every runner
        of the fleet (runner shard I of N, slot j: I - 1 + N * j)."""
        return self.shard - 1 + self.shards * self.slots.index(slot)

    def shard_budget(self, kernel: str, now: float) -> float:
        """Seconds for this shard: the time left, split evenly over this kernel and the ones after it.

        A worker runs the kernels in plan order, so measuring from its own
        start makes a slow start-up (or a restarted worker) cost every later
        shard a little instead of the last one all."""
        return (self.deadline - now) / (len(self.kernels) - self.kernels.index(kernel))

    # -- JSON ---------------------------------------------------------------------
    def write(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def read(cls, path: str | Path) -> "Plan":
        data = json.loads(Path(path).read_text())
        if data.get("version") != PLAN_VERSION:
            raise ValueError(f"{path}: gate plan version {data.get('version')!r}, expected {PLAN_VERSION}")
        return cls(**data)


@dataclass
class ShardRecord:
    kernel: str                    # as the plan names it (what resolve() takes)
    slot: str
    kernel_name: str = ""          # the resolved Kernel's own name, which repros and pending files carry
    status: str = "running"        # running | done | error
    worker: str = ""               # pytest-xdist worker id (gw0, ...)
    pid: int = 0
    verdict: str = ""              # PASS, a failure verdict, ERROR
    summary: str = ""
    examples: int = 0
    seed: int | None = None        # the campaign's search seed, and its pool's seed and round
    pool_seed: int | None = None   # (--seed S --pool-seed P --pool-round R draws its cases again)
    pool_round: int | None = None
    elapsed: float = 0.0
    rounds: int = 0                # fuzz() calls the shard made
    verdicts: dict[str, int] = field(default_factory=dict)
    time_to_first_failure: float | None = None
    examples_to_first_failure: int | None = None
    shrink_time: float | None = None
    recovered_crash: bool = False  # the failure is a case left by a process that died earlier
    worker_died: bool = False      # set by the gate: the worker died inside this shard
    repro: list[str] = field(default_factory=list)   # .json, .py, .txt
    examples_db: str = ""          # the database directory the campaign used, resolved
    environment: dict = field(default_factory=dict)  # device name and versions, for recovered crashes
    statistics: dict = field(default_factory=dict)   # what the campaign exercised (Statistics.to_dict())
    notes: list[str] = field(default_factory=list)   # the campaign's notes (an example database that went away)

    @property
    def failed(self) -> bool:
        return self.status != "done" or self.verdict != "PASS"

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1) + "\n")
        os.replace(tmp, path)

    @classmethod
    def read(cls, path: Path) -> "ShardRecord":
        return cls(**json.loads(path.read_text()))
