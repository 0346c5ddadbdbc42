"""Hypothesis draws that depend on their seed alone, not on what the process has imported.

Hypothesis (6.131 on) now and then draws a constant it found in the source of a module
imported from outside site-packages and the standard library: an editable nanfuzz, a user's
adapter, a library's kernel files loaded from a folder, a test module.  Which of those a
process has imported then changes what one seed draws: a seeded campaign would search
otherwise on a developer's editable install than on a runner's wheel, and after a test module
loaded a library's kernels than before.  While ``steady_draws()`` is in force Hypothesis sees
no such constants (its own list stays), so every draw nanfuzz makes (a campaign's search, the
cases it meets first, the farm's samples, ``harness.scaling.drawn``) depends on its seed
alone; a Hypothesis without them runs as it is.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

from hypothesis import HealthCheck, Phase, given, settings as hypothesis_settings

_lock = threading.Lock()
_depth = 0
_original = None


def _providers():
    try:
        from hypothesis.internal.conjecture import providers
    except ImportError:
        return None
    wanted = ("_get_local_constants", "CONSTANTS_CACHE", "Constants")
    return providers if all(hasattr(providers, name) for name in wanted) else None


def _forget_chosen_constants(providers) -> None:
    # the constants allowed per kind of choice are cached, local ones included
    cache = providers.CONSTANTS_CACHE
    getattr(cache, "cache", cache).clear()


@contextlib.contextmanager
def steady_draws() -> Iterator[None]:
    """Hypothesis runs within draw no constant of the process's own modules (nests; threads share it)."""
    global _depth, _original
    providers = _providers()
    if providers is None:
        yield
        return
    with _lock:
        if _depth == 0:
            _original = providers._get_local_constants
            providers._get_local_constants = providers.Constants  # an empty set of constants
            _forget_chosen_constants(providers)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                providers._get_local_constants = _original
                _forget_chosen_constants(providers)


def drawn(strategy, count: int) -> list:
    """The first ``count`` examples ``strategy`` generates, the same on every run."""
    found: list = []

    @hypothesis_settings(max_examples=count, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
                         suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(case):
        found.append(case)

    with steady_draws():
        collect()
    return found
