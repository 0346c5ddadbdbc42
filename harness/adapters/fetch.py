"""Fetch a released wheel's kernel files (vLLM's, AITER's) into a local cache.

``pip download --no-deps`` brings the wheel (no dependency is installed, no
code runs); only the kernel folders' ``*.py`` files and the version file are
unpacked, the wheel itself is deleted, and the result is reused on later
calls.  The folder is ``<name>-<version>`` in nanfuzz's cache:
``$NANFUZZ_CACHE``, else ``$XDG_CACHE_HOME/nanfuzz``, else
``~/.cache/nanfuzz``; it can be given to the library's ``--*-src`` option.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from nanfuzz.reference.errors import NanfuzzError

_COMPLETE = ".complete"  # written last: a folder without it is a broken earlier try
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


@dataclass(frozen=True)
class Release:
    """A project on the package index whose wheel holds Triton kernel files."""

    project: str                    # what pip downloads: "vllm", "amd-aiter"
    folder: str                     # the cache folder's stem: "vllm" -> vllm-0.33.0
    kernel_dirs: tuple[str, ...]    # folders in the wheel whose own *.py files are kept
    extra_files: tuple[str, ...] = ()  # single files kept (the version file)

    @property
    def wheel_stem(self) -> str:  # wheel file names spell the project with underscores
        return self.project.replace("-", "_")

    def cache_dir(self, version: str) -> Path:
        return cache_root() / f"{self.folder}-{version}"

    def unpack(self, wheel: Path, dest: Path) -> None:
        """Copy the kernel files (and the extra files) of a wheel of this project into ``dest``."""
        with zipfile.ZipFile(wheel) as archive:
            for name in archive.namelist():
                folder, _, base = name.rpartition("/")
                if (f"{folder}/" in self.kernel_dirs and base.endswith(".py")) or name in self.extra_files:
                    target = dest / name
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(archive.read(name))
        for folder in self.kernel_dirs:
            if not (dest / folder).is_dir():
                raise NanfuzzError(f"{wheel} holds no {folder} files; is it a {self.project} wheel?")

    def cached(self, version: str) -> Path | None:
        """The kernel tree of ``version`` if a complete one is cached, without fetching."""
        dest = self.cache_dir(version)
        return dest if (dest / _COMPLETE).is_file() else None

    def ensure(self, version: str) -> Path:
        """The cached kernel tree of ``version``, fetched with pip on first use."""
        dest = self.cache_dir(version)
        if self.cached(version) is not None:
            return dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=f".{self.folder}-{version}-", dir=dest.parent) as scratch:
            wheel = self._download(version, Path(scratch) / "wheel")
            staging = Path(scratch) / "tree"
            self.unpack(wheel, staging)
            (staging / _COMPLETE).write_text(f"{wheel.name}\n")
            if not (dest / _COMPLETE).is_file():  # another process may have finished first
                shutil.rmtree(dest, ignore_errors=True)
                try:
                    staging.rename(dest)
                except OSError:
                    if not (dest / _COMPLETE).is_file():
                        raise
        return dest

    def _download(self, version: str, into: Path) -> Path:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--disable-pip-version-check", "--progress-bar", "off", "--retries", "2",
                   "--dest", str(into), f"{self.project}=={version}"]
        done = subprocess.run(command, capture_output=True, text=True)
        wheels = sorted(into.glob(f"{self.wheel_stem}-{version}-*.whl"))
        if done.returncode == 0 and wheels:
            return wheels[0]
        output = done.stdout + done.stderr
        network = any(sign in output for sign in _NETWORK_SIGNS)
        last = next((line.strip() for line in reversed(output.splitlines()) if line.strip()), "no output")
        reason = "no package index is reachable" if network else "pip failed"
        raise FetchError(f"cannot fetch {self.project}=={version} with pip download: {reason} ({last})",
                         network=network)
