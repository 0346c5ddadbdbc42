"""Import a user's adapter module the way ``python -m`` would.

``nanfuzz fuzz --kernel mykernels.nanfuzz_adapter:kernel`` is run from the
root of the user's repository, but the ``nanfuzz`` console script puts its
own folder first on ``sys.path``, not the current directory.  Every import
of a user kernel (the CLI, replay, job processes, the pytest plugin, a repro
script) goes through :func:`import_user_module`, so all of them see the same
modules.
"""
from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType


def cwd_first_on_path() -> str:
    """Put the current directory first on ``sys.path`` (as ``python -m`` does); return it.

    It stays there, as under ``python -m``: an adapter may import its own
    siblings lazily, long after it was resolved.
    """
    cwd = os.getcwd()
    if not sys.path or sys.path[0] not in ("", cwd):
        if cwd in sys.path:
            sys.path.remove(cwd)
        sys.path.insert(0, cwd)
        importlib.invalidate_caches()
    return cwd


def import_user_module(name: str) -> ModuleType:
    """``importlib.import_module(name)`` with the current directory first on ``sys.path``."""
    cwd_first_on_path()
    return importlib.import_module(name)
