"""Fetch a released wheel's (or source distribution's) kernel files into a local cache.

``pip download --no-deps`` brings the wheel (no dependency is installed, no
code runs); only the kernel folders' ``*.py`` files and the version file are
unpacked, the wheel itself is deleted, and the result is reused on later
calls.  A project released as a source distribution alone (flash-attn) is
fetched the same way with ``--no-binary :all:``; pip then asks its build for
its metadata, in this environment (``--no-build-isolation``, so its build finds
torch here) with ``download_env`` set.  The folder is ``<name>-<version>`` in nanfuzz's cache:
``$NANFUZZ_CACHE``, else ``$XDG_CACHE_HOME/nanfuzz``, else
``~/.cache/nanfuzz``; it can be given to the library's ``--*-src`` option.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
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
    only: tuple[str, ...] = ()      # the file names kept in the kernel folders (empty: every *.py)
    download_options: tuple[str, ...] = ()  # more pip options (the wheel tag to take, for a project
                                            # whose wheels differ only in compiled parts)
    sdist: bool = False             # released as a source distribution (.tar.gz), not a wheel
    download_env: tuple[tuple[str, str], ...] = ()  # environment of an sdist's metadata build

    @property
    def wheel_stem(self) -> str:  # wheel file names spell the project with underscores
        return self.project.replace("-", "_")

    def cache_dir(self, version: str) -> Path:
        return cache_root() / f"{self.folder}-{version}"

    def kept(self, name: str) -> bool:
        """Is the archive member ``name`` (a path in the package's tree) one of the kept files?"""
        folder, _, base = name.rpartition("/")
        in_kernels = f"{folder}/" in self.kernel_dirs and base.endswith(".py") and (not self.only or base in self.only)
        return in_kernels or name in self.extra_files

    def unpack(self, archive_path: Path, dest: Path) -> None:
        """Copy the kernel files (and the extra files) of a wheel or sdist of this project into ``dest``."""
        for name, read in _members(archive_path):
            if self.kept(name):
                target = dest / name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(read())
        for folder in self.kernel_dirs:
            if not (dest / folder).is_dir():
                raise NanfuzzError(f"{archive_path} holds no {folder} files; is it a {self.project} "
                                   f"{'source distribution' if self.sdist else 'wheel'}?")

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
        kind = ["--no-binary=:all:", "--no-build-isolation"] if self.sdist else ["--only-binary=:all:"]
        command = [sys.executable, "-m", "pip", "download", "--no-deps", *kind, *self.download_options,
                   "--disable-pip-version-check", "--progress-bar", "off", "--retries", "2",
                   "--dest", str(into), f"{self.project}=={version}"]
        done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **dict(self.download_env)})
        pattern = f"{self.wheel_stem}-{version}.tar.gz" if self.sdist else f"{self.wheel_stem}-{version}-*.whl"
        found = sorted(into.glob(pattern))
        if done.returncode == 0 and found:
            return found[0]
        output = done.stdout + done.stderr
        network = any(sign in output for sign in _NETWORK_SIGNS)
        last = next((line.strip() for line in reversed(output.splitlines()) if line.strip()), "no output")
        reason = "no package index is reachable" if network else "pip failed"
        raise FetchError(f"cannot fetch {self.project}=={version} with pip download: {reason} ({last})",
                         network=network)


def _members(path: Path):
    """(name inside the package's tree, a function reading it) for each file of a wheel or an sdist
    (whose members sit under one ``<name>-<version>/`` folder, left out of the name)."""
    if path.name.endswith(".whl"):
        with zipfile.ZipFile(path) as archive:
            for name in archive.namelist():
                yield name, lambda name=name: archive.read(name)
        return
    with tarfile.open(path) as archive:
        for member in archive.getmembers():
            if member.isfile() and "/" in member.name:
                yield member.name.partition("/")[2], lambda member=member: archive.extractfile(member).read()
