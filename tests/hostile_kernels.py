"""Kernels a repro script resolves by import path (``tests.hostile_kernels:clobber``), run from the repository root.

Module-level Kernel objects, as a user's adapter module holds them; their
display names are not their import paths.
"""
from __future__ import annotations

from nanfuzz.harness.kernel import Kernel
from tests.torch_kernels import CAPS, attention

correct = Kernel("plain torch attention", lambda batch, out: attention(batch, out), CAPS)
# writes zeros into the first guard row past ``out``: CLOBBER
clobber = Kernel("plain torch attention, writes past out", lambda batch, out: attention(batch, out, bug="clobber"), CAPS)
