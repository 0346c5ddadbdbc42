"""What the memory governor asks of a device: its size, what it reports free, what this process
holds between cases and how to give that back; a GPU, the host, or a simulated GPU for tests."""
from __future__ import annotations

import os
from dataclasses import dataclass

GiB = 1 << 30
# Left free beside a reservation on a real device: a CUDA or HIP context that opens after the
# look (a fresh worker, a farm process) takes about half a GiB, and the caching allocator rounds
# every block up (2 MiB pages for large ones) and fragments.
DEVICE_MARGIN = 1 * GiB
# What a process's own GPU context holds beside its allocations, which no allocator counts: CUDA's
# context, its modules and cuBLAS's workspaces, about half a GiB each on an H200 with torch 2.11.
# Counted in every process's entry once it has opened the device, so that many processes on one
# device (a campaign's worker and compile farm, several campaigns) cannot open more contexts than
# the device holds beside the cases they reserved: eleven campaigns of sixteen farm processes each
# ran one H200 out of memory while their ledger entries summed to a fraction of it.
CONTEXT_BYTES = 1 * GiB
# What PyTorch's caching allocator reserves beyond what a check allocates at its peak: blocks of 1
# to 10 MiB come from 20 MiB segments, larger ones are rounded to 2 MiB, and the oracle's chunks of
# varying sizes leave cached blocks that later ones cannot reuse.  Measured on an H200 (torch
# 2.11), production-tier checks of the built-ins reserved up to 82 MiB beyond a 116 MiB estimate
# (a small prefill) and 62 MiB beyond a 3.9 GiB one; on an H100, vLLM TRITON_ATTN's prefill of
# 8,192 tokens in 128 heads reserved 37.0 GiB, 9 GiB beyond what it allocated and 1.0 GiB (3%)
# beyond a 35.9 GiB estimate.
ALLOCATOR_SLACK = 128 << 20
ALLOCATOR_SLACK_SHARE = 1 / 8


def amount(size: float) -> str:
    """A number of bytes for a message: GiB to a tenth, or MiB below one GiB (never "0.0 GiB")."""
    size = max(0.0, size)
    return f"{size / GiB:.1f} GiB" if size >= GiB else f"{size / 2**20:.0f} MiB"


class Footprint(int):
    """Bytes a check holds at its peak, and what they are made of: a case declined for memory says
    which part made it too large."""

    parts: dict[str, int]

    def __new__(cls, **parts: int) -> "Footprint":
        made = super().__new__(cls, sum(parts.values()))
        made.parts = {name.replace("_", " "): int(size) for name, size in parts.items()}
        return made

    def __getnewargs_ex__(self):  # a copy or a pickle keeps the parts
        return (), dict(self.parts)

    def described(self) -> str:
        return ", ".join(f"{name} {amount(size)}" for name, size in self.parts.items())


def out_of_memory(exc: BaseException) -> bool:
    """Did ``exc`` come from an allocation that failed (device memory, or the host's)?"""
    if isinstance(exc, MemoryError):
        return True
    try:
        import torch

        if isinstance(exc, torch.OutOfMemoryError):
            return True
    except (ImportError, AttributeError):
        pass
    # the host allocator's failure is a plain RuntimeError, and so is a device's where the runtime, not
    # the caching allocator, fails ("CUDA error: out of memory" as torch.AcceleratorError: a context,
    # a library's workspace, a kernel's own allocation)
    message = str(exc)
    return isinstance(exc, RuntimeError) and ("DefaultCPUAllocator: can't allocate memory" in message
                                              or "error: out of memory" in message.lower())


@dataclass(frozen=True)
class SimulatedDevice:
    """A device of ``total_bytes`` whose every case needs ``case_bytes`` and whose processes hold
    ``held_bytes`` between cases until they give them back; the device reports no free memory of
    its own, so the ledger alone decides."""

    total_bytes: int
    case_bytes: int
    held_bytes: int = 0
    kept_bytes: int = 0      # what each process holds while it lives (a context), never given back


class DeviceMemory:
    """What the governor asks of a device."""

    key = ""
    where = ""

    def total(self) -> int:
        raise NotImplementedError

    def free(self) -> int | None:
        """What the device reports free now; None: only the ledger counts."""
        raise NotImplementedError

    def held(self) -> int:
        """What this process holds on the device between cases."""
        raise NotImplementedError

    def give_back(self) -> None:
        """Free what this process holds between cases (the pool's caches, the allocator's cache)."""
        from nanfuzz.harness.judge.pool import process_pool

        process_pool().drop()

    def footprint(self, estimate: int) -> int:
        """What a case whose check nanfuzz estimates at ``estimate`` bytes takes here."""
        return estimate

    def margin(self) -> int:
        return DEVICE_MARGIN

    def kept(self, held: int) -> int:
        """Of ``held`` (what this process holds), what it cannot give back while it lives."""
        return 0

    def case_done(self) -> None:
        """A case is over (what a process holds is measured, here: nothing to do)."""


class GpuMemory(DeviceMemory):
    def __init__(self, index: int):
        import torch

        self.index = index
        properties = torch.cuda.get_device_properties(index)  # asks the driver: opens no context
        self.key = "gpu-" + device_key(properties, index)
        self.size = properties.total_memory
        self.where = "GPU"
        self.opened = False   # has this process opened its context on the device (a look at free memory does)

    def total(self) -> int:
        return self.size

    def free(self) -> int:
        """What the device reports free; 0 where even this process's context cannot open (the
        device is full: the look itself needs a context)."""
        import torch

        try:
            free = torch.cuda.mem_get_info(self.index)[0]
        except RuntimeError as exc:
            if not out_of_memory(exc):
                raise
            return 0
        self.opened = True
        return free

    def footprint(self, estimate: int) -> int:
        return estimate + int(estimate * ALLOCATOR_SLACK_SHARE) + ALLOCATOR_SLACK

    def held(self) -> int:
        import torch

        # memory_reserved flattens every statistic of the allocator first (a third of a millisecond)
        reserved = torch.cuda.memory_stats_as_nested_dict(self.index).get("reserved_bytes", {}).get("all", {}).get(
            "current", 0)
        return reserved + (CONTEXT_BYTES if self.opened or reserved else 0)

    def kept(self, held: int) -> int:
        return min(held, CONTEXT_BYTES)  # its context, where it has opened one

    def give_back(self) -> None:
        import torch

        super().give_back()
        with torch.cuda.device(self.index):
            torch.cuda.empty_cache()


class HostMemory(DeviceMemory):
    key, where = "host", "host"

    def total(self) -> int:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

    def free(self) -> int:
        try:  # MemAvailable counts the page cache the kernel would give up; SC_AVPHYS_PAGES does not
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

    def held(self) -> int:
        from nanfuzz.harness.judge.pool import process_pool

        return process_pool().held_bytes()

    def margin(self) -> int:
        return 0  # the host's own report of what it can give is the bound, as it always was


class SimulatedMemory(DeviceMemory):
    def __init__(self, simulated: SimulatedDevice):
        self.simulated = simulated
        self.key, self.where = "simulated", "simulated device"
        self._holding = 0

    def total(self) -> int:
        return self.simulated.total_bytes

    def free(self) -> None:
        return None

    def held(self) -> int:
        return self._holding + self.simulated.kept_bytes

    def kept(self, held: int) -> int:
        return self.simulated.kept_bytes

    def give_back(self) -> None:
        self._holding = 0

    def footprint(self, estimate: int) -> int:
        return self.simulated.case_bytes

    def margin(self) -> int:
        return 0

    def case_done(self) -> None:
        self._holding = self.simulated.held_bytes  # what a real process's pool would keep


def device_key(properties, index: int) -> str:
    """A device's name in the ledger folder: its UUID, the same under any index and any
    ``CUDA_VISIBLE_DEVICES``; where a driver reports none, its name, size and index."""
    uuid = "".join(c for c in str(getattr(properties, "uuid", "") or "") if c.isalnum() or c == "-")
    if uuid.strip("0-"):  # some drivers report all zeros
        return uuid
    name = "".join(c if c.isalnum() else "_" for c in str(getattr(properties, "name", "device")))
    return f"{name}-{getattr(properties, 'total_memory', 0)}-{index}"
