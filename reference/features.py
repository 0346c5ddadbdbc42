"""Named situations a case exercises: for coverage tallies and repro summaries."""
from __future__ import annotations

from nanfuzz.reference.case import NULL_BLOCK, PADDING, Case
from nanfuzz.reference.semantics import Dead, live_key_range, slot_liveness, slot_reasons

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


def poisoned_slots(case: Case) -> list[tuple[int, int]]:
    """The dead slots the poison specification actually fills."""
    reasons = slot_reasons(case)
    sites = case.poison.sites
    if sites is None:
        return [(b, o) for b, row in enumerate(reasons) for o, why in enumerate(row) if why]
    chosen = set()
    for site in sites:
        offsets = range(case.geometry.block_size) if site.offset is None else (site.offset,)
        chosen.update((site.block, o) for o in offsets if reasons[site.block][o])
    return sorted(chosen)


def poison_target(case: Case) -> str:
    """What the poison is in: "V", "KV", "V scales" (per-token-head scale caches), "K codes and scales"."""
    p = case.poison
    sides = p.tensors.upper()
    return {"data": sides, "scales": f"{sides} scales", "data+scales": f"{sides} codes and scales"}[p.parts]


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
    if case.sinks:
        found.add("sinks")
    reasons = slot_reasons(case)
    for b, o in poisoned_slots(case):
        for name, flag in POISON_CLASS_FLAGS.items():
            if reasons[b][o] & flag:
                found.add("poison:" + name)
    found.add("poison-value:" + case.poison.value)
    found.add("poison-tensors:" + case.poison.tensors)
    found.add("kv:" + case.kv_cache.label())
    if case.poison.hits_scales and poisoned_slots(case):
        found.add("poison:scale")
    if case.poison.sites is not None and len(poisoned_slots(case)) == 1:
        found.add("poison:single-slot")
    live = slot_liveness(case)
    kinds = set()
    for seq in case.sequences:
        kinds.add(seq.kind)
        if seq.seq_len % bs:
            found.add("partial-last-block")
        lo, hi = live_key_range(case, seq)
        used = seq.used_blocks(bs)
        for j in range(used):
            start, end = j * bs, min((j + 1) * bs, seq.seq_len)
            block = seq.block_table[j]
            if start < lo < end:
                found.add("straddling-window")
            if end <= lo and seq.query_len:
                found.add("expired-block")
                if block == NULL_BLOCK:
                    found.add("expired-to-null")
                elif any(live[block]):
                    found.add("reused-block")
    found |= kinds
    if len(kinds - {PADDING}) > 1:
        found.add("mixed")
    users: dict[int, int] = {}
    for seq in case.sequences:
        for j in seq.live_blocks(case.sliding_window, bs):
            users[seq.block_table[j]] = users.get(seq.block_table[j], 0) + 1
    if any(n > 1 for n in users.values()):
        found.add("shared-block")
    if len(case.sequences) > 1:
        found.add("multi-sequence")
    return found
