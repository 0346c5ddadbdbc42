"""The one exception type users see.

Every message is a single line that names the bad argument, its value and a
way out; the command line prints it and exits 2.  Our own invariants stay
plain ``assert``.
"""


class NanfuzzError(Exception):
    """Bad input from a user: an unknown kernel, a malformed case, a bad flag."""


class CaseError(NanfuzzError):
    """A case that is not a valid paged-attention batch."""
