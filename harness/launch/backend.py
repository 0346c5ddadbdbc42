"""GPU or Triton interpreter: decided once, before any ``@triton.jit`` import.

Triton reads ``TRITON_INTERPRET`` when a kernel module is imported, so the
CLI and conftest call ``choose_backend`` first thing, and the pytest plugin
before any kernel import it controls; ``wrong_mode_kernels`` finds kernels
someone imported before that.  ``host_threads`` sets how many host threads a
run on the CPU may use.
"""
from __future__ import annotations

import contextlib
import os
import sys

from nanfuzz.reference.errors import NanfuzzError


def gpu_available() -> bool:
    import torch

    return torch.cuda.is_available()  # true on ROCm builds too (HIP answers as cuda)


def choose_backend(device: str | None = None) -> str:
    """Return "cuda" or "cpu" and set ``TRITON_INTERPRET`` to match.

    With no ``device``, a GPU is used when present and the interpreter
    otherwise; an explicit ``TRITON_INTERPRET=1`` from the user forces the
    interpreter (on CPU tensors) even where a GPU exists.
    """
    if device not in (None, "cpu", "cuda"):
        raise NanfuzzError(f"--device {device!r} is not one of cpu, cuda")
    forced = os.environ.get("TRITON_INTERPRET") == "1"
    if device is None:
        device = "cpu" if forced or not gpu_available() else "cuda"
    if device == "cuda" and not gpu_available():
        raise NanfuzzError("--device cuda: no GPU is visible to torch (torch.cuda.is_available() is False); use --device cpu to run under Triton's interpreter")
    if device == "cuda" and forced:
        raise NanfuzzError("--device cuda conflicts with TRITON_INTERPRET=1; unset it or use --device cpu")
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    return device


def wrong_mode_kernels(device: str) -> list[str]:
    """``module.function`` of each imported Triton kernel built for the other mode.

    ``@triton.jit`` makes a ``JITFunction`` (GPU) or, under
    ``TRITON_INTERPRET=1``, an ``InterpretedFunction``, once, when its module
    is imported.  A ``JITFunction`` launched on CPU tensors fails with "0
    active drivers", so a kernel imported before the interpreter was chosen
    would turn every example into a false CRASH.  Triton's and torch's own
    modules are left out; nothing is imported here.
    """
    jit = sys.modules.get("triton.runtime.jit")
    if jit is None:
        return []  # no Triton, no kernel
    interpreter = sys.modules.get("triton.runtime.interpreter")
    interpreted_type = getattr(interpreter, "InterpretedFunction", None)
    wrong = jit.JITFunction if device == "cpu" else interpreted_type
    if wrong is None:
        return []  # the interpreter was never loaded, so no kernel was built for it
    leaf_types = tuple(t for t in (jit.JITFunction, interpreted_type) if t is not None)
    found = set()
    for name, module in list(sys.modules.items()):
        if module is None or name.partition(".")[0] in ("triton", "torch"):
            continue
        try:
            values = list(vars(module).values())
            for value in values:
                if not isinstance(value, jit.KernelInterface):
                    continue
                # @triton.autotune and @triton.heuristics keep the jitted function in .fn
                while not isinstance(value, leaf_types) and isinstance(getattr(value, "fn", None), jit.KernelInterface):
                    value = value.fn
                if isinstance(value, wrong):
                    fn = value.fn
                    found.add(f"{getattr(fn, '__module__', name)}.{getattr(fn, '__qualname__', '?')}")
        except Exception:  # a module object that will not be looked into (no __dict__, a lazy proxy)
            continue
    return sorted(found)


def wrong_mode_message(device: str, kernels: list[str], fix: str) -> str:
    """One line: which kernels, why they cannot run, and ``fix``."""
    shown = ", ".join(kernels[:3]) + (f" and {len(kernels) - 3} more" if len(kernels) > 3 else "")
    if device == "cpu":
        why = ("were imported before nanfuzz chose Triton's interpreter (no GPU), so they are built for a GPU "
               "and every launch would fail with '0 active drivers'")
    else:
        why = "were imported under TRITON_INTERPRET=1, but nanfuzz runs on the GPU"
    return f"nanfuzz: Triton kernels {shown} {why}; {fix}"


def refuse_wrong_mode_kernels(device: str, fix: str) -> None:
    """A NanfuzzError (``wrong_mode_message``) when a Triton kernel was imported for the other mode
    than ``device``'s: every front door checks this before its first verdict, since each launch of
    such a kernel would fail and read as the kernel's CRASH."""
    stray = wrong_mode_kernels(device)
    if stray:
        raise NanfuzzError(wrong_mode_message(device, stray, fix))


def usable_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@contextlib.contextmanager
def host_threads(device: str, *, own_process: bool = False):
    """One thread for torch and for the BLAS and OpenMP pools while kernels run on the CPU,
    and on any device in a process of nanfuzz's own (``own_process``: a supervised worker).

    Every host tensor of a case is small, so a second thread buys nothing;
    and on a CPU shared with other work (xdist workers, ``--jobs``), a pool
    spinning on a busy core costs a great deal: torch's OpenMP pool made
    materialisation and the oracle 10 to 40 times slower (3 ms became 100+
    ms per case on a loaded 2-core machine), and NumPy's OpenBLAS pool
    (the interpreter's ``tl.dot``) made two interpreter processes on two
    cores take 220-310 ms per launch instead of 90-150.  On a GPU host the
    same holds for the workers: with ``--jobs 14`` and the compile farm they
    share the cores, and their host work is small.
    """
    if device != "cpu" and not own_process:
        yield  # a user's GPU session keeps its threads
        return
    import torch
    from threadpoolctl import threadpool_limits

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with threadpool_limits(limits=1):
            yield
    finally:
        torch.set_num_threads(before)
