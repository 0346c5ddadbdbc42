"""Production targets: the situations a production campaign must reach, in each kind of batch.

Kernels break where batches get big: a GQA group past 16 (vLLM's 2D decode kernel pads the group
to 16), element offsets past 2^31 in caches of 8 GiB or more, sequences of 32k keys and more, 128
sequences and more, the largest head size the kernel takes, a window far below ``seq_len``.  A
target is one such situation (``strategies.aims``) in one kind of batch the kernel takes
(``reference.features.BATCH_KINDS``), named ``decode:seq-len>=32768`` or ``prefill:head-size=256``.

``production_targets`` says which targets a campaign declares: every situation in every batch kind
the kernel takes, each with the reason it is out of reach where the kernel's capabilities, the
campaign's size or its pool rule it out.  ``Targets.met`` says which ones a case reaches, and
``Targets.aims`` turns targets into what the production draw aims at.
"""
from __future__ import annotations

from dataclasses import dataclass

from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.features import BATCH_KINDS, FAR_WINDOW_KEYS
from nanfuzz.strategies.aims import (COMPILE_TIME, FAR_WINDOW, HUGE_OFFSETS, LARGEST_HEAD, LONG_KEYS, LONG_SEQUENCE,
                                     MANY, MANY_SEQUENCES, SITUATIONS, WIDE_GROUP, Aim)
from nanfuzz.strategies.production import (ProductionSize, entry_provides, far_window_limit, huge_capable,
                                           query_limit, widest_group)
from nanfuzz.strategies.geometry import Shape

PREFIX = "target:"


@dataclass(frozen=True)
class Targets:
    """A campaign's targets in order, each with why it is out of reach (None: it is within reach)."""

    table: tuple[tuple[str, str | None], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.table)

    def names(self) -> list[str]:
        return [name for name, _ in self.table]

    def within_reach(self) -> list[str]:
        return [name for name, why in self.table if why is None]

    def out_of_reach(self) -> dict[str, str]:
        return {name: why for name, why in self.table if why is not None}

    def met(self, features: set[str], head_size: int) -> list[str]:
        """The targets within reach that a case with these ``features`` (``reference.features``,
        its ``batch:<kind>`` among them) and head size reaches."""
        kinds = [f[len("batch:"):] for f in features if f.startswith("batch:")]
        if not kinds:
            return []
        head = f"head-size={head_size}"
        return [name for name, why in self.table if why is None and name.startswith(kinds[0] + ":")
                and (name.partition(":")[2] in features or name.partition(":")[2] == head)]

    def aims(self, names) -> tuple[Aim, ...]:
        """Aims at ``names`` (targets of this table): one per batch kind, with that kind's situations."""
        by_kind: dict[str, set[str]] = {}
        for name in names:
            by_kind.setdefault(name.partition(":")[0], set()).add(situation_of(name))
        return tuple(Aim(kind, frozenset(by_kind[kind])) for kind in BATCH_KINDS if kind in by_kind)

    def merge(self, other: "Targets") -> "Targets":
        """Both tables' targets, each within reach where either says so (another job's, another shard's)."""
        why = dict(self.table)
        for name, reason in other.table:
            if name not in why or reason is None:
                why[name] = reason
        return Targets(tuple(why.items()))


def situation_of(target: str) -> str:
    """The situation (``strategies.aims``) a target names: ``decode:head-size=256`` is the largest head size."""
    label = target.partition(":")[2]
    return LARGEST_HEAD if label.startswith("head-size=") else label


def batch_kinds(caps: Capabilities) -> tuple[str, ...]:
    """The kinds of batch a kernel takes (``reference.features.BATCH_KINDS``)."""
    decode = caps.min_query_len <= 1
    prefill = caps.max_query_len is None or caps.max_query_len > 1
    mixed = decode and prefill and not caps.uniform_query_len and (caps.max_sequences or 2) >= 2
    return tuple(kind for kind, takes in zip(BATCH_KINDS, (decode, prefill, prefill, mixed)) if takes)


def label(situation: str, caps: Capabilities) -> str:
    """How a target names ``situation``: the largest head size by its number."""
    return f"head-size={max(caps.head_sizes)}" if situation == LARGEST_HEAD else situation


def production_targets(caps: Capabilities, size: ProductionSize, pool: tuple | None = None) -> Targets:
    """Every situation in every batch kind ``caps`` takes, with why each one out of reach is
    (the capabilities, the size, or a pool without an entry that has it)."""
    own, caps = caps, size.bound(caps)
    table = []
    for kind in batch_kinds(caps):
        for situation in SITUATIONS:
            why = _out_of_reach(caps, size, kind, situation, own)
            if why is None and pool and (situation in COMPILE_TIME or situation == HUGE_OFFSETS) and not any(
                    entry_provides(entry, situation, caps, size, kind) for entry in pool):
                why = "pool: no entry of the specialisation pool can have it"
            table.append((f"{kind}:{label(situation, caps)}", why))
    return Targets(tuple(table))


def _out_of_reach(caps: Capabilities, size: ProductionSize, kind: str, situation: str,
                  own: Capabilities) -> str | None:
    """Why a case of ``kind`` can never reach ``situation`` under ``caps`` (the kernel's ``own``
    capabilities bound to ``size``) at ``size`` (None: it can)."""
    longest = size.max_seq_len if caps.max_seq_len is None else min(size.max_seq_len, caps.max_seq_len)
    most = size.max_sequences if caps.max_sequences is None else min(size.max_sequences, caps.max_sequences)
    if situation == WIDE_GROUP and widest_group(caps) <= 16:
        return _limit("at most", widest_group(caps), "query heads per KV head", widest_group(own) <= 16)
    if situation == LONG_SEQUENCE:
        if kind == "prefill" and query_limit(caps, size) < LONG_KEYS:
            return f"a prefill's keys are its new tokens, at most {query_limit(caps, size)} here"
        if longest < LONG_KEYS:
            return _limit("sequences of at most", longest, "keys", caps.max_seq_len == longest)
    if situation == MANY_SEQUENCES:
        if most < MANY:
            return _limit("at most", most, "sequences", caps.max_sequences == most)
        if kind != "decode" and MANY * max(2, caps.min_query_len) > size.max_tokens:
            return f"size: {MANY} prefills of {max(2, caps.min_query_len)} new tokens pass {size.max_tokens} tokens"
    if situation == HUGE_OFFSETS:
        if not size.huge_cache_bytes:
            return "size: no cache past 2^31 elements (only a GPU campaign alone on its device draws one)"
        if not any(huge_capable(Shape(d, kv, kv, h, b), size, caps) for d in caps.dtypes for h in caps.head_sizes
                   for b in caps.block_sizes for kv in range(1, caps.kv_head_limit(size.max_kv_heads) + 1)):
            return (f"capabilities: at most {caps.max_blocks} blocks" if caps.max_blocks is not None
                    else "size: no shape's cache passes 2^31 elements within the size's bytes")
    if situation == FAR_WINDOW:
        if not any(caps.windowed(c) for c in caps.modes()):
            return "capabilities: no sliding window"
        limit = far_window_limit(caps, size, kind)
        if limit < caps.min_window:
            keys = query_limit(caps, size) if kind == "prefill" else longest
            return f"size: a window of at least {caps.min_window} is not far below {keys} keys (an eighth of " \
                   f"a sequence of {FAR_WINDOW_KEYS} or more)"
    return None


def _limit(before: str, value: int, after: str, by_kernel: bool) -> str:
    return f"{'capabilities' if by_kernel else 'size'}: {before} {value} {after}"
