"""How close passing outputs came to MISMATCH's bound: a histogram per arithmetic and size tier.

Every PASS carries its worst row's error in units of what a correct kernel of
its arithmetic may be off (``max_error_ratio``, harness/judge/tolerance.py).  An
:class:`Accuracy` tallies those per arithmetic ("bfloat16", "float32/tf32") and
size tier (small batches, production ones: ``size_tier``) in quarter-octave
bins, so a campaign can say "fp16 production: median 0.4x, 99.9th percentile
0.9x, worst 1.1x, bound 2.5x", jobs can merge their tallies, and the bound
itself is calibrated from these figures (docs/error-model.md).
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

_BINS_PER_OCTAVE = 4
TIERS = ("small", "production")
# The small tier's batches: up to 16 sequences of up to 512 keys (strategies.cases.Size at its
# largest blocks); anything larger is production size, where rows are long and many.
_SMALL_SEQUENCES, _SMALL_KEYS = 16, 512
_ZERO_BIN = -10**6   # ratio 0 (an exact row): below every bin of a positive ratio
QUANTILES = (0.5, 0.99, 0.999)


def size_tier(case) -> str:
    """"small" or "production": how large ``case``'s batch is, for the tallies."""
    small = len(case.sequences) <= _SMALL_SEQUENCES and case.max_seq_len <= _SMALL_KEYS
    return TIERS[0] if small else TIERS[1]


def tally_name(arithmetic: str, tier: str) -> str:
    """A tally's name: the arithmetic, and the tier when it is not the small one ("float16 production")."""
    return arithmetic if tier == TIERS[0] else f"{arithmetic} {tier}"


def _bin(ratio: float) -> int:
    if ratio <= 0:
        return _ZERO_BIN
    # rounded first: a bin's own upper edge (read back from JSON) must land in that bin
    return math.ceil(round(math.log2(ratio) * _BINS_PER_OCTAVE, 9))


def _upper_edge(index: int) -> float:
    return 0.0 if index == _ZERO_BIN else 2.0 ** (index / _BINS_PER_OCTAVE)


@dataclass
class Tally:
    bound: float
    examples: int = 0
    worst: float = 0.0
    bins: Counter = field(default_factory=Counter)

    def quantile(self, q: float) -> float:
        """The upper edge of the bin holding the ``q`` quantile (an upper estimate)."""
        need = q * self.examples
        seen = 0
        for index in sorted(self.bins):
            seen += self.bins[index]
            if seen >= need:
                return min(_upper_edge(index), self.worst)
        return self.worst


@dataclass
class Accuracy:
    tallies: dict[str, Tally] = field(default_factory=dict)

    def add(self, evidence: dict) -> None:
        """Tally one PASS's evidence (anything without a ratio is ignored)."""
        ratio = evidence.get("max_error_ratio")
        if ratio is None:
            return
        name = tally_name(evidence["arithmetic"], evidence.get("tier", TIERS[0]))
        tally = self.tallies.setdefault(name, Tally(bound=evidence["bound"]))
        tally.examples += 1
        tally.worst = max(tally.worst, ratio)
        tally.bins[_bin(ratio)] += 1

    def merge(self, other: "Accuracy") -> "Accuracy":
        for name, theirs in other.tallies.items():
            mine = self.tallies.setdefault(name, Tally(bound=theirs.bound))
            mine.examples += theirs.examples
            mine.worst = max(mine.worst, theirs.worst)
            mine.bins.update(theirs.bins)
        return self

    def highest(self) -> dict | None:
        """The tally whose worst passing example came closest to its bound: ``{"arithmetic", "ratio", "bound"}``
        (``arithmetic`` is the tally's name: the arithmetic and, past the small tier, the tier)."""
        if not self.tallies:
            return None
        name, tally = max(self.tallies.items(), key=lambda item: item[1].worst / item[1].bound)
        return {"arithmetic": name, "ratio": tally.worst, "bound": tally.bound}

    def to_dict(self) -> dict:
        """``{arithmetic: {"examples", "bound", "worst", "quantiles": {"0.5": x, ...},
        "histogram": {upper_edge: count}}}``."""
        return {name: {"examples": t.examples, "bound": t.bound, "worst": t.worst,
                       "quantiles": {str(q): t.quantile(q) for q in QUANTILES},
                       "histogram": {repr(_upper_edge(i)): t.bins[i] for i in sorted(t.bins)}}
                for name, t in sorted(self.tallies.items())}

    @classmethod
    def from_dict(cls, data: dict) -> "Accuracy":
        """The inverse of ``to_dict`` (quantiles are derived, so they are not read back)."""
        tallies = {}
        for name, entry in data.items():
            bins = Counter({_bin(float(edge)): count for edge, count in entry["histogram"].items()})
            tallies[name] = Tally(bound=entry["bound"], examples=entry["examples"], worst=entry["worst"], bins=bins)
        return cls(tallies)

    def table(self) -> str:
        if not self.tallies:
            return "accuracy: no passing example"
        lines = ["accuracy of passing examples: worst row's error in units of what a correct kernel may be off"]
        header = ("arithmetic", "examples", "median", "p99", "p99.9", "worst", "bound")
        rows = [header] + [(name, str(t.examples), *(f"{t.quantile(q):.2f}x" for q in QUANTILES),
                            f"{t.worst:.2f}x", f"{t.bound:g}x") for name, t in sorted(self.tallies.items())]
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        for row in rows:
            lines.append("  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                          for i, (c, w) in enumerate(zip(row, widths))))
        return "\n".join(lines)
