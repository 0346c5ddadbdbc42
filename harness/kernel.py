"""The kernel contract: what an adapter hands nanfuzz.

A kernel is a callable ``run(batch, out)`` plus its capabilities.  ``batch``
is the canonical :class:`~nanfuzz.reference.batch.PagedBatch`; ``out`` is a
``[num_tokens, num_q_heads, v_head_size]`` buffer (V's head size) pre-filled with NaN that the
callable writes into (or it returns a tensor of that shape).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from nanfuzz.harness.device import DeviceProperties
from nanfuzz.reference.batch import PagedBatch
from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.case import Case
from nanfuzz.reference.errors import NanfuzzError

RunFn = Callable[[PagedBatch, torch.Tensor], "torch.Tensor | None"]
# Work a launch needs that a timing must leave out (an adapter's cache-layout
# conversion): returns the launch itself, ready to be called repeatedly.
PrepareFn = Callable[[PagedBatch, torch.Tensor], Callable[[], object]]
# An adapter's escape hatch for a constraint Capabilities cannot say: None when the kernel takes
# the case, else why not (one line).  Declined cases are drawn again, counted and reported.
SupportsFn = Callable[[Case], "str | None"]
# Whether a launch of a case copies its caches (an adapter's layout conversion): a bool for every
# case, or a function of the case.
CopiesFn = Callable[[Case], bool]


@dataclass(frozen=True)
class Kernel:
    name: str                      # family@variant, vllm:..., or a user's own display name
    run: RunFn
    capabilities: Capabilities
    expect: str = "pass"           # built-ins: "pass" (fixed) or "caught" (old, buggy)
    # The size tier its campaigns draw unless told otherwise ("small", "production", "mixed");
    # None: the device's default (mixed on a GPU, small under the interpreter).
    size: str | None = None
    prepare: PrepareFn | None = None  # None: a launch is ``run(batch, out)`` (see harness.perf)
    # What resolve() was given (a user kernel's import path, package.module:attr),
    # so another process, a repro and its replay command can resolve it again.
    spec: str = ""
    # The source tree its code was loaded from (vllm:* kernels' --vllm-src), so that
    # another process loads the same code; None: the installed package.
    source: str | None = None
    supports: SupportsFn | None = None
    # What the adapter leaves out or stands in for (a library module that did not import here),
    # one line each: ``nanfuzz list`` shows them beside the capabilities.
    notes: tuple[str, ...] = ()
    # The GPU a run under Triton's interpreter stands in for: what ``nanfuzz.device_properties()``
    # answers while nanfuzz launches this kernel on the CPU.  None: an MI355X (``harness.device``).
    stands_in_for: DeviceProperties | None = None
    # Whether a launch copies the caches into another layout first: a production check reserves
    # device memory for that copy beside the caches.  True unless the adapter knows it reads them
    # in place (a function of the case where that depends on the case's cache format).
    copies_caches: bool | CopiesFn = True

    def __post_init__(self):
        if self.stands_in_for is not None and not isinstance(self.stands_in_for, DeviceProperties):
            raise NanfuzzError(f"Kernel {self.name!r}: stands_in_for={self.stands_in_for!r} is not a "
                               "nanfuzz.DeviceProperties (e.g. nanfuzz.MI355X, nanfuzz.H200)")

    def declines(self, case: Case) -> str | None:
        """Why the adapter's ``supports`` turns ``case`` down, or None when it takes it."""
        if self.supports is None:
            return None
        try:
            reason = self.supports(case)
        except Exception as exc:  # the adapter's own bug: a configuration error, not a finding
            raise NanfuzzError(f"kernel {self.name}: its supports() raised {type(exc).__name__}: {exc}".splitlines()[0]
                               ) from None
        if reason is not None and not (isinstance(reason, str) and reason.strip()):
            raise NanfuzzError(f"kernel {self.name}: supports() returned {reason!r}; return None to take a case, "
                               "or a one-line reason to decline it")
        return reason.strip().splitlines()[0] if reason else None

    def copies_caches_of(self, case: Case) -> bool:
        """Whether a launch of ``case`` copies its caches (``copies_caches``)."""
        copies = self.copies_caches
        return bool(copies(case) if callable(copies) else copies)

    @property
    def resolvable(self) -> str:
        return self.spec or self.name

    def __call__(self, batch: PagedBatch, out: torch.Tensor) -> torch.Tensor:
        result = self.run(batch, out)
        return out if result is None else result
