"""How an exported repro of a library kernel (vLLM's, AITER's) loads the library's kernel files.

Copied into the script with the library's stand-ins and the adapter's own
call, it answers ``load(group, source)`` as nanfuzz's loader does for the
adapter: with a source tree (the folder that holds ``vllm/`` or ``aiter/``)
it executes the kernel files by path under their real dotted names while
stand-ins for the library's runtime sit in ``sys.modules``; without one it
imports the installed library's modules, and swaps in during each call the
stand-ins a native install still needs (vLLM's ROCm custom paged-attention
kernel is declined, so its Triton path is what runs).  An installed library
whose runtime does not import (no compiled extensions, a bare copy on
``sys.path``) gives its files, as a source tree does.  Standard library only.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path


class LibraryMissing(ImportError):
    """The library's kernel files are not where the script was told to look: the kernel cannot be
    loaded, as when a module it imports is missing (exit status 2, not a finding)."""


class LoadedFiles:
    """The kernel modules of one group by short name; ``active()`` is the context of every call."""

    def __init__(self, modules: dict, call_modules: dict):
        self.modules = modules
        self.call_modules = call_modules

    def __getitem__(self, short_name: str):
        return self.modules[short_name]

    @contextlib.contextmanager
    def active(self, overrides=None):
        """``overrides``: (short module name, attribute) -> what that attribute holds during the call
        (a pinned dispatch rule, a launch wrapper); the old values come back afterwards."""
        saved = {name: sys.modules.get(name) for name in self.call_modules}
        sys.modules.update(self.call_modules)
        attributes = {(self.modules[m], a): v for (m, a), v in (overrides or {}).items()}
        kept = {key: getattr(*key) for key in attributes}
        for (module, attr), value in attributes.items():
            setattr(module, attr, value)
        try:
            yield
        finally:
            for (module, attr), value in kept.items():
                setattr(module, attr, value)
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
            self._loaded[group, source] = self._files(group, source) if source else self._installed(group)
        return self._loaded[group, source]

    def _installed(self, group: str) -> LoadedFiles:
        """The installed library's own modules; its files where its runtime does not import."""
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise LibraryMissing(f"no {self.package} package is importable; give the folder that holds "
                                 f"{self.package}/ with {self.option} DIR or {self.env_var}=DIR")
        before = {name for name in sys.modules if self._owns(name)}
        try:
            return self._native(group)
        except Exception as exc:  # noqa: BLE001 - whatever it is, the runtime is not usable here
            why = " ".join(f"{type(exc).__name__}: {exc}".split())
        for name in [n for n in sys.modules if self._owns(n) and n not in before]:
            del sys.modules[name]
        package_dir = Path(list(spec.submodule_search_locations)[0])
        try:
            return self._files(group, str(package_dir.parent))
        except LibraryMissing as exc:
            raise LibraryMissing(f"the installed {self.package} does not import ({why}) and {exc}") from None

    def _owns(self, name: str) -> bool:
        return name == self.package or name.startswith(self.package + ".")

    def _native(self, group: str) -> LoadedFiles:
        modules = {}
        for entry in self.groups[group]:
            for name in entry.names:
                try:
                    modules[entry.name] = importlib.import_module(f"{self.ops_package}.{name}")
                    break
                except ModuleNotFoundError as exc:
                    if exc.name != f"{self.ops_package}.{name}":
                        raise  # the module is there, something it imports is not
            else:
                if not entry.optional:
                    raise ModuleNotFoundError(f"no {self.ops_package}.{entry.name}")
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
            try:
                spec.loader.exec_module(module)
            except Exception as exc:  # noqa: BLE001 - name the file and the cause
                cause = " ".join(f"{type(exc).__name__}: {exc}".split())
                raise LibraryMissing(f"{path} failed to import under the script's stand-ins for "
                                     f"{self.package}'s runtime ({cause})") from None
            parent, _, child = dotted.rpartition(".")
            setattr(sys.modules[parent], child, module)
            modules[entry.name] = module
        return LoadedFiles(modules, {})
