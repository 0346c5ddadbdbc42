"""Hypothesis strategies over paged-attention cases (imports ``reference`` only)."""
from nanfuzz.strategies.cases import GPU_SIZE, INTERPRETER_SIZE, Size, paged_cases

__all__ = ["paged_cases", "Size", "GPU_SIZE", "INTERPRETER_SIZE"]
