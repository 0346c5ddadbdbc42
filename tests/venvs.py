"""Fresh virtual environments holding this one's packages, less some: a user's machine without nanfuzz, or numpy.

The packages are linked, not installed, so a venv costs a second: every
site-packages folder on this interpreter's path (a venv may chain another's
through a ``.pth`` file) is linked entry by entry into one folder, which the
new venv's own ``.pth`` names.  Editable installs and other ``.pth`` files are
left out, so nanfuzz, installed editable from this checkout, is not importable
there unless asked for.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def _leaves_out(name: str, packages: tuple[str, ...]) -> bool:
    if name.endswith(".pth") or name.startswith(("__editable__", "_nanfuzz")):
        return True
    return any(name == p or name.startswith((p + "-", p + ".")) for p in packages)


def venv_without(folder: Path, *packages: str) -> Path:
    """The python of a new venv in ``folder`` that sees this one's packages but nanfuzz and ``packages``."""
    venv, shared = folder / "venv", folder / "site-packages"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    shared.mkdir()
    left_out = ("nanfuzz", *packages)
    for site in (Path(p) for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()):
        for entry in site.iterdir():
            if not _leaves_out(entry.name, left_out) and not (shared / entry.name).exists():
                (shared / entry.name).symlink_to(entry)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "shared.pth").write_text(f"{shared}\n")  # a plain path: no other .pth runs from it
    return python
