"""split_decode: a split-KV decode wrong only at production size, and its fix."""
import pytest

from nanfuzz.harness.campaign.runner import fuzz
from nanfuzz.harness.judge.check import Verdict, check
from nanfuzz.harness.kernels.split_decode import PARTITION_KEYS, _work_items
from nanfuzz.harness.registry import builtin_kernels
from nanfuzz.reference.case import Case, Geometry, Poison, Sequence

KERNELS = builtin_kernels()
OLD, FIXED = KERNELS["split_decode@drops-last-partition"], KERNELS["split_decode@masked"]


def _decodes(*lengths, window=0, block_size=16):
    rows, next_id = [], 1
    width = max(-(-n // block_size) for n in lengths)
    for n in lengths:
        used = -(-n // block_size)
        rows.append(tuple(range(next_id, next_id + used)) + (0,) * (width - used))
        next_id += used
    return Case(Geometry(4, 2, 64, block_size, next_id, "float16"),
                tuple(Sequence(1, n, row) for n, row in zip(lengths, rows)), sliding_window=window,
                poison=Poison("nan", "kv", None), data_seed=1).validate()


@pytest.mark.parametrize("lengths, window, caught", [
    ((1500,), 0, True),          # the last partition [1024, 1500) is lost
    ((2048,), 0, False),         # a multiple of the partition: nothing to lose
    ((700, 40), 0, False),       # one partition: the single-pass kernel
    ((3000,), 100, True),        # every live key in the lost partition: 0 / 0
    ((2100, 40), 600, True),
], ids=["partial-last", "multiple", "one-pass", "window-in-the-last", "mixed-window"])
def test_the_old_merge_loses_the_last_partial_partition(lengths, window, caught, nanfuzz_device):
    case = _decodes(*lengths, window=window)
    old, fixed = check(OLD, case, nanfuzz_device), check(FIXED, case, nanfuzz_device)
    assert fixed.verdict is Verdict.PASS, fixed.summary
    assert (old.verdict is not Verdict.PASS) is caught, old.summary
    if caught:
        assert old.verdict in (Verdict.MISMATCH, Verdict.NONFINITE)
    split = max(lengths) > PARTITION_KEYS
    assert ("_partition_kernel" in fixed.paths) is split and ("_paged_decode_kernel" in fixed.paths) is not split


def test_partitions_below_the_window_are_never_launched():
    sequences, parts, _, firsts = _work_items(_decodes(5000, window=1500))
    assert parts.tolist() == [3, 4] and firsts.tolist() == [3]  # live keys [3500, 5000)


def test_a_campaign_catches_the_old_merge_and_passes_the_fix(tmp_path, nanfuzz_device):
    caught = fuzz(OLD, device=nanfuzz_device, max_examples=40, seed=1, use_database=False, state_dir=tmp_path)
    assert caught.failed and caught.failure.verdict in (Verdict.MISMATCH, Verdict.NONFINITE), caught.notes
    case = caught.failing_case
    # shrunk: one sequence just past a partition, and at most one more of one key (the old merge also
    # writes NaN into a short sequence's row beside a split one, a NONFINITE that sequence alone lacks)
    assert PARTITION_KEYS < case.max_seq_len < 2 * PARTITION_KEYS and len(case.sequences) <= 2
    assert all(s.seq_len == 1 for s in case.sequences if s.seq_len <= PARTITION_KEYS)
    passed = fuzz(FIXED, device=nanfuzz_device, max_examples=25, seed=1, use_database=False, state_dir=tmp_path)
    assert not passed.failed and passed.statistics.share("path:_partition_kernel") > 0
