"""A library's kernel files, run without the library: ``nanfuzz.load_kernel_files``.

A Triton attention kernel usually sits in a file that imports a little of
the library around it (a logger, a platform query, a flag module) and the
library itself will not import without its compiled extensions.  This
executes only the named files, by path under their real dotted names, while
small stand-ins for those runtime modules sit in ``sys.modules``:

    files = load_kernel_files("path/to/checkout", ["mylib.ops.decode_attention"],
                              standins={"mylib.utils": {"is_hip": lambda: False}})
    decode = files["mylib.ops.decode_attention"]
    with files.active():
        decode.decode_attention_fwd(...)

Every package above a kernel file or a stand-in is a stand-in package with an
empty ``__path__``, so an import the stand-ins do not answer fails with the
module's name instead of reaching into the tree.  A file named ``replaceable``
that fails to import (a backward kernel the installed Triton no longer compiles)
is replaced by a placeholder whose every name is a function that raises, saying
why; ``files.left_out`` says which and why.  A file whose kernels were built
for Triton's interpreter keeps its own names for Triton builtins working there
(``tl_exp2 = tl.exp2``; see ``harness.adapters.interpreter_builtins``).
``sys.modules`` is restored
after loading, and ``active()`` installs the same modules around each call
(Triton resolves a kernel's globals when it first runs), so the stand-ins
never meet the real library in the same process.  nanfuzz's own vLLM and
AITER adapters load their kernels this way.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Collection, Iterator, Mapping, Sequence

from nanfuzz.harness.adapters.interpreter_builtins import make_interpretable
from nanfuzz.harness.adapters.standins import standin_module
from nanfuzz.reference.errors import NanfuzzError

# What a stand-in is given as: a module, or the attributes of one.
Standin = object


@dataclass
class KernelFiles:
    """Kernel modules executed from ``root``, and the stand-ins they run beside."""

    root: Path
    modules: dict[str, types.ModuleType]   # dotted name -> module, in load order
    standins: dict[str, types.ModuleType]  # dotted name -> stand-in module (packages included)
    left_out: dict[str, str] = field(default_factory=dict)  # replaced file's dotted name -> why

    def __getitem__(self, dotted: str) -> types.ModuleType:
        try:
            return self.modules[dotted]
        except KeyError:
            raise KeyError(f"{dotted!r} is not one of the loaded kernel files ({', '.join(self.modules)})") from None

    @property
    def packages(self) -> frozenset[str]:
        """The top-level packages these modules stand for ("vllm", "sglang")."""
        return frozenset(name.partition(".")[0] for name in (*self.modules, *self.standins))

    @contextlib.contextmanager
    def active(self, overrides: Mapping[tuple[str, str], object] | None = None) -> Iterator[None]:
        """The kernel modules and stand-ins in ``sys.modules`` for the duration, every other module of
        their packages hidden; ``overrides`` maps (dotted module name, attribute) to what that
        attribute holds meanwhile (a launch wrapper, a pinned dispatch rule).  All put back after."""
        entries = {**self.standins, **self.modules}
        with swapped_modules(self.packages, entries, exclusive=True), \
                swapped_attributes({(self[m], a): v for (m, a), v in (overrides or {}).items()}):
            yield


def load_kernel_files(root: str | os.PathLike, modules: Sequence[str],
                      standins: Mapping[str, Standin] | None = None, *, library: str = "",
                      replaceable: Collection[str] = ()) -> KernelFiles:
    """Execute ``modules`` (dotted names, in order: a module's in-package imports first) from the tree
    at ``root`` (the folder that holds the top-level package), beside ``standins`` for the runtime
    modules they import (dotted name -> a module, or a dict of its attributes).

    ``library`` names the library in messages.  A missing folder or file, or a file that fails to
    import under the stand-ins, is a ``NanfuzzError`` that names it and the cause; one of
    ``replaceable`` that fails to import is replaced by a placeholder (``KernelFiles.left_out``)."""
    what = library or "kernel"
    tree = Path(root).expanduser()
    if not tree.is_dir():
        raise NanfuzzError(f"{what} source {os.fspath(root)!r} is not a directory; point it at the folder that "
                           f"holds {', '.join(sorted({m.partition('.')[0] for m in modules}))}/")
    paths = {}
    for dotted in modules:
        path = tree / (dotted.replace(".", "/") + ".py")
        if not path.is_file():
            raise NanfuzzError(f"{what} source {tree} lacks {path.relative_to(tree)} (module {dotted})")
        paths[dotted] = path
    made = _standin_modules(standins or {}, modules, library=what)
    loaded: dict[str, types.ModuleType] = {}
    left_out: dict[str, str] = {}
    packages = frozenset(name.partition(".")[0] for name in (*modules, *made))
    with swapped_modules(packages, made, exclusive=True):
        for dotted, path in paths.items():
            try:
                loaded[dotted] = _exec_file(dotted, path, made, what)
            except FileDidNotImport as exc:
                if dotted not in replaceable:
                    raise
                left_out[dotted] = exc.cause
                loaded[dotted] = _placeholder(dotted, exc.cause, made)
    return KernelFiles(root=tree.resolve(), modules=loaded, standins=made, left_out=left_out)


def _placeholder(dotted: str, why: str, standins: dict[str, types.ModuleType]) -> types.ModuleType:
    """A module standing for a file that did not import: every name a function that raises, saying why."""
    module = types.ModuleType(dotted, f"nanfuzz placeholder for {dotted}, which did not import: {why}")

    def any_name(name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def refused(*_args, **_kwargs):
            raise NanfuzzError(f"{dotted}.{name} is not available: {dotted} did not import ({why})")
        refused.__name__ = name
        return refused

    module.__getattr__ = any_name
    sys.modules[dotted] = module
    parent, _, child = dotted.rpartition(".")
    if parent in standins:
        setattr(standins[parent], child, module)
    return module


def _standin_modules(given: Mapping[str, Standin], kernel_modules: Sequence[str], *,
                     library: str) -> dict[str, types.ModuleType]:
    """The stand-ins as modules, with a stand-in package for every parent of them and of the kernel files."""
    names = set(given)
    for dotted in (*given, *kernel_modules):
        parts = dotted.split(".")
        names.update(".".join(parts[:i]) for i in range(1, len(parts)))
    parents = {name.rpartition(".")[0] for name in (*names, *kernel_modules)}
    made: dict[str, types.ModuleType] = {}
    for name in sorted(names):
        value = given.get(name, {})
        if isinstance(value, types.ModuleType):
            made[name] = value
        else:
            made[name] = standin_module(name, dict(value), library=library, package=name in parents)
    for name, module in made.items():
        parent, _, child = name.rpartition(".")
        if parent in made:
            setattr(made[parent], child, module)
    return made


class FileDidNotImport(NanfuzzError):
    """A kernel file that raised while it was executed; ``cause`` is the error, in one line."""

    def __init__(self, message: str, cause: str):
        super().__init__(message)
        self.cause = cause


def _exec_file(dotted: str, path: Path, standins: dict[str, types.ModuleType], library: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(dotted, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[dotted] = module  # imports of later files find it here
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - whatever it is, name the file and the cause
        del sys.modules[dotted]
        cause = " ".join(f"{type(exc).__name__}: {exc}".split())
        raise FileDidNotImport(f"{library} kernel file {path} failed to import under nanfuzz's runtime stand-ins "
                               f"({cause})", cause) from None
    make_interpretable(module.__dict__)  # names kept for Triton builtins run under the interpreter too
    parent, _, child = dotted.rpartition(".")
    if parent in standins:
        setattr(standins[parent], child, module)
    return module


def _owned(name: str, packages: frozenset[str]) -> bool:
    return name.partition(".")[0] in packages


@contextlib.contextmanager
def swapped_modules(packages: frozenset[str], entries: Mapping[str, types.ModuleType], *,
                    exclusive: bool) -> Iterator[None]:
    """Put ``entries`` into ``sys.modules`` for the duration; with ``exclusive``, hide every other
    module of ``packages`` (top-level names) too.  Everything is put back afterwards."""
    names = set(entries)
    if exclusive:
        names |= {name for name in sys.modules if _owned(name, packages)}
    saved = {name: sys.modules[name] for name in names if name in sys.modules}
    for name in names:
        sys.modules.pop(name, None)
    sys.modules.update(entries)
    try:
        yield
    finally:
        for name in [n for n in sys.modules if n in names or (exclusive and _owned(n, packages))]:
            del sys.modules[name]
        sys.modules.update(saved)


@contextlib.contextmanager
def swapped_attributes(values: Mapping[tuple[types.ModuleType, str], object]) -> Iterator[None]:
    saved = {(module, name): getattr(module, name) for module, name in values}
    for (module, name), value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for (module, name), value in saved.items():
            setattr(module, name, value)
