"""Named situations a case exercises: for coverage tallies and repro summaries."""
from __future__ import annotations

import numpy as np

from nanfuzz.reference.case import CHUNKED_PREFILL, DECODE, NULL_BLOCK, PADDING, Case
from nanfuzz.reference.semantics import Dead, live_key_range, liveness, reasons

# The dead-slot classes a campaign can aim its poison at, by name; a case that
# poisons a slot of class NAME has the feature "poison:NAME".
POISON_CLASS_FLAGS = {
    "tail": Dead.TAIL,
    "out-of-window": Dead.OUT_OF_WINDOW,
    "null-block": Dead.NULL_BLOCK,
    "padding": Dead.PADDING,
    "unreferenced": Dead.UNREFERENCED,
}
POISON_CLASS_NAMES = tuple(POISON_CLASS_FLAGS)


def poisoned_mask(case: Case) -> np.ndarray:
    """bool ``[num_blocks, block_size]``: the dead slots the poison specification actually fills,
    and in a large case every slot of a block that holds no live key and that no site names
    (it holds NaN in every run: ``reference.device_build``)."""
    dead = reasons(case) != 0
    sites = case.poison.sites
    if sites is None:
        return dead
    if case.large:
        named = np.zeros(dead.shape[0], dtype=bool)
        named[[site.block for site in sites]] = True
        background = ~liveness(case).any(axis=1) & ~named
        return _named_slots(case, dead) | background[:, None]
    return _named_slots(case, dead)


def _named_slots(case: Case, dead: np.ndarray) -> np.ndarray:
    sites = case.poison.sites
    named = np.zeros_like(dead)
    whole = [site.block for site in sites if site.offset is None]
    if whole:
        named[whole] = True
    single = [(site.block, site.offset) for site in sites if site.offset is not None]
    if single:
        blocks, offsets = zip(*single)
        named[list(blocks), list(offsets)] = True
    return named & dead


def poisoned_slots(case: Case) -> list[tuple[int, int]]:
    """The dead slots the poison specification actually fills, in block order."""
    return list(map(tuple, np.argwhere(poisoned_mask(case)).tolist()))


def poison_target(case: Case) -> str:
    """What the poison is in: "V", "KV", "V scales" (per-token-head scale caches), "K codes and scales",
    "V zero points", "KV codes, scales and zero points"."""
    p = case.poison
    sides = p.tensors.upper()
    if case.geometry.latent:  # one cache: V is its latent part, what only K reads its rotary part
        return {"v": "the latent part (V)", "k": "the rope part", "kv": "the latent and rope parts"}[p.tensors]
    if p.parts == "data":
        return sides
    names = [{"data": "codes", "scales": "scales", "zeros": "zero points"}[part] for part in p.part_names()]
    return f"{sides} " + (names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1])


def case_features(case: Case) -> set[str]:
    g = case.geometry
    bs = g.block_size
    found: set[str] = {f"dtype:{g.dtype}", "causal" if case.causal else "non-causal"}
    if case.sliding_window:
        found.add("window")
        if case.sliding_window == 1:
            found.add("window:1")
        if not case.causal:
            found.add("non-causal+window")
    if g.num_q_heads != g.num_kv_heads:
        found.add("gqa")
    if g.latent:
        found.add(f"mla:{g.latent_rank}+{g.rope_dim}")
    if g.diff_kv:
        found.add("v-head-size!=k")
    if case.sinks:
        found.add("sinks")
    why = reasons(case)
    poisoned = poisoned_mask(case)
    poisoned_why = np.bitwise_or.reduce(why[poisoned]) if poisoned.any() else 0
    for name, flag in POISON_CLASS_FLAGS.items():
        if poisoned_why & int(flag):
            found.add("poison:" + name)
    found.add("poison-value:" + case.poison.value)
    found.add("poison-tensors:" + case.poison.tensors)
    found.add("kv:" + case.kv_cache.label())
    count = int(poisoned.sum())
    if case.poison.hits_scales and count:
        found.add("poison:scale")
    if case.poison.hits_zeros and count:
        found.add("poison:zero-point")
    if case.poison.sites is not None and count == 1:
        found.add("poison:single-slot")
    held = liveness(case).any(axis=1)  # blocks holding keys some query reads
    kinds = set()
    users: list[np.ndarray] = []
    for seq in case.sequences:
        kinds.add(seq.kind)
        if seq.seq_len % bs:
            found.add("partial-last-block")
        lo, _ = live_key_range(case, seq)
        used = seq.used_blocks(bs)
        if lo % bs and lo < seq.seq_len and seq.query_len:
            found.add("straddling-window")
        expired = lo // bs if seq.query_len else 0  # logical blocks wholly below the live range
        if expired:
            found.add("expired-block")
            blocks = np.asarray(seq.block_table[:expired], dtype=np.int64)
            if (blocks == NULL_BLOCK).any():
                found.add("expired-to-null")
            if (held[blocks] & (blocks != NULL_BLOCK)).any():
                found.add("reused-block")
        live_logical = seq.live_blocks(case.sliding_window, bs)
        if live_logical:
            first = min(live_logical)
            users.append(np.asarray(seq.block_table[first:first + len(live_logical)], dtype=np.int64))
    found |= kinds
    if kinds - {PADDING}:
        found.add("batch:" + batch_kind(case))
    if len(kinds - {PADDING}) > 1:
        found.add("mixed")
    if users:
        _, counts = np.unique(np.concatenate(users), return_counts=True)
        if (counts > 1).any():
            found.add("shared-block")
    if len(case.sequences) > 1:
        found.add("multi-sequence")
    return found | size_features(case)


# Sizes where real kernels switch code paths (split-KV decode past a few thousand keys,
# offsets past 2^31 elements), as features: a campaign's statistics say which it reached.
SIZE_FEATURES = ("large", "seq-len>=1024", "seq-len>=32768", "sequences>=128", "query-len>=1024",
                 "expired>=1024", "far-window", "gqa-group>16", "q-heads>=64", "head-size>=192", "cache>=8GiB",
                 "offsets>2^31")
# A window far below seq_len: at most an eighth of a sequence of at least this many keys, so that
# most of its tiles and partitions lie wholly outside the window (skipped, or loaded and masked).
FAR_WINDOW_KEYS = 1024
FAR_WINDOW_RATIO = 8

# What a batch is, by the kinds of its sequences with a query: decode only, prefills without
# context only, prefills with some context (chunked), or decode beside prefills.
BATCH_KINDS = ("decode", "prefill", "chunked-prefill", "mixed")


def batch_kind(case: Case) -> str:
    """The case's kind of batch (``BATCH_KINDS``), of a case with at least one query."""
    kinds = {s.kind for s in case.sequences if s.query_len}
    assert kinds, "a batch without a query has no kind"
    if kinds == {DECODE}:
        return "decode"
    if DECODE in kinds:
        return "mixed"
    return "chunked-prefill" if CHUNKED_PREFILL in kinds else "prefill"


def far_window(window: int, seq_len: int) -> bool:
    """Does a window of ``window`` keys lie far below a sequence of ``seq_len`` keys?"""
    return 0 < window and seq_len >= FAR_WINDOW_KEYS and FAR_WINDOW_RATIO * window <= seq_len


def size_features(case: Case) -> set[str]:
    g = case.geometry
    found = {"large"} if case.large else set()
    longest = case.max_seq_len
    if longest >= 1024:
        found.add("seq-len>=1024")
    if longest >= 32768:
        found.add("seq-len>=32768")
    if len(case.sequences) >= 128:
        found.add("sequences>=128")
    if case.max_query_len >= 1024:
        found.add("query-len>=1024")
    if any(s.live_range(case.sliding_window)[0] >= 1024 for s in case.sequences if s.query_len):
        found.add("expired>=1024")
    if any(far_window(case.sliding_window, s.seq_len) for s in case.sequences if s.query_len):
        found.add("far-window")
    if g.queries_per_kv > 16:
        found.add("gqa-group>16")
    if g.num_q_heads >= 64:
        found.add("q-heads>=64")
    if max(g.head_size, g.v_head_size) >= 192:
        found.add("head-size>=192")
    per_block = g.block_size * g.num_kv_heads * max(g.head_size, g.v_head_size)
    element = 1 if case.kv_cache.key.quantized else (4 if g.dtype == "float32" else 2)
    if g.num_blocks * g.block_size * g.num_kv_heads * g.slot_width * element >= 8 << 30:
        found.add("cache>=8GiB")
    highest = max((max(s.block_table[:s.used_blocks(g.block_size)], default=0) for s in case.sequences), default=0)
    if highest * per_block >= 1 << 31:
        found.add("offsets>2^31")
    return found
