"""The functions users call from Python: ``nanfuzz.fuzz``, ``nanfuzz.check``, ``nanfuzz.check_repro``, ``nanfuzz.replay``.

Each takes a kernel as a :class:`Kernel` or a name (``family@variant``,
``vllm:...``, ``package.module:attr``) and decides the backend first, so a
caller need not know about ``TRITON_INTERPRET``.  A Triton kernel imported
before that, for the other mode, is a NanfuzzError before any verdict, as in
the pytest plugin.  Like the CLI, they are an edge: the ``NANFUZZ_*``
environment is read here, into the settings.
"""
from __future__ import annotations

from nanfuzz.harness.kernel import Kernel

# What to do about a Triton kernel imported for the other mode, by the device chosen.
_WRONG_MODE_FIX = {
    "cpu": "set TRITON_INTERPRET=1 before they are imported (in the environment, or first thing in the "
           "conftest), or leave them unimported and pass the kernel by name ('package.module:attr')",
    "cuda": "import them with TRITON_INTERPRET unset, or pass device='cpu'",
}


def _settings(device: str | None, **options):
    from nanfuzz.harness.campaign.options import split_options
    from nanfuzz.harness.launch.backend import choose_backend, refuse_wrong_mode_kernels
    from nanfuzz.harness.campaign.settings import Settings

    options = split_options(options)  # an unknown keyword is a usage error before the backend is chosen
    device = choose_backend(device)
    # a kernel named by the caller is imported after this, in the mode chosen; one imported before is here now
    refuse_wrong_mode_kernels(device, _WRONG_MODE_FIX[device])
    return Settings.from_environment(device=device, **options)


def _kernel(kernel: Kernel | str, settings) -> Kernel:
    from nanfuzz.harness.launch.import_probe import load_kernel

    return kernel if isinstance(kernel, Kernel) else load_kernel(kernel, settings)


def fuzz(kernel: Kernel | str, *, device: str | None = None, **options):
    """Run a campaign against ``kernel``; returns the Campaign (``.failed``, ``.failure``,
    ``.failing_case``, ``.examples``, ``.statistics``).

    ``options`` are the command line's, as Python names (``harness.campaign.options`` lists them):
    ``max_examples``, ``seed``, ``time_budget``, ``profile``, ``size``, ``jobs``, ``shrink``,
    ``repro_dir``, ``state_dir``, ``example_db``, ``launch_timeout``, ``isolation``,
    ``strict_reads``, ``targeting``, ``pool_size``, ``compile_jobs``, ``vllm_src`` ...
    ``lmdeploy_src``; and what to draw: ``decode_only``, ``prefill_only``, ``no_window``,
    ``window_only``, ``causal_only``, ``non_causal_only``, ``dtype``, ``kv_cache_dtype``,
    ``kv_scales``, ``poison`` (a dead-slot class or a list of them).  An unknown one is a
    ``NanfuzzError`` naming the known ones."""
    from nanfuzz.harness.campaign.jobs import fuzz_parallel
    from nanfuzz.harness.campaign.runner import fuzz as run_campaign

    settings = _settings(device, **options)
    kernel = _kernel(kernel, settings)
    return fuzz_parallel(kernel, settings) if settings.jobs > 1 else run_campaign(kernel, settings)


def check(kernel: Kernel | str, case, *, device: str | None = None):
    """Judge ``kernel`` on one ``Case`` in this process; returns the Outcome (``.verdict``, ``.summary``)."""
    from nanfuzz.harness.judge.check import check as judge

    settings = _settings(device)
    return judge(_kernel(kernel, settings), case, settings.device)


def replay(path, *, kernel: str | None = None, device: str | None = None):
    """Re-run the repro at ``path`` in a fresh worker; returns the Replay (``.still_fails``, ``.line()``)."""
    from nanfuzz.harness.replay import replay as rerun

    return rerun(str(path), kernel_name=kernel, settings=_settings(device))


def check_repro(repro, *, kernel: Kernel | str | None = None, device: str | None = None):
    """Pin a found case in a test: judge the case of a repro (a path, its JSON text, or the record as a
    dict) on its kernel, or on ``kernel`` (the fixed one); raise :class:`nanfuzz.Finding` while it
    fails, return the Outcome once it passes."""
    import json
    from pathlib import Path

    from nanfuzz.harness.report.finding import Finding
    from nanfuzz.harness.report.repro import load_repro, repro_from_json

    path = None
    if isinstance(repro, dict):
        record = repro_from_json(json.dumps(repro))
    elif isinstance(repro, str) and repro.lstrip().startswith("{"):
        record = repro_from_json(repro)
    else:
        path = str(repro)
        record = load_repro(Path(path))
    settings = _settings(device)
    chosen = _kernel(kernel or record["kernel"], settings)
    from nanfuzz.harness.judge.check import check as judge

    outcome = judge(chosen, record["case"], settings.device)
    if outcome.failed:
        __tracebackhide__ = True
        raise Finding(f"{chosen.name}: {outcome.summary}", outcome=outcome, repro=path, kernel=chosen.name)
    return outcome
