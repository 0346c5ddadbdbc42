"""A check reserves what its oracle holds while it judges: ``reference.oracle.oracle_bytes`` bounds the
oracle's measured peak (resident bytes on the CPU, where every freed tensor is given back) for decodes
whose gather dominates, prefills whose scores, rows or allowed mask do, and unsigned rotated caches,
and a host-built check's footprint counts it (without it, a production case's judging took gigabytes no one reserved)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nanfuzz.harness.judge.runs import _COPIES_HELD, case_bytes, check_footprint
from nanfuzz.harness.judge.device_memory import GpuMemory
from nanfuzz.harness.judge.large import large_check_footprint
from nanfuzz.reference.oracle import (_CHUNK_ELEMENTS, _ROWS_PER_GATHER, chunk_sequences, oracle_bytes,
                                      oracle_footprint)
from tests.oracle_peak import case_of

ROOT = Path(__file__).parent.parent
SPECS = {
    "decode, gather-bound": [64, 8, 128, 16, "float16", [[1, 4096]] * 4, {}],
    "prefill, score-bound": [32, 4, 64, 16, "bfloat16", [[256, 2048], [128, 2048]], {}],
    "fp8 per token and head": [32, 8, 128, 16, "float16", [[1, 4096]] * 4, {"dtype": "fp8_e4m3fn", "scales": "token-head"}],
    "4-bit codes, zero points, rotated": [64, 8, 128, 16, "float16", [[1, 4096]] * 4,
                                          {"dtype": "uint4", "zero_points": "code", "scales": "token-head",
                                           "rotation": "hadamard"}],
    "one short decode": [8, 1, 128, 16, "float16", [[1, 512]], {}],
    # a production prefill's shape: many short sequences in wide heads, the rows outweigh the gather
    "prefill of many short sequences, row-bound": [128, 16, 256, 16, "float16", [[29, 29]] * 64, {}],
    # long prefills of one narrow head: the allowed mask and its windowed distances outweigh the scores
    "windowed prefill of long sequences, mask-bound": [1, 1, 32, 16, "float16", [[349, 21536]] * 40, {}, 4096],
    # one long prefill beside many decodes, each padded to its query: the padded rows bound the chunk
    "long prefill beside decodes, padding-bound": [64, 8, 128, 16, "float16", [[384, 384]] + [[1, 384]] * 40, {}],
}


def _measured_peak(spec) -> int:
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("this system keeps no resettable peak of a process's resident set")
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "tests.oracle_peak", json.dumps(spec)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return int(proc.stdout.split()[-1])


@pytest.mark.parametrize("name", SPECS)
def test_the_oracle_peaks_within_what_a_check_reserves_for_it(name):
    case = case_of(SPECS[name])
    peak = _measured_peak(SPECS[name])
    bound = oracle_bytes(case)
    print(f"{name}: peak {peak / 2**20:.0f} MiB, bound {bound / 2**20:.0f} MiB")
    assert peak <= bound
    assert bound <= 3 * max(peak, 8 << 20)  # not so far over that the governor turns cases away for nothing
    assert check_footprint(case) >= _COPIES_HELD * case_bytes(case) + peak


def test_a_chunk_s_padded_rows_stay_within_its_budget():
    """A long query makes every sequence of its chunk as long: the chunk holds fewer sequences for it
    (without it, this case was one chunk of 41 sequences whose judging peaked at 8.0 GiB, now 4.0)."""
    case = case_of(SPECS["long prefill beside decodes, padding-bound"])
    g = case.geometry
    rows = chunk_sequences(case) * case.max_query_len * g.num_q_heads * g.v_head_size
    assert 1 < chunk_sequences(case) < len(case.sequences)
    assert _ROWS_PER_GATHER * rows <= _CHUNK_ELEMENTS


# A production case of vLLM's ROCM_ATTN drawn by tests/test_memory_gpu.py: 164 prefills of up to 29 tokens
# (25 of them empty) in 128 heads of 256, an fp8 cache; its oracle runs in 3 chunks.
_SHORT_PREFILLS = [[0, 0]] * 25 + [[n, n] for n, count in ((14, 3), (15, 11), (16, 10), (17, 10), (18, 9), (19, 12),
                                                          (20, 7), (21, 9), (22, 13), (23, 14), (24, 9), (25, 7),
                                                          (26, 8), (27, 10), (28, 5), (29, 2)) for _ in range(count)]
GPU_MEASURED = [128, 16, 256, 32, "bfloat16", _SHORT_PREFILLS, {"dtype": "fp8_e4m3fn"}]


def test_a_large_check_reserves_what_the_gpu_s_allocator_keeps_beside_a_chunked_oracle():
    """On an H200 this case's oracle alone allocated at most 10,652 MiB, and PyTorch's caching allocator
    reserved 13,560 (blocks one chunk's steps freed that the next chunk's tensors do not fit); the whole
    check held 14,476 where it had been given 13,652.  A large check counts a share of the chunk for
    that; a case whose oracle runs in one chunk adds nothing."""
    case = case_of(GPU_MEASURED)
    assert chunk_sequences(case) < len(case.sequences) == 164
    footprint = large_check_footprint(case, copies_caches=True)
    reuse = footprint.parts["allocator reuse"]
    assert reuse == oracle_footprint(case)[1] > 0
    # what the governor gives a check on a GPU: the estimate, and the caching allocator's slack beside it
    assert GpuMemory.footprint(None, footprint - reuse) < 14_476 << 20 <= GpuMemory.footprint(None, footprint)
    one_chunk = case_of(SPECS["prefill of many short sequences, row-bound"])
    assert chunk_sequences(one_chunk) >= len(one_chunk.sequences) and oracle_footprint(one_chunk)[1] == 0
    assert "allocator reuse" not in large_check_footprint(one_chunk).parts
