"""Fetch a released AITER's Triton attention files into nanfuzz's cache (see ``harness.adapters.fetch``).

The amd-aiter wheel is pure Python; only ``aiter/ops/triton/*.py``,
``aiter/ops/triton/_triton_kernels/*.py`` and ``aiter/_version.py`` are
kept, in ``aiter-<version>`` under the cache folder; it can be given to
``--aiter-src``.
"""
from __future__ import annotations

from pathlib import Path

from nanfuzz.harness.adapters.aiter_loader import TESTED_VERSION
from nanfuzz.harness.adapters.fetch import Release

DEFAULT_VERSION = TESTED_VERSION
AITER = Release(project="amd-aiter", folder="aiter",
                kernel_dirs=("aiter/ops/triton/", "aiter/ops/triton/_triton_kernels/"),
                extra_files=("aiter/_version.py",))


def cache_dir(version: str = DEFAULT_VERSION) -> Path:
    return AITER.cache_dir(version)


def cached_aiter_source(version: str = DEFAULT_VERSION) -> Path | None:
    """The kernel tree of AITER ``version`` if a complete one is cached, without fetching."""
    return AITER.cached(version)


def ensure_aiter_source(version: str = DEFAULT_VERSION) -> Path:
    """The cached kernel tree of AITER ``version``, fetched with pip on first use."""
    return AITER.ensure(version)
