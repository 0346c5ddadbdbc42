"""What a large case needs of its device: the memory a check of it takes (``CaseCheck`` for large
cases is ``harness.judge.check.LargeCaseCheck``; ``harness.judge.memory`` reserves it)."""
from __future__ import annotations

from nanfuzz.harness.judge.pool import process_pool
from nanfuzz.harness.judge.runs import case_bytes
from nanfuzz.reference.device_build import written_blocks
from nanfuzz.reference.oracle import oracle_bytes


def large_case_bytes(case) -> int:
    """About what a large case takes on its device beyond the pool's caches: its compact blocks
    (the poisoned build, the garbage build, a kernel's layout copy), the oracle's working set."""
    g = case.geometry
    blocks = int(written_blocks(case).size)
    element = 4 if g.dtype == "float32" else 2
    compact = blocks * g.block_size * g.num_kv_heads * g.slot_width * element
    return 3 * compact + oracle_bytes(case)


def large_check_footprint(case) -> int:
    """About what this process holds at the peak of a check of a large case: the pool's buffers
    (as large as the case's caches, or larger from an earlier case), a kernel's layout copy of the
    caches, and ``large_case_bytes``."""
    caches = case_bytes(case)
    return max(caches, process_pool().held_bytes()) + caches + large_case_bytes(case)
