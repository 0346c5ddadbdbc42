"""Files that are whole or absent: written to a temporary name in their folder, synced, renamed.

A reader (CI uploading a repro, a person replaying it, a merge of gate outputs)
never sees half a file: on a full disk the temporary file is removed and the
error raised, so a caller prints the finding instead of leaving a truncated
JSON or an empty script beside it.
"""
from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path


def write_atomically(path: str | Path, data: str | bytes, *, encoding: str = "utf-8", errors: str = "strict") -> Path:
    """Write ``data`` to ``path`` whole, or raise OSError leaving ``path`` as it was."""
    path = Path(path)
    payload = data.encode(encoding, errors) if isinstance(data, str) else data
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask decides, as for open()
    try:
        try:
            view = memoryview(payload)
            while view:
                view = view[_write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    _sync_folder(path.parent)
    return path


def _write(fd: int, data: memoryview) -> int:
    return os.write(fd, data)


def _sync_folder(folder: Path) -> None:
    """Make the rename itself durable where the platform allows it (best effort)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
