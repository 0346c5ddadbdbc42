"""Shared fixtures of the project's tests, and which of them are slow."""
import os

import pytest

VLLM_VERSION = "0.33.0"
# The amd-aiter release the aiter:* tests and regressions run against (a pure-Python wheel).
AITER_VERSION = "0.1.7.post2.dev18"
# The sglang and flash-attn releases the sglang:* and fa_amd:* tests and regressions run against.
SGLANG_VERSION = "0.5.23"
FA_VERSION = "2.8.3.post2"
# The lmdeploy release the lmdeploy:* tests and regressions run against.
LMDEPLOY_VERSION = "0.18.0"
OFFLINE_VAR = "NANFUZZ_OFFLINE"

# Tests that run long campaigns (hundreds of examples under Triton's
# interpreter, or whole gate runs): `-m "not slow"` leaves them out.
SLOW_TESTS = {
    "test_fuzz.py": ("test_old_variants_are_caught_within_200_examples", "test_fixed_variants_pass_300_examples",
                     "test_window_bug_shrinks_to_a_minimal_repro"),
    "test_parallel.py": ("test_the_first_failure_stops_the_other_job_and_is_shrunk",
                         "test_a_kernel_that_kills_its_worker_is_a_crash_and_the_jobs_carry_on"),
    "test_specialisations.py": ("test_a_campaign_with_a_pool_stays_inside_it_and_still_catches_a_bug",),
    "test_ci_gate.py": ("test_two_worker_gate_with_an_old_and_a_dying_kernel",),
    "test_ci_user_repository.py": ("test_the_workflow_s_steps_gate_a_user_repository_on_the_cpu",),
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if getattr(item, "originalname", item.name) in SLOW_TESTS.get(item.path.name, ()):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _backend_choice_stays_in_its_test():
    """A test that runs the CLI in-process with ``--device cpu`` sets ``TRITON_INTERPRET=1`` in
    this process's environment; on a GPU, every later subprocess would inherit it."""
    before = os.environ.get("TRITON_INTERPRET")
    yield
    if before is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = before


def _fetched_tree(project: str, version: str, cached, ensure, cache_dir):
    """A released wheel's kernel tree, fetched once with pip into nanfuzz's cache.

    A failed fetch fails the test, in CI and elsewhere; with NANFUZZ_OFFLINE=1
    nothing is fetched and the test is skipped unless the tree is cached.
    """
    from nanfuzz.harness.adapters.fetch import FetchError

    if os.environ.get(OFFLINE_VAR) == "1":
        path = cached(version)
        if path is None:
            pytest.skip(f"{OFFLINE_VAR}=1: {project}=={version} is not cached in {cache_dir(version)} and is not fetched")
        return path
    try:
        return ensure(version)
    except FetchError as exc:
        pytest.fail(f"{exc}; set {OFFLINE_VAR}=1 to skip the tests that need it", pytrace=False)


def vllm_tree(version: str = VLLM_VERSION):
    """vLLM ``version``'s kernel tree (see ``_fetched_tree``)."""
    from nanfuzz.harness.adapters import vllm_fetch

    return _fetched_tree("vllm", version, vllm_fetch.cached_vllm_source, vllm_fetch.ensure_vllm_source,
                         vllm_fetch.cache_dir)


def aiter_tree(version: str = AITER_VERSION):
    """AITER ``version``'s Triton kernel tree from the amd-aiter wheel (see ``_fetched_tree``)."""
    from nanfuzz.harness.adapters import aiter_fetch

    return _fetched_tree("amd-aiter", version, aiter_fetch.cached_aiter_source, aiter_fetch.ensure_aiter_source,
                         aiter_fetch.cache_dir)


def sglang_tree(version: str = SGLANG_VERSION):
    """SGLang ``version``'s Triton attention files from its wheel (see ``_fetched_tree``)."""
    from nanfuzz.harness.adapters import sglang_fetch

    return _fetched_tree("sglang", version, sglang_fetch.cached_sglang_source, sglang_fetch.ensure_sglang_source,
                         sglang_fetch.cache_dir)


def fa_tree(version: str = FA_VERSION):
    """flash-attn ``version``'s AMD Triton backend from its source distribution (see ``_fetched_tree``)."""
    from nanfuzz.harness.adapters import fa_fetch

    return _fetched_tree("flash-attn", version, fa_fetch.cached_fa_source, fa_fetch.ensure_fa_source,
                         fa_fetch.cache_dir)


def lmdeploy_tree(version: str = LMDEPLOY_VERSION):
    """lmdeploy ``version``'s Triton attention files from its wheel (see ``_fetched_tree``)."""
    from nanfuzz.harness.adapters import lmdeploy_fetch

    return _fetched_tree("lmdeploy", version, lmdeploy_fetch.cached_lmdeploy_source,
                         lmdeploy_fetch.ensure_lmdeploy_source, lmdeploy_fetch.cache_dir)


@pytest.fixture(scope="session")
def vllm_source():
    """vLLM 0.33.0's kernel tree (see ``vllm_tree``): pass it as ``resolve(name, vllm_src=...)``."""
    return vllm_tree()


@pytest.fixture(scope="session")
def aiter_source():
    """AITER's kernel tree of the pinned release (see ``aiter_tree``): pass it as ``resolve(name, aiter_src=...)``."""
    return aiter_tree()


@pytest.fixture(scope="session")
def sglang_source():
    """SGLang's kernel tree of the pinned release: pass it as ``resolve(name, sglang_src=...)``."""
    return sglang_tree()


@pytest.fixture(scope="session")
def fa_amd_source():
    """flash-attn's AMD backend of the pinned release: pass it as ``resolve(name, fa_src=...)``."""
    return fa_tree()


@pytest.fixture(scope="session")
def lmdeploy_source():
    """lmdeploy's Triton attention files of the pinned release: pass it as ``resolve(name, lmdeploy_src=...)``."""
    return lmdeploy_tree()
