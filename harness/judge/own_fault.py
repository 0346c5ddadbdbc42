"""Whether an error that escaped a check is nanfuzz's own bug rather than anything the kernel did.

A kernel's own exceptions are caught at its launches and are its CRASH; what escapes a check
afterwards is raised by nanfuzz's judging code.  A device fault or a failed allocation there can
be the kernel's doing (an illegal address surfaces at the judge's next synchronisation), but a
programming error raised in nanfuzz's own files, with no frame of a kernel's or an adapter's on
the way, is a bug of nanfuzz's: reporting it as the kernel's CRASH would be a false finding.
"""
from __future__ import annotations

import sysconfig
import traceback
from pathlib import Path

from nanfuzz.harness.judge.outcome import device_fault, one_line, portable_path

_PROGRAMMING_ERRORS = (AttributeError, NameError, TypeError, KeyError, IndexError, AssertionError, ZeroDivisionError)
_HARNESS = Path(__file__).resolve().parents[1]
_OWN_ROOTS = tuple(str(p) for p in (_HARNESS, _HARNESS.parent / "reference", _HARNESS.parent / "strategies"))
# the built-in kernels and the library adapters are the kernel's side of the contract
_KERNEL_SIDE = tuple(str(_HARNESS / name) for name in ("kernels", "adapters"))
# Python's own library, which nanfuzz's code calls (json, dataclasses, ...): never a kernel's
_STDLIB = str(Path(sysconfig.get_paths()["stdlib"]).resolve())


def _own(filename: str) -> bool:
    return _own_path(str(Path(filename).resolve()))


def _own_path(path: str) -> bool:
    return path.startswith(_OWN_ROOTS) and not path.startswith(_KERNEL_SIDE)


def _nanfuzz_s_or_python_s(filename: str) -> bool:
    path = str(Path(filename).resolve())
    return _own_path(path) or (path.startswith(_STDLIB) and "site-packages" not in path)


def own_fault(exc: BaseException) -> str | None:
    """One line naming nanfuzz's bug where ``exc`` is one (see the module's notes), else None."""
    if not isinstance(exc, _PROGRAMMING_ERRORS) or device_fault(exc):
        return None
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames or not _own(frames[0].filename) or not all(_nanfuzz_s_or_python_s(f.filename) for f in frames):
        return None
    where = next(frame for frame in reversed(frames) if _own(frame.filename))
    return (f"nanfuzz's own error while judging this case, not the kernel's (a bug in nanfuzz; please report it): "
            f"{one_line(exc)} at {portable_path(str(Path(where.filename).resolve()))}:{where.lineno}")
