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
from pathlib import Path
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


def import_user_module(name: str, import_root: str | None = None) -> ModuleType:
    """``importlib.import_module(name)`` with the current directory first on ``sys.path``, and
    ``import_root`` (where a replay found the module's repository) right after it."""
    cwd = cwd_first_on_path()
    if import_root and import_root not in sys.path:
        sys.path.insert(1 if sys.path and sys.path[0] in ("", cwd) else 0, import_root)
        importlib.invalidate_caches()
    return importlib.import_module(name)


# -- where a module came from, for a repro to find it again -------------------------------

def module_origin(module_name: str) -> dict | None:
    """Where ``module_name`` was imported from, relative to its repository (the nearest folder above
    its import root holding ``.git``, else the import root itself): ``{"file", "import_root",
    "repository"}`` (the first two relative, the last absolute, as a hint); None for a module
    without a file."""
    module = sys.modules.get(module_name)
    file = getattr(module, "__file__", None)
    if not file:
        return None
    path = Path(file).resolve()
    root = path.parent
    for _ in range(module_name.count(".") + (path.name == "__init__.py")):
        root = root.parent
    repository = next((folder for folder in (root, *root.parents) if (folder / ".git").exists()), root)
    return {"file": path.relative_to(repository).as_posix(),
            "import_root": root.relative_to(repository).as_posix(), "repository": str(repository)}


def find_import_root(origin: dict, starts: list[Path]) -> str | None:
    """The import root of a recorded ``module_origin`` found again: the first folder at or above one
    of ``starts`` that holds the recorded file (so any folder of the repository will do), then the
    recorded repository itself."""
    candidates = [folder for start in starts for folder in (start.resolve(), *start.resolve().parents)]
    candidates.append(Path(origin["repository"]))
    for folder in candidates:
        if (folder / origin["file"]).is_file():
            return str((folder / origin["import_root"]).resolve())
    return None
