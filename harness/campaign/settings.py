"""Everything a campaign is told, as one explicit object built at the edge.

The CLI, the pytest plugin and the gate read the environment and their
options once and build a ``Settings``; every layer below receives it as an
argument.  No harness module reads the environment or rebinds another's
globals while running.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from nanfuzz.harness.adapters.sources import SOURCES, environment_variable
from nanfuzz.harness.campaign.focus import Focus
from nanfuzz.harness.judge.memory import MemoryPolicy

# Generous: a correct launch of the largest generated case takes milliseconds
# on a GPU and a few seconds under the interpreter; compiles are excluded.
DEFAULT_LAUNCH_TIMEOUT = {"cuda": 60.0, "cpu": 300.0}
# Shrinking stops after this long and reports the smallest failing case so far:
# a HANG costs a launch timeout per candidate, and a gate must finish.
DEFAULT_SHRINK_BUDGET = 600.0


@dataclass(frozen=True)
class Settings:
    device: str = "cpu"                      # "cuda" (the GPU) or "cpu" (Triton's interpreter)
    state_dir: Path = Path(".nanfuzz")      # pending-case journals and, by default, the example database
    examples_dir: Path | None = None         # the example database's local folder, when it lives elsewhere
    example_db: str | None = None            # --example-db: a folder, redis://HOST:PORT/DB, readonly:STORE
    repro_dir: Path = Path(".nanfuzz/repros")
    vllm_src: str | None = None              # a vLLM tree for the vllm:* kernels
    aiter_src: str | None = None             # an AITER tree for the aiter:* kernels
    fa_src: str | None = None                # an unpacked flash-attn source distribution for the fa_amd:* kernels
    sglang_src: str | None = None            # an SGLang tree for the sglang:* kernels
    lmdeploy_src: str | None = None          # an lmdeploy tree for the lmdeploy:* kernels
    import_root: str | None = None           # where a user's adapter imports from besides the current directory
    profile: str | None = None               # None: ci under CI=true, else dev
    max_examples: int | None = None          # None: from the profile
    time_budget: float | None = None         # seconds per kernel; None: from the profile
    seed: int | None = None
    focus: Focus = field(default_factory=Focus)
    shrink: bool = True
    use_database: bool | None = None         # None: from the profile
    size: str | None = None                  # size tier: small, production or mixed (None: the kernel's
                                             # own, else mixed on a GPU and small under the interpreter)
    pool_size: int | None = None             # None: the kernel's own pool on a GPU
    pool_seed: int | None = None             # picks the pool; None: the seed, else 0 (--jobs share one)
    pool_round: int = 0                      # the pool's round: a few entries of its own (harness.campaign.pool_rounds)
    compile_jobs: int | None = None          # compile-farm processes on a GPU; None: one per core, 0: no farm
                                             # (NANFUZZ_COMPILE_JOBS; the gate gives each GPU worker its share)
    jobs: int = 1
    campaigns_per_device: int = 1            # campaigns sharing this device (NANFUZZ_CAMPAIGNS_PER_DEVICE: the
                                             # gate's --workers-per-gpu); only one alone draws a huge cache
    isolation: bool = True                   # launches in a supervised worker process
    launch_timeout: float | None = None      # None: DEFAULT_LAUNCH_TIMEOUT for the device
    replays: int = 3                         # how often a found failure is replayed in a fresh worker
    shrink_budget: float = DEFAULT_SHRINK_BUDGET  # seconds of shrinking before the smallest failure so far stands
    remember_paths: bool = True              # compare the kernel paths reached with earlier campaigns'
                                             # (a gate's shards leave it to the gate, which merges them)
    check_leftovers: bool = True             # replay cases a dead campaign left in the journal first
                                             # (jobs leave it to the run that started them)
    sample_stacks: float | None = None       # seconds between samples of the search thread's stack
                                             # (``nanfuzz bench --stacks``: harness.campaign.stack_samples)
    cuda_index: int | None = None            # pin workers to this GPU
    targeting: bool = True                   # report dead slots addressed and the error ratio to Hypothesis's target()
    strict_reads: bool = False               # a PASS whose traced loads addressed dead slots is a DEAD_READ (interpreter)
    memory: MemoryPolicy = field(default_factory=MemoryPolicy)  # how its processes share the device's memory
                                             # with every other nanfuzz process there (NANFUZZ_MEMORY_DIR)

    @property
    def examples_path(self) -> Path:
        """The example database's local folder: ``example_db`` when that is a plain folder, else
        ``examples_dir`` or STATE/examples (in front of the shared store, if there is one)."""
        from nanfuzz.harness.campaign.example_db import parse

        store = parse(self.example_db)
        if store is not None and not store.layered:
            return Path(store.location)
        return Path(self.examples_dir) if self.examples_dir else Path(self.state_dir) / "examples"

    @property
    def sources(self) -> dict[str, str | None]:
        """The kernel libraries' trees as ``resolve()`` takes them: ``resolve(name, **settings.sources)``."""
        return {"vllm_src": self.vllm_src, "aiter_src": self.aiter_src, "fa_src": self.fa_src,
                "sglang_src": self.sglang_src, "lmdeploy_src": self.lmdeploy_src, "import_root": self.import_root}

    @property
    def timeout(self) -> float:
        return self.launch_timeout if self.launch_timeout is not None else DEFAULT_LAUNCH_TIMEOUT[self.device]

    def replace(self, **changes) -> "Settings":
        return replace(self, **changes)

    @classmethod
    def from_environment(cls, environ=None, **options) -> "Settings":
        """Settings from ``NANFUZZ_*`` variables, overridden by explicit ``options`` that are not None."""
        env = os.environ if environ is None else environ
        values = {
            "state_dir": Path(env.get("NANFUZZ_STATE_DIR") or ".nanfuzz"),
            "examples_dir": Path(env["NANFUZZ_EXAMPLES_DIR"]) if env.get("NANFUZZ_EXAMPLES_DIR") else None,
            "example_db": env.get("NANFUZZ_EXAMPLE_DB") or None,
            **{keyword: env.get(environment_variable(keyword)) or None for keyword, _ in SOURCES.values()},
            "profile": env.get("NANFUZZ_PROFILE") or ("ci" if env.get("CI") else "dev"),
        }
        if (env.get("NANFUZZ_MEMORY_DIR") or "").strip():
            values["memory"] = MemoryPolicy(ledger_dir=env["NANFUZZ_MEMORY_DIR"].strip())
        if (env.get("NANFUZZ_CAMPAIGNS_PER_DEVICE") or "").strip():
            values["campaigns_per_device"] = _count("NANFUZZ_CAMPAIGNS_PER_DEVICE", env["NANFUZZ_CAMPAIGNS_PER_DEVICE"])
        if (env.get("NANFUZZ_COMPILE_JOBS") or "").strip():
            values["compile_jobs"] = _count("NANFUZZ_COMPILE_JOBS", env["NANFUZZ_COMPILE_JOBS"])
        values.update({k: v for k, v in options.items() if v is not None})
        if "repro_dir" not in options or options["repro_dir"] is None:
            values["repro_dir"] = Path(values["state_dir"]) / "repros"
        for name, value in values.items():
            if name in _LEAST and value is not None:
                check_number(name, value, *_LEAST[name])
        _check_folder(Path(values["state_dir"]), "the state folder (--state-dir, NANFUZZ_STATE_DIR)")
        if "memory" in values and values["memory"].ledger_dir:
            _check_folder(Path(values["memory"].ledger_dir), "the memory ledger folder (NANFUZZ_MEMORY_DIR)")
        return cls(**values)


# The least value of each numeric field an edge may set, and whether that value itself is allowed:
# a launch timeout of 0 s (or NaN) would switch the watchdog off, a budget of 0 s would run no example.
_LEAST = {"launch_timeout": (0.0, False), "time_budget": (0.0, False), "shrink_budget": (0.0, False),
          "max_examples": (1, True), "jobs": (1, True), "campaigns_per_device": (1, True), "pool_size": (0, True), "compile_jobs": (0, True),
          "pool_seed": (0, True), "pool_round": (0, True), "replays": (0, True)}


def check_number(label: str, value, least: int | float, allowed: bool) -> None:
    """A usage error naming ``label`` unless ``value`` is a finite number (a whole one where ``least``
    is an int) at least ``least`` (and above it unless ``allowed``)."""
    from nanfuzz.reference.errors import NanfuzzError

    whole = isinstance(least, int)
    shown = f"{value:g}" if isinstance(value, float) else repr(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (whole and not isinstance(value, int)):
        raise NanfuzzError(f"{label}={shown} must be a {'whole ' if whole else ''}number")
    if not math.isfinite(value) or value < least or (value == least and not allowed):
        raise NanfuzzError(f"{label}={shown} must be {'' if whole else 'a finite number '}"
                           f"{'>=' if allowed else '>'} {least:g}")


def _check_folder(path: Path, what: str) -> None:
    """A usage error, now, where ``path`` (or a folder it would be made in) is a file."""
    from nanfuzz.reference.errors import NanfuzzError

    for place in (path, *path.parents):
        if place.exists():
            if not place.is_dir():
                raise NanfuzzError(f"{what} {str(path)!r} cannot be a folder: {str(place)!r} is a file")
            return


def _count(name: str, text: str) -> int:
    from nanfuzz.reference.errors import NanfuzzError

    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise NanfuzzError(f"{name}={text!r} must be a whole number >= 0")
    return value
