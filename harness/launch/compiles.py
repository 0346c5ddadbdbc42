"""How many kernel specialisations a campaign asks Triton for.

On a GPU every new specialisation is a compile (around a second), so a kernel
whose constexprs follow a case's sizes compiles on nearly every example and
the fuzz loop crawls.  On a GPU the count is Triton's own (its post-compile
hook); under the interpreter nothing compiles, so each launch is keyed the way
Triton's JIT keys it: constexpr and launch-option values, tensor dtypes, and
for integers their width and whether they equal 1 or divide by 16.
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field
from typing import Iterator

import torch


@dataclass
class Specialisations:
    keys: set = field(default_factory=set)  # interpreter: the JIT keys seen
    compiles: int = 0                       # GPU: compiles Triton reported
    counted: bool = True                    # False where this Triton has no compile hook

    @property
    def count(self) -> int | None:
        return (len(self.keys) + self.compiles) if self.counted else None


def _constexpr_names(fn) -> frozenset[str]:
    return frozenset(name for name, annotation in getattr(fn, "__annotations__", {}).items()
                     if "constexpr" in str(annotation))


def _arg_key(arg) -> object:
    if isinstance(arg, torch.Tensor):
        return str(arg.dtype)
    if isinstance(arg, bool) or arg is None:
        return arg
    if isinstance(arg, int):
        return ("i64" if not -2**31 <= arg < 2**31 else "i32", arg == 1, arg % 16 == 0)
    if isinstance(arg, float):
        return "fp32"
    return repr(arg)


def launch_key(fn, args: tuple, kwargs: dict, do_not_specialize=()) -> tuple:
    """What Triton's JIT would key a launch of ``fn`` on: constexprs (and launch
    options such as num_warps) by value, the other arguments by ``_arg_key``,
    integers named in ``do_not_specialize`` by their width alone."""
    params = list(inspect.signature(fn).parameters)
    constexprs = _constexpr_names(fn)
    unspecialised = {params[p] if isinstance(p, int) else p for p in do_not_specialize or ()}
    named = dict(zip(params, args))
    named.update(kwargs)

    def key(name, value):
        if name in constexprs or name not in params:
            return repr(value)
        if name in unspecialised and isinstance(value, int) and not isinstance(value, bool):
            return "i64" if not -2**31 <= value < 2**31 else "i32"
        return _arg_key(value)

    return fn.__module__, fn.__qualname__, tuple(sorted((name, key(name, value)) for name, value in named.items()))


@contextlib.contextmanager
def count_specialisations(interpreter: bool) -> Iterator[Specialisations]:
    """Count the specialisations launched inside the block (a new one is a compile on a GPU)."""
    seen = Specialisations()
    if interpreter:
        from triton.runtime.interpreter import InterpretedFunction

        original = InterpretedFunction.run

        def run(self, *args, grid, warmup, **kwargs):
            seen.keys.add(launch_key(self.fn, args, kwargs, self.kwargs.get("do_not_specialize")))
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)

        InterpretedFunction.run = run
        try:
            yield seen
        finally:
            InterpretedFunction.run = original
        return

    import triton

    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        seen.counted = False
        yield seen
        return
    previous = runtime.jit_post_compile_hook

    def hook(*args, **kwargs):
        seen.compiles += 1
        return previous(*args, **kwargs) if previous is not None else None

    runtime.jit_post_compile_hook = hook
    try:
        yield seen
    finally:
        runtime.jit_post_compile_hook = previous
