"""What a large case needs of its device: the memory a check of it takes, and the error for one
that needs more than is free (``CaseCheck`` for large cases is ``harness.judge.check.LargeCaseCheck``)."""
from __future__ import annotations

import torch

from nanfuzz.harness.judge.pool import process_pool
from nanfuzz.harness.judge.runs import case_bytes
from nanfuzz.reference.device_build import written_blocks
from nanfuzz.reference.errors import NanfuzzError


class TooLargeForDevice(NanfuzzError):
    """A case that needs more device memory than is free.  A campaign declines a drawn case
    that raises it (counted, with a note); a repro that does is the usual one-line error."""


def large_case_bytes(case) -> int:
    """About what a large case takes on its device beyond the pool's caches: its compact blocks
    (the poisoned build, the garbage build, a kernel's layout copy), the oracle's gather."""
    g = case.geometry
    blocks = int(written_blocks(case).size)
    element = 4 if g.dtype == "float32" else 2
    compact = blocks * g.block_size * g.num_kv_heads * g.slot_width * element
    gathered = 8 * sum(s.seq_len for s in case.sequences[:64]) * g.num_kv_heads * (g.head_size + g.v_head_size)
    return 3 * compact + min(gathered, 8 << 30)




def refuse_large_if_too_large(case, device: torch.device) -> None:
    """``TooLargeForDevice`` for a large case the device's free memory cannot hold, before anything is allocated."""
    import os

    caches = case_bytes(case)  # what the pool's buffers must hold
    needed = max(0, caches - process_pool().held_bytes()) + caches + large_case_bytes(case)  # + a layout copy
    if device.type == "cuda":
        free, where = torch.cuda.mem_get_info(device)[0], "GPU"
    else:
        free, where = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "host"
    if needed > free:
        raise TooLargeForDevice(f"this case needs about {needed / 2**30:.1f} GiB of {where} memory and "
                                f"{free / 2**30:.1f} GiB are free; refusing it before allocating anything")
