"""Time the float64 oracle on a decode batch: python ci/oracle_timing.py [--seqs N --context L ...]."""
import argparse
import time

import torch

from nanfuzz.reference.case import Case, Geometry, Sequence
from nanfuzz.reference.materialize import materialize
from nanfuzz.reference.oracle import oracle


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    per_seq = -(-a.context // a.block_size)
    seqs = tuple(Sequence(1, a.context, tuple(range(1 + s * per_seq, 1 + (s + 1) * per_seq))) for s in range(a.seqs))
    case = Case(Geometry(a.q_heads, a.kv_heads, a.head_size, a.block_size, 1 + a.seqs * per_seq, "bfloat16"), seqs)
    batch = materialize(case, a.device)
    times = []
    for _ in range(a.repeats + 1):
        if a.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        oracle(batch)
        if a.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    times = sorted(times[1:])
    print(f"oracle {a.device}: {a.seqs} decode seqs x {a.context} keys, Hq {a.q_heads}/Hkv {a.kv_heads}, head {a.head_size}: "
          f"median {times[len(times) // 2] * 1e3:.2f} ms over {a.repeats} runs (first run excluded)")


if __name__ == "__main__":
    main()
