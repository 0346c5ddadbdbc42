"""Fetch a released vLLM's attention-kernel files into nanfuzz's cache (see ``harness.adapters.fetch``).

Only ``vllm/v1/attention/ops/*.py`` and ``vllm/_version.py`` are kept, in
``vllm-<version>`` under the cache folder; it can be given to ``--vllm-src``.
"""
from __future__ import annotations

from pathlib import Path

from nanfuzz.harness.adapters.fetch import FetchError, Release, cache_root  # noqa: F401 - re-exported

DEFAULT_VERSION = "0.33.0"
VLLM = Release(project="vllm", folder="vllm", kernel_dirs=("vllm/v1/attention/ops/",),
               extra_files=("vllm/_version.py",))


def cache_dir(version: str = DEFAULT_VERSION) -> Path:
    return VLLM.cache_dir(version)


def cached_vllm_source(version: str = DEFAULT_VERSION) -> Path | None:
    """The kernel tree of vLLM ``version`` if a complete one is cached, without fetching."""
    return VLLM.cached(version)


def ensure_vllm_source(version: str = DEFAULT_VERSION) -> Path:
    """The cached kernel tree of vLLM ``version``, fetched with pip on first use."""
    return VLLM.ensure(version)
