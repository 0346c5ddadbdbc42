"""Find vLLM's attention-kernel modules and load them without vLLM's runtime.

Where the kernels come from, in order:

1. a vLLM source tree or unpacked wheel named by ``NANFUZZ_VLLM_SRC`` (the
   command line's ``--vllm-src DIR`` sets it through ``set_vllm_source``);
2. an installed ``vllm`` whose kernel modules import for real (a GPU runner
   with vLLM installed): those modules are used as they are;
3. an installed ``vllm`` package that does not import (no compiled
   extensions, a bare copy on ``sys.path``): its files, as in 1.

In 1 and 3 only the kernel files are executed, by file path under their real
dotted names, while small stand-ins (``harness.adapters.vllm_standins``) sit
in ``sys.modules`` for the runtime modules they import.  ``sys.modules`` is
restored afterwards, and again around every call, so the stand-ins never
meet a real vLLM in the same process.
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
from typing import Iterator

import triton
import triton.language as tl

from nanfuzz.harness.adapters import vllm_standins
from nanfuzz.reference.errors import NanfuzzError

ENV_VAR = "NANFUZZ_VLLM_SRC"
OPS_PACKAGE = "vllm.v1.attention.ops"
OPS_DIR = "v1/attention/ops"


@dataclass(frozen=True)
class KernelModule:
    name: str                      # dotted name under OPS_PACKAGE
    functions: tuple[str, ...]     # what the adapters call or launch from it
    optional: bool = False         # absent in older trees; loaded when present

    @property
    def dotted(self) -> str:
        return f"{OPS_PACKAGE}.{self.name}"

    @property
    def relpath(self) -> str:  # inside the vllm package folder
        return f"{OPS_DIR}/{self.name}.py"


# In load order: a module's in-package imports come before it.
GROUPS: dict[str, tuple[KernelModule, ...]] = {
    "rocm_attn": (
        KernelModule("prefix_prefill", ("context_attention_fwd",)),
        KernelModule("chunked_prefill_paged_decode", ("chunked_prefill_paged_decode", "kernel_paged_attention_2d")),
    ),
    "triton_attn": (
        KernelModule("triton_attention_helpers", (), optional=True),
        KernelModule("triton_unified_attention", ("unified_attention", "kernel_unified_attention", "reduce_segments")),
    ),
}


@dataclass
class LoadedKernels:
    """The kernel modules of one group, and what must be in place while they run."""

    group: str
    source: str                                  # where they came from, for reports
    modules: dict[str, types.ModuleType]         # short name -> module
    native: bool                                 # the real vLLM runtime, not stand-ins
    _call_modules: dict[str, types.ModuleType] = field(default_factory=dict, repr=False)

    def __getitem__(self, short_name: str) -> types.ModuleType:
        return self.modules[short_name]

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Install what the kernels import at call time; restore ``sys.modules`` after.

        ``chunked_prefill_paged_decode`` imports ``vllm.platforms.rocm`` on
        every call to ask whether ROCm's custom kernel should run; it gets a
        module that always says no, so the Triton path under test runs on
        every device.
        """
        with _swapped_modules(self._call_modules, exclusive=not self.native):
            yield


_cache: dict[tuple[str, str | None], LoadedKernels] = {}


def load(group: str, source: str | os.PathLike | None = None) -> LoadedKernels:
    """The kernel modules of ``group`` ("rocm_attn" or "triton_attn"), loaded once per source.

    ``source`` is a vLLM source tree or unpacked wheel (``--vllm-src``, or
    ``$NANFUZZ_VLLM_SRC`` read at the edge); None: the installed vllm.
    """
    assert group in GROUPS, group
    explicit = os.fspath(source) if source else None
    key = (group, explicit)
    if key not in _cache:
        _cache[key] = _load(group, explicit)
    return _cache[key]


# -- finding a tree -------------------------------------------------------------

def _package_dir(path: str) -> Path:
    """The ``vllm`` package folder for a user-given path: that folder itself, or its ``vllm/``."""
    given = Path(path).expanduser()
    if not given.is_dir():
        raise NanfuzzError(
            f"vLLM source {path!r} ({ENV_VAR} / --vllm-src) is not a directory; "
            "point it at a vLLM source checkout or an unpacked vllm wheel (the folder that holds vllm/)")
    for package in (given / "vllm", given):
        if (package / OPS_DIR).is_dir():
            return package.resolve()
    raise NanfuzzError(
        f"vLLM source {path!r} ({ENV_VAR} / --vllm-src) has no vllm/{OPS_DIR}/ folder; "
        "point it at a vLLM source checkout or an unpacked vllm wheel (the folder that holds vllm/)")


def _version(package: Path) -> str:
    version_file = package / "_version.py"
    if version_file.is_file():
        found = re.search(r"""__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", version_file.read_text())
        if found:
            return found.group(1)
    for metadata in sorted(package.parent.glob("vllm-*.dist-info/METADATA")):
        found = re.search(r"^Version:\s*(\S+)", metadata.read_text(), re.MULTILINE)
        if found:
            return found.group(1)
    return "unknown version"


# -- loading ----------------------------------------------------------------------

def _load(group: str, explicit: str | None) -> LoadedKernels:
    if explicit is not None:
        return _load_files(group, _package_dir(explicit), origin=f"--vllm-src {explicit}")
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise NanfuzzError(
            f"vllm:{group} needs vLLM's kernels: no vllm package is importable and no --vllm-src / {ENV_VAR} is given; "
            "pip install vllm, or pass --vllm-src DIR (a vLLM source checkout or unpacked wheel)")
    native = _import_native(group)
    if native is not None:
        return native
    package = Path(list(spec.submodule_search_locations)[0]).resolve()
    if not (package / OPS_DIR).is_dir():
        raise NanfuzzError(
            f"vllm:{group}: the installed vllm at {package} has no {OPS_DIR}/ folder and no --vllm-src / {ENV_VAR} is given; "
            "pass --vllm-src DIR (a vLLM source checkout or unpacked wheel)")
    return _load_files(group, package, origin="installed vllm, runtime not importable")


def _import_native(group: str) -> LoadedKernels | None:
    """The installed vLLM's own modules, or None where its runtime does not import."""
    before = {name for name in sys.modules if _is_vllm(name)}
    modules = {}
    try:
        for km in GROUPS[group]:
            try:
                modules[km.name] = importlib.import_module(km.dotted)
            except ModuleNotFoundError as exc:
                if km.optional and exc.name == km.dotted:
                    continue
                raise
    except Exception:  # noqa: BLE001 - any failure means: not a working install
        for name in [n for n in sys.modules if _is_vllm(n) and n not in before]:
            del sys.modules[name]
        return None
    # vLLM swaps in placeholders where it thinks Triton is unusable; those
    # would run nothing, so such an install is no use here.
    if any(getattr(m, "tl", tl) is not tl or getattr(m, "triton", triton) is not triton for m in modules.values()):
        return None
    _check_functions(group, modules, lambda km: getattr(modules[km.name], "__file__", km.dotted))
    version = getattr(sys.modules.get("vllm"), "__version__", "unknown version")
    return LoadedKernels(
        group=group, source=f"installed vllm {version} (native)", modules=modules, native=True,
        _call_modules={"vllm.platforms.rocm": vllm_standins.rocm_platform_module()})


def _load_files(group: str, package: Path, *, origin: str) -> LoadedKernels:
    standins = vllm_standins.build()
    loaded: dict[str, types.ModuleType] = {}
    with _swapped_modules(standins, exclusive=True):
        for km in GROUPS[group]:
            path = package / km.relpath
            if not path.is_file():
                if km.optional:
                    continue
                raise NanfuzzError(
                    f"vLLM source {package} ({origin}) lacks vllm/{km.relpath}, which vllm:{group} runs; "
                    "point --vllm-src at a vLLM tree that has it (nanfuzz is tested with vLLM 0.33.0)")
            loaded[km.name] = _exec_file(km, path, standins)
    _check_functions(group, loaded, lambda km: package / km.relpath)
    modules = dict(standins)
    modules.update({km.dotted: loaded[km.name] for km in GROUPS[group] if km.name in loaded})
    return LoadedKernels(
        group=group, source=f"vLLM {_version(package)} kernels from {package} ({origin})", modules=loaded,
        native=False, _call_modules=modules)


def _exec_file(km: KernelModule, path: Path, standins: dict[str, types.ModuleType]) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(km.dotted, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[km.dotted] = module  # relative imports of later files find it here
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - whatever it is, name the file and the cause
        del sys.modules[km.dotted]
        cause = " ".join(f"{type(exc).__name__}: {exc}".split())
        raise NanfuzzError(
            f"vLLM kernel file {path} failed to import under nanfuzz's runtime stand-ins ({cause}); "
            "this vLLM version needs more of its runtime than nanfuzz provides: install it so that "
            "'import vllm' works, or use vLLM 0.33.0's kernels") from None
    setattr(standins[OPS_PACKAGE], km.name, module)
    return module


def _check_functions(group: str, modules: dict[str, types.ModuleType], where) -> None:
    for km in GROUPS[group]:
        if km.name not in modules:
            continue
        for function in km.functions:
            if not callable(getattr(modules[km.name], function, None)):
                raise NanfuzzError(
                    f"vLLM kernel file {where(km)} has no {function}(), which vllm:{group} drives; "
                    "this vLLM version is not supported: point --vllm-src at vLLM 0.33.0 or a tree "
                    "derived from it")


def _is_vllm(name: str) -> bool:
    return name == "vllm" or name.startswith("vllm.")


@contextlib.contextmanager
def _swapped_modules(entries: dict[str, types.ModuleType], *, exclusive: bool) -> Iterator[None]:
    """Put ``entries`` into ``sys.modules`` for the duration; with ``exclusive``,
    hide every other ``vllm`` module too.  Everything is put back afterwards."""
    names = set(entries)
    if exclusive:
        names |= {name for name in sys.modules if _is_vllm(name)}
    saved = {name: sys.modules[name] for name in names if name in sys.modules}
    for name in names:
        sys.modules.pop(name, None)
    sys.modules.update(entries)
    try:
        yield
    finally:
        for name in [n for n in sys.modules if n in names or (exclusive and _is_vllm(n))]:
            del sys.modules[name]
        sys.modules.update(saved)
