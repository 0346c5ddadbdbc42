"""How an exported repro of a library kernel (vLLM's) loads the library's kernel files.

Copied into the script with the library's stand-ins and the adapter's own
call, it answers ``load(group, source)`` as nanfuzz's loader does for the
adapter: with a source tree (the folder that holds ``vllm/``) it executes
the kernel files by path under their real dotted names while stand-ins for
the library's runtime sit in ``sys.modules``; without one it imports the
installed library's modules, and swaps in during each call the stand-ins a
native install still needs (vLLM's ROCm custom paged-attention kernel is
declined, so its Triton path is what runs).  Standard library only.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path


class LibraryMissing(RuntimeError):
    """The library's kernel files are not where the script was told to look."""


class LoadedFiles:
    """The kernel modules of one group by short name; ``active()`` is the context of every call."""

    def __init__(self, modules: dict, call_modules: dict):
        self.modules = modules
        self.call_modules = call_modules

    def __getitem__(self, short_name: str):
        return self.modules[short_name]

    @contextlib.contextmanager
    def active(self, overrides=None):
        saved = {name: sys.modules.get(name) for name in self.call_modules}
        sys.modules.update(self.call_modules)
        try:
            yield
        finally:
            for name, module in saved.items():
                if module is None:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = module


class LibraryFiles:
    """``package`` ("vllm") keeps its kernels under ``ops_package``; ``groups``: group -> its
    ``KernelModule`` entries in load order; ``standins()`` and ``call_modules()`` build the stand-in
    modules; ``env_var`` and ``option`` name where a source tree may be given."""

    def __init__(self, package, ops_package, groups, standins, call_modules, env_var, option):
        self.package, self.ops_package, self.groups = package, ops_package, groups
        self.standins, self.call_modules = standins, call_modules
        self.env_var, self.option = env_var, option
        self._loaded = {}

    def load(self, group: str, source=None) -> LoadedFiles:
        source = source or os.environ.get(self.env_var) or None
        if (group, source) not in self._loaded:
            self._loaded[group, source] = self._files(group, source) if source else self._native(group)
        return self._loaded[group, source]

    def _native(self, group: str) -> LoadedFiles:
        modules = {}
        for entry in self.groups[group]:
            for name in entry.names:
                try:
                    modules[entry.name] = importlib.import_module(f"{self.ops_package}.{name}")
                    break
                except ImportError as exc:
                    why = exc
            else:
                if not entry.optional:
                    raise LibraryMissing(f"cannot import {self.ops_package}.{entry.name} ({why}); give the folder that "
                                     f"holds {self.package}/ with {self.option} DIR or {self.env_var}=DIR")
        return LoadedFiles(modules, self.call_modules())

    def _files(self, group: str, source: str) -> LoadedFiles:
        root = Path(source).expanduser()
        ops_dir = Path(*self.ops_package.split(".")[1:])
        package_dir = root / self.package if (root / self.package / ops_dir).is_dir() else root
        if not (package_dir / ops_dir).is_dir():
            raise LibraryMissing(f"{source!r} holds no {self.package}/{ops_dir.as_posix()}/; give the folder that holds "
                             f"{self.package}/ (a source checkout or an unpacked wheel)")
        standins = self.standins()
        sys.modules.update(standins)
        modules = {}
        for entry in self.groups[group]:
            paths = [(name, package_dir / ops_dir / (name.replace(".", "/") + ".py")) for name in entry.names]
            found = next(((name, path) for name, path in paths if path.is_file()), None)
            if found is None:
                if entry.optional:
                    continue
                raise LibraryMissing(f"{source!r} lacks {paths[0][1]}, which this kernel runs")
            name, path = found
            dotted = f"{self.ops_package}.{name}"
            spec = importlib.util.spec_from_file_location(dotted, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[dotted] = module
            spec.loader.exec_module(module)
            parent, _, child = dotted.rpartition(".")
            setattr(sys.modules[parent], child, module)
            modules[entry.name] = module
        return LoadedFiles(modules, {})
