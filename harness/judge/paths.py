"""Which Triton kernels a launch ran, and with which compile-time specialisations.

Real kernels switch code path on the batch: vLLM's ``unified_attention`` runs
``kernel_unified_attention_2d`` or the split-K ``kernel_unified_attention_3d``
with ``reduce_segments``; AITER's ``pa_decode`` its v1 kernels or, above 1024
keys, the v2 kernels and their reduction.  A PASS claims only the paths its
examples reached, so each check records the Triton functions its poisoned
run launched (by name) and their constexpr values: on a GPU by wrapping
``JITFunction.run``, under the interpreter ``InterpretedFunction.run``.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Iterator

@functools.lru_cache(maxsize=256)
def _signature(fn) -> tuple[tuple[str, ...], frozenset[str]]:
    try:
        params = tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        params = ()
    constexprs = frozenset(name for name, annotation in getattr(fn, "__annotations__", {}).items()
                           if "constexpr" in str(annotation))
    return params, constexprs


def describe_launch(fn, args: tuple, kwargs: dict) -> tuple[str, str]:
    """(kernel name, its specialisation: ``name[CONST=value,...]``) of a launch of ``fn``."""
    params, constexprs = _signature(fn)
    named = dict(zip(params, args))
    named.update(kwargs)
    values = [f"{name}={named[name]!r}" for name in params if name in constexprs and name in named]
    name = getattr(fn, "__name__", repr(fn))
    return name, f"{name}[{','.join(values)}]"


@contextlib.contextmanager
def recording_launches() -> Iterator[dict[str, set[str]]]:
    """Within: every Triton launch is recorded as ``{kernel name: {specialisations}}``.  Where this
    Triton has neither hook point, nothing is recorded (the dict stays empty)."""
    seen: dict[str, set[str]] = {}
    targets = []
    try:
        from triton.runtime.interpreter import InterpretedFunction
        targets.append(InterpretedFunction)
    except ImportError:
        pass
    try:
        from triton.runtime.jit import JITFunction
        targets.append(JITFunction)
    except ImportError:
        pass
    originals = [(cls, cls.__dict__.get("run")) for cls in targets if "run" in cls.__dict__]

    def wrap(original):
        def run(self, *args, **kwargs):
            if not kwargs.get("warmup", False):
                name, specialisation = describe_launch(self.fn, args, kwargs)
                seen.setdefault(name, set()).add(specialisation)
            return original(self, *args, **kwargs)
        return run

    for cls, original in originals:
        cls.run = wrap(original)
    try:
        yield seen
    finally:
        for cls, original in originals:
            cls.run = original
