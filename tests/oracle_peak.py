"""Run as ``python -m tests.oracle_peak SPEC``: the resident bytes the oracle's judging pass (float64 and
the same-precision reference, measured) adds at its peak, on the CPU, for the case SPEC describes (JSON:
``[q_heads, kv_heads, head_size, block_size, dtype, [[query_len, seq_len], ...], kv_cache fields]``, and
a sliding window after them where the case has one).
Run with ``MALLOC_MMAP_THRESHOLD_`` low, so that every freed tensor leaves the resident set."""
from __future__ import annotations

import json
import sys
from dataclasses import replace

import torch

from nanfuzz.reference.case import KVCache, Poison
from nanfuzz.reference.materialize import materialize
from nanfuzz.reference.oracle import attend_and_measure
from nanfuzz.reference.precision import FLOAT64, same_precision
from tests.cases import consecutive_case


def case_of(spec: list):
    q_heads, kv_heads, head_size, block_size, dtype, seqs, cache, *window = spec
    kv = KVCache(**cache)
    poison = Poison("max" if kv.quantized and kv.dtype.startswith("uint") else "nan", "v", None)
    case = consecutive_case([tuple(s) for s in seqs], q_heads=q_heads, kv_heads=kv_heads, head_size=head_size,
                            block_size=block_size, dtype=dtype, poison=poison, window=window[0] if window else 0)
    return replace(case, kv_cache=kv).validate()


def _resident(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field))


def main() -> None:
    torch.set_num_threads(1)
    case = case_of(json.loads(sys.argv[1]))
    batch = materialize(case, "cpu")
    arithmetic = same_precision(case.geometry.dtype, "ieee")
    with open("/proc/self/clear_refs", "w") as refs:  # the peak from here on
        refs.write("5")
    before = _resident("VmRSS:")
    attend_and_measure(batch, (FLOAT64, arithmetic))
    print(_resident("VmHWM:") - before)


if __name__ == "__main__":
    main()
