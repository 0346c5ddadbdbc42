"""``nanfuzz.Finding``: what a test sees when nanfuzz finds a bug.

An ``AssertionError``, so that pytest reports a failed test (not an error)
and ``pytest.raises(AssertionError)`` or ``xfail(raises=nanfuzz.Finding)``
can name it; it carries the verdict and evidence (``outcome``) and where the
repro was written (``repro``, None when it went to the screen instead).
"""
from __future__ import annotations


class Finding(AssertionError):
    def __init__(self, message: str, *, outcome=None, repro: str | None = None, kernel: str = ""):
        super().__init__(message)
        self.outcome = outcome
        self.repro = repro
        self.kernel = kernel

    @property
    def verdict(self) -> str:
        return self.outcome.verdict.value if self.outcome is not None else "?"
