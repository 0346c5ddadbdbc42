"""Hostile subjects: every way a kernel under review misbehaves is a verdict with a shrunk repro, never a lost case."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from nanfuzz.harness.judge.check import Verdict
from nanfuzz.harness.campaign.runner import fuzz
from nanfuzz.harness.campaign.settings import Settings
from tests import subjects

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def settings(tmp_path):
    return Settings(device="cpu", state_dir=tmp_path / "state", repro_dir=tmp_path / "repros", use_database=False,
                    seed=0, max_examples=100, launch_timeout=2.0)


@pytest.mark.parametrize("subject, verdict, words", [
    (subjects.exits, Verdict.CRASH, "exited with status 3"),
    (subjects.aborts, Verdict.CRASH, "SIGABRT"),
    (subjects.raises_system_exit, Verdict.CRASH, "SystemExit: planted exit"),
    (subjects.calls_sys_exit_zero, Verdict.CRASH, "SystemExit: 0"),
    (subjects.reads_past_value_cache, Verdict.NONFINITE, "redzone past the end of value_cache"),
    (subjects.writes_past_out, Verdict.CLOBBER, "output guard rows"),
], ids=lambda x: getattr(x, "name", None) or str(x)[:20])
def test_each_hostility_is_its_verdict_shrunk_to_one_sequence(subject, verdict, words, settings):
    campaign = fuzz(subject, settings)
    assert campaign.failed and campaign.failure.verdict is verdict, campaign.failure and campaign.failure.summary
    assert words in campaign.failure.summary
    assert len(campaign.failing_case.sequences) == 1 and campaign.failing_case.sliding_window > 0
    assert campaign.failure.evidence["repeated"] == "3/3"


def test_a_launch_that_never_returns_is_a_hang(settings):
    campaign = fuzz(subjects.hangs, settings.replace(launch_timeout=1.0, max_examples=40))
    assert campaign.failed and campaign.failure.verdict is Verdict.HANG
    assert "did not return within 1 s" in campaign.failure.summary
    assert len(campaign.failing_case.sequences) == 1


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_launch_that_ran_past_the_timeout_once_and_then_passed_is_no_hang(tmp_path, jobs):
    """A busy device can hold one launch past the timeout: the same case replayed in a fresh worker
    passes, so the gate passes the kernel, says what happened, and spends its whole budget (with
    --jobs, no sibling stops for it).  One that hangs again is a HANG (the test above)."""
    summary = tmp_path / "summary.json"
    proc = _nanfuzz("fuzz", "--kernel", "tests.subjects:hangs_once", "--device", "cpu", "--launch-timeout", "2",
                    "--max-examples", "60", "--seed", "0", "--jobs", str(jobs), "--state-dir", str(tmp_path / "state"),
                    "--summary-json", str(summary), cwd=tmp_path)
    out, err = proc.communicate(timeout=300)
    assert (tmp_path / "hung.txt").exists()  # a launch did hang
    assert proc.returncode == 0, out + err
    assert "HANG" not in out and "not reported as a HANG" in out + err, out + err
    assert not list((tmp_path / "state").glob("repros/*.json"))
    assert _examples(summary) == 60, out + err


def test_a_fork_server_that_died_once_under_a_case_that_then_passes_is_no_crash(tmp_path):
    """A worker dies with its fork server when something outside kills the server (the host's
    out-of-memory killer): a case that passes every replay in fresh workers is a note, not a CRASH.
    A kernel that kills the server on every launch is a CRASH (tests/test_attacks.py)."""
    summary = tmp_path / "summary.json"
    proc = _nanfuzz("fuzz", "--kernel", "tests.subjects:kills_the_fork_server_once", "--device", "cpu",
                    "--max-examples", "60", "--seed", "0", "--state-dir", str(tmp_path / "state"),
                    "--summary-json", str(summary), cwd=tmp_path)
    out, err = proc.communicate(timeout=300)
    assert (tmp_path / "killed.txt").exists()  # the server was killed
    assert proc.returncode == 0, out + err
    assert "CRASH" not in out and "not reported as a CRASH" in out + err, out + err
    assert _examples(summary) == 60, out + err


def _examples(summary: Path) -> int:
    return sum(k["examples"] for k in json.loads(summary.read_text())["kernels"])


def test_different_bits_on_identical_inputs_are_nondeterministic_not_a_leak(settings):
    campaign = fuzz(subjects.nondeterministic, settings)
    assert campaign.failed and campaign.failure.verdict is Verdict.NONDETERMINISTIC
    assert "identical inputs" in campaign.failure.summary


def test_a_kernel_that_declares_itself_nondeterministic_is_held_to_the_tolerance_instead(settings):
    assert not fuzz(subjects.declared_nondeterministic, settings.replace(max_examples=40)).failed


def test_without_isolation_the_same_kernel_is_judged_in_process(settings):
    campaign = fuzz(subjects.raises_system_exit, settings.replace(isolation=False, max_examples=40))
    assert campaign.failed and campaign.failure.verdict is Verdict.CRASH


def _nanfuzz(*args, cwd, **kwargs):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("CI", None)
    return subprocess.Popen([sys.executable, "-m", "nanfuzz", *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


def test_the_cli_writes_a_crash_repro_and_replay_reproduces_it_in_a_fresh_process(tmp_path):
    proc = _nanfuzz("fuzz", "--kernel", "tests.subjects:aborts", "--max-examples", "60", "--seed", "0",
                    "--device", "cpu", cwd=tmp_path)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, out + err
    (repro,) = (tmp_path / ".nanfuzz" / "repros").glob("*.json")
    assert json.loads(repro.read_text())["verdict"] == "CRASH"
    again = _nanfuzz("replay", str(repro), "--device", "cpu", cwd=tmp_path)
    out, err = again.communicate(timeout=300)
    assert again.returncode == 1 and "SIGABRT" in out, out + err
    assert "Traceback" not in err


def test_an_unwritable_repro_folder_prints_the_finding_in_full(tmp_path):
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the folder should be")
    proc = _nanfuzz("fuzz", "--kernel", "tests.subjects:writes_past_out", "--max-examples", "60", "--seed", "0",
                    "--device", "cpu", "--repro-dir", str(blocked / "repros"), cwd=tmp_path)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, out + err
    assert "cannot write the repro" in err and "Traceback" not in err
    assert '"schema": "nanfuzz-repro"' in out and "CLOBBER" in out


def test_a_correct_kernel_never_crashes_when_campaigns_share_a_state_folder_or_one_is_killed(tmp_path):
    args = ("fuzz", "--kernel", "tests.torch_kernels:correct", "--max-examples", "40", "--device", "cpu",
            "--state-dir", str(tmp_path / "state"))
    first, second = _nanfuzz(*args, cwd=tmp_path), _nanfuzz(*args, cwd=tmp_path)
    for proc in (first, second):
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, out + err
    victim = _nanfuzz(*args[:4], "--max-examples", "100000", *args[6:], cwd=tmp_path)
    for line in victim.stderr:  # progress lines: kill it mid-search, with a case in flight
        if "searching" in line:
            break
    victim.send_signal(signal.SIGKILL)
    victim.communicate()
    after = _nanfuzz(*args, cwd=tmp_path)
    out, err = after.communicate(timeout=300)
    assert after.returncode == 0 and "CRASH" not in out, out + err


def test_ctrl_c_while_shrinking_still_writes_the_failure_found(tmp_path):
    # each hung launch costs the launch timeout: 5 s keeps the shrink going past the first
    # progress line of a log (progress.LOG_EVERY, 30 s), which is what says "shrinking"
    proc = _nanfuzz("fuzz", "--kernel", "tests.subjects:hangs", "--device", "cpu", "--launch-timeout", "5",
                    "--max-examples", "200", "--seed", "0", "--state-dir", str(tmp_path / "state"), cwd=tmp_path,
                    start_new_session=True)
    for line in proc.stderr:  # progress lines: wait until the campaign is shrinking a HANG it found
        if "shrinking" in line:
            break
    else:
        pytest.fail("the campaign never reported shrinking")
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, out + err
    assert "HANG" in out and "Traceback" not in err
    (repro,) = (tmp_path / "state" / "repros").glob("*.json")  # repros live in the state folder
    assert json.loads(repro.read_text())["verdict"] == "HANG"


def test_two_xdist_workers_fuzzing_one_kernel_on_one_state_folder_never_crash(tmp_path):
    (tmp_path / "test_twice.py").write_text(
        "import pytest\n\n"
        "@pytest.mark.parametrize('seed', [1, 2])\n"
        "def test_correct(nanfuzz, seed):\n"
        "    campaign = nanfuzz.fuzz('tests.torch_kernels:correct', max_examples=15, seed=seed)\n"
        "    assert not campaign.failed\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NANFUZZ_STATE_DIR": str(tmp_path / "shared")}
    env.pop("CI", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider",
                           "--nanfuzz-device", "cpu", "test_twice.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "2 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not list((tmp_path / "shared" / "journal").glob("*.json")), "each worker's journal went with it"


def test_a_worker_that_dies_before_it_is_ready_is_one_line_naming_how(settings):
    # the module ends the worker's process as the worker imports it; the campaign's own import is unharmed
    from nanfuzz.harness.registry import resolve
    from nanfuzz.reference.errors import NanfuzzError

    with pytest.raises(NanfuzzError, match=r"the worker process did not start \(the worker process exited with status 7\)"):
        fuzz(resolve("tests.dies_on_load:kernel"), settings.replace(max_examples=2))


def test_no_launch_stays_open_for_the_watchdog_after_a_case_whatever_its_launch_did():
    # a launch that raised never reported "returned"; left open, the next case's slow start would be a HANG
    from nanfuzz.harness.launch.subjects import worker_spec
    from nanfuzz.harness.launch.worker import Supervised
    from tests.cases import consecutive_case

    subject = Supervised(worker_spec(subjects.raises_system_exit, Settings(device="cpu")), launch_timeout=2.0)
    try:
        crashed = subject.check(consecutive_case([(1, 20)], window=4))
        assert crashed.verdict is Verdict.CRASH and not subject._clock.in_launch, crashed.summary
        passed = subject.check(consecutive_case([(1, 20)]))
        assert passed.verdict is Verdict.PASS and not subject._clock.in_launch, passed.summary
    finally:
        subject.close()


def test_a_worker_tells_the_farm_when_its_device_is_open_and_again_after_a_restart():
    # the compile farm opens its GPU contexts after the worker's (many opened at once take seconds each)
    from nanfuzz.harness.launch.subjects import worker_spec
    from nanfuzz.harness.launch.processes import fork_server_context
    from nanfuzz.harness.launch.worker import Supervised
    from tests.cases import consecutive_case

    opened = fork_server_context().Event()
    subject = Supervised(worker_spec(subjects.exits, Settings(device="cpu")), launch_timeout=2.0,
                         device_opened=opened)
    try:
        assert subject.check(consecutive_case([(1, 20)])).verdict is Verdict.PASS
        assert opened.is_set()
        opened.clear()
        assert subject.check(consecutive_case([(1, 20)], window=4)).verdict is Verdict.CRASH  # the worker exits
        assert subject.check(consecutive_case([(1, 20)])).verdict is Verdict.PASS  # in a fresh worker
        assert subject.restarts == 1 and opened.is_set()
    finally:
        subject.close()


def test_a_worker_counts_the_seconds_its_triton_compiles_take_and_ends_one_that_raised(monkeypatch):
    import types

    from triton import knobs

    from nanfuzz.harness.launch import worker

    now = [100.0]  # the worker's clock, moved by hand: the seconds are the test's, not the machine's
    monkeypatch.setattr(worker, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    monkeypatch.setattr(worker, "_compiles", worker._CompileClock())
    events = []
    worker._report_compiles(events.append)
    knobs.runtime.jit_cache_hook()
    now[0] += 0.25
    knobs.runtime.jit_post_compile_hook()
    now[0] += 5.0  # between compiles: not counted
    assert events == ["compile", "compiled"] and worker._compile_seconds() == 0.25
    knobs.runtime.jit_cache_hook()  # a compile that raises: its end is never reported
    now[0] += 0.125
    assert worker._compile_seconds() == 0.375
    assert worker._compiles.since is None  # ended where it was counted, not counted again
    now[0] += 1.0
    assert worker._compile_seconds() == 0.375


def test_a_worker_forked_from_a_process_that_touched_the_gpu_comes_from_the_fork_server_instead(monkeypatch):
    # torch.cuda.is_available() in a job (an adapter's stand-ins ask it) leaves its plain forks unable to
    # use CUDA while is_initialized() stays False: the fork itself must tell, and the worker start again
    import multiprocessing

    from nanfuzz.harness.launch import worker
    from nanfuzz.harness.launch.subjects import worker_spec
    from tests.cases import consecutive_case

    here = os.getpid()
    # a plain fork carries these patches; a child of the fork server does not, and is healthy
    monkeypatch.setattr(worker, "plain_fork_context", lambda: multiprocessing.get_context("fork"))
    monkeypatch.setattr(worker, "forked_after_gpu_use", lambda: os.getppid() == here)
    subject = worker.Supervised(worker_spec(subjects.exits, Settings(device="cpu")), launch_timeout=60.0,
                                prefer_fork=True)
    try:
        assert subject.check(consecutive_case([(1, 20)])).verdict is Verdict.PASS
        assert not subject.prefer_fork and subject._forked_by_server
    finally:
        subject.close()
