"""Campaign profiles: how many examples, how long, how reproducible.

They are also registered as Hypothesis profiles of the same names, so a
user's own ``@given`` tests can load them (``--hypothesis-profile=pr-gate``).
Registering our own ``ci`` replaces Hypothesis's built-in one, which would
otherwise be loaded under ``CI=true``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from hypothesis import HealthCheck, settings

from nanfuzz.reference.errors import NanfuzzError


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

_QUIET_CHECKS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
                 HealthCheck.large_base_example]

for _p in PROFILES.values():
    settings.register_profile(
        _p.name, max_examples=min(_p.max_examples, 10_000), derandomize=_p.derandomize,
        deadline=None, suppress_health_check=_QUIET_CHECKS, print_blob=True,
        **({} if _p.use_database else {"database": None}))


def default_profile_name() -> str:
    return os.environ.get("NANFUZZ_PROFILE") or ("ci" if os.environ.get("CI") else "dev")


def get_profile(name: str | None = None) -> Profile:
    name = name or default_profile_name()
    if name not in PROFILES:
        raise NanfuzzError(f"unknown profile {name!r}; known: {', '.join(PROFILES)}")
    return PROFILES[name]
