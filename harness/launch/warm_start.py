"""First-use costs that a fresh process would otherwise pay inside its first check.

- Triton hashes its own installation once per process, before its first
  compile (``triton_key``: about 0.4 s on a GPU host).  The fork server
  imports this module, which does that once (``hash_triton``): every worker
  and compile-farm process forked from it inherits the hash.
- A worker's first float64 attention pays for torch's lazily loaded device
  code and cuBLAS's set-up (about 0.3 s).  ``warm_oracle`` runs the oracle
  on a tiny case of its own in a thread, while the worker's first check is
  still launching the kernel.

Both only move work earlier; a failure in either is left for the first
check to meet (and report), where it would have happened anyway.
"""
from __future__ import annotations

import os
import threading


def hash_triton() -> None:
    """Compute Triton's installation hash in this process (a no-op under the interpreter, which
    never compiles, and with a Triton that has no such function)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    try:
        from triton.runtime.cache import triton_key

        triton_key()
    except Exception:
        pass


def warm_oracle(kernel, device) -> threading.Thread:
    """Start a thread running the oracle, in float64 and in ``kernel``'s own precision, on a tiny case."""
    thread = threading.Thread(target=_attend_once, args=(kernel, device), daemon=True, name="nanfuzz-warm-oracle")
    thread.start()
    return thread


def _attend_once(kernel, device) -> None:
    try:
        attend_tiny_case(kernel, device)
    except Exception:
        pass


def attend_tiny_case(kernel, device):
    """What a check does around the launch, on a decode and a prefill sequence: move a case to
    ``device``, attend in float64 and in the kernel's precision, measure the rows' errors."""
    from nanfuzz.harness.judge.tolerance import effective_precision, row_errors
    from nanfuzz.reference.batch import PagedBatch
    from nanfuzz.reference.case import Case, Geometry, Sequence
    from nanfuzz.reference.materialize import build_on_host
    from nanfuzz.reference.oracle import attend_and_measure
    from nanfuzz.reference.precision import FLOAT64, same_precision
    from nanfuzz.reference.redzones import Allocation

    caps = kernel.capabilities
    dtype = caps.dtypes[0]
    precision = effective_precision(caps.precision, interpreter=False)
    case = Case(Geometry(2, 1, 16, 16, 4, dtype), (Sequence(1, 20, (1, 2)), Sequence(3, 5, (3, 0)))).validate()
    host = build_on_host(case)
    # Tensor by tensor, not ``in_one_buffer``: that stages every copy in the process's one
    # pinned buffer, which the check running beside this thread is filling.
    batch = PagedBatch.from_allocations(case, {name: Allocation(a.base.to(device), a.index)
                                               for name, a in host.allocations.items()})
    (reference, yardstick), summands = attend_and_measure(batch, (FLOAT64, same_precision(dtype, precision)))
    return row_errors(reference, reference, yardstick, summands, dtype, precision)


hash_triton()  # on import: the fork server imports this module before it forks anything
