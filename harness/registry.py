"""Kernels under test by name: built-ins, vLLM's, AITER's, and users' own ``package.module:attr``.

What a kernel is lives in ``harness.kernel``.  Built-in kernel modules and
the library adapters are imported lazily, so the caller can decide on
``TRITON_INTERPRET`` before any ``@triton.jit`` is defined.
"""
from __future__ import annotations

import importlib
import sys
from dataclasses import replace

from nanfuzz.harness.adapters.sources import SOURCES
from nanfuzz.harness.import_path import import_user_module
from nanfuzz.harness.kernel import Kernel
from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.errors import NanfuzzError

# Built-in families: module path under harness.kernels; each exposes KERNELS.
BUILTIN_MODULES = ("paged_decode", "prefix_prefill", "unified", "split_decode")
# Kernel libraries, by the prefix of their kernel names: the adapter module under
# harness.adapters (its kernel(name, source) and KERNEL_NAMES), and the keyword its
# source tree travels as: resolve()'s and Settings' field, the command line's option
# with a dash (--vllm-src, --fa-src).
LIBRARIES = {library: keyword for library, (keyword, _) in SOURCES.items()}


def builtin_kernels() -> dict[str, Kernel]:
    kernels: dict[str, Kernel] = {}
    for family in BUILTIN_MODULES:
        module = importlib.import_module(f"nanfuzz.harness.kernels.{family}")
        for kernel in module.KERNELS:
            kernels[kernel.name] = kernel
    return kernels


def resolve(name: str, vllm_src: str | None = None, aiter_src: str | None = None,
            import_root: str | None = None, fa_src: str | None = None, sglang_src: str | None = None,
            lmdeploy_src: str | None = None) -> Kernel:
    """Turn a kernel name from the command line or a repro into a Kernel.

    ``vllm_src`` / ``aiter_src`` / ``fa_src`` / ``sglang_src`` / ``lmdeploy_src``: where ``vllm:*`` /
    ``aiter:*`` / ``fa_amd:*`` / ``sglang:*`` / ``lmdeploy:*`` kernels load their library's kernel files
    from (None: the installed package);
    ``import_root``: a folder a user's adapter module imports from besides the
    current directory (a replay run elsewhere in its repository);
    ``Settings.sources`` holds them all.

    The Kernel's ``spec`` is ``name``, so ``kernel.resolvable`` resolves it
    again in another process (a job, a replay, a repro script).
    """
    if is_user_spec(name):
        return replace(_user_kernel(name, import_root), spec=name, source=import_root)
    kernel = _resolve(name, {"vllm": vllm_src, "aiter": aiter_src, "fa_amd": fa_src, "sglang": sglang_src,
                             "lmdeploy": lmdeploy_src})
    return kernel if kernel.spec else replace(kernel, spec=name)


def resolve_for_process(name: str, sources: dict, stands_in_for=None) -> Kernel:
    """``name`` resolved again in a process of the run's (a job, a campaign side by side), with the
    device properties the run's kernel stands in for (``Kernel.stands_in_for``), which its import
    path alone may not give."""
    kernel = resolve(name, **sources)
    return kernel if stands_in_for is None else replace(kernel, stands_in_for=stands_in_for)


def library_of(name: str) -> str | None:
    """The kernel library a kernel name belongs to ("vllm", "aiter", "fa_amd", "sglang", "lmdeploy"), or None."""
    prefix, colon, _ = name.partition(":")
    return prefix if colon and prefix in LIBRARIES else None


def kernel_sources(kernel: Kernel, sources: dict[str, str | None] | None = None) -> dict[str, str | None]:
    """resolve()'s source keywords that load ``kernel``'s code again elsewhere: ``sources``
    (``Settings.sources``) with the tree the kernel was loaded from in its library's place."""
    chosen = {**{source_key(library): None for library in LIBRARIES}, "import_root": None}
    chosen.update(sources or {})
    path = import_path(kernel)
    library = library_of(path)
    if library and kernel.source:
        chosen[source_key(library)] = kernel.source
    elif is_user_spec(path) and kernel.source:
        chosen["import_root"] = kernel.source
    return chosen


def source_key(library: str) -> str:
    """The keyword a library's source tree travels as: "vllm_src", "fa_src"."""
    return LIBRARIES[library]


def source_flag(library: str) -> str:
    """The command line's option for a library's source tree: "--vllm-src", "--fa-src"."""
    return "--" + source_key(library).replace("_", "-")


def source_option(kernel: Kernel, sources: dict[str, str | None] | None = None) -> str:
    """`` --vllm-src DIR`` (or ``--aiter-src``, ...) where the kernel came from an explicit tree, for replay lines.

    A user's adapter module may wrap any library and read its tree from the environment, so its
    line names every tree of the run's ``sources`` (``Settings.sources``).
    """
    path = import_path(kernel)
    library = library_of(path)
    if library:
        return f" {source_flag(library)} {kernel.source}" if kernel.source else ""
    if not is_user_spec(path):
        return ""
    given = sources or {}
    return "".join(f" {source_flag(each)} {given[source_key(each)]}" for each in LIBRARIES
                   if given.get(source_key(each)))


def import_path(kernel: Kernel) -> str:
    """What resolves ``kernel`` again in another process: what a worker, a repro and a replay use.

    A resolved Kernel carries it as ``spec``.  A Kernel object never resolved
    from a name (a test that imported its adapter itself) is found at the
    ``module:attr`` that holds that very object; built-in kernels go by name.
    """
    if kernel.spec:
        return kernel.spec
    if _is_builtin(kernel):
        return kernel.name
    return _find_in_modules(kernel) or kernel.name


def library_kernel_names(variants: bool = False) -> list[str]:
    """Every library kernel's name, with the ``@path`` variants an adapter lists (``VARIANTS``)."""
    names = []
    for library in LIBRARIES:
        adapters = _adapters(library)
        names += adapters.KERNEL_NAMES
        names += getattr(adapters, "VARIANTS", ()) if variants else ()
    return names


def _adapters(library: str):
    return importlib.import_module(f"nanfuzz.harness.adapters.{library}")


def is_user_spec(name: str) -> bool:
    """Does ``name`` name a user's own adapter (``package.module:attr``)?"""
    return ":" in name and "@" not in name and library_of(name) is None


def _resolve(name: str, sources: dict[str, str | None]) -> Kernel:
    library = library_of(name)
    if library:
        return _adapters(library).kernel(name, sources[library])
    known = builtin_kernels()
    if name not in known:
        raise NanfuzzError(f"unknown kernel {name!r}; known: {', '.join(sorted(known))}, "
                           f"{', '.join(library_kernel_names())}, or package.module:attr "
                           "(a nanfuzz.Kernel in your adapter module)")
    return known[name]


def _user_kernel(spec: str, import_root: str | None = None) -> Kernel:
    """The Kernel object at ``package.module:attr``, imported from the current directory.

    Only a ``Kernel``, or a callable ``run(batch, out)`` carrying a
    ``.capabilities`` attribute, is accepted; nothing found there is ever
    called to obtain one.
    """
    module_name, _, attr = spec.partition(":")
    if not all(part.isidentifier() for part in module_name.split(".")) or not all(
            part.isidentifier() for part in attr.split(".")):
        raise NanfuzzError(f"kernel {spec!r} is not an import path; write package.module:attr "
                           "(e.g. mykernels.nanfuzz_adapter:kernel)")
    try:
        module = import_user_module(module_name, import_root)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # a user's module may fail in any way while importing, SystemExit included
        message = f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__
        top = module_name.split(".")[0]
        hint = (f"; run nanfuzz from the folder that holds {top!r} (it imports from the current directory)"
                if isinstance(exc, ModuleNotFoundError) and exc.name == top else "")
        raise NanfuzzError(f"kernel {spec!r}: cannot import module {module_name!r} ({message}){hint}") from None
    where = f"module {module_name!r} ({getattr(module, '__file__', None) or 'built-in'})"
    obj = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise NanfuzzError(f"kernel {spec!r}: {where} has no attribute {attr!r}") from None
    if isinstance(obj, Kernel):
        return obj
    if callable(obj) and isinstance(getattr(obj, "capabilities", None), Capabilities):
        return Kernel(name=spec, run=obj, capabilities=obj.capabilities)
    found = " ".join(repr(obj).split())
    found = found if len(found) <= 80 else found[:77] + "..."
    raise NanfuzzError(
        f"kernel {spec!r}: {where} holds {attr} = {found}, a {type(obj).__name__}, not a nanfuzz Kernel "
        "(nanfuzz never calls it to get one); name a Kernel object instead, e.g. "
        "kernel = Kernel(name, run, Capabilities(...)) in your adapter module, with "
        "from nanfuzz import Kernel, Capabilities")


def _is_builtin(kernel: Kernel) -> bool:
    families = (sys.modules.get(f"nanfuzz.harness.kernels.{family}") for family in BUILTIN_MODULES)
    return any(kernel is k for module in families if module is not None for k in module.KERNELS)


def _find_in_modules(kernel: Kernel) -> str | None:
    """``module:attr`` of a loaded module that holds this very Kernel object, if any."""
    for module_name, module in sorted(list(sys.modules.items()), key=lambda item: item[0]):
        if module is None or module_name == "__main__":
            continue
        try:
            namespace = vars(module)
        except TypeError:
            continue
        for attr, value in list(namespace.items()):
            if value is kernel:
                return f"{module_name}:{attr}"
    return None
