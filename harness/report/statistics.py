"""What a campaign exercised: the share of examples in each situation.

A :class:`Statistics` is fed every generated case (``add``) and tallies the
situations :func:`~nanfuzz.reference.features.case_features` names (decode,
chunked prefill, a window, a reused block, NaN in the tail...) plus the
block and head size.  Jobs each keep their own and ``merge`` them; it
pickles, and ``to_dict`` / ``from_dict`` carry it through JSON.

    stats = Statistics()
    for case in cases:
        stats.add(case)
    print(stats.table())
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from nanfuzz.harness.report import coverage
from nanfuzz.reference.case import DTYPES, KV_CACHE_DTYPES, POISON_TENSORS, POISON_VALUES, Case
from nanfuzz.reference.features import BATCH_KINDS, POISON_CLASS_NAMES, SIZE_FEATURES, case_features
from nanfuzz.strategies.targets import PREFIX as TARGET, Targets

READS_GROUP = "dead slots addressed (traced loads)"
# (title, situations always listed, prefixes of situations listed when seen)
GROUPS: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("kinds of sequence", ("decode", "prefill", "chunked-prefill", "padding-sequence", "mixed",
                           "multi-sequence", "partial-last-block"), ()),
    ("kinds of batch", tuple(f"batch:{kind}" for kind in BATCH_KINDS), ()),
    ("masks and windows", ("causal", "non-causal", "window", "window:1", "non-causal+window",
                           "straddling-window"), ()),
    ("poisoned dead slots", ("poison:tail", "poison:out-of-window", "poison:null-block", "poison:padding",
                             "poison:unreferenced", "poison:single-slot"), ("poison:scale",)),
    ("blocks", ("expired-block", "expired-to-null", "reused-block", "shared-block"), ()),
    ("heads", ("gqa", "sinks"), ("mla:", "v-head-size!=k")),
    ("sizes", SIZE_FEATURES, ()),
    ("kernel paths", (), ("path:",)),
    ("dtypes", (), ("dtype:",)),
    ("kv caches", (), ("kv:",)),
    ("block sizes", (), ("block:",)),
    ("head sizes", (), ("head:",)),
    ("poison values", (), ("poison-value:", "poison-tensors:")),
    # what each example's check saw its loads address: coverage.table sets it out beside the
    # poisoned classes, so ``table`` leaves it out
    (READS_GROUP, (), coverage.PREFIXES),
)
# The production targets a campaign declares (``strategies.targets``), those within reach each with
# its count; the campaign meets each one at least this often before it aims at it less.
TARGETS_GROUP = "production targets"
# How the note of a campaign that left declared targets unreached begins (``unreached_line``).
UNREACHED_NOTE = "production targets not reached: "

# Listed, every class, for a kernel whose adapter made index buffers (``reference.layouts``): the
# classes their entries point at are what such a layout can reach, and the others it cannot.
LAYOUT_GROUP = ("dead slots its index buffers point at",
                tuple(f"{coverage.LAYOUT}{name}" for name in ("indexed", *POISON_CLASS_NAMES)))
OTHER = "other"

_ORDER = {f"dtype:{d}": i for i, d in enumerate(DTYPES)}
_ORDER.update({f"kv:{d}{mode}": i + 10 * (mode != "") for i, d in enumerate(KV_CACHE_DTYPES)
               for mode in ("", "/token-head")})
_ORDER.update({f"poison-value:{v}": i for i, v in enumerate(POISON_VALUES)})
_ORDER.update({f"poison-tensors:{t}": 100 + i for i, t in enumerate(POISON_TENSORS)})


def features(case: Case) -> set[str]:
    """``case_features(case)`` plus ``block:<block_size>`` and ``head:<head_size>``."""
    g = case.geometry
    head = f"{g.head_size}/{g.head_size_v}" if g.diff_kv else str(g.head_size)
    return case_features(case) | {f"block:{g.block_size}", f"head:{head}"}


def _sort_key(name: str) -> tuple:
    tail = name.rpartition(":")[2]
    return (_ORDER.get(name, 1000), int(tail) if tail.isdigit() else 0, name)


def excluded_by(caps) -> frozenset[str]:
    """The always-listed situations a kernel with capabilities ``caps`` never takes: a decode-only
    kernel's statistics list no prefill, a kernel without windows no window."""
    out = set()
    if caps.max_query_len == 1:
        out |= {"prefill", "chunked-prefill", "mixed"}
    if caps.min_query_len > 1:
        out |= {"decode", "mixed"}
    if not caps.causal:
        out.add("causal")
    if not caps.non_causal:
        out |= {"non-causal", "non-causal+window"}
    if not caps.sliding_window:
        out |= {"window", "window:1", "non-causal+window", "straddling-window", "expired-block", "expired-to-null",
                "poison:out-of-window"}
    if not caps.non_causal_window:
        out.add("non-causal+window")
    if caps.min_window > 1:
        out.add("window:1")
    if not caps.sinks:
        out.add("sinks")
    if caps.max_query_len == 1:
        out |= {"batch:prefill", "batch:chunked-prefill", "batch:mixed"}
    if caps.min_query_len > 1:
        out |= {"batch:decode", "batch:mixed"}
    if caps.uniform_query_len:
        out.add("batch:mixed")
    return frozenset(out)


@dataclass
class Statistics:
    """Counts of situations over ``examples`` cases; ``seconds`` is the time ``add`` took;
    ``excluded``: situations the kernel does not take, left out of the listing (``excluded_by``).
    ``specialisations`` counts the examples whose poisoned run launched each Triton kernel
    specialisation (``judge.paths``); the kernels themselves are the situations ``path:NAME``."""

    examples: int = 0
    counts: Counter = field(default_factory=Counter)
    seconds: float = 0.0
    specialisations: Counter = field(default_factory=Counter)
    excluded: frozenset = frozenset()
    declined: Counter = field(default_factory=Counter)  # drawn cases the kernel's supports() declined, by reason
    targets: Targets = Targets()  # the production targets the campaign declares (``strategies.targets``)
    # the targets within reach that the cases its supports() declined would have reached, by target
    declined_targets: Counter = field(default_factory=Counter)

    @classmethod
    def for_capabilities(cls, caps, targets: Targets = Targets()) -> "Statistics":
        return cls(excluded=excluded_by(caps), targets=targets)

    def add(self, case: Case, paths: dict | None = None, observed: set[str] = frozenset()) -> None:
        """Tally one example: its case's situations, the Triton kernels it launched (``paths``) and
        ``observed``, what its check saw the kernel do (``harness.report.coverage``: the dead slots
        its loads addressed)."""
        start = time.perf_counter()
        found = features(case)
        self.counts.update(found | observed)
        if self.targets:
            self.counts.update(TARGET + name for name in self.targets.met(found, case.geometry.head_size))
        if paths:
            self.counts.update(f"path:{name}" for name in paths)
            self.specialisations.update(spec for specs in paths.values() for spec in specs)
        self.examples += 1
        self.seconds += time.perf_counter() - start

    def decline(self, reason: str, case: Case | None = None) -> None:
        """Tally a drawn case the kernel's supports() declined, and the targets it would have reached."""
        self.declined[reason] += 1
        if case is not None and self.targets:
            self.declined_targets.update(self.targets.met(features(case), case.geometry.head_size))

    def paths(self) -> list[str]:
        """The Triton kernels some example launched."""
        return sorted(name[len("path:"):] for name in self.counts if name.startswith("path:"))

    def merge(self, other: "Statistics") -> "Statistics":
        """Add ``other``'s tallies to these (another job's); returns self."""
        self.excluded = other.excluded if not self.examples else self.excluded & other.excluded
        self.examples += other.examples
        self.counts.update(other.counts)
        self.seconds += other.seconds
        self.specialisations.update(other.specialisations)
        self.declined.update(other.declined)
        self.declined_targets.update(other.declined_targets)
        self.targets = self.targets.merge(other.targets)
        return self

    def target_count(self, name: str) -> int:
        return self.counts[TARGET + name]

    def unreached(self) -> list[tuple[str, str]]:
        """Every declared target no example reached, with why: the reason it is out of reach, or
        the budget (the examples the campaign had) for one within reach."""
        found = []
        for name, why in self.targets.table:
            if why is not None:
                found.append((name, why))
            elif not self.counts[TARGET + name] and self.declined_targets[name]:
                found.append((name, "supports(): the kernel declined every drawn case that reached it"))
            elif not self.counts[TARGET + name]:
                found.append((name, f"budget: not met in {self.examples} example{'s' if self.examples != 1 else ''}"))
        return found

    def unreached_line(self) -> str | None:
        """One line naming each declared target no example reached and why; None when none."""
        missed = self.unreached()
        if not missed:
            return None
        by_reason: dict[str, list[str]] = {}
        for name, why in missed:
            by_reason.setdefault(why, []).append(name)
        return UNREACHED_NOTE + "; ".join(
            f"{', '.join(names)} ({why})" for why, names in by_reason.items())

    def share(self, name: str) -> float:
        """The fraction of examples in situation ``name`` (0.0 before any example)."""
        return self._of(self.counts[name])

    def _of(self, count: int) -> float:
        return count / self.examples if self.examples else 0.0

    def groups(self) -> list[tuple[str, list[tuple[str, int]]]]:
        """``[(title, [(situation, count), ...]), ...]`` in reporting order.

        Each group's fixed situations are listed even when no example had
        them (what the campaign never reached); sizes, dtypes and values
        only as seen; situations no group names come last, under "other".
        """
        out = []
        placed: set[str] = set()
        for title, listed, prefixes in GROUPS:
            seen = [n for n in self.counts if n not in listed and any(n.startswith(p) for p in prefixes)]
            names = [*(n for n in listed if n not in self.excluded or self.counts[n]), *sorted(seen, key=_sort_key)]
            placed.update(names)
            if names:
                out.append((title, [(n, self.counts[n]) for n in names]))
        title, names = LAYOUT_GROUP
        if self.counts[names[0]]:
            out.append((title, [(n, self.counts[n]) for n in names]))
        placed.update(names)
        if self.targets:
            reachable = self.targets.within_reach()
            out.append((TARGETS_GROUP, [(name, self.counts[TARGET + name]) for name in reachable]))
            placed.update(TARGET + name for name in reachable)
        switches = self.switches()
        if switches:
            out.append(("kernel switches", sorted(switches.items())))
        other = sorted(n for n in self.counts if n not in placed)
        if other:
            out.append((OTHER, [(n, self.counts[n]) for n in other]))
        return out

    def switches(self) -> dict[str, int]:
        """Each boolean constexpr that took both values over the campaign's launches, by kernel
        (``NAME IS_3D=True``): which side of a kernel's own switch the examples reached."""
        seen: dict[tuple[str, str], Counter] = {}
        for spec, count in self.specialisations.items():
            name, _, rest = spec.partition("[")
            for item in rest.rstrip("]").split(","):
                flag, _, value = item.partition("=")
                if value in ("True", "False"):
                    seen.setdefault((name, flag), Counter())[value] += count
        return {f"{name} {flag}={value}": n for (name, flag), values in seen.items() if len(values) == 2
                for value, n in values.items()}

    def to_dict(self) -> dict:
        """JSON-ready: ``{"examples", "seconds", "groups": {title: {situation: {"count", "share"}}}}``."""
        return {
            "examples": self.examples,
            "seconds": round(self.seconds, 6),
            "excluded": sorted(self.excluded),
            "groups": {title: {name: {"count": count, "share": round(self._of(count), 6)} for name, count in rows}
                       for title, rows in self.groups()},
            "specialisations": dict(self.specialisations.most_common()),
            "declined": dict(self.declined.most_common()),
            "targets": [{"target": name, "count": self.counts[TARGET + name], "out_of_reach": why,
                         "declined": self.declined_targets[name]} for name, why in self.targets.table],
        }

    @classmethod
    def from_dict(cls, data: dict) -> "Statistics":
        """The inverse of ``to_dict`` (situations with a count of 0 are dropped)."""
        counts = Counter({name: entry["count"] for title, rows in data["groups"].items()
                          if title not in ("kernel switches", TARGETS_GROUP)
                          for name, entry in rows.items() if entry["count"]})
        targets = data.get("targets", [])
        counts.update({TARGET + entry["target"]: entry["count"] for entry in targets if entry["count"]})
        return cls(examples=data["examples"], counts=counts, seconds=data.get("seconds", 0.0),
                   specialisations=Counter(data.get("specialisations", {})),
                   excluded=frozenset(data.get("excluded", ())),
                   declined=Counter(data.get("declined", {})),
                   declined_targets=Counter({entry["target"]: entry["declined"] for entry in targets
                                             if entry.get("declined")}),
                   targets=Targets(tuple((entry["target"], entry["out_of_reach"]) for entry in targets)))

    def table(self) -> str:
        """An aligned text table: group, situation, examples, share."""
        header = f"what the campaign exercised ({self.examples} example{'s' if self.examples != 1 else ''})"
        if self.declined:
            header += (f"; {sum(self.declined.values())} drawn cases declined by the kernel's supports() ("
                       + ", ".join(f"{reason}: {n}" for reason, n in self.declined.most_common(3)) + ")")
        if not self.examples:
            return header
        rows = [(title if i == 0 else "", name, str(count), f"{100 * self._of(count):.1f}%")
                for title, entries in self.groups() if title != READS_GROUP for i, (name, count) in enumerate(entries)]
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines = [header]
        for row in rows:
            lines.append(f"  {row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]:>{widths[2]}}  "
                         f"{row[3]:>{widths[3]}}".rstrip())
        if self.specialisations:
            lines.append(f"  {len(self.specialisations)} distinct kernel specialisations launched "
                         "(each with its examples in --summary-json)")
        for name, why in self.unreached():
            lines.append(f"  not reached: {name} ({why})")
        return "\n".join(lines)
