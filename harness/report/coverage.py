"""Read coverage over a campaign: which dead-slot classes the kernel's loads addressed.

Each example's check says which dead slots its poisoned run's loads addressed
(``Outcome.reads``, traced under Triton's interpreter: ``harness.judge.reads``).
Its situations go into the campaign's ``Statistics`` beside the case's own
(``observed``), so jobs merge them and the summary JSON and the gate carry them:

    reads:traced                the example's loads were traced
    reads:<class>               they addressed a dead slot of that class
    reads:<input>:<class>       ... of that input (key_cache, value_cache, q, ...)
    reads-unused:<input>:<class>  ... and the example passed: the value never reached the output
    layout:indexed              the adapter handed the kernel index buffers (``reference.layouts``)
    layout:<class>              ... and an entry of them points at a dead slot of that class

``table`` sets the share addressed beside the share poisoned, class by class;
``claim`` says what a PASS covers (the classes the kernel's loads reached, and those never);
``unused_note`` is the campaign's note for dead slots loaded and then masked.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from nanfuzz.reference.features import POISON_CLASS_NAMES

if TYPE_CHECKING:
    from nanfuzz.harness.judge.outcome import Outcome
    from nanfuzz.harness.report.statistics import Statistics

TRACED = "reads:traced"
PREFIXES = ("reads:", "reads-unused:")
LAYOUT = "layout:"
REDZONES = "redzones"
CLASSES = (*POISON_CLASS_NAMES, REDZONES)
CACHES = ("key_cache", "value_cache")
UNUSED_NOTE = "passing examples whose loads addressed dead slots the output never used"
NOT_MEASURED = ("dead slots addressed: not measured (only a Triton launch's loads are traced, and only under "
                "Triton's interpreter, --device cpu)")


def observed(outcome: Outcome) -> set[str]:
    """What one example's check saw: the dead-slot classes its index buffers point at, and the read
    coverage of a traced run."""
    found = {f"{LAYOUT}{cls}" for cls in outcome.layout}
    reads = outcome.reads
    if not reads or not reads.get("traced"):
        return found
    found.add(TRACED)
    passed = outcome.verdict.value == "PASS"
    for name, classes in reads["addressed"].items():
        for cls in classes:
            found |= {f"reads:{cls}", f"reads:{name}:{cls}"}
            if passed:
                found.add(f"reads-unused:{name}:{cls}")
    return found


def _inputs(statistics: Statistics) -> list[str]:
    """The inputs some example's loads addressed dead slots of, the caches first."""
    seen = {name.split(":")[1] for name in statistics.counts if name.startswith("reads:") and name.count(":") == 2}
    return [*CACHES, *sorted(seen - set(CACHES))]


def table(statistics: Statistics) -> str:
    """Per dead-slot class: the share of examples that poisoned it, that addressed it, and per input."""
    traced = statistics.counts[TRACED]
    if not statistics.examples:
        return ""
    if not traced:
        return NOT_MEASURED
    inputs = _inputs(statistics)
    header = ("class", "poisoned", "addressed", *inputs)
    rows = [header]
    for cls in CLASSES:
        poisoned = "-" if cls == REDZONES else _share(statistics.counts[f"poison:{cls}"], statistics.examples)
        rows.append((cls, poisoned, _share(statistics.counts[f"reads:{cls}"], traced),
                     *(_share(statistics.counts[f"reads:{name}:{cls}"], traced) for name in inputs)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [f"dead slots poisoned, and addressed by the kernel's loads (traced in {traced} of "
             f"{statistics.examples} examples, masked-off lanes left out)"]
    for row in rows:
        lines.append("  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    lines.append("  " + claim(statistics))
    return "\n".join(lines)


def claim(statistics: Statistics) -> str:
    """What a PASS covers: the dead-slot classes the kernel's loads addressed (their poison was loaded
    and kept out of the output) and those they never addressed (not read at all: the PASS says
    nothing of how the kernel would mask them)."""
    traced = statistics.counts[TRACED]
    if not traced:
        return NOT_MEASURED
    reached = []
    for cls in CLASSES:
        names = [n for n in _inputs(statistics) if statistics.counts[f"reads:{n}:{cls}"]]
        if names:
            reached.append(f"{cls} ({', '.join(names)})")
    never = [cls for cls in CLASSES if not statistics.counts[f"reads:{cls}"]]
    addressed = "; ".join(reached) if reached else "no dead slot"
    return (f"dead slots its loads addressed in {traced} traced examples: {addressed}"
            + (f"; never addressed: {', '.join(never)}" if never and reached else ""))


def unused_note(kernel: str, statistics: Statistics) -> str | None:
    """The note for a kernel that loaded dead slots in passing examples (their values never reached
    its output), naming each input and class; None when it never did."""
    unused = {name.partition(":")[2]: n for name, n in statistics.counts.items() if name.startswith("reads-unused:")}
    if not unused:
        return None
    listed = ", ".join(f"{what.replace(':', ' ')} in {n}" for what, n in sorted(unused.items(), key=lambda x: -x[1]))
    return (f"{kernel}: {UNUSED_NOTE} ({listed} "
            f"examples of {statistics.counts[TRACED]} traced): the kernel loads them and masks their values "
            "afterwards; --strict-reads makes this a finding (DEAD_READ)")


def _share(count: int, total: int) -> str:
    return f"{100 * count / total:.1f}%" if total else "-"
