"""Kernel modules that call Triton builtins the interpreter does not patch, made to run under Triton's interpreter.

On a GPU, Triton's code generator hands every builtin a kernel calls its semantic (``_semantic=``),
whatever name the call reaches it by.  Triton's interpreter runs a kernel as Python instead, and
for the length of a launch it replaces the builtins on ``triton.language`` (its ``math`` and
``core`` too) with versions that carry the interpreter's semantic (``_patch_lang`` in
``triton/runtime/interpreter.py``).  Two kinds of call miss that and fail every launch with "Did
you forget to add @triton.jit ?", though the kernel runs on a GPU:

- a name bound to a builtin when its module was imported, outside that namespace
  (``tl_exp2 = tl.exp2``, ``from triton.language import exp2``; lmdeploy's kernels keep
  ``tl_exp2``, ``tl_log2`` and libdevice's ``tanh`` so), which still holds the original;
- a builtin of ``triton.language.extra`` (``tl.extra.cuda.libdevice.tanh``,
  ``tl.extra.cuda.gdc_wait``), which the interpreter never patches.

A third fails in some interpreters only: a scalar a kernel computes, used where Python wants an
integer (``range(loop_start, loop_end, BLOCK_N)`` in lmdeploy's prefill).  Triton 3.6's interpreter
converts it with ``int()`` of its one-element array, which NumPy 2.4 refuses ("only 0-dimensional
arrays can be converted to Python scalars"); Triton 3.9's takes the element.  Within
``interpretable_launches`` every interpreter takes the element.

``make_interpretable`` rebinds the first kind, in a module whose kernels were built for the
interpreter, to a function that calls the builtin as the interpreter has it at call time; the
kernel-file loader does so for every file it executes.  ``interpretable_launches``, around each
of nanfuzz's launches, does so for every module a launched kernel reaches (however it was
imported), patches the second kind as the interpreter patches ``triton.language``, and gives the
interpreter what those builtins need of it: libdevice's and ROCm's OCML math functions in numpy
(``LIBDEVICE_MATH``), and grid dependency control (PDL) as nothing to wait for, since the
interpreter runs one launch to its end before the next begins.

What nothing here makes run (inline assembly, another extern function) raises
``InterpreterCannotRun``; ``cannot_run_reason`` finds it, or the interpreter's own refusal, in a
launch's error and names the builtin, so that nanfuzz reports the interpreter as the reason (one
line, exit 2) rather than a CRASH of the kernel.
"""
from __future__ import annotations

import contextlib
import importlib
import types
from typing import Callable, Iterator

import numpy as np

_ABSENT = object()  # an attribute a patch added, which putting things back removes
# What Triton's interpreter raises for what it does not implement, and what a builtin
# called without a semantic raises.
_NOT_IN_INTERPRETER = "not supported in interpreter mode"
_NO_SEMANTIC = "Did you forget to add @triton.jit"


# The extern math functions the interpreter runs, by their name in libdevice (``__nv_tanhf``) and
# ROCm's OCML (``__ocml_tanh_f32``) without prefix and type suffix: numpy's functions of the same
# name (the interpreter's own tl.exp, tl.sqrt, ... are numpy's too).
LIBDEVICE_MATH = {
    "tanh": np.tanh, "exp": np.exp, "exp2": np.exp2, "log": np.log, "log2": np.log2, "sqrt": np.sqrt,
    "rsqrt": lambda x: 1 / np.sqrt(x), "sin": np.sin, "cos": np.cos, "floor": np.floor, "ceil": np.ceil,
    "abs": np.abs, "fabs": np.abs, "pow": np.power, "fmax": np.fmax, "fmin": np.fmin,
    "fdivide": np.divide, "div_rn": np.divide, "fdiv_rn": np.divide,
}
# Grid dependency control (PDL): a hint and a wait between launches on a GPU, which Triton builds
# from its semantic (3.9) or inline assembly (3.7); nothing to do where launches run one by one.
_GRID_DEPENDENCY_CONTROL = frozenset({"gdc_wait", "gdc_launch_dependents"})
# Modules of triton.language.extra whose builtins a kernel calls by their full name.
_EXTRA_MODULES = ("triton.language.extra.cuda", "triton.language.extra.cuda.libdevice",
                  "triton.language.extra.cuda.gdc", "triton.language.extra.hip", "triton.language.extra.hip.libdevice")


class InterpreterCannotRun(RuntimeError):
    """A kernel called a Triton builtin that Triton's interpreter has no implementation of."""


def _interpreted_type():
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # a Triton without an interpreter
        return None
    return InterpretedFunction


def _is_builtin(value) -> bool:
    from triton.language.core import is_builtin

    try:
        return callable(value) and is_builtin(value)
    except Exception:  # a lazy proxy or an object that refuses attribute lookups
        return False


def _owners() -> dict[int, tuple[types.ModuleType, str]]:
    """id(builtin) -> (a module of ``triton.language`` the interpreter patches, its name there)."""
    import triton.language as tl

    found = {}
    for owner in (tl.core, tl.math, tl):  # tl last: a name of its own wins
        for name, value in vars(owner).items():
            if _is_builtin(value):
                found[id(value)] = (owner, name)
    return found


def _full_name(builtin) -> str:
    module = getattr(builtin, "__module__", "") or ""
    return f"{module.replace('triton.language', 'tl')}.{getattr(builtin, '__name__', repr(builtin))}".lstrip(".")


def _with_interpreter_semantic(builtin, name: str) -> Callable:
    """Call ``builtin`` as the interpreter's own patching does, with its semantic; an operation the
    interpreter does not implement raises ``InterpreterCannotRun`` naming ``name``."""
    from triton.runtime import interpreter

    def call(*args, **kwargs):
        kwargs = {k: v for k, v in kwargs.items() if k not in ("_semantic", "_builder")}
        try:
            if hasattr(interpreter, "interpreter_semantic"):
                return builtin(*args, **kwargs, _semantic=interpreter.interpreter_semantic)
            return builtin(*args, **kwargs, _builder=interpreter.interpreter_builder)  # Triton before 3.4
        except NotImplementedError as exc:
            raise InterpreterCannotRun(f"{name}: {exc}") from exc

    return call


def _nothing_to_wait_for(*_args, **_kwargs) -> None:
    """Grid dependency control under the interpreter: one launch ends before the next begins."""


def _rebound(builtin, owners) -> Callable:
    name = _full_name(builtin)
    if getattr(builtin, "__name__", "") in _GRID_DEPENDENCY_CONTROL:
        return _nothing_to_wait_for
    fallback = _with_interpreter_semantic(builtin, name)
    if id(builtin) not in owners:
        return fallback
    owner, attr = owners[id(builtin)]

    def call(*args, **kwargs):
        current = getattr(owner, attr)  # during a launch: the interpreter's version
        if current is builtin or _is_builtin(current):
            return fallback(*args, **kwargs)  # the interpreter left this one unpatched
        return current(*args, **kwargs)

    call.__name__ = call.__qualname__ = getattr(builtin, "__name__", "builtin")
    call.__wrapped__ = builtin
    return call


def _jitted(value):
    """The interpreted function inside ``value`` (a kernel, or an autotuner or heuristics around one), or None."""
    interpreted = _interpreted_type()
    seen = 0
    while value is not None and seen < 8:
        if interpreted is not None and isinstance(value, interpreted):
            return value
        try:
            value = getattr(value, "fn", None)
        except Exception:  # a lazy proxy that refuses attribute lookups
            return None
        seen += 1
    return None


def make_interpretable(namespace: dict) -> list[str]:
    """Rebind the builtin aliases of a module's globals (``module.__dict__``, or a kernel's
    ``fn.__globals__``) and of every module whose kernels it reaches, if its kernels were built for
    the interpreter; returns the names rebound (none, once they are)."""
    rebound: list[str] = []
    pending, seen = [namespace], set()
    owners = None
    while pending:
        globals_ = pending.pop()
        if id(globals_) in seen:
            continue
        seen.add(id(globals_))
        values = list(globals_.items())
        kernels = [k for k in (_jitted(v) for _, v in values) if k is not None]
        if not kernels:
            continue  # nothing built for the interpreter here: on a GPU the compiler needs the originals
        for name, value in values:
            if _is_builtin(value):
                owners = owners if owners is not None else _owners()
                globals_[name] = _rebound(value, owners)
                rebound.append(f"{globals_.get('__name__', '?')}.{name}")
        pending += [k.fn.__globals__ for k in kernels]
    return rebound


@contextlib.contextmanager
def interpretable_launches(interpreter: bool = True) -> Iterator[None]:
    """Within, each kernel launched under the interpreter has its modules' builtin aliases rebound
    first (``make_interpretable``), whichever way its module was imported, and the builtins of
    ``triton.language.extra`` run there (see the module's notes); all put back after."""
    interpreted = _interpreted_type() if interpreter else None
    original = interpreted.__dict__.get("run") if interpreted is not None else None
    if original is None:
        yield
        return

    def run(self, *args, **kwargs):
        make_interpretable(self.fn.__globals__)
        return original(self, *args, **kwargs)

    saved = [(interpreted, "run", original)]
    interpreted.run = run
    try:
        saved += _patch_extra_builtins()
        yield
    finally:
        for owner, name, value in reversed(saved):
            if value is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, value)


def _patch_extra_builtins() -> list[tuple[object, str, object]]:
    """Patch ``triton.language.extra``'s builtins and the interpreter's builder as the module's notes
    say; returns what to put back."""
    from triton.runtime import interpreter

    saved = []

    def put(owner, name, value):
        saved.append((owner, name, owner.__dict__.get(name, _ABSENT)))
        setattr(owner, name, value)

    put(type(interpreter.interpreter_builder), "create_extern_elementwise", _extern_elementwise)
    for module, name, replacement in _extra_replacements():
        put(module, name, replacement)
    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is not None:
        put(interpreter, "_patch_lang_tensor", _with_scalar_index(patch_tensor))
    return saved


def _with_scalar_index(patch_tensor: Callable) -> Callable:
    """The interpreter's patch of ``tl.tensor`` for a launch, then an ``__index__`` that takes a scalar's
    one element, whatever the shape of the array holding it (see the module's notes)."""
    def patch(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", _scalar_index)

    return patch


def _scalar_index(self) -> int:
    return int(self.handle.data.item())


_extra_rebound: list[tuple[types.ModuleType, str, Callable]] = []


def _extra_replacements() -> list[tuple[types.ModuleType, str, Callable]]:
    """(module, name, what runs under the interpreter) for every builtin of ``triton.language.extra``:
    found and wrapped once per process (a few hundred of them, every launch patches them all)."""
    if not _extra_rebound:
        for module in _extra_modules():
            for name, value in list(vars(module).items()):
                if _is_builtin(value):
                    _extra_rebound.append((module, name, _rebound(value, {})))
    return _extra_rebound


def _extra_modules() -> list[types.ModuleType]:
    """The modules of ``triton.language.extra`` a kernel reaches, by attribute (``tl.extra.cuda``) and
    by import: Triton loads its backends' extras by hand, and the two can be different objects."""
    import triton.language as tl

    found: dict[int, types.ModuleType] = {}
    extra = getattr(tl, "extra", None)
    for backend in (getattr(extra, name, None) for name in ("cuda", "hip")):
        for module in (backend, getattr(backend, "libdevice", None), getattr(backend, "gdc", None)):
            if isinstance(module, types.ModuleType):
                found[id(module)] = module
    for dotted in _EXTRA_MODULES:
        try:
            module = importlib.import_module(dotted)
        except ImportError:  # a Triton without that backend's extras
            continue
        found[id(module)] = module
    return list(found.values())


def _extern_elementwise(self, lib_name, lib_path, symbol, args, ret_type, is_pure):
    """The interpreter's ``create_extern_elementwise``: ``LIBDEVICE_MATH``'s functions in numpy."""
    from triton.runtime.interpreter import TensorHandle, _get_np_dtype

    function = LIBDEVICE_MATH.get(_math_name(symbol))
    if function is None:
        raise InterpreterCannotRun(f"extern function {symbol}: not one of the math functions nanfuzz runs under "
                                   f"the interpreter ({', '.join(sorted(LIBDEVICE_MATH))})")
    scalar = getattr(ret_type, "scalar", ret_type)
    with np.errstate(all="ignore"):
        data = function(*(arg.data for arg in args))
    return TensorHandle(np.asarray(data).astype(_get_np_dtype(scalar)), scalar)


def _math_name(symbol: str) -> str:
    """``__nv_tanhf``, ``__nv_fast_fdividef``, ``__ocml_tanh_f32`` -> ``tanh``, ``fdivide``, ``tanh``."""
    name = symbol
    for prefix in ("__nv_fast_", "__nv_", "__ocml_native_", "__ocml_"):
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    for suffix in ("_f16", "_f32", "_f64"):
        if name.endswith(suffix):
            return name[:-len(suffix)]
    if name not in LIBDEVICE_MATH and name.endswith("f") and name[:-1] in LIBDEVICE_MATH:
        return name[:-1]  # libdevice's float version
    return name


def cannot_run_reason(exc: BaseException) -> str | None:
    """Why a launch that raised ``exc`` under the interpreter failed for the interpreter's sake, in
    one line naming the builtin; None when the failure is the kernel's own."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = str(exc)
        refused = isinstance(exc, NotImplementedError) and _NOT_IN_INTERPRETER in text
        if isinstance(exc, InterpreterCannotRun) or refused:
            return text.splitlines()[0]
        if isinstance(exc, ValueError) and _NO_SEMANTIC in text:
            return (f"{_builtin_in_traceback(exc) or 'a Triton builtin'} is called by a name the interpreter does "
                    "not patch (it patches triton.language's own names for a launch)")
        exc = exc.__cause__ or exc.__context__
    return None


def _builtin_in_traceback(exc: BaseException) -> str | None:
    """The builtin whose wrapper raised ``exc`` (Triton's ``builtin`` decorator keeps it as ``fn``)."""
    tb, found = exc.__traceback__, None
    while tb is not None:
        fn = tb.tb_frame.f_locals.get("fn") if tb.tb_frame.f_code.co_name == "wrapper" else None
        if fn is not None and callable(fn):
            found = _full_name(fn)
        tb = tb.tb_next
    return found
