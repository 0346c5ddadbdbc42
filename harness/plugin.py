"""pytest plugin: options, fixtures and a readable failure report.

Loaded by the ``pytest11`` entry point of an installed nanfuzz, or by the
root ``conftest.py`` of this repository.  It is inert until used: a session
in which no test requests ``nanfuzz``, ``nanfuzz_device`` or
``nanfuzz_kernel`` and no ``--nanfuzz-*`` option is given runs as it would
without nanfuzz (same environment, thread counts and Hypothesis profiles; no
torch import).

On first use nanfuzz chooses the GPU or Triton's interpreter, pins xdist
worker N to GPU N mod count, holds host threads to one on the CPU, and
refuses Triton kernels that were imported for the other mode.  A
``--nanfuzz-*`` option makes that happen at configure time, before test
modules are imported; otherwise the session fixture does it.  What it
changed is undone when the session ends.  The engine is imported lazily.
"""
from __future__ import annotations

import contextlib
import hashlib
import os

import pytest

from nanfuzz.reference.case import KV_CACHE_DTYPES, SCALE_MODES  # plain data: imports no torch
from nanfuzz.harness.report.finding import Finding  # plain Python: imports no torch
from nanfuzz.reference.errors import NanfuzzError

DEFAULT_REPRO_DIR = ".nanfuzz/repros"
_OPTIONS = ("nanfuzz_kernel", "nanfuzz_device", "nanfuzz_examples", "nanfuzz_profile", "nanfuzz_time_budget",
            "nanfuzz_repro_dir", "nanfuzz_example_db", "nanfuzz_kv_cache_dtype", "nanfuzz_kv_scales", "nanfuzz_size",
            "nanfuzz_window_only")


class _Use:
    """nanfuzz's state in one pytest process: the chosen device and what to undo."""

    def __init__(self):
        self.device: str | None = None
        self.undo = contextlib.ExitStack()


_USE = pytest.StashKey[_Use]()


def pytest_addoption(parser):
    group = parser.getgroup("nanfuzz", "NaN-poisoning fuzzing of paged-attention kernels")
    group.addoption("--nanfuzz-kernel", action="append", default=[], metavar="NAME",
                    help="kernel to fuzz (repeatable): family@variant, vllm:rocm_attn, vllm:triton_attn or "
                         "package.module:callable; parametrizes the nanfuzz_kernel fixture")
    group.addoption("--nanfuzz-device", choices=("cpu", "cuda"), default=None,
                    help="cuda: the GPU; cpu: Triton's interpreter (default: GPU if present). Given, nanfuzz "
                         "chooses before test modules are imported")
    group.addoption("--nanfuzz-examples", type=int, default=None, metavar="N",
                    help="examples per campaign (default: from the profile)")
    group.addoption("--nanfuzz-profile", default=None, choices=("dev", "ci", "pr-gate", "nightly"),
                    help="campaign profile (default: ci under CI=true, else dev)")
    group.addoption("--nanfuzz-time-budget", type=float, default=None, metavar="SECONDS",
                    help="wall-time bound per campaign")
    group.addoption("--nanfuzz-repro-dir", default=None, metavar="DIR",
                    help=f"where failing cases are written (default {DEFAULT_REPRO_DIR})")
    group.addoption("--nanfuzz-example-db", default=None, metavar="URL",
                    help="example database: a folder (default STATE/examples), redis://HOST:PORT/DB (a shared Redis "
                         "or Valkey server), or readonly:STORE to read one without writing to it "
                         "(default $NANFUZZ_EXAMPLE_DB)")
    group.addoption("--nanfuzz-kv-cache-dtype", default=None, choices=KV_CACHE_DTYPES,
                    help="campaigns fuzz only this KV-cache dtype (auto: unquantized; default: every one the "
                         "kernel takes and the device runs)")
    group.addoption("--nanfuzz-kv-scales", default=None, choices=SCALE_MODES,
                    help="campaigns fuzz quantized caches with per-tensor or per-token-head scales only")
    group.addoption("--nanfuzz-window-only", action="store_true", default=None,
                    help="campaigns draw only cases with a sliding window (a kernel without one is a usage error)")
    group.addoption("--nanfuzz-size", default=None, choices=("small", "production", "mixed"),
                    help="how large campaigns' cases get (default: the kernel's own, else mixed on a GPU and small "
                         "under the interpreter)")


MARKERS = (
    "nanfuzz(**options): default options (max_examples=, time_budget=, seed=, profile=, ...) of every "
    "nanfuzz.fuzz() call in this test",
    "nanfuzz_shards(count=None): run this test's campaign as COUNT shards (default: one per xdist worker), each a "
    "test of its own with its share of the examples, its own seed and its own specialisation pool",
)


@pytest.hookimpl(tryfirst=True)  # before Hypothesis's own plugin loads --hypothesis-profile
def pytest_configure(config):
    config.stash[_USE] = _Use()
    for marker in MARKERS:
        config.addinivalue_line("markers", marker)
    profile = config.getoption("--hypothesis-profile", default=None)
    if isinstance(profile, str) and profile.startswith("nanfuzz-"):
        from nanfuzz.harness.campaign.profiles import register_hypothesis_profiles

        register_hypothesis_profiles()
    if any(config.getoption(name) not in (None, []) for name in _OPTIONS):
        try:
            _activate(config, early=True)
            if config.getoption("nanfuzz_example_db") and not hasattr(config, "workerinput"):
                from nanfuzz.harness.campaign.example_db import check

                check(config.getoption("nanfuzz_example_db"))  # once, in the controlling process
        except NanfuzzError as exc:
            raise pytest.UsageError(str(exc)) from None


def pytest_unconfigure(config):
    use = config.stash.get(_USE, None)
    if use is not None:
        use.undo.close()


def _worker_index(config) -> int | None:
    worker = getattr(config, "workerinput", {}).get("workerid") or os.environ.get("PYTEST_XDIST_WORKER")
    if worker and worker.startswith("gw"):
        return int(worker[2:])
    return None


def _restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _wrong_mode_fix(device: str, early: bool) -> str:
    if device == "cuda":
        return "import them with TRITON_INTERPRET unset, or pass --nanfuzz-device cpu"
    if early:
        return "set TRITON_INTERPRET=1 in the environment before pytest starts"
    return ("set TRITON_INTERPRET=1 in the environment before pytest starts, or pass --nanfuzz-device cpu "
            "(nanfuzz then chooses before test modules are imported)")


def _activate(config, *, early: bool) -> str:
    """Choose the device and set up the session for it, once; NanfuzzError when it cannot run."""
    use = config.stash[_USE]
    if use.device is not None:
        return use.device
    from nanfuzz.harness.launch.backend import choose_backend, host_threads, refuse_wrong_mode_kernels

    requested = config.getoption("nanfuzz_device")
    if requested == "cuda" and os.environ.get("TRITON_INTERPRET") == "1":
        raise NanfuzzError("--nanfuzz-device cuda conflicts with TRITON_INTERPRET=1; unset it or use --nanfuzz-device cpu")
    use.undo.callback(_restore_env, "TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET"))
    try:
        try:
            device = choose_backend(requested)
        except NanfuzzError as exc:
            raise NanfuzzError(str(exc).replace("--device", "--nanfuzz-device")) from None
        refuse_wrong_mode_kernels(device, _wrong_mode_fix(device, early))
    except NanfuzzError:
        use.undo.close()
        raise
    # xdist workers share the cores: one host thread each while nanfuzz is in use
    use.undo.enter_context(host_threads(device))
    index = _worker_index(config)
    if device == "cuda" and index is not None:
        import torch

        count = torch.cuda.device_count()
        if count > 1:
            torch.cuda.set_device(index % count)
    use.device = device
    return device


def _worker_count(config) -> int:
    workers = getattr(config, "workerinput", {}).get("workercount")
    return int(workers) if workers else 1


def pytest_generate_tests(metafunc):
    shards = metafunc.definition.get_closest_marker("nanfuzz_shards")
    if shards is not None and "nanfuzz_shard" in metafunc.fixturenames:
        count = (shards.args[0] if shards.args else shards.kwargs.get("count")) or _worker_count(metafunc.config)
        if not isinstance(count, int) or count < 1:
            raise pytest.UsageError(f"nanfuzz_shards({count!r}): give a whole number of shards >= 1, or none for "
                                    "one per xdist worker")
        metafunc.parametrize("nanfuzz_shard", [(i, count) for i in range(count)], indirect=True,
                             ids=[f"shard{i}of{count}" for i in range(count)])
    if "nanfuzz_kernel" in metafunc.fixturenames:
        names = metafunc.config.getoption("nanfuzz_kernel")
        if names:
            metafunc.parametrize("nanfuzz_kernel", names, ids=names, indirect=True)


@pytest.fixture(scope="session")
def nanfuzz_device(request) -> str:
    """"cuda" on a GPU runner, "cpu" (Triton interpreter) elsewhere; requesting it puts nanfuzz to use."""
    try:
        return _activate(request.config, early=False)
    except NanfuzzError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture
def nanfuzz_kernel(request, nanfuzz_device):
    """The Kernel named by one --nanfuzz-kernel option (the test is skipped without one)."""
    name = getattr(request, "param", None)
    if name is None:
        pytest.skip("no --nanfuzz-kernel given")
    try:
        return _load(name, nanfuzz_device)
    except NanfuzzError as exc:
        raise pytest.UsageError(str(exc)) from None


def _load(name: str, device: str):
    """The kernel ``name``; a user's module imported first in a probe process, as the command does
    (one that exits, hangs or kills its process is a usage error, not the end of the session)."""
    from nanfuzz.harness.campaign.settings import Settings
    from nanfuzz.harness.launch.import_probe import load_kernel

    return load_kernel(name, Settings.from_environment(device=device))


def _hypothesis_seed(config) -> int | None:
    """``--hypothesis-seed`` as an int (a non-numeric seed is hashed, as Hypothesis accepts any string)."""
    seed = config.getoption("--hypothesis-seed", default=None)
    if seed is None:
        return None
    try:
        return int(seed)
    except ValueError:
        return int.from_bytes(hashlib.sha256(str(seed).encode()).digest()[:4], "big")


@pytest.fixture
def nanfuzz_shard(request) -> tuple[int, int]:
    """(this shard, shards): (0, 1) unless the test is marked ``nanfuzz_shards``."""
    return getattr(request, "param", (0, 1))


class NanfuzzFixture:
    """What the ``nanfuzz`` fixture offers a kernel test: ``fuzz(kernel, **options)`` returns the
    ``nanfuzz.Campaign``, ``check(kernel, case)`` the ``nanfuzz.Outcome``; on a finding both write the
    repro and raise ``nanfuzz.Finding``.  ``device`` is "cuda" or "cpu"; ``shard`` is (index, count)."""

    def __init__(self, request, device: str, shard: tuple[int, int] = (0, 1)):
        self._request = request
        self.device = device
        self.shard = shard
        self.repro_dir = request.config.getoption("nanfuzz_repro_dir") or DEFAULT_REPRO_DIR

    def _kernel(self, kernel):
        from nanfuzz.harness.kernel import Kernel

        return kernel if isinstance(kernel, Kernel) else _load(kernel, self.device)

    def fuzz(self, kernel, *, max_examples: int | None = None, **options):
        """Run a campaign; on a failure write the repro and fail the test with its picture.

        The options are those of ``nanfuzz.fuzz`` (``harness.campaign.options``); ``--hypothesis-seed``
        is the seed unless the call gives one.
        """
        import io
        from pathlib import Path

        from nanfuzz.harness.campaign.options import split_options
        from nanfuzz.harness.campaign.runner import fuzz
        from nanfuzz.harness.report.failures import report_failure
        from nanfuzz.harness.campaign.settings import Settings

        __tracebackhide__ = True
        marker = self._request.node.get_closest_marker("nanfuzz")
        options = split_options({**(marker.kwargs if marker else {}), **options}, "nanfuzz.fuzz()")
        max_examples = max_examples or options.pop("max_examples", None)
        kernel = self._kernel(kernel)
        config = self._request.config
        seed = options.pop("seed", None)
        index, count = self.shard
        if count > 1:
            # this shard's share of the examples, its own seed and pool; the example database is shared
            from nanfuzz.harness.campaign.profiles import get_profile

            total = max_examples or config.getoption("nanfuzz_examples") or get_profile(
                options.get("profile") or config.getoption("nanfuzz_profile")).max_examples
            max_examples = max(1, -(-total // count))
            seed = None if seed is None else seed * count + index
            options.setdefault("pool_seed", index)
        kv = {"kv_cache_dtype": config.getoption("nanfuzz_kv_cache_dtype"),
              "kv_scales": config.getoption("nanfuzz_kv_scales"),
              "window_only": config.getoption("nanfuzz_window_only")}
        if any(kv.values()):
            from dataclasses import replace

            from nanfuzz.harness.campaign.focus import Focus

            focus = options.get("focus") or Focus()
            options["focus"] = replace(focus, **{k: getattr(focus, k) or v for k, v in kv.items() if v})
        # the plugin is an edge: the environment and the options become Settings here, once
        settings = Settings.from_environment(
            device=self.device, repro_dir=Path(self.repro_dir),
            max_examples=max_examples or config.getoption("nanfuzz_examples"),
            profile=options.pop("profile", None) or config.getoption("nanfuzz_profile"),
            time_budget=options.pop("time_budget", None) or config.getoption("nanfuzz_time_budget"),
            example_db=options.pop("example_db", None) or config.getoption("nanfuzz_example_db"),
            size=options.pop("size", None) or config.getoption("nanfuzz_size"),
            seed=seed if seed is not None else _hypothesis_seed(config))
        campaign = fuzz(kernel, settings, **options)
        if config.getoption("--hypothesis-show-statistics", default=False):
            self._request.node.user_properties.append(("nanfuzz_campaign", _campaign_record(campaign)))
        if campaign.failed:
            shown = io.StringIO()
            paths = report_failure(kernel, campaign, settings, stream=shown)
            if paths:
                self._request.node.user_properties.append(("nanfuzz_repro", paths[0]))
            raise Finding(shown.getvalue().strip(), outcome=campaign.failure, repro=paths[0] if paths else None,
                          kernel=kernel.name)
        return campaign

    def check(self, kernel, case):
        """Check one case; on a failure write the repro and fail the test."""
        from nanfuzz.harness.judge.check import check
        from nanfuzz.harness.report.picture import picture
        from nanfuzz.harness.report.repro import write_repro

        __tracebackhide__ = True
        kernel = self._kernel(kernel)
        outcome = check(kernel, case, self.device)
        if outcome.failed:
            paths = write_repro(kernel, case, outcome, self.repro_dir, self.device)
            self._request.node.user_properties.append(("nanfuzz_repro", str(paths[0])))
            raise Finding(f"{kernel.name}: {outcome.summary}\n{picture(case)}\nrepro: {paths[0]}", outcome=outcome,
                          repro=str(paths[0]), kernel=kernel.name)
        return outcome


Nanfuzz = NanfuzzFixture  # the name it had


@pytest.fixture
def nanfuzz(request, nanfuzz_device, nanfuzz_shard) -> NanfuzzFixture:
    """``nanfuzz.fuzz(kernel)`` and ``nanfuzz.check(kernel, case)`` for kernel tests (a ``NanfuzzFixture``)."""
    return NanfuzzFixture(request, nanfuzz_device, nanfuzz_shard)


def _campaign_record(campaign) -> dict:
    """Plain data (it crosses from an xdist worker in the test report)."""
    return {"kernel": campaign.kernel, "device": campaign.device, "examples": campaign.examples,
            "verdicts": dict(campaign.verdicts), "elapsed": campaign.elapsed,
            "statistics": campaign.statistics.table() if campaign.statistics.examples else ""}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    repros = [value for key, value in item.user_properties if key == "nanfuzz_repro"]
    if report.failed and repros:
        report.sections.append(("nanfuzz repro", "\n".join(repros)))


def pytest_terminal_summary(terminalreporter):
    if not terminalreporter.config.getoption("--hypothesis-show-statistics", default=False):
        return
    campaigns = [(report.nodeid, value) for reports in terminalreporter.stats.values() for report in reports
                 if getattr(report, "when", None) == "call"
                 for key, value in getattr(report, "user_properties", ()) if key == "nanfuzz_campaign"]
    if not campaigns:
        return
    terminalreporter.section("nanfuzz campaign statistics")
    for nodeid, c in campaigns:
        verdicts = ", ".join(f"{count} {verdict}" for verdict, count in sorted(c["verdicts"].items())) or "none"
        terminalreporter.write_line(f"{nodeid}: {c['kernel']} on {c['device']}: {c['examples']} examples "
                                    f"({verdicts}) in {c['elapsed']:.2f} s")
        for line in c["statistics"].splitlines():
            terminalreporter.write_line(f"    {line}")
