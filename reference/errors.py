"""The one exception type users see.

Every message is a single line that names the bad argument, its value and a
way out; the command line prints it and exits 2.  Our own invariants stay
plain ``assert``.
"""


class NanfuzzError(Exception):
    """Bad input from a user: an unknown kernel, a malformed case, a bad flag."""


class CaseError(NanfuzzError):
    """A case that is not a valid paged-attention batch."""


class UnsupportedHere(NanfuzzError):
    """A kernel that cannot run in this environment at all (its Triton, its device), whatever the case:
    a usage error where it is asked for, and no more where it is only a default (a gate's)."""
