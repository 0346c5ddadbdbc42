"""A campaign's pool of kernel specialisations, for kernels that compile per shape.

vLLM's kernels take the window width, the head counts, the head and block
sizes, causality and sinks as ``tl.constexpr``: each new combination is a
new compile (seconds on a GPU), and free draws make nearly every example a
new combination.  Such a kernel declares ``Capabilities.specialisation_pool``;
its campaigns then draw each case's compile-time part from a fixed pool of
that many combinations and vary everything else (lengths, block tables,
poison, data) freely, so compiles are paid once per pool entry, and a
Triton cache kept between runs (the gate carries one) is hit.

The pool is a pure function of the capabilities, its size and a seed, so a
campaign with the same seed meets the same pool (and the same cached
compiles); another seed rotates the geometries covered.  Entries are sorted
simplest first, so shrinking moves toward the simplest one that still fails.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.case import KVCache
from nanfuzz.strategies.geometry import Shape, head_sizes
from nanfuzz.strategies.quantization import kv_cache_options

# Widths for pool entries: one key, block-edge neighbours of 16/32/64 and a
# few that end inside blocks of every size; past the longest sequence a width
# acts as no window, which is a case worth meeting too.
WINDOW_MENU = (1, 2, 3, 7, 16, 17, 33, 63, 100, 129, 300)
# The share of drawn entries with a window: the freed and reused blocks below a
# window are where most masking bugs live.
WINDOW_SHARE = 0.6


@dataclass(frozen=True)
class Specialisation:
    """The compile-time part of a case."""

    shape: Shape
    causal: bool
    window: int  # 0 = none
    sinks: bool
    kv_cache: tuple[str, bool] | KVCache = ("auto", False)  # cache dtype, per-token-head scales? (or a format)

    def complexity(self, caps: Capabilities) -> tuple:
        s = self.shape
        order = caps.dtypes.index(s.dtype), caps.block_sizes.index(s.block_size)
        options = kv_cache_options(caps)
        kv = options.index(self.kv_cache) if self.kv_cache in options else len(options)
        return (s.num_kv_heads, s.num_q_heads, s.head_size, s.head_size_v != 0, s.head_size_v, *order,
                self.window != 0, not self.causal, self.sinks, self.window, kv)


def specialisation_pool(caps: Capabilities, size: int, seed: int, *, interpreter: bool = False,
                        max_kv_heads: int = 4) -> tuple[Specialisation, ...]:
    """``size`` distinct specialisations ``caps`` accepts (more if the fixed ones need it), simplest first.

    Holds the simplest one of each mode (causal, non-causal) with and without
    a one-key window, so every campaign meets each mode and shrinks to the
    smallest repro of its kind; in a pool too small for all of them and
    drawn entries besides, those come first and take at most half of it (a
    pool of two is the simplest entry and one drawn, not two of the
    smallest shape).  The cache dtype and scale mode are part of an entry
    (a quantized cache is a compile of its own).
    """
    if size < 1:
        raise ValueError(f"a specialisation pool needs at least one entry, not {size}")
    rng = random.Random(f"nanfuzz-pool:{seed}")
    dtypes = caps.runnable_dtypes(interpreter)
    kv_cap = caps.kv_head_limit(max_kv_heads)
    smallest = Shape(dtypes[0], 1, 1, block_size=caps.block_sizes[0], **head_sizes(caps.head_size_pairs()[0]))
    caches = kv_cache_options(caps)
    # caps.head_sizes in its own order, then the diff_kv pairs: the draws of kernels without them are as before
    pairs = tuple((h, h) for h in caps.head_sizes) + caps.diff_kv
    windowed_modes = [causal for causal in caps.modes() if caps.windowed(causal)]
    menu = tuple(w for w in WINDOW_MENU if w >= caps.min_window) or (caps.min_window,)
    simplest = []
    for causal in caps.modes():
        if not caps.window_only:
            simplest.append(Specialisation(smallest, causal, 0, False, caches[0]))
        if caps.windowed(causal):
            simplest.append(Specialisation(smallest, causal, caps.min_window, False, caches[0]))
    kept = simplest if size >= 2 * len(simplest) else simplest[:max(1, size // 2)]
    pool: dict[Specialisation, None] = dict.fromkeys(kept)
    for _ in range(50 * size):
        if len(pool) >= size:
            break
        kv = rng.randint(1, kv_cap)
        shape = Shape(rng.choice(dtypes), kv * rng.randint(1, caps.max_q_heads // kv), kv,
                      block_size=rng.choice(caps.block_sizes), **head_sizes(rng.choice(pairs)))
        # The window first, then a mode that takes it: a kernel that windows one mode only
        # meets windows as often as one that windows both.
        window = rng.choice(menu) if windowed_modes and (caps.window_only or rng.random() < WINDOW_SHARE) else 0
        causal = rng.choice(windowed_modes if window else caps.modes())
        sinks = caps.sinks and rng.random() < 0.5
        # the first cache option alone keeps the choices (and pools) of kernels without quantized caches
        cache = rng.choice(caches) if len(caches) > 1 else caches[0]
        pool[Specialisation(shape, causal, window, sinks, cache)] = None
    return tuple(sorted(pool, key=lambda s: s.complexity(caps)))


def entry_traits(entry: Specialisation) -> set[str]:
    """The compile-time traits of an entry a pool may lack: its dtype, head and block size, KV
    heads, kind of GQA group, kind of window, mode, sinks and cache."""
    s = entry.shape
    group = s.num_q_heads // s.num_kv_heads
    kind_of_group = "1" if group == 1 else ">16" if group > 16 else "2^n" if group & (group - 1) == 0 else "other"
    kind_of_window = "none" if not entry.window else "1" if entry.window == 1 else (
        "narrow" if entry.window < 64 else "wide")
    return {f"dtype:{s.dtype}", f"head:{s.head_size}", f"block:{s.block_size}", f"kv-heads:{s.num_kv_heads}",
            f"group:{kind_of_group}", f"window:{kind_of_window}", f"causal:{entry.causal}", f"sinks:{entry.sinks}",
            f"kv:{entry.kv_cache}"}


def most_novel(candidates, count: int, known) -> tuple[Specialisation, ...]:
    """``count`` of ``candidates`` (not in ``known``), each in turn the one with the most traits
    (``entry_traits``) that ``known`` and those chosen before it lack; ties go to the earlier candidate."""
    seen = set().union(*(entry_traits(e) for e in known)) if known else set()
    left = [c for c in dict.fromkeys(candidates) if c not in set(known)]
    chosen: list[Specialisation] = []
    while left and len(chosen) < count:
        best = max(left, key=lambda c: len(entry_traits(c) - seen))
        chosen.append(best)
        left.remove(best)
        seen |= entry_traits(best)
    return tuple(chosen)
