"""The functions users call from Python: ``nanfuzz.fuzz``, ``nanfuzz.check``, ``nanfuzz.replay``.

Each takes a kernel as a :class:`Kernel` or a name (``family@variant``,
``vllm:...``, ``package.module:attr``) and decides the backend first, so a
caller need not know about ``TRITON_INTERPRET``.  Like the CLI, they are an
edge: the ``NANFUZZ_*`` environment is read here, into the settings.
"""
from __future__ import annotations

from nanfuzz.harness.kernel import Kernel


def _settings(device: str | None, **options):
    from nanfuzz.harness.launch.backend import choose_backend
    from nanfuzz.harness.campaign.settings import Settings

    return Settings.from_environment(device=choose_backend(device), **options)


def _kernel(kernel: Kernel | str, settings) -> Kernel:
    from nanfuzz.harness.launch.import_probe import load_kernel

    return kernel if isinstance(kernel, Kernel) else load_kernel(kernel, settings)


def fuzz(kernel: Kernel | str, *, device: str | None = None, **options):
    """Run a campaign against ``kernel``; ``options`` are ``Settings`` fields (``max_examples``,
    ``seed``, ``time_budget``, ...).  Returns the Campaign (``.failed``, ``.failure``, ``.failing_case``,
    ``.statistics``)."""
    from nanfuzz.harness.campaign.runner import fuzz as run_campaign

    settings = _settings(device, **options)
    return run_campaign(_kernel(kernel, settings), settings)


def check(kernel: Kernel | str, case, *, device: str | None = None):
    """Judge ``kernel`` on one ``Case`` in this process; returns the Outcome (``.verdict``, ``.summary``)."""
    from nanfuzz.harness.judge.check import check as judge

    settings = _settings(device)
    return judge(_kernel(kernel, settings), case, settings.device)


def replay(path, *, kernel: str | None = None, device: str | None = None):
    """Re-run the repro at ``path`` in a fresh worker; returns the Replay (``.still_fails``, ``.line()``)."""
    from nanfuzz.harness.replay import replay as rerun

    return rerun(str(path), kernel_name=kernel, settings=_settings(device))
