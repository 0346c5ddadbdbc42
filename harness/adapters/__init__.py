"""Adapters that drive kernels living outside nanfuzz (vLLM's attention kernels)."""
