"""Aiming a campaign: narrow a kernel's capabilities to one kind of case."""
from __future__ import annotations

from dataclasses import dataclass

from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.errors import NanfuzzError


@dataclass(frozen=True)
class Focus:
    decode_only: bool = False
    prefill_only: bool = False
    no_window: bool = False
    causal_only: bool = False
    non_causal_only: bool = False
    dtype: str | None = None
    poison_classes: tuple[str, ...] | None = None  # dead-slot classes to poison; None = all

    def label(self) -> str:
        parts = [name.replace("_", "-") for name in ("decode_only", "prefill_only", "no_window",
                                                     "causal_only", "non_causal_only") if getattr(self, name)]
        if self.dtype:
            parts.append(self.dtype)
        if self.poison_classes:
            parts.append("poison=" + "+".join(self.poison_classes))
        return ",".join(parts)

    def apply(self, caps: Capabilities, kernel_name: str) -> Capabilities:
        changes: dict = {}
        if self.decode_only and self.prefill_only:
            raise NanfuzzError("--decode-only and --prefill-only exclude each other; pick one")
        if self.causal_only and self.non_causal_only:
            raise NanfuzzError("--causal-only and --non-causal-only exclude each other; pick one")
        if self.decode_only:
            if caps.min_query_len > 1:
                raise NanfuzzError(f"--decode-only: kernel {kernel_name} is prefill-only")
            changes["max_query_len"] = 1
        if self.prefill_only:
            if caps.decode_only:
                raise NanfuzzError(f"--prefill-only: kernel {kernel_name} is decode-only")
            changes["min_query_len"] = 2
        if self.no_window:
            changes["sliding_window"] = False
        if self.causal_only:
            if not caps.causal:
                raise NanfuzzError(f"--causal-only: kernel {kernel_name} has no causal mode")
            changes["non_causal"] = False
        if self.non_causal_only:
            if not caps.non_causal:
                raise NanfuzzError(f"--non-causal-only: kernel {kernel_name} has no non-causal mode")
            changes["causal"] = False
        if self.dtype:
            if self.dtype not in caps.dtypes:
                raise NanfuzzError(f"--dtype {self.dtype}: kernel {kernel_name} supports {', '.join(caps.dtypes)}")
            changes["dtypes"] = (self.dtype,)
        return caps.restrict(**changes)
