"""``paged_cases``: the Hypothesis strategy over whole poisoned batches."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from hypothesis import strategies as st

from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.case import Case, Geometry, Poison, Sequence
from nanfuzz.strategies.aims import COMPILE_TIME, HUGE_OFFSETS, Aim, Aims
from nanfuzz.strategies.batches import Lengths, causal_flags, sequence_lengths, windows
from nanfuzz.strategies.draws import BOOLEANS, integers, pick
from nanfuzz.strategies.geometry import shapes
from nanfuzz.strategies.poison import draw_poison
from nanfuzz.strategies.production import (ProductionSize, draw_aim, entry_provides, needed_entries,
                                           production_case, production_size, wide_entries)
from nanfuzz.strategies.quantization import kv_caches
from nanfuzz.strategies.specialisations import Specialisation, most_novel, specialisation_pool
from nanfuzz.strategies.tables import draw_block_tables
from nanfuzz.strategies.targets import production_targets

# Size tiers: small (fast, shrinks well), production (the sizes real kernels switch paths at),
# or mixed: mostly small, a steady share at production size.
TIERS = ("small", "production", "mixed")
# In a mixed campaign, production cases against small ones: a production case costs tens to
# hundreds of milliseconds on a GPU against about two for a small one.
MIXED_WEIGHTS = (15, 1)


@dataclass(frozen=True)
class LongBatches:
    """Now and then, a batch larger than the rest of its tier: ``min_sequences`` to
    ``max_sequences`` sequences, the first one of ``min_keys`` to ``max_keys`` keys, one batch in
    ``2 ** coins`` (each of ``coins`` drawn booleans comes up true: a fair coin each, which
    Hypothesis generates at an even rate, where a one-in-eight integer comes up unevenly from one
    run to the next).  A long batch is a usual one lengthened: the same choices, its first
    sequence given more keys (whole blocks more, about: its last key sits in the same slot of its
    last block, so that its tail is the same) and more sequences after it, so that a failure the
    usual batch of the same choices shows can shrink back to it, and one only a long batch shows
    shrinks toward its fewest sequences and keys."""

    min_sequences: int
    max_sequences: int
    min_keys: int
    max_keys: int
    coins: int


@dataclass(frozen=True)
class Size:
    """How large generated batches get."""

    max_sequences: int = 16
    max_blocks_per_sequence: int = 8
    max_query_len: int = 48
    max_kv_heads: int = 4
    max_q_heads: int = 16
    long: LongBatches | None = None

    def bound(self, caps: Capabilities) -> Capabilities:
        """``caps`` with its head counts held to this size."""
        return caps.restrict(max_q_heads=min(caps.max_q_heads, self.max_q_heads))


# Under the interpreter every program runs in Python, tens of microseconds
# per operation: keep batches small.  Four sequences still mix decode,
# prefill, chunked prefill and padding; eight query heads still give every
# GQA group from 1 to 8 (5/1, 6/2 and 7/1 among them).  One batch in eight has
# five to eight sequences, the first of 1025 to 1280 keys: past the 1024-key
# boundaries (partitions, segments, tiles of 2^n keys) and past four sequences,
# so that a CPU campaign meets bugs only length or count shows.  Hypothesis
# draws them in clumps: 2 to 21 of the 150 examples of nine seeded campaigns of
# the built-in kernels, which took about half as much CPU again as without them.
INTERPRETER_LONG = LongBatches(min_sequences=5, max_sequences=8, min_keys=1025, max_keys=1280, coins=3)
INTERPRETER_SIZE = Size(max_sequences=4, max_blocks_per_sequence=5, max_query_len=16, max_kv_heads=2, max_q_heads=8,
                        long=INTERPRETER_LONG)
GPU_SIZE = Size()


def default_size(interpreter: bool) -> Size:
    return INTERPRETER_SIZE if interpreter else GPU_SIZE


def default_tier(interpreter: bool) -> str:
    """What a campaign draws when nothing says otherwise: small under the interpreter, mixed on a GPU."""
    return "small" if interpreter else "mixed"


# Entries a pool gains at each turn: from one run to the next (``pool_round``) and as a long campaign
# grows its pool (``growth``).  Each new entry is a compile on a GPU (seconds): a few at a time.
ROTATION_ENTRIES = 4


def campaign_pool(caps: Capabilities, entries: int, seed: int, *, interpreter: bool = False, tier: str = "small",
                  pool_round: int = 0, growth: int = 0) -> tuple[Specialisation, ...]:
    """A pool for ``paged_cases`` at its default size: every entry fits the batches it draws.

    A tier with production cases adds a quarter as many entries of production shapes (up to
    128 query heads, GQA groups past 16, the largest head sizes), and then whatever the pool still
    lacks of the production situations the kernel allows (``production.needed_entries``): a group
    past 16, the largest head size, a cache past 2^31 elements, a far window.  ``pool_round`` (a
    run's number) and ``growth`` (how often the campaign has grown its pool) each add ``ROTATION_ENTRIES``
    entries, those with traits the pool lacks first (``specialisations.most_novel``): the same seed
    meets other shapes from run to run and through a long campaign, and keeps its first entries
    (and their compiles)."""
    size = default_size(interpreter)
    pool = specialisation_pool(size.bound(caps), entries, seed, interpreter=interpreter,
                               max_kv_heads=size.max_kv_heads)
    if tier != "small":
        wide = wide_entries(caps, max(2, entries // 4), seed, interpreter=interpreter, known=pool)
        pool = pool + tuple(w for w in wide if w not in pool)
        pool = pool + needed_entries(caps, pool, seed, interpreter=interpreter)
    turns = ([f"round{pool_round}"] if pool_round else []) + [f"round{pool_round}-growth{g}"
                                                              for g in range(1, growth + 1)]
    for turn in turns:
        pool = pool + _rotated(caps, f"{seed}:{turn}", pool, interpreter, tier)
    return pool


def _rotated(caps: Capabilities, key: str, pool: tuple, interpreter: bool, tier: str) -> tuple[Specialisation, ...]:
    """``ROTATION_ENTRIES`` new entries for ``pool`` (half of production shapes in a tier with production cases)."""
    size = default_size(interpreter)
    small = specialisation_pool(size.bound(caps), len(pool) + 8 * ROTATION_ENTRIES, key, interpreter=interpreter,
                                max_kv_heads=size.max_kv_heads)
    if tier == "small":
        return most_novel(small, ROTATION_ENTRIES, pool)
    wide = most_novel(wide_entries(caps, 8 * ROTATION_ENTRIES, key, interpreter=interpreter, known=pool),
                      ROTATION_ENTRIES // 2, pool)
    return wide + most_novel(small, ROTATION_ENTRIES - len(wide), pool + wide)


def paged_cases(capabilities: Capabilities = Capabilities(), *,
                interpreter: bool = False, size: Size | None = None,
                poison_classes: tuple[str, ...] | None = None,
                pool: tuple[Specialisation, ...] | None = None, tier: str = "small",
                production: ProductionSize | None = None, aims: Aims | None = None) -> st.SearchStrategy[Case]:
    """A valid, poisoned paged-attention batch that ``capabilities`` accepts.

    Shrinks toward one decode sequence of one key, one KV head, the smallest
    head size with V as wide as K, no window, an unquantized cache (then per-tensor fp8, then
    per-token-head scales), and NaN in V of a single dead slot.  ``poison_classes``
    aims the poison at some dead-slot classes only (see ``strategies.poison``).
    ``pool`` fixes the compile-time part (shape, causality, window, sinks, cache dtype) to
    one of its entries (see ``strategies.specialisations``).  ``tier`` (``TIERS``) says how
    large: ``small`` at ``size``, ``production`` at ``production`` (``strategies.production``),
    or ``mixed``, which shrinks toward small.  ``aims`` (``strategies.aims``) is what production
    cases are aimed at; by default every production target within reach (``strategies.targets``).
    """
    if tier not in TIERS:
        raise ValueError(f"tier={tier!r} is not one of {TIERS}")
    small = _small_cases(capabilities, interpreter, size, poison_classes, pool)
    if tier == "small":
        return small
    production = production or production_size(interpreter)
    if aims is None:
        targets = production_targets(capabilities, production, pool)
        aims = Aims(targets.aims(targets.within_reach()))
    large = _production_cases(capabilities, interpreter, production, poison_classes, pool, aims)
    if tier == "production":
        return large

    @st.composite
    def mixed(draw) -> Case:
        return draw(large if pick(draw, ("small", "production"), MIXED_WEIGHTS) == "production" else small)

    return mixed()


def _production_cases(capabilities: Capabilities, interpreter: bool, production: ProductionSize,
                      poison_classes, pool, aims: Aims) -> st.SearchStrategy[Case]:
    fixed_parts = st.sampled_from(pool) if pool else None
    poison_classes = tuple(poison_classes) if poison_classes is not None else None
    choices, weights = (None, *aims.aims), aims.weights()
    entries: dict = {}  # the columns of each aim as drawn (``_entries_for``)

    @st.composite
    def cases(draw) -> Case:
        aim = draw_aim(draw, pick(draw, choices, weights)) if aims else None
        fixed = draw(fixed_parts) if pool else None
        if aim is not None and pool:
            # the aim's spread picks a situation the case aims at, and an entry that has it
            columns = _entries_for(capabilities, production, pool, aim, entries)
            column = columns[aim.spread % len(columns)]
            fixed = column[aim.spread // len(columns) % len(column)]
        case = production_case(draw, capabilities, production, interpreter, poison_classes, fixed, aim)
        assert capabilities.unsupported(case, interpreter=interpreter) is None, capabilities.unsupported(
            case, interpreter=interpreter)
        return case

    return cases()


def _entries_for(caps: Capabilities, production: ProductionSize, pool, aim: Aim, known: dict) -> tuple[tuple, ...]:
    """The pool entries an aimed case takes, one column per compile-time situation it aims at:
    the entries that have it (of those, the ones that also take a huge cache where it aims at one
    too); one column of every entry where it aims at none, or none has one.  ``known``: the
    columns worked out before, by kind and situations."""
    key = (aim.kind, aim.situations)
    if key not in known:
        known[key] = _columns(caps, production, pool, aim)
    return known[key]


def _columns(caps: Capabilities, production: ProductionSize, pool, aim: Aim) -> tuple[tuple, ...]:
    bounded = production.bound(caps)

    def having(situation: str, entries) -> tuple:
        return tuple(e for e in entries if entry_provides(e, situation, bounded, production, aim.kind))

    usable = (having(HUGE_OFFSETS, pool) if HUGE_OFFSETS in aim else ()) or tuple(pool)
    columns = [having(s, usable) or having(s, pool) for s in COMPILE_TIME if s in aim]
    return tuple(column for column in columns if column) or (usable,)


def _small_cases(capabilities: Capabilities, interpreter: bool, size: Size | None, poison_classes,
                 pool) -> st.SearchStrategy[Case]:
    size = size or default_size(interpreter)
    caps = size.bound(capabilities)
    # Everything that does not depend on a drawn value is built here, once per strategy.
    fixed_parts = st.sampled_from(pool) if pool else None
    free_shapes = None if pool else shapes(caps, interpreter=interpreter, max_kv_heads=size.max_kv_heads)
    free_caches = None if pool else kv_caches(caps)
    poison_classes = tuple(poison_classes) if poison_classes is not None else None
    by_block_size = {bs: _lengths(caps, size, bs) for bs in caps.block_sizes}
    long = _long_batches(caps, size)
    if long is not None:
        longer = _longer_lengths(caps, size, long)

    @st.composite
    def cases(draw) -> Case:
        # first, so that Hypothesis's search of new choice prefixes tries both kinds of batch early
        is_long = long is not None and all([draw(BOOLEANS) for _ in range(long.coins)])  # every coin drawn
        fixed = draw(fixed_parts) if pool else None
        shape = fixed.shape if fixed else draw(free_shapes)
        kv_cache = draw(kv_caches(caps, fixed.kv_cache) if fixed else free_caches)
        bs = shape.block_size
        first_lengths, more_lengths = by_block_size[bs]
        # The first sequence has a query, so every batch has at least one output row.
        first = draw(first_lengths)
        others = _uniform_lengths(caps, size, bs, first.query_len) if caps.uniform_query_len else more_lengths
        lengths = [first] + draw(others)
        # windows as wide as the usual lengths: a long batch's first sequence gets one far below it
        longest = max(x.seq_len for x in lengths)
        if long is not None:  # drawn whatever the coins say: the same choices either way
            keys, more = draw(longer)
            if is_long:
                lengths = _lengthened(lengths, keys, more, long, caps, bs)
        if fixed:
            causal, window, sinks = fixed.causal, fixed.window, fixed.sinks
        else:
            causal = draw(causal_flags(caps))
            window = draw(windows(caps, longest, bs, causal))
            sinks = draw(BOOLEANS) if caps.sinks else False

        # Which logical blocks hold live keys follows from the lengths and the
        # window alone; the real tables depend on it.
        live_blocks = [Sequence(x.query_len, x.seq_len, ()).live_blocks(window, bs) for x in lengths]
        tables = draw_block_tables(draw, lengths, live_blocks, bs)

        unpoisoned = Case(
            geometry=Geometry(shape.num_q_heads, shape.num_kv_heads, shape.head_size, bs,
                              tables.num_blocks, shape.dtype, caps.latent_rank(shape.head_size), shape.head_size_v),
            sequences=tuple(Sequence(x.query_len, x.seq_len, row) for x, row in zip(lengths, tables.rows)),
            sliding_window=window, causal=causal, sinks=sinks,
            padding_block=tables.padding_block, poison=Poison(), data_seed=0, kv_cache=kv_cache)
        poison = draw_poison(draw, unpoisoned, poison_classes)
        seed = draw(DATA_SEEDS)
        case = unpoisoned.replace(poison=poison, data_seed=seed).validate()
        assert capabilities.unsupported(case, interpreter=interpreter) is None, capabilities.unsupported(case, interpreter=interpreter)
        return case

    return cases()


DATA_SEEDS = integers(0, 2**32 - 1)


@functools.lru_cache(maxsize=256)
def _uniform_lengths(caps: Capabilities, size: Size, block_size: int, query_len: int):
    """The other sequences' list when every sequence with a query has ``query_len`` of them."""
    max_len = _longest(caps, size, block_size)
    return st.lists(sequence_lengths(caps, max_len, size.max_query_len, query_len=query_len),
                    max_size=_most_sequences(caps, size) - 1)


def _longest(caps: Capabilities, size: Size, block_size: int) -> int:
    """The longest sequence a small case may hold: the size's blocks, within the kernel's ``max_seq_len``."""
    longest = size.max_blocks_per_sequence * block_size
    return longest if caps.max_seq_len is None else min(longest, caps.max_seq_len)


def _most_sequences(caps: Capabilities, size: Size) -> int:
    return size.max_sequences if caps.max_sequences is None else min(size.max_sequences, caps.max_sequences)


def _long_batches(caps: Capabilities, size: Size) -> LongBatches | None:
    """The size's long batches, where the kernel takes them (enough keys and sequences, and one query
    length per batch not required)."""
    long = size.long
    if long is None or caps.uniform_query_len:
        return None
    if (caps.max_seq_len is not None and caps.max_seq_len < long.min_keys) or (
            caps.max_sequences is not None and caps.max_sequences < long.min_sequences):
        return None
    return long


@functools.lru_cache(maxsize=64)
def _longer_lengths(caps: Capabilities, size: Size, long: LongBatches):
    """What lengthens a batch: the first sequence's keys, and the sequences that follow the usual ones
    (as the size's usual sequences in the smallest blocks, so that they cost little)."""
    max_keys = long.max_keys if caps.max_seq_len is None else min(long.max_keys, caps.max_seq_len)
    most = long.max_sequences if caps.max_sequences is None else min(long.max_sequences, caps.max_sequences)
    more = st.lists(sequence_lengths(caps, _longest(caps, size, min(caps.block_sizes)), size.max_query_len),
                    max_size=most - 2)
    return st.tuples(integers(long.min_keys, max_keys), more)


def _lengthened(lengths: list, keys: int, more: list, long: LongBatches, caps: Capabilities,
                block_size: int) -> list:
    """A usual batch's lengths made long: its first sequence given about ``keys`` keys, its last in the
    same slot of a block as its usual length's (a prefill becomes a chunked prefill of its new
    tokens), ``more`` sequences after the others, and decodes of one key after those up to
    ``long.min_sequences``; never more than ``long.max_sequences``."""
    first = lengths[0]
    most_keys = long.max_keys if caps.max_seq_len is None else min(long.max_keys, caps.max_seq_len)
    same_slot = keys + (first.seq_len - keys) % block_size
    if same_slot > most_keys:
        same_slot -= block_size
    if same_slot >= long.min_keys:
        keys = same_slot
    first = Lengths(1, keys) if first.query_len == 1 else Lengths(min(first.query_len, keys - 1), keys)
    most = long.max_sequences if caps.max_sequences is None else min(long.max_sequences, caps.max_sequences)
    out = ([first] + lengths[1:] + more)[:most]
    fill = Lengths(1, 1) if caps.min_query_len <= 1 else Lengths(0, 0)
    return out + [fill] * (long.min_sequences - len(out))


def _lengths(caps: Capabilities, size: Size, block_size: int):
    """The first sequence's lengths (it has a query) and the other sequences' list, for one block size."""
    max_len = _longest(caps, size, block_size)
    return (sequence_lengths(caps, max_len, size.max_query_len, padding=False),
            st.lists(sequence_lengths(caps, max_len, size.max_query_len), max_size=_most_sequences(caps, size) - 1))
