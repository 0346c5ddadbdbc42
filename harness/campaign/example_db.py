"""The example database, chosen by one string (``--example-db``, ``NANFUZZ_EXAMPLE_DB``).

    DIR                        a folder (the default: STATE/examples)
    redis://HOST[:PORT][/DB]   a Redis or Valkey server that a fleet of runners shares
    rediss://...               the same over TLS
    readonly:STORE             STORE (a server URL or a folder) is read, never written

With a server or a read-only store, the campaign's local folder stands in
front of it: every entry read from the store can be replayed, every entry
written goes to the local folder too (and to the store unless it is
read-only).  Hypothesis's own ``MultiplexedDatabase``, ``ReadOnlyDatabase``
and ``RedisExampleDatabase`` do the work.  A store that stops answering in
the middle of a run costs one note: the run goes on with the local folder,
which has kept every finding.
"""
from __future__ import annotations

import os
import tempfile
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from hypothesis.database import (DirectoryBasedExampleDatabase, ExampleDatabase, MultiplexedDatabase,
                                 ReadOnlyDatabase)

from nanfuzz.reference.errors import NanfuzzError

READONLY = "readonly:"
SERVER_SCHEMES = ("redis", "rediss")
# Every key nanfuzz writes on a server starts with this, so that one server (or one of its
# numbered databases) can hold other data too, and `--scan --pattern 'nanfuzz:*'` finds them all.
KEY_PREFIX = b"nanfuzz:"
CONNECT_TIMEOUT = 5.0   # seconds: a server that does not accept a connection by then is unreachable
REPLY_TIMEOUT = 10.0    # seconds: every command is a small set operation
SYNTAX = "a folder, redis://HOST:PORT/DB, rediss://HOST:PORT/DB, or readonly: before either"


@dataclass(frozen=True)
class Store:
    """A parsed ``--example-db``: a folder, or a server URL; possibly read-only."""
    location: str
    server: bool
    readonly: bool = False

    @property
    def shown(self) -> str:
        """The store as messages name it (a password in the URL is hidden)."""
        text = _without_password(self.location) if self.server else self.location
        return (READONLY + text) if self.readonly else text

    @property
    def layered(self) -> bool:
        """Does a local folder stand in front of this store (true for all but a plain folder)?"""
        return self.server or self.readonly


def parse(text: str | None) -> Store | None:
    """``--example-db`` as a Store; None for "the local folder"; NanfuzzError when it cannot be one."""
    if text is None or not str(text).strip():
        return None
    text = str(text).strip()
    readonly = text.startswith(READONLY)
    rest = text[len(READONLY):].strip() if readonly else text
    if not rest:
        raise NanfuzzError(f"--example-db={text!r} names no store after {READONLY!r}; give {SYNTAX}")
    if "://" not in rest:
        return Store(rest, server=False, readonly=readonly)
    url = urllib.parse.urlsplit(rest)
    if url.scheme not in SERVER_SCHEMES:
        raise NanfuzzError(f"--example-db={_without_password(text)!r}: unknown scheme {url.scheme!r}; give {SYNTAX}")
    try:
        port = url.port
    except ValueError:
        port = -1
    problem = ("names no host" if not url.hostname else
               "has a port that is not a number from 1 to 65535" if port is not None and not 0 < port < 65536 else
               "has a database that is not a number (redis://HOST:PORT/0)"
               if url.path.strip("/") and not url.path.strip("/").isdigit() else None)
    if problem:
        raise NanfuzzError(f"--example-db={_without_password(text)!r} {problem}; give {SYNTAX}")
    return Store(rest, server=True, readonly=readonly)


def _without_password(url: str) -> str:
    parts = urllib.parse.urlsplit(url) if "://" in url else None
    if parts is None or parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def _client(store: Store):
    try:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry
    except ImportError:
        raise NanfuzzError(f"--example-db={store.shown!r} needs the redis client: pip install 'nanfuzz[redis]'") from None
    try:
        # one quick retry: a server that has gone away should cost seconds, not a backoff schedule
        return redis.Redis.from_url(store.location, socket_connect_timeout=CONNECT_TIMEOUT,
                                    socket_timeout=REPLY_TIMEOUT, retry=Retry(NoBackoff(), 1))
    except (ValueError, TypeError) as exc:
        raise NanfuzzError(f"--example-db={store.shown!r}: {exc}; give {SYNTAX}") from None


def check(text: str | None) -> Store | None:
    """At the edge (CLI, gate, plugin): the store parses, and a server answers, or NanfuzzError.

    In the middle of a run the same trouble is a note, not an error (see ``open_database``)."""
    store = parse(text)
    if store is None:
        return None
    if not store.server:
        if store.readonly and not Path(store.location).is_dir():
            raise NanfuzzError(f"--example-db={store.shown!r}: {store.location!r} is not a folder")
        return store
    client = _client(store)
    try:
        client.ping()
    except Exception as exc:  # redis-py's errors, and TypeError for a query option it does not know
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise NanfuzzError(f"example database {store.shown} does not answer ({reason}); start the server, "
                           "fix --example-db, or leave it out to use the local folder") from None
    finally:
        client.close()
    return store


def open_database(text: str | None, local: Path, note: Callable[[str], None]):
    """The database a campaign reads and writes: the local folder alone, or it in front of a store.

    ``local`` is the local folder, ``Settings.examples_path`` (the store itself when that is a
    plain folder).  ``note`` receives one line for each trouble the campaign should tell its
    user about.  Returns None when there is no usable database at all.
    """
    store = parse(text)
    folder = Path(local)
    local_db = _local_folder(folder, note)
    # no store behind the folder, or one that stopped answering earlier in this process (noted then)
    if store is None or not store.layered or store.shown in _lost:
        return local_db
    if store.server:
        from hypothesis.extra.redis import RedisExampleDatabase

        shared = RedisExampleDatabase(_client(store), key_prefix=KEY_PREFIX)
    else:
        shared = DirectoryBasedExampleDatabase(store.location)
    if store.readonly:
        shared = ReadOnlyDatabase(shared)
    layers = [db for db in (local_db, _Guarded(shared, store.shown, folder if local_db else None, note)) if db]
    return MultiplexedDatabase(*layers)


def _local_folder(path: Path, note: Callable[[str], None]):
    try:
        path.mkdir(parents=True, exist_ok=True)
        # a probe of its own: the jobs of a --jobs run all probe the same folder at once
        fd, probe = tempfile.mkstemp(prefix=".nanfuzz-write-test-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        note(f"example database {str(path)!r} is not writable ({exc.strerror}); running without it")
        return None
    return DirectoryBasedExampleDatabase(str(path))


# Stores that stopped answering in this process: later campaigns go straight to their local folder.
_lost: set[str] = set()


def _store_errors() -> tuple[type[BaseException], ...]:
    try:
        from redis.exceptions import RedisError
    except ImportError:
        return (OSError,)
    return (OSError, RedisError)


class _Guarded(ExampleDatabase):
    """A shared store that may stop answering mid-run: its first error becomes one note, and from
    then on the store is left out, so the layers in front of it carry on alone."""

    def __init__(self, db: ExampleDatabase, shown: str, local: Path | None, note: Callable[[str], None]):
        super().__init__()
        self._db, self._shown, self._local, self._note = db, shown, local, note
        self._errors = _store_errors()

    def __repr__(self) -> str:
        return f"_Guarded({self._db!r})"

    def _lose(self, exc: BaseException) -> None:
        if self._shown in _lost:
            return
        _lost.add(self._shown)
        reason = " ".join(str(exc).split()) or type(exc).__name__
        where = (f"its local folder {str(self._local)!r}, which keeps every finding" if self._local is not None
                 else "no example database")
        self._note(f"example database {self._shown} stopped answering ({type(exc).__name__}: {reason}); "
                   f"the run goes on with {where}")

    def fetch(self, key: bytes) -> Iterable[bytes]:
        if self._shown in _lost:
            return
        try:
            values = list(self._db.fetch(key))  # errors surface here, not inside Hypothesis's loop
        except self._errors as exc:
            self._lose(exc)
            return
        yield from values

    def _call(self, method: str, *args) -> None:
        if self._shown in _lost:
            return
        try:
            getattr(self._db, method)(*args)
        except self._errors as exc:
            self._lose(exc)

    def save(self, key: bytes, value: bytes) -> None:
        self._call("save", key, value)

    def delete(self, key: bytes, value: bytes) -> None:
        self._call("delete", key, value)

    def move(self, src: bytes, dest: bytes, value: bytes) -> None:
        self._call("move", src, dest, value)

    def _start_listening(self) -> None:
        pass  # nanfuzz does not listen for changes

    def _stop_listening(self) -> None:
        pass
