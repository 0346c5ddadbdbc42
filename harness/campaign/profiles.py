"""Campaign profiles: how many examples, how long, how reproducible.

A campaign builds its own Hypothesis settings from its profile.  The same
profiles exist as Hypothesis profiles prefixed ``nanfuzz-`` (``nanfuzz-dev``,
``nanfuzz-ci``, ``nanfuzz-pr-gate``, ``nanfuzz-nightly``) for a user's own
``@given`` tests, registered only on request: importing this module registers
nothing and loads nothing, so a user's ``dev`` or ``ci`` profile stays theirs.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from nanfuzz.reference.errors import NanfuzzError

HYPOTHESIS_PREFIX = "nanfuzz-"


@dataclass(frozen=True)
class Profile:
    name: str
    max_examples: int
    time_budget: float | None  # seconds for the whole campaign of one kernel; None = no bound
    derandomize: bool
    use_database: bool
    description: str


PROFILES = {
    p.name: p
    for p in (
        Profile("dev", 200, None, False, True, "local work: 200 examples, random, example database on"),
        Profile("ci", 300, None, True, False, "CPU CI: 300 derandomized examples, no database"),
        Profile("pr-gate", 1_000_000, 15 * 60.0, False, True,
                "GPU PR gate: bounded by wall time (15 min default), shared example database"),
        Profile("nightly", 1_000_000, 2 * 3600.0, False, True, "nightly: 2 hours a kernel, shared database"),
    )
}


def register_hypothesis_profiles() -> list[str]:
    """Register ``nanfuzz-<profile>`` with Hypothesis (none is loaded); returns their names."""
    from hypothesis import HealthCheck, settings

    quiet = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
             HealthCheck.large_base_example]
    names = []
    for p in PROFILES.values():
        names.append(HYPOTHESIS_PREFIX + p.name)
        settings.register_profile(
            names[-1], max_examples=min(p.max_examples, 10_000), derandomize=p.derandomize,
            deadline=None, suppress_health_check=quiet, print_blob=True,
            **({} if p.use_database else {"database": None}))
    return names


def default_profile_name() -> str:
    return os.environ.get("NANFUZZ_PROFILE") or ("ci" if os.environ.get("CI") else "dev")


def get_profile(name: str | None = None) -> Profile:
    name = name or default_profile_name()
    if name not in PROFILES:
        raise NanfuzzError(f"unknown profile {name!r}; known: {', '.join(PROFILES)}")
    return PROFILES[name]
