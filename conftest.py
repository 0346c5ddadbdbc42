"""Root conftest: this repository's own test configuration.

It loads the nanfuzz pytest plugin unless the installed entry point already
did.  The plugin is inert until a test uses it, but this project's test
modules import ``@triton.jit`` kernels at module level, so the GPU or
Triton's interpreter is chosen here, in ``pytest_configure``, before any test
module is imported; on the CPU every process (each xdist worker too) keeps
one host thread for the session.  Tests marked ``gpu`` are skipped unless
the session runs on a GPU.  A ``gpu_alone`` test (one that takes the device's
memory as another program would, outside every ledger) runs while no other
gpu test runs, in this process or any other xdist worker: the gpu tests hold
a shared lock on one file for the session's machine, a ``gpu_alone`` test an
exclusive one.
"""
import contextlib
import fcntl
import importlib.metadata
import os
import tempfile

import pytest


def _entry_point_loads_plugin() -> bool:
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        return False
    return any(ep.value == "nanfuzz.harness.plugin" for ep in importlib.metadata.entry_points(group="pytest11"))


pytest_plugins = [] if _entry_point_loads_plugin() else ["nanfuzz.harness.plugin"]

_device_key = pytest.StashKey[str]()
_session_key = pytest.StashKey[contextlib.ExitStack]()


def pytest_configure(config):
    from nanfuzz.harness.launch.backend import choose_backend, host_threads
    from nanfuzz.reference.errors import NanfuzzError

    try:
        device = choose_backend(config.getoption("nanfuzz_device", default=None))
    except NanfuzzError as exc:
        raise pytest.UsageError(str(exc)) from None
    config.stash[_device_key] = device
    config.stash[_session_key] = contextlib.ExitStack()
    config.stash[_session_key].enter_context(host_threads(device))


def pytest_unconfigure(config):
    session = config.stash.get(_session_key, None)
    if session is not None:
        session.close()


def pytest_collection_modifyitems(config, items):
    gpu_tests = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_tests:
        return
    from nanfuzz.harness.launch.backend import gpu_available

    if config.stash[_device_key] == "cuda":
        return
    reason = ("needs a GPU; this session runs under Triton's interpreter (TRITON_INTERPRET=1)" if gpu_available()
              else "needs a GPU; torch sees none (torch.cuda.is_available() is False)")
    for item in gpu_tests:
        item.add_marker(pytest.mark.skip(reason=reason))


# every pytest process on the machine that runs gpu tests agrees on this file
_GPU_TESTS_LOCK = os.path.join(tempfile.gettempdir(), "nanfuzz-gpu-tests.lock")


@pytest.fixture(autouse=True)
def _device_shared_between_gpu_tests(request):
    if request.node.get_closest_marker("gpu") is None or request.config.stash[_device_key] != "cuda":
        yield
        return
    alone = request.node.get_closest_marker("gpu_alone") is not None
    with open(_GPU_TESTS_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
