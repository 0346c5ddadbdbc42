"""One state folder: Hypothesis's own files (its constants cache) go into STATE/hypothesis during a campaign.

Hypothesis keeps files in ``.hypothesis/`` of the current directory unless told
otherwise; a nanfuzz run would leave that folder beside ``.nanfuzz/`` in the
repository root.  Only while a campaign runs does it point elsewhere: a user's
own Hypothesis tests in the same pytest session keep their ``.hypothesis/``.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def hypothesis_files_in(state_dir: Path) -> Iterator[None]:
    from hypothesis import configuration

    before = getattr(configuration, "__hypothesis_home_directory", None)
    configuration.set_hypothesis_home_dir(Path(state_dir) / "hypothesis")
    try:
        yield
    finally:
        configuration.set_hypothesis_home_dir(before)
