"""A text picture of a case's block tables: which slots are live, expired,
tail, freed, reused or poisoned.  It goes into repros and failure messages."""
from __future__ import annotations

from nanfuzz.reference.case import CHUNKED_PREFILL, NULL_BLOCK, PADDING, Case, Sequence
from nanfuzz.reference.features import poison_target, poisoned_slots
from nanfuzz.reference.semantics import live_key_range, slot_liveness

LEGEND = ("slots: o live  x expired (out of window)  t tail past seq_len  p padding entry  "
          "r dead here, live for another sequence;  UPPER CASE = poisoned ({value} in {tensors})")


def _kind(seq: Sequence) -> str:
    if seq.kind == PADDING and seq.seq_len:
        return "no query"  # keys in the cache, but no query this step
    return {PADDING: "padding", CHUNKED_PREFILL: "chunked prefill"}.get(seq.kind, seq.kind)


def _kv_cache(case: Case) -> str:
    kv = case.kv_cache
    if not kv.quantized:
        return ""
    if kv.token_head:
        return f", {kv.dtype} cache with per-token-head scales"
    return f", {kv.dtype} cache (k_scale {kv.k_scale:g}, v_scale {kv.v_scale:g})"


def picture(case: Case) -> str:
    g = case.geometry
    bs = g.block_size
    poisoned = set(poisoned_slots(case))
    live_any = slot_liveness(case)
    window = f"window {case.sliding_window}" if case.sliding_window else "no window"
    lines = [
        f"{len(case.sequences)} sequence(s), block_size {bs}, {g.num_blocks} physical blocks, "
        f"Hq {g.num_q_heads} / Hkv {g.num_kv_heads}, head {g.head_size}, {g.dtype}, "
        f"{'causal' if case.causal else 'non-causal'}, {window}{', sinks' if case.sinks else ''}, seed {case.data_seed}"
        + _kv_cache(case),
        LEGEND.format(value=case.poison.value, tensors=poison_target(case)),
    ]
    live_blocks = [seq.live_blocks(case.sliding_window, bs) for seq in case.sequences]
    owners: dict[int, list[int]] = {}
    for s, seq in enumerate(case.sequences):
        for j in live_blocks[s]:
            owners.setdefault(seq.block_table[j], []).append(s)
    for s, seq in enumerate(case.sequences):
        lo, hi = live_key_range(case, seq)
        lines.append(f"seq {s}: {_kind(seq)}, query_len {seq.query_len}, seq_len {seq.seq_len}, "
                     f"context {seq.context_len}, live keys [{lo}, {hi})")
        used = seq.used_blocks(bs)
        for j, block in enumerate(seq.block_table):
            cells = []
            for offset in range(bs):
                key = j * bs + offset
                if j >= used:
                    c = "p"
                elif key >= seq.seq_len:
                    c = "t"
                elif lo <= key < hi:
                    c = "o"
                elif live_any[block][offset]:
                    c = "r"
                else:
                    c = "x"
                if (block, offset) in poisoned:
                    c = c.upper()
                cells.append(c)
            notes = []
            if block == NULL_BLOCK:
                notes.append("null block")
            if j >= used:
                notes.append("padding")
            others = [o for o in owners.get(block, []) if o != s]
            if others:
                live_here = s in owners.get(block, [])
                notes.append(("shared with" if live_here else "reused by") + " seq " + ",".join(map(str, others)))
            elif j < used and j not in live_blocks[s]:
                if block != NULL_BLOCK:
                    notes.append("freed (expired)")
            lines.append(f"  logical {j:>2} -> block {block:>3} [{''.join(cells)}] {'; '.join(notes)}".rstrip())
    referenced = {b for seq in case.sequences for b in seq.block_table}
    loose = [b for b in range(g.num_blocks) if b not in referenced]
    if loose:
        counts = ", ".join(f"{b} ({sum((b, o) in poisoned for o in range(bs))}/{bs} poisoned)" for b in loose)
        lines.append(f"blocks in no table: {counts}")
    return "\n".join(lines)
