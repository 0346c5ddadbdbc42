"""The GPU a CPU run stands in for: one declaration (``Kernel(stands_in_for=...)``), one answer
(``nanfuzz.device_properties()``), which every library's stand-ins give."""
from __future__ import annotations

import pytest

from nanfuzz import H200, MI355X, DeviceProperties, Kernel, device_properties
from nanfuzz.harness.adapters import aiter_standins, sglang_standins
from nanfuzz.harness.adapters.standins import amd_arch, torch_on
from nanfuzz.harness.device import standing_in_for
from nanfuzz.harness.judge.check import check
from nanfuzz.harness.kernels._common import INTERPRETED
from nanfuzz.reference.errors import NanfuzzError
from tests.cases import consecutive_case
from tests.torch_kernels import CAPS, attention

pytestmark = pytest.mark.skipif(not INTERPRETED, reason="what a run under Triton's interpreter stands in for")
CASE = consecutive_case(seqs=[(1, 20)], q_heads=2, kv_heads=1, head_size=32)


def _sized_by_the_device(batch, out):
    """Correct attention that refuses to run unless the device it is told of is an H200's size."""
    if device_properties().compute_units != H200.compute_units:
        raise RuntimeError(f"sized for {device_properties().name}")
    return attention(batch, out)


sized_by_the_device = Kernel("torch@h200-sized", _sized_by_the_device, CAPS,
                             spec="tests.test_device_properties:sized_by_the_device")


def test_an_mi355x_by_default():
    props = device_properties()
    assert (props.name, props.arch, props.compute_units, props.capability, props.is_hip) == (
        MI355X.name, "gfx950", 256, (9, 5), True)
    assert props.interpreted


def test_the_kernel_s_declaration_is_what_its_launches_see():
    declared = Kernel("torch@h200-sized", _sized_by_the_device, CAPS, stands_in_for=H200)
    assert check(declared, CASE, "cpu").verdict.value == "PASS"
    undeclared = Kernel("torch@h200-sized", _sized_by_the_device, CAPS)
    outcome = check(undeclared, CASE, "cpu")
    assert outcome.verdict.value == "CRASH" and "sized for AMD Instinct MI355X" in outcome.summary
    assert device_properties().name == MI355X.name  # the declaration ends with the launch


def test_the_declaration_travels_to_the_worker_and_the_jobs(tmp_path):
    """A Kernel declared with ``dataclasses.replace`` resolves undeclared by its import path in a
    supervised worker or a job's process; the declaration goes with it."""
    import dataclasses

    from nanfuzz.harness.campaign.jobs import fuzz_parallel
    from nanfuzz.harness.campaign.runner import fuzz

    declared = dataclasses.replace(sized_by_the_device, stands_in_for=H200)
    alone = fuzz(declared, device="cpu", max_examples=2, seed=1, use_database=False, state_dir=tmp_path / "a")
    assert alone.examples == 2 and not alone.failed, alone.failure.summary
    jobs = fuzz_parallel(declared, device="cpu", max_examples=2, seed=1, jobs=2, use_database=False,
                         state_dir=tmp_path / "j")
    assert jobs.examples == 2 and not jobs.failed, jobs.failure.summary


def test_every_library_s_stand_ins_answer_for_the_stood_in_device():
    assert (sglang_standins.get_device_core_count(), aiter_standins.get_num_sms(), amd_arch()) == (256, 256, "gfx950")
    assert not sglang_standins.is_cuda() and sglang_standins.is_hip()
    with standing_in_for(H200):
        assert (sglang_standins.get_device_core_count(), aiter_standins.get_num_sms(), amd_arch()) == (132, 132, "")
        assert sglang_standins.is_cuda() and not sglang_standins.is_hip()
    seen = torch_on(H200)
    assert seen.version.hip is None and seen.cuda.get_device_properties(0).multi_processor_count == 132
    assert seen.float16 is __import__("torch").float16  # every other name is torch's own


def test_bad_declarations_are_one_line():
    with pytest.raises(NanfuzzError, match="stands_in_for='H200' is not a nanfuzz.DeviceProperties"):
        Kernel("k", attention, CAPS, stands_in_for="H200")
    with pytest.raises(NanfuzzError, match=r"DeviceProperties\(vendor='intel'\) must be 'amd' or 'nvidia'"):
        DeviceProperties("x", "intel", "xe", 1, 1, 0, 16)
    with pytest.raises(NanfuzzError, match=r"compute_units=0"):
        DeviceProperties("x", "amd", "gfx950", 0, 9, 5, 64)
