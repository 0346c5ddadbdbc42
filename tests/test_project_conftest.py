"""The project's own test configuration: slow and gpu markers, the vLLM and AITER fetch policy, the cache folder."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from nanfuzz.harness.launch import backend
from nanfuzz.harness.adapters import aiter_fetch, vllm_fetch
from nanfuzz.harness.adapters.vllm_fetch import FetchError
from tests.conftest import AITER_VERSION, SLOW_TESTS, aiter_tree, vllm_tree

ROOT = Path(__file__).resolve().parents[1]


def test_every_test_marked_slow_exists():
    for module, names in SLOW_TESTS.items():
        source = (ROOT / "tests" / module).read_text()
        for name in names:
            assert re.search(rf"^def {name}\(", source, re.MULTILINE), f"{module} has no {name}: update SLOW_TESTS"


def test_the_slow_tests_carry_the_marker():
    from tests import conftest

    slow = _Item(originalname="test_fixed_variants_pass_300_examples", path=ROOT / "tests" / "test_fuzz.py")
    quick = _Item(originalname="test_pending_file_is_written_before_each_launch", path=ROOT / "tests" / "test_fuzz.py")
    elsewhere = _Item(originalname="test_fixed_variants_pass_300_examples", path=ROOT / "tests" / "test_other.py")
    conftest.pytest_collection_modifyitems(None, [slow, quick, elsewhere])
    assert [item.get_closest_marker("slow") is not None for item in (slow, quick, elsewhere)] == [True, False, False]


class _Item:
    def __init__(self, *marks: str, originalname: str = "test_x", path: Path = ROOT / "tests" / "test_x.py"):
        self.marks = [getattr(pytest.mark, name).mark for name in marks]
        self.name = self.originalname = originalname
        self.path = path

    def get_closest_marker(self, name):
        return next((mark for mark in self.marks if mark.name == name), None)

    def add_marker(self, marker):
        self.marks.append(marker.mark)


class _Config:
    def __init__(self, module, device: str):
        self.stash = pytest.Stash()
        self.stash[module._device_key] = device


@pytest.fixture
def root_conftest():
    spec = importlib.util.spec_from_file_location("nanfuzz_root_conftest", ROOT / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_tests_are_skipped_off_the_gpu(root_conftest, monkeypatch):
    monkeypatch.setattr(backend, "gpu_available", lambda: False)
    gpu, other = _Item("gpu"), _Item()
    root_conftest.pytest_collection_modifyitems(_Config(root_conftest, "cpu"), [gpu, other])
    skip = gpu.get_closest_marker("skip")
    assert skip is not None and "torch.cuda.is_available() is False" in skip.kwargs["reason"]
    assert other.get_closest_marker("skip") is None


def test_gpu_tests_run_on_the_gpu(root_conftest):
    gpu = _Item("gpu")
    root_conftest.pytest_collection_modifyitems(_Config(root_conftest, "cuda"), [gpu])
    assert gpu.get_closest_marker("skip") is None


def test_without_gpu_tests_the_gpu_is_not_asked_about(root_conftest, monkeypatch):
    def never():
        raise AssertionError("gpu_available() called with no gpu-marked test")

    monkeypatch.setattr(backend, "gpu_available", never)
    root_conftest.pytest_collection_modifyitems(_Config(root_conftest, "cpu"), [_Item(), _Item("slow")])


def _fetch_fails(*args, **kwargs):
    raise FetchError("cannot fetch vllm==0.33.0 with pip download: no package index is reachable (...)",
                     network=True)


@pytest.mark.parametrize("ci", [None, "true"])
def test_a_failed_fetch_is_a_failure_not_a_skip(monkeypatch, tmp_path, ci):
    monkeypatch.setenv("NANFUZZ_CACHE", str(tmp_path))
    monkeypatch.delenv("NANFUZZ_OFFLINE", raising=False)
    if ci:
        monkeypatch.setenv("CI", ci)
    monkeypatch.setattr(vllm_fetch, "ensure_vllm_source", _fetch_fails)
    with pytest.raises(pytest.fail.Exception, match="no package index is reachable.*set NANFUZZ_OFFLINE=1"):
        vllm_tree()


def test_a_failed_aiter_fetch_is_a_failure_too(monkeypatch, tmp_path):
    monkeypatch.setenv("NANFUZZ_CACHE", str(tmp_path))
    monkeypatch.setenv("CI", "true")
    monkeypatch.delenv("NANFUZZ_OFFLINE", raising=False)
    monkeypatch.setattr(aiter_fetch, "ensure_aiter_source", _fetch_fails)
    with pytest.raises(pytest.fail.Exception, match="no package index is reachable.*set NANFUZZ_OFFLINE=1"):
        aiter_tree()
    monkeypatch.setenv("NANFUZZ_OFFLINE", "1")
    with pytest.raises(pytest.skip.Exception, match=rf"^NANFUZZ_OFFLINE=1: amd-aiter=={AITER_VERSION} is not cached"):
        aiter_tree()


def test_offline_skips_without_fetching_and_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("NANFUZZ_CACHE", str(tmp_path))
    monkeypatch.setenv("NANFUZZ_OFFLINE", "1")
    monkeypatch.setattr(vllm_fetch, "ensure_vllm_source", _fetch_fails)
    with pytest.raises(pytest.skip.Exception, match=r"^NANFUZZ_OFFLINE=1: vllm==0.33.0 is not cached in "):
        vllm_tree()


def test_offline_uses_a_cached_tree(monkeypatch, tmp_path):
    monkeypatch.setenv("NANFUZZ_CACHE", str(tmp_path))
    monkeypatch.setenv("NANFUZZ_OFFLINE", "1")
    monkeypatch.setattr(vllm_fetch, "ensure_vllm_source", _fetch_fails)
    tree = tmp_path / "vllm-0.33.0"
    tree.mkdir()
    (tree / ".complete").write_text("vllm-0.33.0-cp38-abi3-manylinux1_x86_64.whl\n")
    assert vllm_tree() == tree


@pytest.mark.parametrize("env, expected", [
    ({"NANFUZZ_CACHE": "{tmp}/mine", "XDG_CACHE_HOME": "{tmp}/xdg"}, "{tmp}/mine"),
    ({"XDG_CACHE_HOME": "{tmp}/xdg"}, "{tmp}/xdg/nanfuzz"),
    ({"XDG_CACHE_HOME": "relative/ignored"}, "{home}/.cache/nanfuzz"),
    ({}, "{home}/.cache/nanfuzz"),
])
def test_the_cache_folder(monkeypatch, tmp_path, env, expected):
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    for name in ("NANFUZZ_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value.format(tmp=tmp_path))
    assert vllm_fetch.cache_dir("0.33.0") == Path(expected.format(tmp=tmp_path, home=home)) / "vllm-0.33.0"
