"""Known failures: the shrunk failing cases of a kernel, kept in the example database as cases.

Hypothesis keeps its own entries as choice sequences, which mean a case only
under the exact strategy, capabilities and specialisation pool that drew
them (the database key says which).  Runners of a fleet fuzz different pools,
so a failure one runner found would reach another only if both drew the same
pool.  A known failure is the case itself (its JSON), kept under a key that
names only the kernel, the device, the campaign's focus and the case
schema: every campaign of that kernel replays it before it searches, whatever
its pool.  A known failure that passes is forgotten (in the stores that may
be written); one that fails again is the campaign's failure, already shrunk.
Entries kept under an older case schema that this nanfuzz still reads are
replayed too, so an upgrade loses none; new ones go under the current key.
"""
from __future__ import annotations

from nanfuzz.reference.case import READABLE_SCHEMA_VERSIONS, SCHEMA_VERSION, Case
from nanfuzz.reference.errors import NanfuzzError


def key(kernel_name: str, device: str, focus_label: str, version: int = SCHEMA_VERSION) -> bytes:
    return f"failures:{kernel_name}:{device}:{focus_label}:case-v{version}".encode()


def _older_keys(key_: bytes) -> list[bytes]:
    """``key_`` (a current key) under each older schema version this nanfuzz reads."""
    stem, _, _ = key_.rpartition(b":case-v")
    return [stem + f":case-v{version}".encode() for version in READABLE_SCHEMA_VERSIONS if version != SCHEMA_VERSION]


def remember(database, key_: bytes, case: Case) -> None:
    database.save(key_, case.to_json().encode())


def known(database, key_: bytes) -> list[tuple[bytes, Case]]:
    """The stored cases, oldest encoding first; entries that no longer read as a case are dropped."""
    found = []
    for raw in sorted({raw for k in (key_, *_older_keys(key_)) for raw in database.fetch(k)}):
        try:
            found.append((raw, Case.from_json(raw.decode())))
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError, NanfuzzError):
            forget(database, key_, raw)
    return found


def forget(database, key_: bytes, raw: bytes) -> None:
    """Drop ``raw`` from ``key_`` and from its older-schema keys, wherever ``known`` found it."""
    for k in (key_, *_older_keys(key_)):
        database.delete(k, raw)
