"""One compile per binary among processes (harness.launch.shared_compiles): the first process to miss a
binary claims it, the others wait for it to land in Triton's cache; a claim ends with its binary,
its process, or a failed compile, so no process waits for a compile nobody is doing."""
from __future__ import annotations

import multiprocessing
import os
import threading
import time
import types

import pytest

from nanfuzz.harness.launch import shared_compiles

KEY, METADATA = "SOMEBINARYKEY", "kernel.json"


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    return tmp_path


def _compile(manager) -> dict:
    """What Triton's compile writes at its end: the files, then the group naming them."""
    group = {METADATA: manager.put("{}", METADATA, binary=False)}
    manager.put_group(METADATA, group)
    return group


def _holder(cache_dir: str, end: str, claimed, go) -> None:
    os.environ["TRITON_CACHE_DIR"] = cache_dir
    manager = shared_compiles._claiming_class()(KEY)
    assert manager.get_group(METADATA) is None  # a miss: the binary is ours to compile
    claimed.set()
    go.wait(30)
    if end == "finishes":
        _compile(manager)
    elif end == "dies":
        os._exit(3)
    elif end == "fails":
        shared_compiles.release_claims()  # as the worker does after a case whose compile raised
    time.sleep(30)


def _wait_in_thread(manager):
    found = {}

    def run():
        started = time.monotonic()
        found["group"] = manager.get_group(METADATA)
        found["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=run)
    thread.start()
    return thread, found


@pytest.mark.parametrize("end", ["finishes", "dies", "fails"])
def test_a_process_missing_a_claimed_binary_waits_for_it_and_no_longer(cache_dir, end):
    context = multiprocessing.get_context("fork")
    claimed, go = context.Event(), context.Event()
    holder = context.Process(target=_holder, args=(str(cache_dir), end, claimed, go), daemon=True)
    holder.start()
    try:
        assert claimed.wait(30)
        manager = shared_compiles._claiming_class()(KEY)
        thread, found = _wait_in_thread(manager)
        time.sleep(0.5)
        assert thread.is_alive()  # still waiting: the holder is compiling
        go.set()
        thread.join(30)
        assert not thread.is_alive() and found["seconds"] >= 0.4
        if end == "finishes":
            assert found["group"] and set(found["group"]) == {METADATA}  # loaded, not compiled again
        else:
            assert found["group"] is None  # nobody is compiling it any more: this process claims it
            claim = os.path.join(manager.cache_dir, shared_compiles.CLAIM_FILE)
            assert open(claim).read() == str(os.getpid())
            _compile(manager)
            assert not os.path.exists(claim)
    finally:
        holder.kill()
        holder.join(10)
        shared_compiles.release_claims()


def _no_waiting(monkeypatch) -> None:
    """A wait for another process's compile sleeps between looks: here, any sleep fails the test."""
    def sleep(seconds):
        raise AssertionError(f"waited ({seconds} s) where nobody holds a claim")

    monkeypatch.setattr(shared_compiles, "time", types.SimpleNamespace(monotonic=time.monotonic, time=time.time,
                                                                            sleep=sleep))


def test_a_hit_and_an_unclaimed_miss_do_not_wait(cache_dir, monkeypatch):
    _no_waiting(monkeypatch)
    manager = shared_compiles._claiming_class()(KEY)
    assert manager.get_group(METADATA) is None
    group = _compile(manager)
    assert shared_compiles._claiming_class()(KEY).get_group(METADATA) == group
    assert not os.listdir(manager.cache_dir) or shared_compiles.CLAIM_FILE not in os.listdir(manager.cache_dir)


def test_a_stale_claim_is_ignored(cache_dir, monkeypatch):
    manager = shared_compiles._claiming_class()(KEY)
    claim = os.path.join(manager.cache_dir, shared_compiles.CLAIM_FILE)
    with open(claim, "w") as f:
        f.write(str(os.getppid()))  # a live process, but its claim is older than the timeout
    old = time.time() - shared_compiles.CLAIM_TIMEOUT - 10
    os.utime(claim, (old, old))
    _no_waiting(monkeypatch)
    assert manager.get_group(METADATA) is None
    assert open(claim).read() == str(os.getpid())
    shared_compiles.release_claims()
    assert not os.path.exists(claim)


def test_install_leaves_a_cache_manager_of_the_user_s_own_alone(monkeypatch):
    from triton import knobs
    from triton.runtime.cache import FileCacheManager

    class Remote(FileCacheManager):
        pass

    monkeypatch.setattr(knobs.cache, "manager_class", Remote)
    assert not shared_compiles.available() and not shared_compiles.install()
    assert knobs.cache.manager_class is Remote
    monkeypatch.setattr(knobs.cache, "manager_class", None)
    assert shared_compiles.install() and knobs.cache.manager_class is shared_compiles._claiming_class()


def test_a_process_skipping_claims_raises_at_once_for_a_live_holder_and_compiles_what_nobody_holds(cache_dir,
                                                                                               monkeypatch):
    context = multiprocessing.get_context("fork")
    claimed, go = context.Event(), context.Event()
    holder = context.Process(target=_holder, args=(str(cache_dir), "finishes", claimed, go), daemon=True)
    holder.start()
    monkeypatch.setattr(shared_compiles._state, "skip_claimed", True)
    try:
        assert claimed.wait(30)
        _no_waiting(monkeypatch)  # no wait for the holder's compile
        with pytest.raises(shared_compiles.ClaimedElsewhere):
            shared_compiles._claiming_class()(KEY).get_group(METADATA)
        assert holder.is_alive() and not go.is_set()  # it answered while the holder still compiles
        assert shared_compiles._claiming_class()("ANOTHERKEY").get_group(METADATA) is None  # unclaimed: ours
        holder.kill()
        holder.join(10)
        assert shared_compiles._claiming_class()(KEY).get_group(METADATA) is None  # a dead holder's: taken over
    finally:
        holder.kill()
        holder.join(10)
        shared_compiles.release_claims()
