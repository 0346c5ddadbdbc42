"""Adapters that drive kernels living outside nanfuzz (vLLM's and AMD AITER's attention kernels)."""
