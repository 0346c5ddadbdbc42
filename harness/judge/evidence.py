"""Turning bad output rows into evidence a kernel engineer can act on."""
from __future__ import annotations

import bisect

import numpy as np
import torch

from nanfuzz.reference.case import Case
from nanfuzz.reference.features import POISON_CLASS_FLAGS, poison_target, poisoned_mask
from nanfuzz.reference.semantics import reasons

MAX_LISTED = 12
# Runs of poisoned slots listed per class and sequence (a production case can reach thousands).
MAX_RUNS = 32


def sequence_of_tokens(case: Case, tokens: list[int]) -> list[int]:
    starts = case.query_start_loc()
    return [bisect.bisect_right(starts, t) - 1 for t in tokens]


def reachable_poison(case: Case, seq_index: int) -> dict[str, list[list[int]]]:
    """Poisoned slots in blocks that sequence's table points at, by dead-slot class.

    Each class maps to ``[[block, first_offset, last_offset], ...]`` runs, the first
    ``MAX_RUNS`` of them.
    """
    why = reasons(case)
    blocks = np.unique(np.asarray(case.sequences[seq_index].block_table, dtype=np.int64))
    poisoned = poisoned_mask(case)[blocks]
    found: dict[str, list[list[int]]] = {}
    for name, flag in POISON_CLASS_FLAGS.items():
        hit = poisoned & ((why[blocks] & int(flag)) != 0)
        if not hit.any():
            continue
        runs: list[list[int]] = []
        for row, offset in np.argwhere(hit).tolist():
            block = int(blocks[row])
            if runs and runs[-1][0] == block and runs[-1][2] == offset - 1:
                runs[-1][2] = offset
            elif len(runs) < MAX_RUNS:
                runs.append([block, offset, offset])
            else:
                break
        found[name] = runs
    return found


def bad_rows(mask: torch.Tensor) -> tuple[list[int], list[int], int]:
    """Tokens and heads with any bad element in a ``[T, H, D]`` mask, and the count of bad rows."""
    rows = mask.any(dim=-1)                       # [T, H]
    tokens = rows.any(dim=1).nonzero().flatten().tolist()
    heads = rows.any(dim=0).nonzero().flatten().tolist()
    return tokens, heads, int(rows.sum())


def describe_rows(case: Case, mask: torch.Tensor) -> dict:
    tokens, heads, count = bad_rows(mask)
    seqs = sorted(set(sequence_of_tokens(case, tokens)))
    found = {
        "bad_rows": count,
        "total_rows": case.num_tokens * case.geometry.num_q_heads,
        "tokens": tokens[:MAX_LISTED],
        "heads": heads[:MAX_LISTED],
        "sequences": seqs[:MAX_LISTED],
        "reachable_poison": {str(s): reachable_poison(case, s) for s in seqs[:MAX_LISTED]},
    }
    if case.poison.parts != "data":
        found["poison_in"] = poison_target(case)
    return found


# Where non-finite rows come from when no slot a row's sequence lists is poisoned.
NO_POISON_IN_TABLE = ("no poisoned slot in its table (the NaN came from elsewhere: blocks it does not list, "
                      "or past the end of a tensor)")


def span(xs: list[int]) -> str:
    if not xs:
        return "-"
    if xs == list(range(xs[0], xs[-1] + 1)) and len(xs) > 2:
        return f"{xs[0]}-{xs[-1]}"
    return ",".join(map(str, xs[:6])) + (",..." if len(xs) > 6 else "")


def classes_line(evidence: dict) -> str:
    classes = sorted({c for per_seq in evidence["reachable_poison"].values() for c in per_seq})
    line = ", ".join(classes) if classes else NO_POISON_IN_TABLE
    return line + (f" (poison in {evidence['poison_in']})" if "poison_in" in evidence else "")
