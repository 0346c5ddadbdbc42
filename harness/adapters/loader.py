"""Find a kernel library's Triton modules (vLLM's, AITER's) and load them without the library's runtime.

Where the kernels come from, in order:

1. a source tree or unpacked wheel given explicitly (``--vllm-src DIR`` /
   ``$NANFUZZ_VLLM_SRC``, ``--aiter-src DIR`` / ``$NANFUZZ_AITER_SRC``, read
   once at the edge into ``Settings``);
2. the installed package, when its kernel modules import for real (a GPU
   runner with vLLM or AITER installed): those modules are used as they are;
3. the installed package when it does not import (no compiled extensions, a
   bare copy on ``sys.path``): its files, as in 1.

In 1 and 3 only the kernel files are executed, through the public loader
(``harness.adapters.kernel_files``, ``nanfuzz.load_kernel_files``): by file path
under their real dotted names, while small stand-ins for the library's runtime
helpers sit in ``sys.modules`` for the modules they import.  ``sys.modules`` is
restored afterwards, and again around every call, so the stand-ins never meet
the real library in the same process.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import re
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import triton
import triton.language as tl

from nanfuzz.harness.adapters.kernel_files import load_kernel_files, swapped_attributes, swapped_modules
from nanfuzz.reference.errors import NanfuzzError


@dataclass(frozen=True)
class KernelModule:
    name: str                      # dotted name under the library's ops package ("_triton_kernels.pa_decode")
    functions: tuple[str, ...]     # what the adapters call or launch from it
    optional: bool = False         # absent in older trees; loaded when present
    # where other trees keep it instead, tried in order after ``name``: names under the ops
    # package, or a module's whole dotted name ("sglang.srt.layers.attention.triton_ops.x")
    moved_to: tuple[str, ...] = ()
    # a module the kernels under test never call (a backward pass beside the forward one):
    # where it does not import on this Triton it is replaced by a placeholder (``LoadedKernels.left_out``)
    replaceable: bool = False

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.moved_to)


@dataclass(frozen=True)
class Library:
    """A kernel library as the loader sees it: where its kernel files live, what they import."""

    name: str                      # for messages: "vLLM", "AITER"
    package: str                   # the top-level import name: "vllm", "aiter"
    ops_package: str               # dotted package the kernel modules sit under
    option: str                    # the command-line option naming a tree: "--vllm-src"
    env_var: str                   # the environment variable doing the same
    distribution: str              # the wheel's name on disk: "vllm", "amd_aiter" (for *.dist-info)
    tested: str                    # the release nanfuzz is tested with: "vLLM 0.33.0"
    groups: dict[str, tuple[KernelModule, ...]]   # kernel name after "prefix:" -> its modules in load order
    standins: Callable[[], dict[str, types.ModuleType]]   # fresh stand-in modules by dotted name
    # modules a native install still needs swapped in while the kernels run
    native_call_modules: Callable[[], dict[str, types.ModuleType]] = dict
    prefix: str = ""               # the kernels' name prefix where it is not the package: "fa_amd"
    release: str = "wheel"         # what a release unpacks from: "wheel", "source distribution"

    @property
    def ops_dir(self) -> str:      # inside the package folder
        return self.ops_package.partition(".")[2].replace(".", "/")

    @property
    def tree_hint(self) -> str:
        article = "an" if self.name[0] in "AEIOSUl" else "a"  # an SGLang, an AITER, an lmdeploy
        return (f"{article} {self.name} source checkout or an unpacked {self.distribution.replace('_', '-')} "
                f"{self.release} (the folder that holds {self.package}/)")

    def dotted(self, name: str) -> str:
        return name if name.startswith(self.package + ".") else f"{self.ops_package}.{name}"

    def relpath(self, name: str) -> str:  # inside the package folder
        return self.dotted(name).partition(".")[2].replace(".", "/") + ".py"

    @property
    def kernel_dirs(self) -> tuple[str, ...]:
        """Folders inside the package folder where a tree keeps kernel files: the ops package's,
        then any other a moved module names."""
        found = {self.ops_dir: None}
        for modules in self.groups.values():
            for km in modules:
                found.update(dict.fromkeys(self.relpath(n).rpartition("/")[0] for n in km.moved_to))
        return tuple(found)

    def owns(self, module_name: str) -> bool:
        return module_name == self.package or module_name.startswith(self.package + ".")

    def kernel_name(self, group: str) -> str:
        return f"{self.prefix or self.package}:{group}"


@dataclass
class LoadedKernels:
    """The kernel modules of one group, and what must be in place while they run."""

    library: Library
    group: str
    source: str                                  # where they came from, for reports
    modules: dict[str, types.ModuleType]         # KernelModule.name -> module
    native: bool                                 # the library's real runtime, not stand-ins
    _call_modules: dict[str, types.ModuleType] = field(default_factory=dict, repr=False)
    left_out: dict[str, str] = field(default_factory=dict)  # KernelModule.name -> why it did not import

    def __getitem__(self, short_name: str) -> types.ModuleType:
        return self.modules[short_name]

    @contextlib.contextmanager
    def active(self, overrides: dict[tuple[str, str], object] | None = None) -> Iterator[None]:
        """Install what the kernels import at call time; restore ``sys.modules`` after.

        ``overrides`` maps (module name, attribute) to what that attribute of
        a loaded module holds for the duration (a launch wrapper, a pinned
        dispatch rule); the old values come back afterwards.
        """
        with swapped_modules(frozenset({self.library.package}), self._call_modules, exclusive=not self.native), \
                swapped_attributes({(self.modules[m], a): v for (m, a), v in (overrides or {}).items()}):
            yield


_cache: dict[tuple[str, str, str | None], LoadedKernels] = {}


def loaded_module(dotted: str) -> types.ModuleType | None:
    """A kernel module this process loaded under the name ``dotted`` (it is not left in
    ``sys.modules``), or None."""
    for loaded in _cache.values():
        for module in loaded.modules.values():
            if module.__name__ == dotted:
                return module
    return None


def load(library: Library, group: str, source: str | os.PathLike | None = None) -> LoadedKernels:
    """The kernel modules of ``library``'s ``group``, loaded once per source.

    ``source`` is a source tree or unpacked wheel (the library's ``--*-src``,
    or its environment variable read at the edge); None: the installed package.
    """
    assert group in library.groups, group
    explicit = os.fspath(source) if source else None
    key = (library.package, group, explicit)
    if key not in _cache:
        _cache[key] = _load(library, group, explicit)
    return _cache[key]


# -- finding a tree -------------------------------------------------------------

def _package_dir(library: Library, path: str) -> Path:
    """The package folder for a user-given path: that folder itself, or its ``<package>/``."""
    given = Path(path).expanduser()
    where = f"{library.name} source {path!r} ({library.env_var} / {library.option})"
    if not given.is_dir():
        raise NanfuzzError(f"{where} is not a directory; point it at {library.tree_hint}")
    for package in (given / library.package, given):
        if any((package / folder).is_dir() for folder in library.kernel_dirs):
            return package.resolve()
    raise NanfuzzError(f"{where} has no {library.package}/{library.ops_dir}/ folder; point it at {library.tree_hint}")


def _version(library: Library, package: Path) -> str:
    # flash-attn keeps it in __init__.py, lmdeploy in version.py
    for version_file in (package / "_version.py", package / "version.py", package / "__init__.py"):
        if version_file.is_file():
            found = re.search(r"""__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", version_file.read_text())
            if found:
                return found.group(1)
    for metadata in sorted(package.parent.glob(f"{library.distribution}-*.dist-info/METADATA")):
        found = re.search(r"^Version:\s*(\S+)", metadata.read_text(), re.MULTILINE)
        if found:
            return found.group(1)
    return "unknown version"


# -- loading ----------------------------------------------------------------------

def _load(library: Library, group: str, explicit: str | None) -> LoadedKernels:
    if explicit is not None:
        return _load_files(library, group, _package_dir(library, explicit), origin=f"{library.option} {explicit}")
    spec = importlib.util.find_spec(library.package)
    kernel = library.kernel_name(group)
    if spec is None or not spec.submodule_search_locations:
        raise NanfuzzError(
            f"{kernel} needs {library.name}'s kernels: no {library.package} package is importable and no "
            f"{library.option} / {library.env_var} is given; install it, or pass {library.option} DIR, "
            f"{library.tree_hint}")
    native = _import_native(library, group)
    if native is not None:
        return native
    package = Path(list(spec.submodule_search_locations)[0]).resolve()
    if not any((package / folder).is_dir() for folder in library.kernel_dirs):
        raise NanfuzzError(
            f"{kernel}: the installed {library.package} at {package} has no {library.ops_dir}/ folder and no "
            f"{library.option} / {library.env_var} is given; pass {library.option} DIR, {library.tree_hint}")
    return _load_files(library, group, package, origin=f"installed {library.package}, runtime not importable")


def _import_native(library: Library, group: str) -> LoadedKernels | None:
    """The installed library's own modules, or None where its runtime does not import."""
    before = {name for name in sys.modules if library.owns(name)}
    modules = {}
    try:
        for km in library.groups[group]:
            for name in km.names:
                try:
                    modules[km.name] = importlib.import_module(library.dotted(name))
                    break
                except ModuleNotFoundError as exc:
                    if exc.name != library.dotted(name):
                        raise  # the module is there, something it imports is not
            else:
                if not km.optional:
                    raise ModuleNotFoundError(library.dotted(km.name))
    except Exception:  # noqa: BLE001 - any failure means: not a working install
        for name in [n for n in sys.modules if library.owns(n) and n not in before]:
            del sys.modules[name]
        return None
    # A library may swap in placeholders where it thinks Triton is unusable;
    # those would run nothing, so such an install is no use here.
    if any(getattr(m, "tl", tl) is not tl or getattr(m, "triton", triton) is not triton for m in modules.values()):
        return None
    _check_functions(library, group, modules,
                     lambda km: getattr(modules[km.name], "__file__", None) or modules[km.name].__name__)
    version = getattr(sys.modules.get(library.package), "__version__", "unknown version")
    return LoadedKernels(
        library=library, group=group, source=f"installed {library.package} {version} (native)", modules=modules,
        native=True, _call_modules=library.native_call_modules())


def _load_files(library: Library, group: str, package: Path, *, origin: str) -> LoadedKernels:
    chosen: dict[str, str] = {}  # KernelModule.name -> the name it has in this tree
    for km in library.groups[group]:
        name = next((n for n in km.names if (package / library.relpath(n)).is_file()), None)
        if name is None:
            if km.optional:
                continue
            raise NanfuzzError(
                f"{library.name} source {package} ({origin}) lacks {library.package}/{library.relpath(km.name)}, "
                f"which {library.kernel_name(group)} runs; point {library.option} at a {library.name} tree that "
                f"has it (nanfuzz is tested with {library.tested})")
        chosen[km.name] = name
    replaceable = [library.dotted(chosen[km.name]) for km in library.groups[group]
                   if km.replaceable and km.name in chosen]
    try:
        files = load_kernel_files(package.parent, [library.dotted(n) for n in chosen.values()], library.standins(),
                                  library=library.name, replaceable=replaceable)
    except NanfuzzError as exc:
        raise NanfuzzError(f"{exc}; this {library.name} version needs more of its runtime than nanfuzz provides: "
                           f"install it so that 'import {library.package}' works, or use {library.tested}'s "
                           "kernels") from None
    loaded = {short: files[library.dotted(name)] for short, name in chosen.items()}
    left_out = {short: files.left_out[library.dotted(name)] for short, name in chosen.items()
                if library.dotted(name) in files.left_out}
    _check_functions(library, group, {k: v for k, v in loaded.items() if k not in left_out},
                     lambda km: loaded[km.name].__file__)
    return LoadedKernels(
        library=library, group=group, source=f"{library.name} {_version(library, package)} kernels from {package} "
        f"({origin})", modules=loaded, native=False, _call_modules={**files.standins, **files.modules},
        left_out=left_out)


def _check_functions(library: Library, group: str, modules: dict[str, types.ModuleType], where) -> None:
    for km in library.groups[group]:
        if km.name not in modules:
            continue
        for function in km.functions:
            if not callable(getattr(modules[km.name], function, None)):
                raise NanfuzzError(
                    f"{library.name} kernel file {where(km)} has no {function}(), which {library.kernel_name(group)} "
                    f"drives; this {library.name} version is not supported: point {library.option} at "
                    f"{library.tested} or a tree derived from it")
