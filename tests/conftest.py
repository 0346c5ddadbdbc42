"""Shared fixtures of the project's tests."""
import os

import pytest

VLLM_VERSION = "0.33.0"


@pytest.fixture(scope="session")
def vllm_source():
    """vLLM 0.33.0's kernel tree, fetched once with pip into the cache; skipped only
    when it is not cached and no package index is reachable."""
    from nanfuzz.harness.adapters import vllm as vllm_adapters
    from nanfuzz.harness.adapters import vllm_loader
    from nanfuzz.harness.adapters.vllm_fetch import FetchError, ensure_vllm_source

    try:
        path = ensure_vllm_source(VLLM_VERSION)
    except FetchError as exc:
        if exc.network:
            pytest.skip(f"vllm=={VLLM_VERSION} is not cached and no package index is reachable: {exc}")
        raise
    previous = os.environ.get(vllm_loader.ENV_VAR)
    vllm_adapters.set_vllm_source(path)
    yield path
    vllm_adapters.set_vllm_source(previous)
