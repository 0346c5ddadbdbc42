"""The subject a campaign checks its cases on: a supervised worker, or the kernel in this process.

A worker rebuilds the kernel from its import path (``WorkerSpec``); a Kernel
made on the fly in the caller's code has none, and runs in this process
instead (``InProcess``), as it does with ``isolation=False``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from nanfuzz.harness.kernel import Kernel
from nanfuzz.harness.launch.worker import InProcess, Supervised, WorkerSpec, judged
from nanfuzz.reference.errors import NanfuzzError

if TYPE_CHECKING:  # settings travel inward as an argument; nothing here reads them at import
    from nanfuzz.harness.campaign.settings import Settings


def make_subject(kernel: Kernel, settings: Settings, prefer_fork: bool = False):
    """The kernel behind a supervised worker, or in this process with ``isolation=False``.
    ``prefer_fork``: see ``Supervised``."""
    return subject_for(kernel, settings, worker_spec(kernel, settings) if settings.isolation else None, prefer_fork)


def check_once(kernel: Kernel, settings: Settings, case, **options):
    """``case``'s outcome from a subject made for it alone (a worker process unless ``isolation``
    is off: a kernel that faults its device ends that worker's context, not the caller's), closed
    after; ``options`` go to its ``check``.  A ``Declined`` is its one-line error."""
    subject = make_subject(kernel, settings)
    try:
        return judged(subject.check(case, **options))
    finally:
        subject.close()


def subject_for(kernel: Kernel, settings: Settings, spec: WorkerSpec | None, prefer_fork: bool = False,
                device_opened=None):
    """``make_subject`` for a caller that has ``kernel``'s ``worker_spec`` already (None: in this process)."""
    if spec is None or not settings.isolation:
        return InProcess(kernel, settings.device, strict_reads=settings.strict_reads, memory=settings.memory)
    return Supervised(spec, launch_timeout=settings.timeout, prefer_fork=prefer_fork, device_opened=device_opened)


def worker_spec(kernel: Kernel, settings: Settings) -> WorkerSpec | None:
    """How another process loads ``kernel`` (None for a Kernel made on the fly, which has no import path)."""
    if not reachable_by_path(kernel):
        return None
    from nanfuzz.harness.registry import import_path, kernel_sources

    return WorkerSpec(kernel=import_path(kernel), device=settings.device, cuda_index=settings.cuda_index,
                      strict_reads=settings.strict_reads, stands_in_for=kernel.stands_in_for,
                      memory=settings.memory,
                      **kernel_sources(kernel, settings.sources))


def reachable_by_path(kernel: Kernel) -> bool:
    """Does resolving the kernel's import path in a fresh process give this kernel's code?"""
    from nanfuzz.harness.registry import import_path, kernel_sources, resolve

    try:
        again = resolve(import_path(kernel), **kernel_sources(kernel))
    except NanfuzzError:
        return False
    return again.name == kernel.name and _code(again.run) == _code(kernel.run)


def _code(run) -> tuple:
    """What a run function is, across two resolutions (each may build its own partial or closure)."""
    run = getattr(run, "func", run)  # functools.partial
    return getattr(run, "__module__", None), getattr(run, "__qualname__", None), getattr(run, "__code__", None)
