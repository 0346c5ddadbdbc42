"""``nanfuzz bench --scaling``: what an example costs against its live keys, at each size tier.

Cases are drawn as a campaign of the kernel draws them (small and production
tiers), sorted into buckets by their live keys (the keys some query reads,
summed over the batch), and each is checked twice in this process: the first
check pays the compiles, the second is measured.  A row gives a bucket's
milliseconds per example by phase (materialisation, the three launches, the
oracle, the same-precision reference, the verdict), the peak device memory
of a check (GPU), and live keys per second.  The cost of a production case
should follow its live keys, not its cache: a huge cache's row sits beside
the rows of its live keys.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from nanfuzz.harness.campaign.scope import campaign_capabilities, campaign_pool_of, campaign_strategy
from nanfuzz.harness.campaign.settings import Settings
from nanfuzz.harness.judge.check import check
from nanfuzz.harness.kernel import Kernel
from nanfuzz.reference.case import Case
from nanfuzz.reference.features import size_features
from nanfuzz.strategies.steady import drawn

PHASES = ("materialize", "kernel", "oracle", "reference", "verdict")
# Bucket bounds in live keys: each bucket holds [bound, next bound).
BUCKETS = (0, 1 << 10, 1 << 13, 1 << 16, 1 << 18, 1 << 20, 1 << 22)
CASES_PER_BUCKET = 3
DRAWN = 400  # cases drawn per tier to fill the buckets


def live_keys(case: Case) -> int:
    """Keys some query reads, summed over the batch's sequences."""
    total = 0
    for seq in case.sequences:
        lo, hi = seq.live_range(case.sliding_window)
        total += hi - lo
    return total


@dataclass
class Row:
    tier: str
    bucket: int
    cases: int = 0
    keys: int = 0
    seconds: float = 0.0
    phases: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    peak_bytes: int = 0
    huge: int = 0  # cases whose cache passes 2^31 elements

    def to_dict(self) -> dict:
        n = max(1, self.cases)
        return {"tier": self.tier, "live_keys_from": self.bucket, "cases": self.cases,
                "mean_live_keys": self.keys // n, "ms_per_example": round(1000 * self.seconds / n, 2),
                "ms_by_phase": {p: round(1000 * s / n, 2) for p, s in self.phases.items()},
                "peak_gib": round(self.peak_bytes / 2**30, 3), "huge_caches": self.huge,
                "keys_per_second": round(self.keys / self.seconds) if self.seconds else None}


def scaling(kernel: Kernel, settings: Settings, progress=print) -> list[dict]:
    """The table's rows (``Row.to_dict``), small tier first."""
    import torch

    device = torch.device(settings.device)
    caps, _ = campaign_capabilities(kernel, settings)
    rows: list[Row] = []
    for tier in ("small", "production"):
        pool, _ = campaign_pool_of(caps, settings, tier=tier)
        by_bucket: dict[int, list[Case]] = {}
        for case in drawn(campaign_strategy(caps, settings, pool, tier), DRAWN):
            bucket = max(b for b in BUCKETS if b <= live_keys(case))
            chosen = by_bucket.setdefault(bucket, [])
            if len(chosen) < CASES_PER_BUCKET:
                chosen.append(case)
        for bucket in sorted(by_bucket):
            row = Row(tier, bucket)
            for case in by_bucket[bucket]:
                check(kernel, case, device)  # its compiles
                if device.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats(device)
                started = time.perf_counter()
                outcome = check(kernel, case, device)
                row.seconds += time.perf_counter() - started
                if device.type == "cuda":
                    row.peak_bytes = max(row.peak_bytes, torch.cuda.max_memory_allocated(device))
                for phase in PHASES:
                    row.phases[phase] += outcome.timings.get(phase, 0.0)
                row.cases += 1
                row.keys += live_keys(case)
                row.huge += "offsets>2^31" in size_features(case)
            rows.append(row)
            progress(f"{kernel.name} {tier} >= {bucket} live keys: {row.to_dict()['ms_per_example']} ms/example")
    return [row.to_dict() for row in rows]


def table_rows(rows: list[dict]) -> list[tuple]:
    head = ("tier", "live keys", "cases", "ms/ex", *(f"{p[:6]} ms" for p in PHASES), "peak GiB", "keys/s", "huge")
    return [head] + [(r["tier"], f">={r['live_keys_from']} (mean {r['mean_live_keys']})", r["cases"],
                      r["ms_per_example"], *(r["ms_by_phase"][p] for p in PHASES), r["peak_gib"],
                      r["keys_per_second"], r["huge_caches"]) for r in rows]
