"""pytest plugin: options, fixtures and a readable failure report.

Loaded by the ``pytest11`` entry point of an installed nanfuzz, or by the
root ``conftest.py`` of this repository.  The engine is imported lazily.
Under pytest-xdist each worker is pinned to one GPU (worker N gets GPU
N mod count), and without a GPU everything runs under Triton's interpreter,
one host thread per worker.
"""
from __future__ import annotations

import contextlib
import os

import pytest

from nanfuzz.harness.backend import choose_backend, host_threads


def pytest_addoption(parser):
    group = parser.getgroup("nanfuzz", "NaN-poisoning fuzzing of paged-attention kernels")
    group.addoption("--nanfuzz-kernel", action="append", default=[], metavar="NAME",
                    help="kernel to fuzz (repeatable): family@variant, vllm:rocm_attn, vllm:triton_attn or "
                         "package.module:callable; parametrizes the nanfuzz_kernel fixture")
    group.addoption("--nanfuzz-device", choices=("cpu", "cuda"), default=None,
                    help="cuda: the GPU; cpu: Triton's interpreter (default: GPU if present)")
    group.addoption("--nanfuzz-examples", type=int, default=None, metavar="N",
                    help="examples per campaign (default: from the profile)")
    group.addoption("--nanfuzz-profile", default=None, choices=("dev", "ci", "pr-gate", "nightly"),
                    help="campaign profile (default: ci under CI=true, else dev)")
    group.addoption("--nanfuzz-time-budget", type=float, default=None, metavar="SECONDS",
                    help="wall-time bound per campaign")
    group.addoption("--nanfuzz-repro-dir", default=".nanfuzz/repros", metavar="DIR",
                    help="where failing cases are written (default .nanfuzz/repros)")


def _worker_index(config) -> int | None:
    worker = getattr(config, "workerinput", {}).get("workerid") or os.environ.get("PYTEST_XDIST_WORKER")
    if worker and worker.startswith("gw"):
        return int(worker[2:])
    return None


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA or ROCm device; skipped without one")
    device = config.getoption("--nanfuzz-device")
    if device == "cuda" and os.environ.get("TRITON_INTERPRET") == "1":
        raise pytest.UsageError("--nanfuzz-device cuda conflicts with TRITON_INTERPRET=1; unset it or use --nanfuzz-device cpu")
    from nanfuzz.reference.errors import NanfuzzError

    try:
        config._nanfuzz_device = choose_backend(device)
    except NanfuzzError as exc:
        raise pytest.UsageError(str(exc)) from None
    # xdist workers share the cores: one host thread each, for the whole session
    config._nanfuzz_session = contextlib.ExitStack()
    config._nanfuzz_session.enter_context(host_threads(config._nanfuzz_device))
    index = _worker_index(config)
    if config._nanfuzz_device == "cuda" and index is not None:
        import torch

        count = torch.cuda.device_count()
        if count > 1:
            torch.cuda.set_device(index % count)


def pytest_unconfigure(config):
    session = getattr(config, "_nanfuzz_session", None)
    if session is not None:
        session.close()


def pytest_generate_tests(metafunc):
    if "nanfuzz_kernel" in metafunc.fixturenames:
        names = metafunc.config.getoption("--nanfuzz-kernel")
        if names:
            metafunc.parametrize("nanfuzz_kernel", names, ids=names, indirect=True)


@pytest.fixture(scope="session")
def nanfuzz_device(request) -> str:
    """"cuda" on a GPU runner, "cpu" (Triton interpreter) elsewhere."""
    return request.config._nanfuzz_device


@pytest.fixture
def nanfuzz_kernel(request):
    """The Kernel named by one --nanfuzz-kernel option (the test is skipped without one)."""
    name = getattr(request, "param", None)
    if name is None:
        pytest.skip("no --nanfuzz-kernel given")
    from nanfuzz.harness.registry import resolve
    from nanfuzz.reference.errors import NanfuzzError

    try:
        return resolve(name)
    except NanfuzzError as exc:
        raise pytest.UsageError(str(exc)) from None


class Nanfuzz:
    """What the ``nanfuzz`` fixture offers a kernel test."""

    def __init__(self, request, device: str):
        self._request = request
        self.device = device
        self.repro_dir = request.config.getoption("--nanfuzz-repro-dir")

    def _kernel(self, kernel):
        from nanfuzz.harness.kernel import Kernel
        from nanfuzz.harness.registry import resolve

        return kernel if isinstance(kernel, Kernel) else resolve(kernel)

    def fuzz(self, kernel, *, max_examples: int | None = None, **options):
        """Run a campaign; on a failure write the repro and fail the test with its picture."""
        from nanfuzz.harness.fuzz import fuzz
        from nanfuzz.harness.picture import picture
        from nanfuzz.harness.repro import write_repro

        kernel = self._kernel(kernel)
        config = self._request.config
        campaign = fuzz(kernel, device=self.device,
                        max_examples=max_examples or config.getoption("--nanfuzz-examples"),
                        profile=config.getoption("--nanfuzz-profile"),
                        time_budget=options.pop("time_budget", config.getoption("--nanfuzz-time-budget")),
                        **options)
        if campaign.failed:
            paths = write_repro(kernel.name, campaign.failing_case, campaign.failure, self.repro_dir, self.device)
            self._request.node.user_properties.append(("nanfuzz_repro", str(paths[0])))
            pytest.fail(f"{kernel.name}: {campaign.failure.summary}\n{picture(campaign.failing_case)}\n"
                        f"repro: {paths[0]}\nreplay: nanfuzz replay {paths[0]}", pytrace=False)
        return campaign

    def check(self, kernel, case):
        """Check one case; on a failure write the repro and fail the test."""
        from nanfuzz.harness.check import check
        from nanfuzz.harness.picture import picture
        from nanfuzz.harness.repro import write_repro

        kernel = self._kernel(kernel)
        outcome = check(kernel, case, self.device)
        if outcome.failed:
            paths = write_repro(kernel.name, case, outcome, self.repro_dir, self.device)
            self._request.node.user_properties.append(("nanfuzz_repro", str(paths[0])))
            pytest.fail(f"{kernel.name}: {outcome.summary}\n{picture(case)}\nrepro: {paths[0]}", pytrace=False)
        return outcome


@pytest.fixture
def nanfuzz(request, nanfuzz_device) -> Nanfuzz:
    """``nanfuzz.fuzz(kernel)`` and ``nanfuzz.check(kernel, case)`` for kernel tests."""
    return Nanfuzz(request, nanfuzz_device)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    repros = [value for key, value in item.user_properties if key == "nanfuzz_repro"]
    if report.failed and repros:
        report.sections.append(("nanfuzz repro", "\n".join(repros)))
