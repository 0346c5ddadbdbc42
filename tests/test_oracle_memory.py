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
from nanfuzz.reference.oracle import _CHUNK_ELEMENTS, _ROWS_PER_GATHER, chunk_sequences, oracle_bytes
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
