"""Aiming a campaign: narrow a kernel's capabilities to one kind of case."""
from __future__ import annotations

from dataclasses import dataclass

from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.errors import NanfuzzError

# Dead-slot classes only a windowed case has: poisoning them alone aims the campaign at windows.
WINDOW_CLASSES = frozenset({"out-of-window"})


@dataclass(frozen=True)
class Focus:
    decode_only: bool = False
    prefill_only: bool = False
    no_window: bool = False
    window_only: bool = False          # every case has a sliding window (implied by poisoning out-of-window alone)
    causal_only: bool = False
    non_causal_only: bool = False
    dtype: str | None = None
    poison_classes: tuple[str, ...] | None = None  # dead-slot classes to poison; None = all
    kv_cache_dtype: str | None = None  # one cache dtype ("auto": unquantized); None = every one the kernel takes
    kv_scales: str | None = None       # "tensor" or "token-head" scales only; None = both

    @property
    def windows_only(self) -> bool:
        """Are only windowed cases wanted: ``window_only``, or poison aimed at out-of-window slots alone?"""
        return self.window_only or bool(self.poison_classes) and set(self.poison_classes) <= WINDOW_CLASSES

    def label(self) -> str:
        parts = [name.replace("_", "-") for name in ("decode_only", "prefill_only", "no_window", "window_only",
                                                     "causal_only", "non_causal_only") if getattr(self, name)]
        if self.dtype:
            parts.append(self.dtype)
        if self.poison_classes:
            parts.append("poison=" + "+".join(self.poison_classes))
        if self.kv_cache_dtype:
            parts.append("kv=" + self.kv_cache_dtype)
        if self.kv_scales:
            parts.append("kv-scales=" + self.kv_scales)
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
        if self.no_window and self.windows_only:
            raise NanfuzzError(f"--no-window and {self._window_flag()} exclude each other; pick one")
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
        if self.windows_only:
            windowed = caps.restrict(**changes)
            if not any(windowed.windowed(causal) for causal in windowed.modes()):
                raise NanfuzzError(f"{self._window_flag()}: kernel {kernel_name} takes no sliding window"
                                   + (" in the modes asked for" if caps.sliding_window else ""))
            changes["window_only"] = True
        if self.dtype:
            if self.dtype not in caps.dtypes:
                raise NanfuzzError(f"--dtype {self.dtype}: kernel {kernel_name} supports {', '.join(caps.dtypes)}")
            changes["dtypes"] = (self.dtype,)
        if self.kv_cache_dtype or self.kv_scales:
            changes.update(self._kv_caches(caps, kernel_name))
        return caps.restrict(**changes)

    def _window_flag(self) -> str:
        return "--window-only" if self.window_only else "--poison out-of-window (which draws only windowed cases)"

    def _kv_caches(self, caps: Capabilities, kernel_name: str) -> dict:
        per_tensor, token_head, formats = caps.kv_cache_dtypes, caps.token_head_dtypes, caps.cache_formats
        if self.kv_cache_dtype:
            per_tensor = tuple(d for d in per_tensor if d == self.kv_cache_dtype)
            token_head = tuple(d for d in token_head if d == self.kv_cache_dtype)
            formats = tuple(kv for kv in formats if self.kv_cache_dtype in (kv.side("k").dtype, kv.side("v").dtype))
        if self.kv_scales == "tensor":
            token_head = ()
            formats = tuple(kv for kv in formats if not kv.sides_with("scales"))
        elif self.kv_scales == "token-head":
            per_tensor = ()
            formats = tuple(kv for kv in formats if kv.sides_with("scales"))
        if not per_tensor and not token_head and not formats:
            flags = " ".join(f"--{flag} {value}" for flag, value in (("kv-cache-dtype", self.kv_cache_dtype),
                                                                      ("kv-scales", self.kv_scales)) if value)
            raise NanfuzzError(f"{flags}: kernel {kernel_name} takes {caps.describe_kv_cache()}")
        return {"kv_cache_dtypes": per_tensor, "token_head_dtypes": token_head, "cache_formats": formats}
