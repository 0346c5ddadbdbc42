"""Fetch a released FlashAttention's AMD Triton backend into nanfuzz's cache (see ``harness.adapters.fetch``).

flash-attn is released as a source distribution (its wheels are built where it is
installed); only ``flash_attn/flash_attn_triton_amd/*.py``, ``flash_attn/flash_attn_interface.py``
and ``flash_attn/__init__.py`` (its version) are kept, in ``flash-attn-<version>`` under the
cache folder; it can be given to ``--fa-src``.  pip asks the sdist's ``setup.py`` for its
metadata, which imports torch: it runs in this environment, told to build no CUDA extension.
"""
from __future__ import annotations

from pathlib import Path

from nanfuzz.harness.adapters.fetch import Release

DEFAULT_VERSION = "2.8.3.post2"
FLASH_ATTN = Release(
    project="flash-attn", folder="flash-attn", kernel_dirs=("flash_attn/flash_attn_triton_amd/",),
    extra_files=("flash_attn/flash_attn_interface.py", "flash_attn/__init__.py"), sdist=True,
    # flash-attn's setup.py reads these: no CUDA compile, the Triton AMD backend's build
    download_env=(("FLASH_ATTENTION_SKIP_CUDA_BUILD", "TRUE"), ("FLASH_ATTENTION_TRITON_AMD_ENABLE", "TRUE")))


def cache_dir(version: str = DEFAULT_VERSION) -> Path:
    return FLASH_ATTN.cache_dir(version)


def cached_fa_source(version: str = DEFAULT_VERSION) -> Path | None:
    """The kernel tree of flash-attn ``version`` if a complete one is cached, without fetching."""
    return FLASH_ATTN.cached(version)


def ensure_fa_source(version: str = DEFAULT_VERSION) -> Path:
    """The cached kernel tree of flash-attn ``version``, fetched with pip on first use."""
    return FLASH_ATTN.ensure(version)
