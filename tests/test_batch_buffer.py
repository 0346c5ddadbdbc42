"""A batch in one buffer (reference.redzones.move_together): every allocation keeps its bits,
layout and alignment; a clone is one independent buffer; one comparison of two buffers
tells whether a kernel wrote anywhere, and the regions it wrote are still named."""
import torch

from nanfuzz.harness.judge.writes import any_written as _any_written, written_regions as _written_regions
from nanfuzz.reference.batch import PagedBatch
from nanfuzz.reference.case import KVCache, Poison
from nanfuzz.reference.materialize import build_on_host
from nanfuzz.reference.redzones import shared_buffer
from tests.cases import consecutive_case

MIXED = ((1, 9), (5, 21), (0, 7), (3, 3))


def _batches():
    yield build_on_host(consecutive_case(MIXED, dtype="bfloat16", window=6, block_size=8, sinks=True,
                                         poison=Poison("nan", "kv")))
    yield build_on_host(consecutive_case(MIXED, q_heads=4, kv_heads=2, block_size=8, seed=2).replace(
        kv_cache=KVCache("fp8_e4m3fn", "token-head"), poison=Poison("nan", "kv")))


def _apart(batch: PagedBatch) -> PagedBatch:
    """The batch with every allocation in a buffer of its own."""
    return PagedBatch.from_allocations(batch.case, {name: a.clone() for name, a in batch.allocations.items()})


def test_every_allocation_keeps_its_bits_shape_and_view_and_starts_256_byte_aligned():
    for built in _batches():
        assert shared_buffer(built.allocations) is not None  # built in one host buffer already
        for host in (built, _apart(built)):
            _moved_whole(host)


def _moved_whole(host: PagedBatch) -> None:
    packed = host.in_one_buffer("cpu")
    buffer = shared_buffer(packed.allocations)
    before = shared_buffer(host.allocations)
    assert buffer is not None and (before is None or before.data_ptr() != buffer.data_ptr())
    for name, allocation in host.allocations.items():
        moved = packed.allocations[name]
        assert moved.base.dtype == allocation.base.dtype and moved.base.shape == allocation.base.shape
        assert torch.equal(moved.base.view(torch.uint8), allocation.base.view(torch.uint8))
        assert (moved.base.data_ptr() - buffer.data_ptr()) % 256 == 0
        assert moved.index == allocation.index
    for name, tensor in host.inputs().items():
        assert torch.equal(getattr(packed, name).view(torch.uint8), tensor.view(torch.uint8)), name


def test_a_clone_is_one_independent_buffer_and_a_write_anywhere_is_seen_and_named():
    for host in _batches():
        batch = host.in_one_buffer("cpu")
        snapshot = batch.clone()
        assert shared_buffer(snapshot.allocations).data_ptr() != shared_buffer(batch.allocations).data_ptr()
        assert not bool(_any_written(batch, snapshot)) and _written_regions(batch, snapshot) == []
        batch.value_cache.view(torch.uint8).view(-1)[3] ^= 1
        assert bool(_any_written(batch, snapshot))
        (written,) = _written_regions(batch, snapshot)
        assert written.tensor == "value_cache" and written.places == ((0, 0),), written
        assert written.label.startswith("value_cache at block 0 slot 0 ("), written
        assert not bool(_any_written(snapshot, snapshot.clone()))
        side = batch.allocations["key_cache"].sides()[-1][1]
        batch.allocations["key_cache"].base[side].view(torch.uint8).view(-1)[0] ^= 1
        assert [w.label for w in _written_regions(batch, snapshot)] == ["the redzone past the end of key_cache",
                                                                       written.label]


def test_a_write_between_allocations_is_a_write_too():
    host = next(_batches())
    batch = host.in_one_buffer("cpu")
    snapshot = batch.clone()
    buffer = shared_buffer(batch.allocations)
    ends = sorted(a.base.data_ptr() - buffer.data_ptr() + a.base.numel() * a.base.element_size()
                  for a in batch.allocations.values())
    gap = next(end for end in ends if end % 256)  # padding up to the next allocation
    buffer[gap] ^= 1
    assert bool(_any_written(batch, snapshot)) and _written_regions(batch, snapshot) == []
