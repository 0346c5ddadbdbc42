"""A text picture of a case's block tables: which slots are live, expired,
tail, freed, reused or poisoned.  It goes into repros and failure messages."""
from __future__ import annotations

import numpy as np

from nanfuzz.reference.case import CHUNKED_PREFILL, NULL_BLOCK, PADDING, Case, Sequence
from nanfuzz.reference.features import poison_target, poisoned_mask
from nanfuzz.reference.semantics import live_key_range, liveness

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
    if kv.extended:
        return f", {kv.label()} cache"
    if kv.token_head:
        return f", {kv.dtype} cache with per-token-head scales"
    return f", {kv.dtype} cache (k_scale {kv.k_scale:g}, v_scale {kv.v_scale:g})"


# A production-size case has thousands of table entries: the picture shows the first
# sequences, and of each the entries around its live range's ends, eliding the rest.
MAX_SEQUENCES_SHOWN = 16
ENTRIES_AT_EACH_END = 3


def _shown_entries(seq: Sequence, lo: int, bs: int) -> list[int | None]:
    """The logical entries of ``seq`` the picture draws, None where it elides a run."""
    width = len(seq.block_table)
    keep: set[int] = set()
    for anchor in (0, lo // bs, seq.used_blocks(bs) - 1, width - 1):
        keep.update(range(max(0, anchor - ENTRIES_AT_EACH_END + 1), min(width, anchor + ENTRIES_AT_EACH_END)))
    shown: list[int | None] = []
    for j in sorted(keep):
        if shown and shown[-1] is not None and j > shown[-1] + 1:
            shown.append(None)
        shown.append(j)
    return shown


def _head(g) -> str:
    """``head 64``, ``head K 192 / V 128``, or for a latent cache ``latent cache 64 + rope 16 (V: the first 64)``."""
    if g.latent:
        return f"latent cache {g.latent_rank} + rope {g.rope_dim} (V: the first {g.latent_rank})"
    if g.diff_kv:
        return f"head K {g.head_size} / V {g.head_size_v}"
    return f"head {g.head_size}"


# Blocks in no table named one by one; the rest are counted.
MAX_LOOSE_BLOCKS_SHOWN = 16


def _loose_blocks(blocks: np.ndarray, poisoned_slots: np.ndarray, bs: int) -> str:
    """``blocks in no table: block 0 (0 of 16 slots poisoned), block 5 (16 of 16 slots poisoned)``."""
    shown = ", ".join(f"block {b} ({n} of {bs} slots poisoned)" for b, n in
                      zip(blocks[:MAX_LOOSE_BLOCKS_SHOWN].tolist(), poisoned_slots[:MAX_LOOSE_BLOCKS_SHOWN].tolist()))
    rest = blocks.size - MAX_LOOSE_BLOCKS_SHOWN
    more = (f", and {rest} more block{'s' if rest > 1 else ''} ({int(poisoned_slots[MAX_LOOSE_BLOCKS_SHOWN:].sum())} "
            f"of {rest * bs} slots poisoned)") if rest > 0 else ""
    return f"blocks in no table: {shown}{more}"


def picture(case: Case) -> str:
    g = case.geometry
    bs = g.block_size
    poisoned = poisoned_mask(case)
    live_any = liveness(case)
    window = f"window {case.sliding_window}" if case.sliding_window else "no window"
    lines = [
        f"{len(case.sequences)} sequence(s), block_size {bs}, {g.num_blocks} physical blocks, "
        f"Hq {g.num_q_heads} / Hkv {g.num_kv_heads}, {_head(g)}, {g.dtype}, "
        f"{'causal' if case.causal else 'non-causal'}, {window}{', sinks' if case.sinks else ''}, seed {case.data_seed}"
        + _kv_cache(case),
        LEGEND.format(value=case.poison.value, tensors=poison_target(case)),
    ]
    live_blocks = [seq.live_blocks(case.sliding_window, bs) for seq in case.sequences]
    owners: dict[int, list[int]] = {}
    for s, seq in enumerate(case.sequences):
        for j in live_blocks[s]:
            owners.setdefault(seq.block_table[j], []).append(s)
    for s, seq in enumerate(case.sequences[:MAX_SEQUENCES_SHOWN]):
        lo, hi = live_key_range(case, seq)
        lines.append(f"seq {s}: {_kind(seq)}, query_len {seq.query_len}, seq_len {seq.seq_len}, "
                     f"context {seq.context_len}, live keys [{lo}, {hi})")
        used = seq.used_blocks(bs)
        shown = _shown_entries(seq, lo, bs) if len(seq.block_table) > 4 * ENTRIES_AT_EACH_END else range(
            len(seq.block_table))
        for j in shown:
            if j is None:
                lines.append("  ...")
                continue
            block = seq.block_table[j]
            cells = []
            for offset in range(bs):
                key = j * bs + offset
                if j >= used:
                    c = "p"
                elif key >= seq.seq_len:
                    c = "t"
                elif lo <= key < hi:
                    c = "o"
                elif live_any[block, offset]:
                    c = "r"
                else:
                    c = "x"
                if poisoned[block, offset]:
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
                notes.append(("shared with" if live_here else "reused by") + " seq " + ",".join(map(str, others[:8]))
                             + (",..." if len(others) > 8 else ""))
            elif j < used and j not in live_blocks[s]:
                if block != NULL_BLOCK:
                    notes.append("freed (expired)")
            lines.append(f"  logical {j:>2} -> block {block:>3} [{''.join(cells)}] {'; '.join(notes)}".rstrip())
    if len(case.sequences) > MAX_SEQUENCES_SHOWN:
        lines.append(f"... {len(case.sequences) - MAX_SEQUENCES_SHOWN} more sequences")
    referenced = np.zeros(g.num_blocks, dtype=bool)
    for seq in case.sequences:
        referenced[list(seq.block_table)] = True
    loose = np.flatnonzero(~referenced)
    if loose.size:
        lines.append(_loose_blocks(loose, poisoned[loose].sum(axis=1), bs))
    return "\n".join(lines)
