"""Which workers the gate starts: one per visible GPU, or N on the CPU.

A GPU worker is pinned through its environment (``HIP_VISIBLE_DEVICES``
and ``CUDA_VISIBLE_DEVICES`` set to one id), so inside the worker that GPU
is device 0 and nothing else is visible.  The ids come from the gate's own
visibility variables when they are set (a runner that hands the job GPUs 4-7
says ``HIP_VISIBLE_DEVICES=4,5,6,7``), else 0..count-1.  ``ROCR_VISIBLE_DEVICES``
is inherited untouched: HIP's ids are relative to it.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field

from nanfuzz.harness.launch.backend import usable_cores
from nanfuzz.reference.errors import NanfuzzError

MAX_CPU_WORKERS = 8


@dataclass(frozen=True)
class Slot:
    """One worker's place: a name for reports and the environment that pins it."""

    name: str                      # gpu0, gpu1, ... or cpu0, cpu1, ...
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Workers:
    device: str                    # "cuda" (ROCm answers as cuda too) or "cpu"
    slots: tuple[Slot, ...]
    description: str               # for the log and the summary


def default_cpu_workers() -> int:
    return max(1, min(usable_cores(), MAX_CPU_WORKERS))


def cpu_workers(count: int | None) -> Workers:
    count = count or default_cpu_workers()
    slots = tuple(Slot(f"cpu{i}") for i in range(count))
    return Workers("cpu", slots, f"{count} CPU worker(s), Triton interpreter")


def visible_ids(env: dict[str, str], count: int, rocm: bool) -> list[str]:
    """The ids a worker may name in its visibility variables, one per usable GPU."""
    names = ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES") if rocm else ("CUDA_VISIBLE_DEVICES",)
    for name in names:
        value = env.get(name)
        if value is not None and value.strip():
            ids = [part.strip() for part in value.split(",") if part.strip()]
            return ids[:count]
    return [str(i) for i in range(count)]


def gpu_workers(ids: list[str], limit: int | None, platform: str, per_gpu: int = 1) -> Workers:
    """``per_gpu`` workers pinned to each GPU: a campaign is mostly Python while
    its GPU idles, so several per GPU multiply the examples per second."""
    if limit is not None:
        ids = ids[:limit]
    # NANFUZZ_CAMPAIGNS_PER_DEVICE: campaigns sharing a GPU leave the huge caches (8+ GiB each) alone
    slots = tuple(Slot(f"gpu{i}" if per_gpu == 1 else f"gpu{i}-{j}",
                       {"HIP_VISIBLE_DEVICES": gid, "CUDA_VISIBLE_DEVICES": gid,
                        "NANFUZZ_CAMPAIGNS_PER_DEVICE": str(per_gpu)})
                  for i, gid in enumerate(ids) for j in range(per_gpu))
    each = "" if per_gpu == 1 else f", {per_gpu} per GPU"
    return Workers("cuda", slots, f"{len(slots)} GPU worker(s) ({platform}; GPU ids {', '.join(ids)}{each})")


def smi_gpu_count() -> tuple[int, str]:
    """GPUs the vendor tools list, whatever torch thinks: (count, tool)."""
    probes = (("rocm-smi", ["rocm-smi", "--showid"], r"^GPU\[\d+\]"),
              ("amd-smi", ["amd-smi", "list"], r"^GPU:\s*\d+"),
              ("nvidia-smi", ["nvidia-smi", "-L"], r"^GPU \d+:"))
    for tool, argv, pattern in probes:
        if shutil.which(argv[0]) is None:
            continue
        try:
            text = subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        ids = {line.split(":")[0].strip() for line in text.splitlines() if re.match(pattern, line.strip())}
        if ids:
            return len(ids), tool
    return 0, ""


def detect(device: str, workers: int | None, env: dict[str, str] | None = None, per_gpu: int = 1) -> Workers:
    """Workers for ``device`` ("auto", "cuda" or "cpu"); ``workers`` caps or sets their number
    (GPU: the number of GPUs used, each running ``per_gpu`` workers)."""
    env = dict(os.environ if env is None else env)
    if workers is not None and workers < 1:
        raise NanfuzzError(f"--workers={workers} must be >= 1")
    if per_gpu < 1:
        raise NanfuzzError(f"--workers-per-gpu={per_gpu} must be >= 1")
    if device == "cpu" or (device == "auto" and env.get("TRITON_INTERPRET") == "1"):
        return cpu_workers(workers)
    if env.get("TRITON_INTERPRET") == "1":
        raise NanfuzzError("--device cuda conflicts with TRITON_INTERPRET=1; unset it or use --device cpu")
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        listed, tool = smi_gpu_count()
        if listed:
            raise NanfuzzError(
                f"{tool} lists {listed} GPU(s) but torch {torch.__version__} sees none; install the ROCm (or CUDA) "
                "build of torch, check the container's --device flags, or pass --device cpu to use the interpreter")
        if device == "cuda":
            raise NanfuzzError("--device cuda: no GPU is visible to torch (torch.cuda.is_available() is False); "
                               "use --device cpu to run under Triton's interpreter")
        return cpu_workers(workers)
    rocm = bool(getattr(torch.version, "hip", None))
    platform = f"ROCm {torch.version.hip}" if rocm else f"CUDA {torch.version.cuda}"
    # No device query beyond the count here: the gate's own process stays off the GPUs.
    return gpu_workers(visible_ids(env, count, rocm), workers, platform, per_gpu)
