"""Fetch a released vLLM's attention-kernel files into a local cache.

``pip download --no-deps`` brings the wheel (no dependency is installed, no
code runs); only ``vllm/v1/attention/ops/*.py`` and ``vllm/_version.py`` are
unpacked, the wheel itself is deleted, and the result is reused on later
calls.  The folder is ``vllm-<version>`` in nanfuzz's cache: ``$NANFUZZ_CACHE``,
else ``$XDG_CACHE_HOME/nanfuzz``, else ``~/.cache/nanfuzz``; it can be given
to ``--vllm-src``.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from nanfuzz.reference.errors import NanfuzzError

DEFAULT_VERSION = "0.33.0"
_COMPLETE = ".complete"  # written last: a folder without it is a broken earlier try
_OPS_PREFIX = "vllm/v1/attention/ops/"
_EXTRA_MEMBERS = ("vllm/_version.py",)
# pip's words for "no index could be reached" (DNS, routing, refused, TLS, timeouts).
_NETWORK_SIGNS = (
    "NewConnectionError", "Failed to establish a new connection", "Temporary failure in name resolution",
    "Name or service not known", "Network is unreachable", "No route to host", "Connection refused",
    "ConnectTimeoutError", "Read timed out", "ProxyError", "Max retries exceeded", "Could not fetch URL",
)


class FetchError(NanfuzzError):
    """The wheel could not be fetched; ``network`` is true when no package index answered."""

    def __init__(self, message: str, *, network: bool):
        super().__init__(message)
        self.network = network


def cache_root() -> Path:
    """``$NANFUZZ_CACHE``, else ``$XDG_CACHE_HOME/nanfuzz``, else ``~/.cache/nanfuzz``."""
    if os.environ.get("NANFUZZ_CACHE"):
        return Path(os.environ["NANFUZZ_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    # the XDG spec says a relative path there is invalid and to be ignored
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "nanfuzz"
    return Path.home() / ".cache" / "nanfuzz"


def cache_dir(version: str = DEFAULT_VERSION) -> Path:
    return cache_root() / f"vllm-{version}"


def unpack_kernel_files(wheel: Path, dest: Path) -> None:
    """Copy the kernel files (and the version file) of a vllm wheel into ``dest/vllm/``."""
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            in_ops = name.startswith(_OPS_PREFIX) and name.endswith(".py") and "/" not in name[len(_OPS_PREFIX):]
            if in_ops or name in _EXTRA_MEMBERS:
                target = dest / name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(archive.read(name))
    if not (dest / _OPS_PREFIX).is_dir():
        raise NanfuzzError(f"{wheel} holds no {_OPS_PREFIX} files; is it a vllm wheel?")


def cached_vllm_source(version: str = DEFAULT_VERSION) -> Path | None:
    """The kernel tree of vLLM ``version`` if a complete one is cached, without fetching."""
    dest = cache_dir(version)
    return dest if (dest / _COMPLETE).is_file() else None


def ensure_vllm_source(version: str = DEFAULT_VERSION) -> Path:
    """The cached kernel tree of vLLM ``version``, fetched with pip on first use."""
    dest = cache_dir(version)
    if cached_vllm_source(version) is not None:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".vllm-{version}-", dir=dest.parent) as scratch:
        wheel = _download(version, Path(scratch) / "wheel")
        staging = Path(scratch) / "tree"
        unpack_kernel_files(wheel, staging)
        (staging / _COMPLETE).write_text(f"{wheel.name}\n")
        if not (dest / _COMPLETE).is_file():  # another process may have finished first
            shutil.rmtree(dest, ignore_errors=True)
            try:
                staging.rename(dest)
            except OSError:
                if not (dest / _COMPLETE).is_file():
                    raise
    return dest


def _download(version: str, into: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--progress-bar", "off", "--retries", "2",
               "--dest", str(into), f"vllm=={version}"]
    done = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(into.glob(f"vllm-{version}-*.whl"))
    if done.returncode == 0 and wheels:
        return wheels[0]
    output = done.stdout + done.stderr
    network = any(sign in output for sign in _NETWORK_SIGNS)
    last = next((line.strip() for line in reversed(output.splitlines()) if line.strip()), "no output")
    reason = "no package index is reachable" if network else "pip failed"
    raise FetchError(f"cannot fetch vllm=={version} with pip download: {reason} ({last})", network=network)
