"""Fetch a released SGLang's Triton attention files into nanfuzz's cache (see ``harness.adapters.fetch``).

Only ``decode_attention.py``, ``extend_attention.py`` and ``score_mod.py`` of
``sglang/kernels/ops/attention/`` and ``sglang/_version.py`` are kept, in
``sglang-<version>`` under the cache folder; it can be given to ``--sglang-src``.
"""
from __future__ import annotations

from pathlib import Path

from nanfuzz.harness.adapters.fetch import Release

DEFAULT_VERSION = "0.5.23"
SGLANG = Release(
    project="sglang", folder="sglang", kernel_dirs=("sglang/kernels/ops/attention/",),
    extra_files=("sglang/_version.py",), only=("decode_attention.py", "extend_attention.py", "score_mod.py"),
    # sglang's wheels are built per Python and platform for compiled parts the kernel files do
    # not use; any of them holds the same kernel files, so one tag is fetched wherever nanfuzz runs
    download_options=("--python-version", "3.11", "--platform", "manylinux_2_34_x86_64"))


def cache_dir(version: str = DEFAULT_VERSION) -> Path:
    return SGLANG.cache_dir(version)


def cached_sglang_source(version: str = DEFAULT_VERSION) -> Path | None:
    """The kernel tree of SGLang ``version`` if a complete one is cached, without fetching."""
    return SGLANG.cached(version)


def ensure_sglang_source(version: str = DEFAULT_VERSION) -> Path:
    """The cached kernel tree of SGLang ``version``, fetched with pip on first use."""
    return SGLANG.ensure(version)
