"""What a large case needs of its device: the memory a check of it takes (``CaseCheck`` for large
cases is ``harness.judge.check.LargeCaseCheck``; ``harness.judge.memory`` reserves it)."""
from __future__ import annotations

from nanfuzz.harness.judge.device_memory import Footprint
from nanfuzz.harness.judge.pool import CachePool, process_pool
from nanfuzz.harness.judge.runs import cache_bytes, case_bytes, element_size, oracle_parts, token_bytes
from nanfuzz.reference.batch import PagedBatch
from nanfuzz.reference.device_build import DeviceBuild, build_on_device, written_blocks


def written_bytes(case) -> int:
    """About what a large case's blocks that hold something take once (``written_blocks``)."""
    g = case.geometry
    blocks = int(written_blocks(case).size)
    return blocks * g.block_size * g.num_kv_heads * g.slot_width * element_size(case)


def large_check_footprint(case, copies_caches: bool = True) -> Footprint:
    """About what this process holds at the peak of a check of a large case: the pool's buffers
    (as large as the case's caches, or larger from an earlier case), a kernel's layout copy of the
    caches where it makes one (``Kernel.copies_caches``), its written blocks three times (the
    poisoned build, the garbage build, and the blocks gathered back out of the caches that
    ``CachePool.changed`` compares with the build, with its comparisons), and the oracle's working set
    (``oracle_parts``)."""
    caches = case_bytes(case)
    copy = {"layout_copy": caches} if copies_caches else {}
    return Footprint(pool_caches=max(caches, process_pool().held_bytes()), **copy,
                     written_blocks=3 * written_bytes(case), **oracle_parts(case))


# fp32 rows a kernel's own scratch may hold per output element: a split-K launch's segment outputs, maxima
# and sums (vLLM's TRITON_ATTN: 16 segments of a head padded to a power of two, twice the head at most)
SCRATCH_ROWS_PER_OUTPUT = 2 * 16 + 2


def large_build_footprint(case, copies_caches: bool = True) -> Footprint:
    """About what a compile-only launch of a large case holds (``harness.launch.farm``): its caches in a
    pool of its own, a kernel's layout copy of them, its written blocks (three times: the build's
    transients, as a check counts them), its tokens twice, its output, and the kernel's own scratch
    (``SCRATCH_ROWS_PER_OUTPUT``); never more than a check of it (``large_check_footprint``).  Nothing
    is judged there, so a check's copies and oracle are not: a compile process that reserved a check's
    footprint held 29 GiB of an 80 GB GPU through a compile of many seconds, allocating 4, while the
    campaign's check waited for it."""
    caches = cache_bytes(case)
    copy = {"layout_copy": caches} if copies_caches else {}
    g = case.geometry
    output = case.num_tokens * g.num_q_heads * g.v_head_size * 4
    build = Footprint(pool_caches=caches, **copy, written_blocks=3 * written_bytes(case), tokens=2 * token_bytes(case),
                      output=output, kernel_scratch=SCRATCH_ROWS_PER_OUTPUT * output)
    check = large_check_footprint(case, copies_caches)
    return build if build < check else check


def large_batch(case, small: dict, caches: dict) -> PagedBatch:
    """A large case's batch: its small inputs beside its caches, views into a pool's buffers."""
    return PagedBatch.from_allocations(case, {**small, **caches})


def built_in_pool(case, device, pool: CachePool) -> tuple[DeviceBuild, dict]:
    """A large case built on ``device`` as the blocks it writes, and its caches attached in ``pool``
    (``reference.device_build``, ``harness.judge.pool``)."""
    build = build_on_device(case, device)
    return build, pool.attach(build)
