"""Production-size batches: the sizes where real kernels switch code paths.

vLLM's 3D split-KV decode, AITER's pa_decode v2 above 1024 keys, tile and
partition skipping below a sliding window, many-block prefill loops, GQA
groups past 16, head sizes of 192 and 256, and element offsets
``block_id * stride`` past 2^31 live only in batches far larger than the
small tier draws.  A production case may hold decode sequences of up to 128k
keys, chunked prefills with contexts of tens of thousands of keys and up to
2048 new tokens, up to 256 sequences, up to 128 query heads, and a cache of
millions of slots whose block ids pass the 2^31-element boundary.

Every size is drawn with a few choices (a length as an exponent and a value
below it, a table as a placement and a seed rather than entry by entry), so
drawing a case costs milliseconds and shrinking moves every size toward
small: fewer and shorter sequences, fresh blocks in order from 1, no huge
cache, one KV head.  Budgets (live keys, query tokens, attention work, table
entries) bound each batch; a length that would pass one is cut to fit.
"""
from __future__ import annotations

import functools
import random
from dataclasses import dataclass, replace

import numpy as np
from hypothesis import strategies as st

from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.case import (CHUNKED_PREFILL, DECODE, LIMITS, MAX_SLOTS, MAX_TABLE_ENTRIES, NULL_BLOCK,
                                    PADDING, PREFILL, Case, Geometry, Poison,
                                    PoisonSite, Sequence)
from nanfuzz.reference.features import FAR_WINDOW_KEYS, FAR_WINDOW_RATIO, POISON_CLASS_FLAGS
from nanfuzz.reference.semantics import reasons
from nanfuzz.strategies.aims import (FAR_WINDOW, FLOOR_STEPS, HUGE_OFFSETS, LARGEST_HEAD, LONG_KEYS, LONG_SEQUENCE,
                                     MANY, MANY_SEQUENCES, SITUATIONS, WIDE_GROUP, Aim)
from nanfuzz.strategies.batches import Lengths, allowed_kinds, causal_flags
from nanfuzz.strategies.draws import BOOLEANS, integers, pick
from nanfuzz.strategies.geometry import Shape, head_sizes
from nanfuzz.strategies.poison import draw_poison_kind
from nanfuzz.strategies.quantization import kv_caches

# The element offset kernels compute as ``block_id * stride``: past it, an int32 product wraps.
OFFSET_BOUNDARY = 1 << 31
# Granularities a window's edge is aimed at, besides the block size: Triton tiles (16 to
# 256 keys), split-KV segments and partitions (512 to 4096 keys: vLLM's 3D segments,
# AITER's 1024-key v2 partitions).
EDGE_GRANULARITIES = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
# Window widths far below production lengths, and a few that straddle a partition.
WINDOWS = (1, 17, 128, 500, 1000, 1024, 2047, 4096, 8192)
# Production poison: one slot, whole blocks, or every dead slot (the last weighs most: it is
# the one a careless kernel meets first, and it costs no list of sites).
SCOPE_WEIGHTS = (1, 1, 2)
# Room for the blocks placed above a huge cache's 2^31-element boundary.
HIGH_BLOCKS = 1 << 14


@dataclass(frozen=True)
class ProductionSize:
    """How large production batches get, and the budgets that keep one batch affordable."""

    max_sequences: int = 256
    max_seq_len: int = 1 << 17          # 128k keys
    max_context: int = 1 << 16          # a chunked prefill's context
    max_query_len: int = 2048
    max_kv_heads: int = 16
    max_q_heads: int = 128
    # Budgets per batch.  Live keys bound the cache writes and the oracle's gather; tokens the
    # queries; attention (sum over sequences of query_len x live keys x query heads) the oracle's
    # float64 pass, about 2^33 x head size x 4 flops at most: a second on an H200.
    max_live_keys: int = 1 << 21
    max_tokens: int = 1 << 13
    max_attention: int = 1 << 33
    max_table_entries: int = 1 << 20
    # A huge cache: block ids past the 2^31-element boundary in every dtype (fp32: 8 GiB a cache).
    # 0: never (a campaign sharing its device with others, or the interpreter).
    huge_cache_bytes: int = 9 << 30

    def bound(self, caps: Capabilities) -> Capabilities:
        return caps.restrict(max_q_heads=min(caps.max_q_heads, self.max_q_heads))


PRODUCTION_SIZE = ProductionSize()
# Under the interpreter every tile operation costs tens of microseconds: production there is
# long enough to cross partitions and many blocks (4k keys), never a huge cache.
INTERPRETER_PRODUCTION_SIZE = ProductionSize(
    max_sequences=8, max_seq_len=4096, max_context=4096, max_query_len=64, max_kv_heads=2, max_q_heads=8,
    max_live_keys=1 << 14, max_tokens=128, max_attention=1 << 21, max_table_entries=1 << 12, huge_cache_bytes=0)


def production_size(interpreter: bool) -> ProductionSize:
    return INTERPRETER_PRODUCTION_SIZE if interpreter else PRODUCTION_SIZE


# -- choices: drawn one by one, or for a batch's many sequences from one drawn seed ------

# The first sequences of a batch are drawn choice by choice (each shrinks on its own); the
# rest follow from one drawn seed, so a batch of 256 sequences costs tens of choices, not a
# thousand, and shrinking drops them by the count.
INDIVIDUAL_SEQUENCES = 4


class _Drawn:
    """Choices from Hypothesis, each shrinking on its own."""

    def __init__(self, draw):
        self.draw = draw

    def integer(self, lo: int, hi: int) -> int:
        return self.draw(integers(lo, hi)) if hi > lo else lo

    def pick(self, options, weights=None):
        return pick(self.draw, options, weights)

    def boolean(self) -> bool:
        return self.draw(BOOLEANS)


class _Seeded:
    """The same choices from a generator seeded by one drawn integer."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def integer(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi) if hi > lo else lo

    def pick(self, options, weights=None):
        return options[0] if len(options) == 1 else self.rng.choices(options, weights)[0]

    def boolean(self) -> bool:
        return self.rng.random() < 0.5


def _log_int(choose, lo: int, hi: int, top_weight: int = 1) -> int:
    """An integer in [lo, hi], about uniform in its number of binary digits (the top three
    weighing ``top_weight`` times the others); shrinks toward lo."""
    if hi <= lo:
        return lo
    top = (hi - lo).bit_length()
    if top_weight == 1:
        digits = choose.integer(0, top)
    else:
        digits = choose.pick(tuple(range(top + 1)), tuple(top_weight if d > top - 3 else 1 for d in range(top + 1)))
    span = min(hi - lo, (1 << digits) - 1)
    return lo + choose.integer(0, span)


def production_shapes(caps: Capabilities, size: ProductionSize, interpreter: bool) -> st.SearchStrategy[Shape]:
    return _shapes(size.bound(caps), size.max_kv_heads, interpreter)


def widest_group(caps: Capabilities, kv_heads: int = 1) -> int:
    """The widest GQA group a case with ``kv_heads`` KV heads may have."""
    widest = caps.max_q_heads // kv_heads
    return widest if caps.max_group is None else min(widest, caps.max_group)


@functools.lru_cache(maxsize=64)
def _shapes(caps: Capabilities, max_kv_heads: int, interpreter: bool):
    """Shrinks toward the first dtype, one KV head, MHA, the smallest head size, the first block size.
    Generated, a third of the groups are wider than 16 where the kernel takes them."""
    dtypes = caps.runnable_dtypes(interpreter)
    pairs = caps.head_size_pairs()

    @st.composite
    def shape(draw) -> Shape:
        dtype = pick(draw, dtypes)
        kv_heads = _log_int(_Drawn(draw), 1, caps.kv_head_limit(max_kv_heads))
        widest = widest_group(caps, kv_heads)
        if widest > 16 and pick(draw, ("narrow", "wide"), (2, 1)) == "wide":
            group = draw(integers(17, widest))
        else:
            group = draw(integers(1, min(16, widest)))
        heads = head_sizes(pick(draw, pairs))
        block_size = pick(draw, caps.block_sizes)
        return Shape(dtype, kv_heads * group, kv_heads, block_size=block_size, **heads)

    return shape()


# -- aims: a drawn case bent toward what it aims at ---------------------------------------
#
# An aimed case makes the very choices a free case makes, and its aim then bends the values they
# gave (a wider group, a longer first sequence, more sequences, blocks past 2^31 ...).  With the
# aim shrunk away, the same choices give the free case again.  Each bend hangs on a choice of its
# own (``draw_aim``), generated on and shrinking to off, and each floor (the first sequence's
# keys, the batch's sequences) on a share of it, generated whole and shrinking step by step: a
# failure that needs one bend sheds the others, and one that needs 3000 keys of a 32k floor
# shrinks to a floor just past 3000.

# A bend of an aim is off, and a floor cut, only where each of this many draws says so: one case
# in eight while Hypothesis draws evenly.  One draw weighted seven to one would promise as much,
# but Hypothesis favours a draw's simplest value far beyond its weight when a case holds many
# choices, and copies choices between a case's spans: so drawn, an aimed production case kept its
# 32k-key floor in a third of the cases aimed at it.  A bend is on where any of its coin flips
# is, and a floor keeps the largest of its shares, so shrinking sheds a bend flip by flip and cuts
# a floor share by share, each step a case of its own.
DRAWS_PER_BEND = 3
_SHARE = integers(0, 2 * FLOOR_STEPS - 1)  # the upper half keeps the floor whole
_SPREAD = integers(0, 2**16 - 1)


def _bend_on(draw) -> bool:
    return any([draw(BOOLEANS) for _ in range(DRAWS_PER_BEND)])


def _floor_share(draw) -> int:
    return min(FLOOR_STEPS, max(draw(_SHARE) for _ in range(DRAWS_PER_BEND)))


def draw_aim(draw, aim: Aim | None) -> Aim | None:
    """``aim`` as one case takes it: every situation with a choice of its own, on or off, and the
    share of each floor it keeps.  The same choices whatever ``aim`` is (None included), so that
    shrinking an aim away leaves every later choice in place."""
    on = [_bend_on(draw) for _ in SITUATIONS]
    length_share, count_share = _floor_share(draw), _floor_share(draw)
    spread = draw(_SPREAD)
    if aim is None:
        return None
    kept = frozenset(s for s, yes in zip(SITUATIONS, on) if yes and s in aim)
    return Aim(aim.kind, kept, length_share, count_share, spread)


def _share(floor: int, share: int) -> int:
    return floor * share // FLOOR_STEPS


def bend_shape(shape: Shape, aim: Aim | None, caps: Capabilities, size: ProductionSize) -> Shape:
    """``shape`` with ``aim``'s group past 16 and largest head size, where the kernel takes them."""
    if aim is None:
        return shape
    caps = size.bound(caps)
    kv, group = shape.num_kv_heads, shape.num_q_heads // shape.num_kv_heads
    head = max(caps.head_sizes) if LARGEST_HEAD in aim else shape.head_size
    if WIDE_GROUP in aim and group <= 16 and widest_group(caps) > 16:
        kv = max(k for k in range(1, kv + 1) if widest_group(caps, k) > 16)
        group = 17 + (group - 1) % (widest_group(caps, kv) - 16)
    return Shape(shape.dtype, kv * group, kv, head, shape.block_size)


def bend_window(causal: bool, window: int, aim: Aim | None, caps: Capabilities,
                size: ProductionSize) -> tuple[bool, int]:
    """(causal, window) with a window ``aim``'s batch kind can hold far below a sequence, where it
    aims at one and the kernel takes windows."""
    if aim is None or FAR_WINDOW not in aim or not any(caps.windowed(c) for c in caps.modes()):
        return causal, window
    if not caps.windowed(causal):
        causal = next(c for c in caps.modes() if caps.windowed(c))
    far = far_windows(caps, size, aim.kind)
    if window in far:
        return causal, window
    return causal, far[window % len(far)]


def _as_kind(kind: str, lengths: Lengths, caps: Capabilities, size: ProductionSize) -> Lengths:
    """``lengths`` as a request of ``kind``, its keys kept where the kind can have them."""
    if kind == PADDING:
        return Lengths(0, 0)
    seq_len = max(1, lengths.seq_len)
    if kind == DECODE:
        return Lengths(1, seq_len)
    q_lo, q_hi = _fewest_tokens(caps, kind), max(_fewest_tokens(caps, kind), query_limit(caps, size))
    query_len = min(q_hi, max(q_lo, lengths.query_len if lengths.query_len > 1 else min(seq_len, 16)))
    if kind == PREFILL:
        return Lengths(query_len, query_len)
    return Lengths(query_len, query_len + max(1, seq_len - query_len))


def _bend_requests(requests: list, aim: Aim | None, caps: Capabilities, size: ProductionSize, window: int,
                   longest: int, q_heads: int) -> list:
    """The drawn requests of a batch of ``aim``'s kind: the first as that kind, at least as long as
    the aim asks (``_first_length``); the others of the kinds such a batch holds, a prefill among
    them in a mixed batch."""
    if aim is None:
        return requests
    first_kinds, other_kinds = _BATCH_REQUESTS[aim.kind]
    bent = [(kind, x) if kind in other_kinds else (other_kinds[0], _as_kind(other_kinds[0], x, caps, size))
            for kind, x in requests[1:]]
    if aim.kind == "mixed" and not any(kind in (PREFILL, CHUNKED_PREFILL) for kind, _ in bent):
        x = bent[0][1] if bent else requests[0][1]
        bent[:1] = [(CHUNKED_PREFILL, _as_kind(CHUNKED_PREFILL, x, caps, size))]
    kind, first = requests[0]
    if kind != first_kinds[0]:
        kind, first = first_kinds[0], _as_kind(first_kinds[0], first, caps, size)
    least = min(_first_length(aim, window), longest)
    if kind == PREFILL:
        query_len = max(first.query_len, min(least, query_limit(caps, size)))
        first = Lengths(query_len, query_len)
    elif least:
        query_len = first.query_len
        if kind == CHUNKED_PREFILL:
            # few enough new tokens that the context asked for stays within the attention budget
            # (half of it for a batch of many sequences)
            most = size.max_attention // ((1 + (MANY_SEQUENCES in aim)) * q_heads * least)
            query_len = max(_fewest_tokens(caps, kind), min(query_len, most))
        first = Lengths(query_len, max(first.seq_len - first.query_len + query_len, least))
    return [(kind, first), *bent]


# -- lengths ---------------------------------------------------------------------------

class _Budget:
    """What is left of a batch's budgets as its sequences are drawn."""

    def __init__(self, size: ProductionSize, q_heads: int, window: int):
        self.size, self.q_heads, self.window = size, q_heads, window
        self.keys, self.tokens, self.attention = size.max_live_keys, size.max_tokens, size.max_attention

    def live(self, query_len: int, seq_len: int) -> int:
        context = seq_len - query_len
        return seq_len - (max(0, context - self.window + 1) if self.window else 0)

    def fit(self, query_len: int, seq_len: int, share: int = 1) -> tuple[int, int]:
        """(query_len, seq_len) cut down until they fit a ``share``-th of what is left of the
        batch's budgets: the new tokens halved until they fit alone, then the context cut to
        the longest that still fits."""
        context = max(0, seq_len - query_len)
        query_len = min(query_len, self.tokens // share)
        while query_len > 1 and self._over(query_len, query_len, share):
            query_len //= 2
        if self._over(query_len, query_len + context, share):
            room = min(self.keys // share, self.attention // share // max(1, query_len * self.q_heads))
            context = max(0, min(context, room - query_len))
        return query_len, context + query_len

    def _over(self, query_len: int, seq_len: int, share: int = 1) -> bool:
        live = self.live(query_len, seq_len)
        return live > self.keys // share or query_len * live * self.q_heads > self.attention // share

    def take(self, query_len: int, seq_len: int) -> None:
        live = self.live(query_len, seq_len) if query_len else 0
        self.keys -= live
        self.tokens -= query_len
        self.attention -= query_len * live * self.q_heads

    @property
    def spent(self) -> bool:
        return self.keys < 1 or self.tokens < 1 or self.attention < self.q_heads


def _aim(choose, length: int, window: int, floor: int, block_size: int) -> int:
    """``length`` moved so that its window's first live key sits at (or beside) a boundary of a
    drawn granularity: a block, a tile, a segment or partition; unchanged without a window.  The
    same choices with a window or without, so that shrinking a window away keeps the lengths."""
    aimed = choose.boolean()
    granularity = choose.pick((block_size, *EDGE_GRANULARITIES))
    beside = choose.pick((0, -1, 1))
    if not window or not aimed or length <= window + floor:
        return length
    edge = length - window  # the first live key, for a decode (one query at length - 1)
    edge = max(granularity, edge - edge % granularity) + beside
    return max(floor, edge + window)


def _long(choose, lo: int, hi: int) -> int:
    """A length in [lo, hi] on a log scale whose top three binary orders weigh eight times the
    others: a production campaign meets the longest sequences often.  Shrinks toward lo."""
    return _log_int(choose, lo, hi, top_weight=8)


def query_limit(caps: Capabilities, size: ProductionSize) -> int:
    """The most new tokens a production sequence may have."""
    return size.max_query_len if caps.max_query_len is None else min(size.max_query_len, caps.max_query_len)


def _request(choose, caps: Capabilities, size: ProductionSize, window: int, block_size: int, first: bool,
             longest: int) -> tuple[str, Lengths]:
    """One production request before the batch's budgets: its kind and lengths (at most
    ``longest`` keys).  Shrinks toward a decode of one key."""
    kind = choose.pick(allowed_kinds(caps, padding=not first))
    q_hi = query_limit(caps, size)
    q_lo = _fewest_tokens(caps, kind)
    if kind == PADDING:
        return kind, Lengths(0, 0)
    if kind == DECODE:
        query_len, seq_len = 1, _long(choose, 1, longest)
    else:
        # chunked prefill fills a step's token budget: long chunks weigh four times the others
        query_len = _log_int(choose, q_lo, max(q_lo, min(q_hi, longest)), top_weight=4)
        context = 0 if kind == PREFILL else _long(choose, 1, max(1, min(size.max_context, longest - query_len)))
        seq_len = context + query_len
    return kind, Lengths(query_len, min(longest, _aim(choose, seq_len, window, query_len, block_size)))


@functools.lru_cache(maxsize=256)
def _requests(caps: Capabilities, size: ProductionSize, window: int, block_size: int, first: bool, longest: int):
    @st.composite
    def request(draw):
        return _request(_Drawn(draw), caps, size, window, block_size, first, longest)
    return request()


def _like(bulk: _Seeded, template: tuple[str, Lengths], caps: Capabilities) -> tuple[str, Lengths]:
    """A bulk request: one of the drawn ones, its lengths scaled by a seeded factor in (1/2, 1], or
    now and then a sequence without a query.  Bulk sequences are never longer than a drawn one, so
    a failure that a long sequence shows shrinks with the drawn sequence it copies."""
    kind, lengths = template
    if kind != PADDING and not bulk.integer(0, 7) and PADDING in allowed_kinds(caps, padding=True):
        return PADDING, Lengths(0, 0)
    if kind == PADDING:
        return kind, lengths
    factor = bulk.integer(513, 1024)
    query_len = max(_fewest_tokens(caps, kind), lengths.query_len * factor // 1024) if kind != DECODE else 1
    context = (lengths.seq_len - lengths.query_len) * factor // 1024
    if kind == CHUNKED_PREFILL:
        context = max(1, context)
    return kind, Lengths(query_len, query_len + (0 if kind == PREFILL else context))


def _fewest_tokens(caps: Capabilities, kind: str) -> int:
    """The fewest new tokens a request of ``kind`` has: one for a decode, two for a prefill (with
    one it would be a decode), and never fewer than the kernel's shortest query."""
    return max(1 if kind == DECODE else 2, caps.min_query_len)


def _fit(caps: Capabilities, budget: _Budget, kind: str, lengths: Lengths, first: bool,
         share: int = 1) -> Lengths | None:
    """``lengths`` cut to a ``share``-th of what the batch's budgets have left (None: nothing is
    left for it, or too little to stay a request of its kind)."""
    if kind == PADDING:
        return lengths
    q_lo = max(1, caps.min_query_len)
    if budget.spent:
        return None
    query_len, seq_len = budget.fit(lengths.query_len, lengths.seq_len, share)
    if kind == CHUNKED_PREFILL and seq_len == query_len and query_len > q_lo:
        query_len -= 1  # keep one key of context
    if query_len < q_lo:  # the budget left too few tokens for this kernel's shortest query
        assert not first, f"a production size must hold one query of {q_lo} tokens"
        return None
    if query_len < _fewest_tokens(caps, kind) and not first:
        return None  # cut to one token, a prefill would be a decode
    budget.take(query_len, seq_len)
    return Lengths(query_len, seq_len)


# The kinds of request each kind of batch is drawn from: its first request's, and the others'.
_BATCH_REQUESTS = {
    "decode": ((DECODE,), (DECODE, PADDING)),
    "prefill": ((PREFILL,), (PREFILL, PADDING)),
    "chunked-prefill": ((CHUNKED_PREFILL,), (PREFILL, CHUNKED_PREFILL, PADDING)),
    "mixed": ((DECODE,), (DECODE, PREFILL, CHUNKED_PREFILL, PADDING)),
}


def _first_length(aim: Aim | None, window: int) -> int:
    """The fewest keys ``aim`` asks of a batch's first sequence: 32k for a long sequence, and for a
    far window a sequence it lies far below (at most the aim's cut floor)."""
    if aim is None:
        return 0
    least = LONG_KEYS if LONG_SEQUENCE in aim else 0
    if FAR_WINDOW in aim and window:
        least = max(least, FAR_WINDOW_KEYS, FAR_WINDOW_RATIO * window)
    return _share(least, aim.length_share)


def _draw_lengths(draw, caps: Capabilities, size: ProductionSize, budget: _Budget, block_size: int,
                  bulk: _Seeded, bulk_count: int, aim: Aim | None = None) -> tuple[list[Lengths], int]:
    """The first requests drawn one by one (a Hypothesis list, so shrinking deletes them), then
    ``bulk_count`` more like them (``_like``); each cut to the budgets, in order, a bulk request
    to its share of what the ones before it left, so that the batch reaches its count.  ``aim``:
    the kind of batch, and the length its first sequence reaches.
    Returns the lengths and how many of them were drawn one by one."""
    limit = size.max_seq_len if caps.max_seq_len is None else min(size.max_seq_len, caps.max_seq_len)
    longest = min(limit, max(4096, 4 * size.max_live_keys // (INDIVIDUAL_SEQUENCES + bulk_count)))
    window = budget.window
    requests = [draw(_requests(caps, size, window, block_size, True, longest))]
    most = size.max_sequences if caps.max_sequences is None else min(size.max_sequences, caps.max_sequences)
    requests += draw(st.lists(_requests(caps, size, window, block_size, False, longest),
                              max_size=min(INDIVIDUAL_SEQUENCES, most) - 1))
    # an aim's first sequence passes the share of a batch of many up to a long sequence's keys:
    # the others share what it leaves (a live-key budget cut for a shared device keeps its 32k)
    requests = _bend_requests(requests, aim, caps, size, window, max(longest, min(LONG_KEYS, limit)),
                              budget.q_heads)[:most]
    # aimed at many sequences, the first takes at most half the budgets, each later one its share
    many = aim is not None and MANY_SEQUENCES in aim
    individual = len(requests)
    requests += [_like(bulk, requests[j % individual], caps) for j in range(bulk_count)]
    requests = requests[:most]
    lengths, drawn = [], 0
    for i, (kind, raw) in enumerate(requests):
        share = len(requests) - i if i >= individual or (many and i) else 1 + (many and not i)
        fitted = _fit(caps, budget, kind, raw, first=i == 0, share=share)
        if fitted is not None:
            lengths.append(fitted)
            drawn += i < individual
    return lengths, drawn


# -- tables ----------------------------------------------------------------------------

# Where a sequence's blocks sit: fresh ids in order, the same ids in a drawn order, or above
# the 2^31-element boundary of a huge cache.
PLACEMENTS = ("fresh", "scattered", "high")
EXPIRED_TARGETS = ("own", "null", "reused")


@dataclass
class _Tables:
    rows: list[list[int]]
    num_blocks: int
    padding_block: int
    huge: bool


def huge_capable(shape: Shape, size: ProductionSize, caps: Capabilities | None = None) -> bool:
    """Can a case of ``shape`` place blocks past the 2^31-element boundary at ``size`` (and within
    ``caps.max_blocks``)?"""
    threshold = _huge_threshold(shape, size)
    if threshold is None:
        return False
    return caps is None or caps.max_blocks is None or threshold + HIGH_BLOCKS + 2 * 64 + 3 <= caps.max_blocks


def _huge_threshold(shape: Shape, size: ProductionSize) -> int | None:
    """The first block whose element offset passes 2^31, if a cache past it fits the size's bytes."""
    per_block = shape.block_size * shape.num_kv_heads * max(shape.head_size, shape.head_size_v)
    threshold = -(-OFFSET_BOUNDARY // per_block)
    element = 4 if shape.dtype == "float32" else 2
    blocks = threshold + HIGH_BLOCKS + 2 * 64
    fits = blocks * per_block * element <= size.huge_cache_bytes
    slots_ok = blocks * shape.block_size <= MAX_SLOTS and blocks <= LIMITS["num_blocks"]
    return threshold if size.huge_cache_bytes and fits and slots_ok else None


def _draw_tables(draw, lengths: list[Lengths], window: int, shape: Shape, size: ProductionSize,
                 individual: int, bulk: _Seeded, high: bool = False) -> _Tables:
    """Physical blocks for every sequence, a few choices per sequence (``bulk``'s past the first
    ``individual``).  Shrinks toward fresh blocks in order from 1, expired entries in
    their own blocks, no sharing, no huge cache.  ``high``: a huge cache, the first sequence's
    blocks past its 2^31-element boundary (where the shape's cache fits the size)."""
    bs = shape.block_size
    threshold = _huge_threshold(shape, size)
    high = high and threshold is not None
    huge = threshold is not None and (pick(draw, (False, True), (2, 1)) or high)
    next_fresh, next_high = 1, (threshold or 0) + draw(integers(0, 64)) if huge else 0
    rows: list[list[int]] = []
    donors: list[int] = []  # the physical blocks holding live keys of the sequences so far, in order
    drawn = _Drawn(draw)
    for s, length in enumerate(lengths):
        choose = drawn if s < individual else bulk
        used = -(-length.seq_len // bs)
        seq = Sequence(length.query_len, length.seq_len, ())
        lo, hi = seq.live_range(window)
        first_live = lo // bs if length.query_len else used
        placement = choose.pick(PLACEMENTS if huge else PLACEMENTS[:2])
        if high and s == 0:
            placement = "high"
        if placement == "high" and next_high + used > threshold + HIGH_BLOCKS:
            placement = "fresh"  # the high region is full
        expired = choose.pick(EXPIRED_TARGETS) if first_live else "own"
        shared_from = choose.integer(0, s - 1) if s and choose.boolean() else None
        if placement == "high":
            ids = list(range(next_high, next_high + used))
            next_high += used
        else:
            ids = list(range(next_fresh, next_fresh + used))
            next_fresh += used
        if placement == "scattered":
            random.Random(choose.integer(0, 2**32 - 1)).shuffle(ids)
        if expired == "null":
            ids[:first_live] = [NULL_BLOCK] * first_live
        elif expired == "reused" and donors:
            ids[:first_live] = [donors[j % len(donors)] for j in range(first_live)]
        if shared_from is not None and first_live == 0:
            donor = rows[shared_from]
            full = min(len(donor), length.seq_len // bs, -(-lengths[shared_from].seq_len // bs) - 1)
            shared = choose.integer(0, max(0, full)) if full > 0 else 0
            while shared and NULL_BLOCK in donor[:shared]:  # a prefix holds live keys: never the null block
                shared -= 1
            ids[:shared] = donor[:shared]
        rows.append(ids)
        donors.extend(b for b in ids[first_live:used] if b != NULL_BLOCK)
    spare = draw(integers(0, 2))
    top = max(next_fresh, next_high)
    dedicated_trap = draw(BOOLEANS)
    num_blocks = top + spare + int(dedicated_trap)
    padding_block = num_blocks - 1 if dedicated_trap else NULL_BLOCK
    width = max(1, max(len(r) for r in rows) + draw(integers(0, 2)))
    return _Tables([r + [padding_block] * (width - len(r)) for r in rows], num_blocks, padding_block, huge)


# -- poison ----------------------------------------------------------------------------

def _draw_poison(draw, case: Case, classes: tuple[str, ...] | None) -> Poison:
    """Poison for a production case, chosen without listing its millions of dead slots.

    ``all`` (every dead slot), a few whole dead blocks, or one dead slot of a drawn class of a
    drawn sequence (its tail, its expired keys, its padding entry).  Generated, it favours NaN,
    in K and V both, and every dead slot."""
    value, tensors, parts = draw_poison_kind(draw, case.kv_cache)
    scope = pick(draw, ("slot", "blocks", "all"), SCOPE_WEIGHTS)
    if scope == "all" and classes is None:
        return Poison(value, tensors, None, parts)
    why = reasons(case)
    wanted = 0xFF
    if classes is not None:
        wanted = 0
        for name in classes:
            wanted |= int(POISON_CLASS_FLAGS[name])
    bs = case.geometry.block_size
    if scope == "blocks":
        blocks = _dead_blocks(case, why, wanted)
        if blocks:
            chosen = sorted({blocks[draw(integers(0, len(blocks) - 1))] for _ in range(draw(integers(1, 4)))})
            return Poison(value, tensors, tuple(PoisonSite(b) for b in chosen), parts)
    s = draw(integers(0, len(case.sequences) - 1))
    seq = case.sequences[s]
    used = seq.used_blocks(bs)
    # the seq's own dead slots near the edges a kernel reads past: its tail, its last expired key
    lo, _ = seq.live_range(case.sliding_window)
    near = []
    if seq.seq_len % bs:
        near += [(seq.block_table[used - 1], o) for o in range(seq.seq_len % bs, bs)]
    if lo:
        near += [(seq.block_table[(k) // bs], k % bs) for k in range(max(0, lo - bs), lo)]
    if used < len(seq.block_table):
        near += [(seq.block_table[used], o) for o in range(bs)]
    near = [(b, o) for b, o in near if why[b, o] & wanted]
    if near:
        block, offset = near[draw(integers(0, len(near) - 1))]
        return Poison(value, tensors, (PoisonSite(block, offset),), parts)
    blocks = _dead_blocks(case, why, wanted)
    if blocks:
        return Poison(value, tensors, (PoisonSite(blocks[draw(integers(0, len(blocks) - 1))]),), parts)
    return Poison(value, tensors, None if classes is None else (), parts)


def _dead_blocks(case: Case, why, wanted: int) -> list[int]:
    """Blocks referenced by some table (or the null and padding blocks) whose every slot is dead
    and of a wanted class, at most a few hundred."""
    candidates = {NULL_BLOCK, case.padding_block}
    for seq in case.sequences:
        candidates.update(seq.block_table[:64])
        if len(candidates) > 512:
            break
    ids = np.array(sorted(candidates), dtype=np.int64)
    rows = why[ids]
    whole = ((rows != 0) & ((rows & wanted) != 0)).all(axis=1)
    return ids[whole].tolist()


# -- the whole case --------------------------------------------------------------------

def production_case(draw, caps: Capabilities, size: ProductionSize, interpreter: bool,
                    poison_classes: tuple[str, ...] | None, fixed=None, aim: Aim | None = None) -> Case:
    """A production-size case (``fixed``: a pool entry's compile-time part), drawn with ``draw``;
    ``aim`` (``strategies.aims``): the kind of batch and the situations it reaches where it can."""
    caps = size.bound(caps)
    if fixed is not None:
        shape, causal, window, sinks = fixed.shape, fixed.causal, fixed.window, fixed.sinks
        kv_cache = draw(kv_caches(caps, fixed.kv_cache))
    else:
        shape = bend_shape(draw(production_shapes(caps, size, interpreter)), aim, caps, size)
        kv_cache = draw(kv_caches(caps))
        causal = draw(causal_flags(caps))
        widths = _windows(caps) if caps.window_only else (0, *_windows(caps))
        window = pick(draw, widths) if caps.windowed(causal) else 0
        causal, window = bend_window(causal, window, aim, caps, size)
        sinks = draw(BOOLEANS) if caps.sinks else False
    most = size.max_sequences if caps.max_sequences is None else min(size.max_sequences, caps.max_sequences)
    drawn = _Drawn(draw)
    bulk_seed = drawn.integer(0, 2**32 - 1)
    many = max(0, most - INDIVIDUAL_SEQUENCES)
    bucket = drawn.pick(("none", "some", "many"), (3, 2, 1))  # then one integer, whichever the bucket
    bulk_count = drawn.integer(*{"none": (0, 0), "some": (0, min(60, many)), "many": (min(124, many), many)}[bucket])
    if aim is not None and MANY_SEQUENCES in aim and most >= MANY:
        bulk_count = max(bulk_count, _share(MANY, aim.count_share) - 1)  # with the first sequence, at least MANY
    budget = _Budget(size, shape.num_q_heads, window)
    lengths, individual = _draw_lengths(draw, caps, size, budget, shape.block_size, _Seeded(bulk_seed), bulk_count,
                                        aim)
    _cap_table(lengths, shape.block_size, size)
    if caps.uniform_query_len:
        lengths = _one_query_length(lengths)
    high = aim is not None and HUGE_OFFSETS in aim
    tables = _draw_tables(draw, lengths, window, shape, size, individual, _Seeded(bulk_seed + 1), high)
    num_blocks = tables.num_blocks
    if caps.max_blocks is not None and num_blocks > caps.max_blocks:
        tables = _draw_tables(draw, lengths, window, shape, replace(size, huge_cache_bytes=0), individual,
                              _Seeded(bulk_seed + 1))
        num_blocks = tables.num_blocks
    unpoisoned = Case(
        geometry=Geometry(shape.num_q_heads, shape.num_kv_heads, shape.head_size, shape.block_size, num_blocks,
                          shape.dtype, caps.latent_rank(shape.head_size), shape.head_size_v),
        sequences=tuple(Sequence(x.query_len, x.seq_len, tuple(row)) for x, row in zip(lengths, tables.rows)),
        sliding_window=window, causal=causal, sinks=sinks, padding_block=tables.padding_block, poison=Poison(),
        data_seed=0, kv_cache=kv_cache)
    poison = _draw_poison(draw, unpoisoned, poison_classes)
    return unpoisoned.replace(poison=poison, data_seed=draw(integers(0, 2**32 - 1))).validate()


def _windows(caps: Capabilities) -> tuple[int, ...]:
    """``WINDOWS`` the kernel takes (none narrower than ``Capabilities.min_window``)."""
    return tuple(w for w in WINDOWS if w >= caps.min_window) or (caps.min_window,)


def far_window_limit(caps: Capabilities, size: ProductionSize, kind: str) -> int:
    """The widest window a batch of ``kind`` can hold far below a sequence (0: none): an eighth of
    its longest sequence, a prefill's being its new tokens."""
    longest = size.max_seq_len if caps.max_seq_len is None else min(size.max_seq_len, caps.max_seq_len)
    if kind == "prefill":
        longest = min(longest, query_limit(caps, size))
    return longest // FAR_WINDOW_RATIO if longest >= FAR_WINDOW_KEYS else 0


def far_windows(caps: Capabilities, size: ProductionSize, kind: str) -> tuple[int, ...]:
    """The production windows a batch of ``kind`` can hold far below a sequence."""
    limit = far_window_limit(caps, size, kind)
    return tuple(w for w in _windows(caps) if w <= limit) or (caps.min_window,)



def _one_query_length(lengths: list[Lengths]) -> list[Lengths]:
    """Every sequence with a query cut to the shortest query among them, context kept
    (``Capabilities.uniform_query_len``): fewer tokens and keys, so the budgets still hold."""
    q = min(x.query_len for x in lengths if x.query_len)
    return [Lengths(q, x.seq_len - x.query_len + q) if x.query_len else x for x in lengths]


def _cap_table(lengths: list[Lengths], block_size: int, size: ProductionSize) -> None:
    """Shorten the longest sequences until the padded table fits ``max_table_entries`` (and the case model's)."""
    limit = min(size.max_table_entries, MAX_TABLE_ENTRIES)
    while len(lengths) * max(-(-x.seq_len // block_size) for x in lengths) + 2 * len(lengths) > limit:
        i = max(range(len(lengths)), key=lambda n: lengths[n].seq_len)
        x = lengths[i]
        context = (x.seq_len - x.query_len) // 2
        lengths[i] = Lengths(x.query_len, context + x.query_len) if context else Lengths(max(1, x.query_len // 2),
                                                                                         max(1, x.query_len // 2))
        if all(-(-y.seq_len // block_size) <= 1 for y in lengths):
            break


def wide_entries(caps: Capabilities, count: int, seed, *, interpreter: bool = False,
                 known: tuple = ()) -> tuple:
    """``count`` pool entries of production shapes (``strategies.specialisations``): many query
    heads, groups past 16 where the kernel takes them, the largest head sizes, production windows."""
    from nanfuzz.strategies.quantization import kv_cache_options
    from nanfuzz.strategies.specialisations import WINDOW_SHARE, Specialisation

    size = production_size(interpreter)
    caps = size.bound(caps)
    rng = random.Random(f"nanfuzz-wide:{seed}")
    dtypes = caps.runnable_dtypes(interpreter)
    caches = kv_cache_options(caps)
    heads = sorted(caps.head_size_pairs(), key=max)
    windowed = [causal for causal in caps.modes() if caps.windowed(causal)]
    found: dict = {}
    for _ in range(50 * count):
        if len(found) >= count:
            break
        kv = rng.choice([k for k in (1, 2, 4, 8, 16) if k <= caps.kv_head_limit(size.max_kv_heads)])
        widest = widest_group(caps, kv)
        group = rng.randint(17, widest) if widest > 16 and rng.random() < 0.5 else rng.randint(1, min(16, widest))
        head = heads[-1] if rng.random() < 0.5 else rng.choice(heads)
        shape = Shape(rng.choice(dtypes), kv * group, kv, block_size=rng.choice(caps.block_sizes), **head_sizes(head))
        window = rng.choice(_windows(caps)) if windowed and (caps.window_only or rng.random() < WINDOW_SHARE) else 0
        causal = rng.choice(windowed if window else caps.modes())
        entry = Specialisation(shape, causal, window, caps.sinks and rng.random() < 0.5,
                               rng.choice(caches) if len(caches) > 1 else caches[0])
        if entry not in known:
            found[entry] = None
    return tuple(found)


# -- what a pool needs for the production situations --------------------------------------

def entry_provides(entry, situation: str, caps: Capabilities, size: ProductionSize, kind: str = "decode") -> bool:
    """Can a case of pool entry ``entry`` (``strategies.specialisations``) reach ``situation``
    (``strategies.aims``) in a batch of ``kind``?"""
    shape = entry.shape
    if situation == WIDE_GROUP:
        return shape.num_q_heads // shape.num_kv_heads > 16
    if situation == LARGEST_HEAD:
        return shape.head_size == max(caps.head_sizes)
    if situation == FAR_WINDOW:
        return 0 < entry.window <= far_window_limit(caps, size, kind)
    if situation == HUGE_OFFSETS:
        return huge_capable(shape, size, caps)
    return True


def pool_situations(caps: Capabilities, size: ProductionSize) -> tuple[str, ...]:
    """The situations a pool entry decides that ``caps`` can reach at ``size``: a group past 16, the
    largest head size, a cache past 2^31 elements, a window far below a prefill's (or a decode's) keys."""
    caps = size.bound(caps)
    found = [LARGEST_HEAD]
    if widest_group(caps) > 16:
        found.append(WIDE_GROUP)
    if size.huge_cache_bytes:
        found.append(HUGE_OFFSETS)
    if any(caps.windowed(c) for c in caps.modes()) and far_window_limit(caps, size, _strictest_kind(caps)) >= \
            caps.min_window:
        found.append(FAR_WINDOW)
    return tuple(found)


def _strictest_kind(caps: Capabilities) -> str:
    """The batch kind whose far windows are narrowest: a prefill's, where the kernel takes prefills."""
    return "prefill" if caps.max_query_len is None or caps.max_query_len > 1 else "decode"


def needed_entries(caps: Capabilities, pool: tuple, seed, *, interpreter: bool = False) -> tuple:
    """Production entries that give ``pool`` each situation of ``pool_situations`` it lacks, as few as
    a greedy cover of a few hundred drawn candidates takes (none when it lacks nothing)."""
    size = production_size(interpreter)
    kind = _strictest_kind(caps)

    def lacking(entries) -> set[str]:
        return {s for s in pool_situations(caps, size)
                if not any(entry_provides(e, s, caps, size, kind) for e in entries)}

    missing = lacking(pool)
    added: list = []
    if not missing:
        return ()
    candidates = wide_entries(caps, 256, f"{seed}:needed", interpreter=interpreter, known=pool)
    while missing:
        best = max(candidates, key=lambda e: len({s for s in missing if entry_provides(e, s, caps, size, kind)}),
                   default=None)
        if best is None or not any(entry_provides(best, s, caps, size, kind) for s in missing):
            break  # no candidate has what is left (the pool's situations said the kernel allows it)
        added.append(best)
        missing = lacking(list(pool) + added)
    return tuple(added)

