"""The block-table picture: its lines say what they mean."""
from __future__ import annotations

from dataclasses import replace

from nanfuzz.harness.report.picture import picture
from nanfuzz.reference.case import Poison, PoisonSite
from tests.cases import consecutive_case


def test_a_block_in_no_table_is_named_as_a_block_with_its_poisoned_slots():
    # blocks 0 (the null block) and 2 are in no table: only one slot of block 2 is poisoned
    case = consecutive_case([(1, 5)], spare_entries=0, poison=Poison("nan", "v", (PoisonSite(1, 7), PoisonSite(2, 3))))
    last = picture(case).splitlines()[-1]
    assert last == "blocks in no table: block 0 (0 of 16 slots poisoned), block 2 (1 of 16 slots poisoned)"


def test_past_sixteen_blocks_in_no_table_the_rest_are_counted():
    case = consecutive_case([(1, 5)], spare_entries=0)
    case = replace(case, geometry=replace(case.geometry, num_blocks=20)).validate()  # blocks 0 and 2..19 unused
    last = picture(case).splitlines()[-1]
    assert last.startswith("blocks in no table: block 0 (16 of 16 slots poisoned), block 2 (16 of 16 slots")
    assert last.endswith("block 16 (16 of 16 slots poisoned), and 3 more blocks (48 of 48 slots poisoned)")
