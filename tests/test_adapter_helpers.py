"""The public helpers an adapter converts the canonical batch with, and the public kernel-file loader."""
from __future__ import annotations

import pytest
import torch

import nanfuzz
from nanfuzz.reference.case import Case, Geometry, Sequence
from nanfuzz.reference.errors import NanfuzzError
from nanfuzz.reference.materialize import materialize
from nanfuzz.reference.semantics import slot_liveness, slot_reasons

# Sequence 0 decodes at position 5 with a window of 3 (keys 3..5 live, 0..2 expired); sequence 1 pads;
# sequence 2 is a chunked prefill of 2 tokens over 9 keys.  Blocks of 4; padding entries point at 0.
CASE = Case(Geometry(2, 1, 32, 4, 8, "float16"),
            (Sequence(1, 6, (3, 5, 0)), Sequence(0, 0, (0, 0, 0)), Sequence(2, 9, (1, 2, 4))), sliding_window=3).validate()


@pytest.fixture(scope="module")
def batch():
    return materialize(CASE)


def test_scheduled_leaves_out_sequences_without_a_query(batch):
    kept = nanfuzz.scheduled(batch)
    assert kept.indices == (0, 2) and len(kept) == 2
    assert kept.block_table.tolist() == [[3, 5, 0], [1, 2, 4]]
    assert kept.seq_lens.tolist() == [6, 9]
    assert kept.query_start_loc.tolist() == [0, 1, 3]  # the rows of batch.q are the scheduled ones, in order
    assert (kept.max_seq_len, kept.max_query_len) == (9, 2)


def test_scheduled_hands_back_the_batch_s_own_tensors_when_every_sequence_has_a_query():
    case = CASE.replace(sequences=(CASE.sequences[0], CASE.sequences[2]))
    batch = materialize(case)
    assert nanfuzz.scheduled(batch).block_table is batch.block_table  # its redzones stay around it


def test_live_key_ranges_follow_the_window():
    assert nanfuzz.live_key_ranges(CASE) == [(3, 6), (0, 0), (5, 9)]
    assert nanfuzz.live_key_ranges(CASE.replace(sliding_window=0)) == [(0, 6), (0, 0), (0, 9)]


def _slot(case, seq, key):
    s = case.sequences[seq]
    return s.block_table[key // case.geometry.block_size] * case.geometry.block_size + key % case.geometry.block_size


def test_token_indices_of_page_size_one_list_each_live_key_s_slot(batch):
    index = nanfuzz.token_indices(batch)
    assert index.sequences == (0, 2) and index.page_size == 1
    assert index.kv_indptr.tolist() == [0, 3, 7]
    assert index.kv_indices.tolist() == [_slot(CASE, 0, k) for k in range(3, 6)] + [_slot(CASE, 2, k) for k in range(5, 9)]
    assert index.kv_start.tolist() == [3, 5]
    assert index.kv_indices.dtype == torch.int32
    live = slot_liveness(CASE)
    assert all(live[s // 4][s % 4] for s in index.kv_indices.tolist())
    every = nanfuzz.token_indices(batch, keys="all")
    assert every.kv_indptr.tolist() == [0, 6, 15] and every.kv_start.tolist() == [0, 0]


def test_token_indices_of_larger_pages_and_a_capacity_padded_with_dead_pages(batch):
    index = nanfuzz.token_indices(batch, page_size=2, keys="all", capacity=12)
    assert index.kv_indptr.tolist() == [0, 3, 8]
    assert index.kv_last_page_len.tolist() == [2, 1]
    pages, flat = batch.key_cache.view(-1, 2, 1, 32), batch.key_cache.view(-1, 1, 32)  # pages of two slots
    for i, seq in enumerate(index.sequences):
        listed = index.kv_indices[index.kv_indptr[i]:index.kv_indptr[i + 1]].tolist()
        for key in range(CASE.sequences[seq].seq_len):
            assert torch.equal(pages[listed[key // 2]][key % 2], flat[_slot(CASE, seq, key)])
    reasons = slot_reasons(CASE)
    spare = index.kv_indices[8:].tolist()
    assert len(spare) == 4 and all(reasons[p * 2 // 4][p * 2 % 4 + j] for p in spare for j in range(2))  # dead
    live = nanfuzz.token_indices(batch, page_size=2)
    assert live.kv_start.tolist() == [2, 4]  # the first page starts before the live range


def test_token_indices_refuse_a_page_that_does_not_divide_the_block(batch):
    with pytest.raises(NanfuzzError, match="page must divide the block size 4"):
        nanfuzz.token_indices(batch, page_size=3)
    with pytest.raises(NanfuzzError, match="keys='most'"):
        nanfuzz.token_indices(batch, keys="most")
    with pytest.raises(NanfuzzError, match="capacity=2"):
        nanfuzz.token_indices(batch, capacity=2)


def test_req_to_token_maps_positions_to_slots_and_the_rest_to_dead_slots(batch):
    table = nanfuzz.req_to_token(batch)
    assert table.shape == (2, 12) and table.dtype == torch.int32
    assert table[1, :9].tolist() == [_slot(CASE, 2, k) for k in range(9)]
    reasons = slot_reasons(CASE)
    past = table[0, 6:].tolist() + table[1, 9:].tolist()
    assert all(reasons[s // 4][s % 4] for s in past)  # past each request's length: dead slots only
    with pytest.raises(NanfuzzError, match="narrower"):
        nanfuzz.req_to_token(batch, width=8)


@pytest.mark.parametrize("window, causal, expected", [
    (0, True, (0, (-1, -1), -1)), (5, True, (5, (4, 0), 4)), (5, False, (5, (4, 4), 4)), (1, True, (1, (0, 0), 0))])
def test_window_conventions(window, causal, expected):
    case = CASE.replace(sliding_window=window, causal=causal)
    assert (nanfuzz.sliding_window(case), nanfuzz.window_size(case), nanfuzz.window_left(case)) == expected


# -- the kernel-file loader -----------------------------------------------------------------

KERNEL_FILE = '''\
from mylib.runtime.platform import is_hip
from mylib.ops.helpers import twice


def attend(x):
    return twice(x) + (100 if is_hip() else 0)
'''


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "mylib" / "ops").mkdir(parents=True)
    (tmp_path / "mylib" / "ops" / "attention.py").write_text(KERNEL_FILE)
    (tmp_path / "mylib" / "ops" / "helpers.py").write_text("def twice(x):\n    return 2 * x\n")
    (tmp_path / "mylib" / "__init__.py").write_text("raise ImportError('the real library needs its extensions')\n")
    return tmp_path


def test_kernel_files_run_beside_their_stand_ins_and_leave_sys_modules_alone(tree):
    import sys

    before = {name for name in sys.modules if name.startswith("mylib")}
    files = nanfuzz.load_kernel_files(tree, ["mylib.ops.helpers", "mylib.ops.attention"],
                                      {"mylib.runtime.platform": {"is_hip": lambda: False}}, library="mylib")
    assert {name for name in sys.modules if name.startswith("mylib")} == before
    attention = files["mylib.ops.attention"]
    with files.active():
        assert attention.attend(3) == 6
        assert sys.modules["mylib.ops.attention"] is attention
    with files.active({("mylib.ops.attention", "twice"): lambda x: -x}):
        assert attention.attend(3) == -3
    assert attention.twice(3) == 6  # the override is undone


def test_a_kernel_file_that_needs_more_than_the_stand_ins_is_one_clear_error(tree):
    with pytest.raises(NanfuzzError, match=r"mylib kernel file .*attention.py failed to import .*mylib.runtime"):
        nanfuzz.load_kernel_files(tree, ["mylib.ops.helpers", "mylib.ops.attention"], library="mylib")
    with pytest.raises(NanfuzzError, match=r"cannot import name 'is_hip'"):
        nanfuzz.load_kernel_files(tree, ["mylib.ops.helpers", "mylib.ops.attention"],
                                  {"mylib.runtime.platform": {}}, library="mylib")
    with pytest.raises(NanfuzzError, match=r"lacks mylib/ops/missing.py"):
        nanfuzz.load_kernel_files(tree, ["mylib.ops.missing"], library="mylib")
    with pytest.raises(NanfuzzError, match="is not a directory"):
        nanfuzz.load_kernel_files(tree / "nowhere", ["mylib.ops.helpers"])
