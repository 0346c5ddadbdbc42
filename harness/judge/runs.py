"""Launching a kernel on a batch, and waiting for the device only where a verdict needs it.

On a GPU the host waits for the device twice per case, not once per launch
(see ``harness.judge.check``).  For the supervisor's watchdog a launch lasts
until the wait for it has returned, so a kernel that never ends is a HANG of
its launch wherever the host first waits for it; a device fault that
surfaces in the wait is a CRASH of the runs waited for.  A kernel is expected
to order its work on the current stream, as PyTorch's own operators do; each
wait also waits for every other stream.
"""
from __future__ import annotations

import functools
import hashlib

import torch

from nanfuzz.harness.adapters.interpreter_builtins import interpretable_launches
from nanfuzz.harness.device import standing_in_for
from nanfuzz.harness.judge.memory import Footprint, HarnessOutOfMemory, out_of_memory
from nanfuzz.harness.judge.outcome import Outcome, crash
from nanfuzz.harness.kernel import Kernel
from nanfuzz.reference.case import Case
from nanfuzz.reference.redzones import OUT_GUARD_ROWS

GUARD_ROWS = OUT_GUARD_ROWS  # canary rows after the last token's output row
# A check holds the batch, its pristine copy and two more copies for the later runs.
_COPIES_HELD = 5


def no_events(event: str) -> None:
    pass


def sync(device: torch.device) -> None:
    """Wait for the device: asleep on a blocking event, not spinning (a GPU's default wait spins
    a core, and a ``--jobs`` run has more processes waiting than the host has cores), then for
    every stream (a kernel may launch on its own)."""
    if device.type == "cuda":
        stream = torch.cuda.current_stream(device)
        event = _blocking_event(stream.device_index)
        event.record(stream)
        event.synchronize()
        torch.cuda.synchronize(device)


@functools.cache
def _blocking_event(device_index: int) -> torch.cuda.Event:
    """One event per device, recorded again for each wait."""
    return torch.cuda.Event(blocking=True)


def launch(kernel: Kernel, batch, device, events=no_events, *, wait: bool = True
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch on ``batch``: (what the kernel returned, the output rows, the output buffer with its
    guard rows).  ``wait=False``, on a GPU: return without waiting for the device, the launch
    still open for the watchdog until ``await_runs`` has waited for it, so whatever waits for the
    device in between (the oracle may) is timed as the launch."""
    case = batch.case
    g = case.geometry
    try:
        buffer = torch.full((case.num_tokens + GUARD_ROWS, g.num_q_heads, g.v_head_size), float("nan"),
                            dtype=batch.q.dtype, device=device)
    except BaseException as exc:
        if out_of_memory(exc):  # nanfuzz's allocation, before the launch: never the kernel's verdict
            raise HarnessOutOfMemory(f"{type(exc).__name__}: {exc}".splitlines()[0]) from exc
        raise
    out = buffer[: case.num_tokens]
    events("launch")
    with standing_in_for(kernel.stands_in_for), interpretable_launches(device.type == "cpu"):
        try:
            result = kernel(batch.for_kernel(), out)  # what the adapter rebinds on its batch is never judged
        except BaseException as exc:
            # A launch before the one that raised may have faulted the device (a binary put off while
            # it compiled elsewhere raises after the case's first kernel ran): nothing would wait for
            # that launch, and its fault would surface in the next case.  The fault is what to report.
            fault = None if isinstance(exc, KeyboardInterrupt) else pending_fault(device)
            if fault is not None:
                raise fault from exc
            raise
    if wait or device.type != "cuda":
        sync(device)
        events("returned")
    return result, out, buffer


def pending_fault(device: torch.device) -> BaseException | None:
    """The device fault a launch left to surface at the next wait (None: none, or not a GPU)."""
    if device.type != "cuda":
        return None
    try:
        sync(device)
    except Exception as exc:
        return exc
    return None


def await_runs(device, events, when: str) -> Outcome | None:
    """Wait for the runs launched without waiting (and the work queued behind them), then close
    their launch for the watchdog: None, or the CRASH of a device fault they raised."""
    if device.type != "cuda":
        return None
    try:
        sync(device)
    except KeyboardInterrupt:  # a Ctrl-C or a stop signal met while waiting (``--no-isolation``): no verdict
        raise
    except BaseException as exc:  # an asynchronous fault of the kernel surfaces here
        return crash(exc, when)
    events("returned")
    return None


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()


def case_bytes(case: Case) -> int:
    """About what one copy of a case's tensors (redzones included) takes."""
    return cache_bytes(case) + token_bytes(case)


def token_bytes(case: Case) -> int:
    """About what one copy of a case's tokens (its queries, new keys and values, redzones included) takes."""
    g = case.geometry
    tokens = (case.num_tokens + 2) * (g.num_q_heads * g.head_size + g.num_kv_heads * (g.head_size + g.v_head_size))
    return tokens * element_size(case)


def cache_bytes(case: Case) -> int:
    """About what one copy of a case's KV caches (redzones included) takes."""
    from nanfuzz.reference.redzones import CACHE_BLOCKS_AFTER, CACHE_BLOCKS_BEFORE

    g = case.geometry
    caches = (g.num_blocks + CACHE_BLOCKS_BEFORE + CACHE_BLOCKS_AFTER) * g.block_size * g.num_kv_heads * g.slot_width
    return caches * element_size(case)


def element_size(case: Case) -> int:
    """Bytes of one element of the case's dtype."""
    from nanfuzz.reference.materialize import TORCH_DTYPES

    return torch.empty((), dtype=TORCH_DTYPES[case.geometry.dtype]).element_size()


def check_footprint(case: Case) -> Footprint:
    """About what this process holds at the peak of a check of a host-built ``case``: the batch,
    its pristine copy and two more for the later runs, the oracle's working set while it judges
    (``oracle_parts``), beside what the pool of large cases keeps."""
    from nanfuzz.harness.judge.pool import process_pool

    return Footprint(case_copies=_COPIES_HELD * case_bytes(case), **oracle_parts(case),
                     kept_large_caches=process_pool().held_bytes())


def oracle_parts(case: Case) -> dict[str, int]:
    """A check's footprint parts for its oracle: the oracle's working set, and where it works in chunks
    what a device's caching allocator keeps beside it (``reference.oracle.oracle_footprint``)."""
    from nanfuzz.reference.oracle import oracle_footprint

    oracle, reuse = oracle_footprint(case)
    return {"oracle": oracle, **({"allocator_reuse": reuse} if reuse else {})}
