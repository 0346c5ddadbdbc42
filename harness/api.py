"""The functions users call from Python: ``nanfuzz.fuzz``, ``nanfuzz.check``, ``nanfuzz.replay``.

Each takes a kernel as a :class:`Kernel` or a name (``family@variant``,
``vllm:...``, ``package.module:attr``) and decides the backend first, so a
caller need not know about ``TRITON_INTERPRET``.
"""
from __future__ import annotations

from nanfuzz.harness.kernel import Kernel


def _kernel(kernel: Kernel | str) -> Kernel:
    from nanfuzz.harness.registry import resolve

    return kernel if isinstance(kernel, Kernel) else resolve(kernel)


def fuzz(kernel: Kernel | str, *, device: str | None = None, **options):
    """Run a campaign against ``kernel``; returns the Campaign (``.failed``, ``.failure``, ``.failing_case``)."""
    from nanfuzz.harness.backend import choose_backend
    from nanfuzz.harness.fuzz import fuzz as run_campaign

    device = choose_backend(device)
    return run_campaign(_kernel(kernel), device=device, **options)


def check(kernel: Kernel | str, case, *, device: str | None = None):
    """Judge ``kernel`` on one ``Case``; returns the Outcome (``.verdict``, ``.summary``, ``.evidence``)."""
    from nanfuzz.harness.backend import choose_backend
    from nanfuzz.harness.check import check as judge

    device = choose_backend(device)
    return judge(_kernel(kernel), case, device)


def replay(path, *, kernel: str | None = None, device: str | None = None):
    """Re-run the repro at ``path``; returns the Replay (``.still_fails``, ``.line()``)."""
    from nanfuzz.harness.backend import choose_backend
    from nanfuzz.harness.replay import replay as rerun

    device = choose_backend(device)
    return rerun(str(path), kernel_name=kernel, device=device)
