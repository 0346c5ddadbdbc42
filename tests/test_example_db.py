"""The example database by URL: a folder, a real Redis server, read-only layering, a server that goes away.

Every server here is a real ``redis-server`` (see ``tests.redis_server``).
The subject is the plain-torch kernel with the window off-by-one bug: the
simplest generated case has no window and passes, so a campaign whose first
example fails is one that replayed a stored failure.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nanfuzz.harness.campaign import example_db, known_failures
from nanfuzz.harness.campaign.runner import fuzz
from nanfuzz.harness.campaign.search import database_label
from nanfuzz.harness.kernel import Kernel
from nanfuzz.harness.campaign.settings import Settings
from nanfuzz.reference.case import SCHEMA_VERSION
from nanfuzz.reference.errors import NanfuzzError
from tests.fleet_subjects import STOP_PID_VAR
from tests.redis_server import redis_server  # noqa: F401 (a fixture)
from tests.torch_kernels import CAPS, attention, torch_kernel

ROOT = Path(__file__).resolve().parents[1]
BUGGY = torch_kernel("window-off-by-one")
# The same kernel name with the bug fixed, as a pull request would bring it (runs in this process).
FIXED = Kernel(BUGGY.name, lambda batch, out: attention(batch, out), CAPS)


@pytest.fixture(autouse=True)
def _no_lost_stores():
    example_db._lost.clear()  # a server that went away in one test is no news to the next
    yield
    example_db._lost.clear()


def campaign(kernel, tmp_path, name: str, db: str | None, **options):
    settings = Settings(device="cpu", state_dir=tmp_path / name, repro_dir=tmp_path / name / "repros",
                        example_db=db, profile="dev", replays=0)
    return fuzz(kernel, settings.replace(**{"max_examples": 150, **options}))


def stored(server) -> dict[bytes, set[bytes]]:
    client = server.client()
    try:
        return {key: client.smembers(key) for key in client.keys("nanfuzz:*")}
    finally:
        client.close()


# -- the URL ---------------------------------------------------------------------------

@pytest.mark.parametrize("text, problem", [
    ("ftp://host/x", "unknown scheme 'ftp'"),
    ("redis://:6379/0", "names no host"),
    ("redis://db.example:port/0", "has a port that is not a number"),
    ("redis://db.example:6379/zero", "has a database that is not a number"),
    ("readonly:", "names no store after 'readonly:'"),
    ("redis://:hunter2@db.example:99999/0", "redis://:***@db.example:99999/0"),
])
def test_a_bad_url_is_one_line_naming_the_fix(text, problem):
    with pytest.raises(NanfuzzError) as error:
        example_db.check(text)
    message = str(error.value)
    assert problem in message and "\n" not in message and "hunter2" not in message
    if "scheme" in problem or "host" in problem:
        assert "redis://HOST:PORT/DB" in message


def test_the_syntax():
    assert example_db.parse(None) is None and example_db.parse("  ") is None
    folder = example_db.parse("ci/examples")
    assert (folder.server, folder.readonly, folder.layered) == (False, False, False)
    shared = example_db.parse("readonly:redis://db.example:6379/2")
    assert (shared.server, shared.readonly, shared.layered, shared.location) == (
        True, True, True, "redis://db.example:6379/2")
    assert example_db.parse("readonly:/mnt/team-examples").layered
    # a plain folder is the local folder itself; a layered store has STATE/examples in front of it
    assert Settings(state_dir=Path("s"), example_db="elsewhere").examples_path == Path("elsewhere")
    assert Settings(state_dir=Path("s"), example_db="redis://h:1/0").examples_path == Path("s/examples")


def test_the_key_space_separates_what_would_replay_different_cases():
    from nanfuzz.strategies import STRATEGY_VERSION

    base = dict(kernel_name="k@v", device="cuda", focus_label="", caps=CAPS, pool=(1, 2, 3), pool_seed=4)
    label = database_label(**base)
    assert f"strategies-v{STRATEGY_VERSION}" in label
    variants = [dict(kernel_name="k@w"), dict(device="cpu"), dict(focus_label="decode-only"),
                dict(caps=CAPS.restrict(sinks=False)), dict(pool=(1, 2)), dict(pool_seed=5), dict(pool=None)]
    labels = {database_label(**{**base, **change}) for change in variants}
    assert label not in labels and len(labels) == len(variants)


def test_a_known_failure_replayed_first_is_one_of_the_examples_asked_for(tmp_path):
    assert campaign(BUGGY, tmp_path, "state", None, isolation=False).failed
    fixed = campaign(FIXED, tmp_path, "state", None, isolation=False, max_examples=5)
    assert not fixed.failed and fixed.examples == 5  # the replay of the stored failure, then 4 drawn
    assert fixed.statistics.examples == 5


# -- a real server -----------------------------------------------------------------------

KNOWN_KEY = b"nanfuzz:" + known_failures.key("torch@window-off-by-one", "cpu", "")


def test_known_failures_kept_under_an_older_case_schema_are_replayed_and_forgotten_there():
    from hypothesis.database import InMemoryExampleDatabase

    from tests.cases import consecutive_case

    database, case = InMemoryExampleDatabase(), consecutive_case([(1, 5)])
    old_key, key = (known_failures.key("k", "cpu", "", version) for version in (1, SCHEMA_VERSION))
    database.save(old_key, case.to_json().encode())
    [(raw, found)] = known_failures.known(database, key)
    assert found == case and key.endswith(f":case-v{SCHEMA_VERSION}".encode())
    known_failures.forget(database, key, raw)
    assert not list(database.fetch(old_key)) and not known_failures.known(database, key)

def test_a_second_campaign_on_the_server_replays_the_first_s_failure_first(tmp_path, redis_server):
    server = redis_server()
    first = campaign(BUGGY, tmp_path, "runner-a", server.url)
    assert first.failed and first.examples_to_first_failure > 1  # found by searching
    keys = stored(server)
    known = KNOWN_KEY
    assert known in keys and len(keys) >= 2  # the case, and Hypothesis's own entries under its digest

    second = campaign(BUGGY, tmp_path, "runner-b", server.url)
    assert second.failed and second.examples_to_first_failure == 1
    assert second.failing_case == first.failing_case

    # Hypothesis's own entries replay it too, without the known failure: same key, same case
    client = server.client()
    client.delete(known)
    client.close()
    third = campaign(BUGGY, tmp_path, "runner-c", server.url, max_examples=1, shrink=False)
    assert third.failed and third.examples_to_first_failure == 1 and third.failing_case == first.failing_case


def test_another_strategy_version_does_not_replay_the_stored_bytes(tmp_path, redis_server, monkeypatch):
    server = redis_server()
    assert campaign(BUGGY, tmp_path, "a", server.url).failed
    client = server.client()
    client.delete(KNOWN_KEY)
    client.close()
    import nanfuzz.harness.campaign.search as fuzz_module

    monkeypatch.setattr(fuzz_module, "STRATEGY_VERSION", fuzz_module.STRATEGY_VERSION + 1)
    later = campaign(BUGGY, tmp_path, "b", server.url, max_examples=1, shrink=False)
    assert not later.failed and later.examples == 1  # the simplest case, not the old entry


def test_readonly_reads_the_team_s_corpus_and_writes_only_its_own_folder(tmp_path, redis_server):
    server = redis_server()
    assert campaign(BUGGY, tmp_path, "nightly", server.url).failed
    corpus = stored(server)

    pr = campaign(BUGGY, tmp_path, "pr", "readonly:" + server.url)
    assert pr.failed and pr.examples_to_first_failure == 1  # read from the server
    assert stored(server) == corpus  # and nothing written back
    local = list((tmp_path / "pr" / "examples").rglob("*"))
    assert any(p.is_file() for p in local)  # its finding stays in its own folder

    # the pull request fixed the kernel: its run passes and leaves the team's entries alone
    fixed = campaign(FIXED, tmp_path, "pr-fixed", "readonly:" + server.url, max_examples=3)
    assert not fixed.failed and stored(server) == corpus
    # a writing run of the fixed kernel forgets the known failure
    campaign(FIXED, tmp_path, "main-fixed", server.url, max_examples=3)
    assert KNOWN_KEY not in stored(server)


def _cli(tmp_path, *args, **env):
    base = {k: v for k, v in os.environ.items() if not k.startswith(("NANFUZZ_", "PYTEST_"))}
    return subprocess.run([sys.executable, "-m", "nanfuzz", *args], cwd=tmp_path, capture_output=True, text=True,
                          env={**base, "PYTHONPATH": str(ROOT), "CI": "true", **env}, timeout=300)


def test_a_server_that_stops_mid_run_is_one_line_and_the_finding_stays_local(tmp_path, redis_server):
    server = redis_server()
    proc = _cli(tmp_path, "fuzz", "--kernel", "tests.fleet_subjects:stops_the_server", "--device", "cpu",
                "--max-examples", "200", "--state-dir", "state", "--example-db", server.url,
                "--summary-json", "first.json", **{STOP_PID_VAR: str(server.pid)})
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert server.process.poll() is not None  # the server did stop in the middle of the run
    lines = [line for line in proc.stderr.splitlines() if "stopped answering" in line]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"nanfuzz: example database {server.url} stopped answering (")
    assert "the run goes on with its local folder" in lines[0] and "Traceback" not in proc.stderr
    first = json.loads((tmp_path / "first.json").read_text())["kernels"][0]
    assert first["verdict"] == "NONFINITE" and Path(tmp_path / first["repro"][0]).exists()

    # the local folder kept the finding: a run on it alone replays it first
    again = _cli(tmp_path, "fuzz", "--kernel", "tests.fleet_subjects:stops_the_server", "--device", "cpu",
                 "--max-examples", "5", "--state-dir", "state", "--example-db", "state/examples",
                 "--summary-json", "again.json")
    assert again.returncode == 1, again.stderr[-2000:]
    assert json.loads((tmp_path / "again.json").read_text())["kernels"][0]["examples_to_first_failure"] == 1


def test_a_server_that_does_not_answer_is_exit_2_at_the_start(tmp_path, redis_server):
    server = redis_server()
    url = server.url
    server.stop()
    proc = _cli(tmp_path, "fuzz", "--kernel", "paged_decode@masked", "--device", "cpu", "--example-db", url)
    assert proc.returncode == 2
    err = proc.stderr.strip()
    assert err.startswith(f"nanfuzz: example database {url} does not answer (") and "\n" not in err, err
    assert "nanfuzz fuzz:" not in proc.stdout  # nothing ran
    bad = _cli(tmp_path, "fuzz", "--kernel", "paged_decode@masked", "--device", "cpu", "--example-db", "http://x")
    assert bad.returncode == 2 and "unknown scheme 'http'" in bad.stderr and bad.stderr.count("\n") == 1


def test_the_plugin_takes_the_database_and_checks_it_at_the_start(tmp_path):
    (tmp_path / "test_kernel.py").write_text(
        "def test_kernel(nanfuzz):\n    nanfuzz.fuzz('tests.torch_kernels:window_off_by_one', max_examples=150)\n")
    base = {k: v for k, v in os.environ.items() if not k.startswith(("NANFUZZ_", "PYTEST_"))}

    def pytest_run(*args):
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nanfuzz-device",
                               "cpu", *args, "test_kernel.py"], cwd=tmp_path, capture_output=True, text=True,
                              env={**base, "PYTHONPATH": str(ROOT)}, timeout=300)

    bad = pytest_run("--nanfuzz-example-db", "ftp://x")
    assert bad.returncode == 4, bad.stdout + bad.stderr
    assert "--example-db='ftp://x': unknown scheme 'ftp'" in bad.stderr
    found = pytest_run("--nanfuzz-example-db", "team-examples")
    assert found.returncode == 1 and "NONFINITE" in found.stdout, found.stdout[-2000:]
    assert any(p.is_file() for p in (tmp_path / "team-examples").rglob("*"))  # the failure went where it was told


def _probe_many(path: str, start, rounds: int, failures) -> None:
    notes: list[str] = []
    start.wait()
    for _ in range(rounds):
        if example_db._local_folder(Path(path), notes.append) is None:
            failures.put(notes[-1])
            return
    failures.put(None)


def test_jobs_probing_one_fresh_folder_at_once_all_get_their_database(tmp_path):
    """The jobs of a --jobs run open the same local folder at the same moment."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    processes, start, failures = 8, context.Barrier(8), context.Queue()
    folder = tmp_path / "state" / "examples"
    jobs = [context.Process(target=_probe_many, args=(str(folder), start, 200, failures)) for _ in range(processes)]
    for job in jobs:
        job.start()
    found = [failures.get(timeout=60) for _ in jobs]
    for job in jobs:
        job.join(timeout=10)
    assert found == [None] * processes
    assert list(folder.iterdir()) == []  # no probe left behind
