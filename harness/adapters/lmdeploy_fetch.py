"""Fetch a released lmdeploy's Triton attention files into nanfuzz's cache (see ``harness.adapters.fetch``).

Only the files of ``lmdeploy/pytorch/kernels/cuda/`` that the ``lmdeploy:*`` kernels load
(``pagedattention.py``, ``flashattention.py``, ``flatten_kv_cache.py`` and the two they import,
``turbo_quant.py`` and ``utils.py``) and ``lmdeploy/version.py`` are kept, in
``lmdeploy-<version>`` under the cache folder; it can be given to ``--lmdeploy-src``.
"""
from __future__ import annotations

from pathlib import Path

from nanfuzz.harness.adapters.fetch import Release

DEFAULT_VERSION = "0.18.0"
LMDEPLOY = Release(
    project="lmdeploy", folder="lmdeploy", kernel_dirs=("lmdeploy/pytorch/kernels/cuda/",),
    extra_files=("lmdeploy/version.py",),
    only=("pagedattention.py", "flashattention.py", "flatten_kv_cache.py", "turbo_quant.py", "utils.py"),
    # lmdeploy's wheels are built per Python and platform for its TurboMind engine, which the
    # PyTorch engine's kernel files do not use; any of them holds the same files
    download_options=("--python-version", "3.11", "--platform", "manylinux_2_28_x86_64"))


def cache_dir(version: str = DEFAULT_VERSION) -> Path:
    return LMDEPLOY.cache_dir(version)


def cached_lmdeploy_source(version: str = DEFAULT_VERSION) -> Path | None:
    """The kernel tree of lmdeploy ``version`` if a complete one is cached, without fetching."""
    return LMDEPLOY.cached(version)


def ensure_lmdeploy_source(version: str = DEFAULT_VERSION) -> Path:
    """The cached kernel tree of lmdeploy ``version``, fetched with pip on first use."""
    return LMDEPLOY.ensure(version)
