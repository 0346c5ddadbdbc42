"""Hypothesis strategies over paged-attention cases (imports ``reference`` only)."""
from nanfuzz.strategies.cases import GPU_SIZE, INTERPRETER_SIZE, Size, paged_cases

# What a stored Hypothesis choice sequence means: raise it with any change here that makes an old
# sequence draw a different case.  Example-database keys carry it, so entries of another version
# are never replayed (they expire, or a new database starts clean).
STRATEGY_VERSION = 5

__all__ = ["paged_cases", "Size", "GPU_SIZE", "INTERPRETER_SIZE", "STRATEGY_VERSION"]
