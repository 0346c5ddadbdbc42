"""The memory governor on a GPU: the device named by its UUID, what other programs hold counted,
a production check within what it reserved, and campaigns sharing one GPU that keep their findings."""
from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nanfuzz.harness.campaign.focus import Focus
from nanfuzz.harness.campaign.scope import campaign_capabilities, campaign_pool_of, campaign_strategy
from nanfuzz.harness.campaign.settings import Settings
from nanfuzz.harness.judge.check import Verdict, check
from nanfuzz.harness.judge.large import large_check_footprint
from nanfuzz.harness.judge.memory import GiB, MemoryPolicy, TooLargeForDevice, governor
from nanfuzz.harness.judge.runs import check_footprint
from nanfuzz.harness.registry import builtin_kernels, resolve
from nanfuzz.harness.scaling import drawn

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_s_ledger_is_named_by_its_uuid(tmp_path):
    share = governor(MemoryPolicy(ledger_dir=str(tmp_path)), torch.device("cuda"))
    properties = torch.cuda.get_device_properties(0)
    uuid = str(getattr(properties, "uuid", "")).replace("GPU-", "")
    named_by = uuid[:8] if uuid.strip("0-") else properties.name.split()[0]  # a driver that tells no UUID
    assert share.device.key.startswith("gpu-") and named_by in share.device.key
    assert (tmp_path / f"{share.device.key}.json").exists()


def _occupy(leave_free: int, ready, done) -> None:
    """Another program: all of the GPU's free memory but ``leave_free`` bytes, outside any ledger."""
    free = torch.cuda.mem_get_info()[0]
    held = torch.empty(max(0, free - leave_free), dtype=torch.uint8, device="cuda")
    ready.set()
    done.wait(300)
    del held


@pytest.mark.gpu_alone  # meanwhile the device has 4 GiB free: another test's kernel could run out in its launch
def test_what_other_programs_hold_on_the_gpu_is_counted(tmp_path):
    context = multiprocessing.get_context("spawn")
    ready, done = context.Event(), context.Event()
    other = context.Process(target=_occupy, args=(4 * GiB, ready, done))
    other.start()
    try:
        assert ready.wait(120)
        share = governor(MemoryPolicy(ledger_dir=str(tmp_path)), torch.device("cuda"))
        with pytest.raises(TooLargeForDevice, match="free to it"):
            share.reserve(8 * GiB, patience=1.0)
        done.set()
        other.join(60)
        assert share.reserve(8 * GiB, patience=60.0) == share.device.footprint(8 * GiB)
        share.settle()
    finally:
        done.set()
        other.join(10)


# vLLM's TRITON_ATTN reads plain caches in place, ROCM_ATTN copies them into its own layout
LIBRARY_KERNELS = {"vllm:triton_attn": Focus(causal_only=True, kv_cache_dtype="auto"),
                   "vllm:rocm_attn": Focus(no_window=True)}


def _kernel(name: str):
    if name in LIBRARY_KERNELS:
        if not os.environ.get("NANFUZZ_VLLM_SRC"):
            pytest.skip("needs NANFUZZ_VLLM_SRC, a vLLM 0.33.0 tree")
        return resolve(name, vllm_src=os.environ["NANFUZZ_VLLM_SRC"]), LIBRARY_KERNELS[name]
    return builtin_kernels()[name], Focus()


@pytest.mark.parametrize("name", ["paged_decode@masked", "split_decode@masked", "prefix_prefill@masked",
                                  *LIBRARY_KERNELS])
def test_a_production_check_peaks_within_what_it_reserves(name, tmp_path):
    kernel, focus = _kernel(name)
    settings = Settings(device="cuda", state_dir=tmp_path, size="production", campaigns_per_device=2,  # no huge cache
                        focus=focus)
    caps, _ = campaign_capabilities(kernel, settings)
    pool, _ = campaign_pool_of(caps, settings, tier="production")
    share = governor(settings.memory, torch.device("cuda"))
    rows, declined = [], 0
    for case in drawn(campaign_strategy(caps, settings, pool, "production"), 6):
        try:
            check(kernel, case, "cuda")  # its compiles; a case larger than the device is declined
        except TooLargeForDevice:
            declined += 1  # as a campaign declines it: nothing runs, nothing is reserved
            continue
        share.give_back()  # nothing held from the last case: the peak is this one's
        estimate = large_check_footprint(case, kernel.copies_caches_of(case)) if case.large else check_footprint(case)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        outcome = check(kernel, case, "cuda")
        peak, allocated = torch.cuda.max_memory_reserved(), torch.cuda.max_memory_allocated()
        assert outcome.verdict is Verdict.PASS, outcome.summary
        rows.append((peak, allocated, estimate))
    # a peak held past the estimate but allocated within it is the caching allocator's (``oracle.oracle_footprint``)
    print(f"{name}: peak held (allocated) / estimate (its parts) / reserved per case, MiB: " + "; ".join(
        f"{p >> 20} ({a >> 20}) / {e >> 20} ({e.described()}) / {share.device.footprint(e) >> 20}" for p, a, e in rows)
        + f"; {declined} declined")
    assert len(rows) >= 4
    # what the governor reserves: the estimate and the caching allocator's rounding beside it
    assert all(peak <= share.device.footprint(estimate) for peak, _, estimate in rows)


@pytest.mark.parametrize("name", ["paged_decode@masked", "split_decode@masked", "prefix_prefill@masked",
                                  *LIBRARY_KERNELS])
def test_a_compile_process_s_launch_peaks_within_what_it_reserves(name, tmp_path):
    """A compile process builds a case and launches it (compile-only there; run here, so the kernel's
    own buffers count too) within what it reserves (``farm.compile_footprint``), a fraction of a check's."""
    from nanfuzz.harness.launch import farm

    kernel, focus = _kernel(name)
    settings = Settings(device="cuda", state_dir=tmp_path, size="production", campaigns_per_device=2, focus=focus)
    caps, _ = campaign_capabilities(kernel, settings)
    pool, _ = campaign_pool_of(caps, settings, tier="production")
    share = governor(settings.memory, torch.device("cuda"))
    rows = []
    for case in drawn(campaign_strategy(caps, settings, pool, "production"), 6):
        estimate = farm.compile_footprint(kernel, case)
        if share.larger_than_device(estimate):
            continue
        share.give_back()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        batch = farm.compile_batch(case, torch.device("cuda"))  # a large case's stand-in: run here, it reads its tables
        g = case.geometry
        out = torch.empty(case.num_tokens, g.num_q_heads, g.v_head_size, dtype=batch.q.dtype, device="cuda")
        kernel(batch, out)
        torch.cuda.synchronize()
        del batch, out
        rows.append((torch.cuda.max_memory_reserved(), estimate, case.large))
        g = case.geometry
        print(f"{name}: {case.num_tokens} tokens of {len(case.sequences)} sequences, {g.num_q_heads}/{g.num_kv_heads} "
              f"heads of {g.head_size}, {g.dtype}: peak held {rows[-1][0] >> 20} MiB (allocated "
              f"{torch.cuda.max_memory_allocated() >> 20}), reserved {share.device.footprint(estimate) >> 20} MiB for "
              f"{estimate.described() if hasattr(estimate, 'described') else estimate}")
    assert sum(large for *_, large in rows) >= 2
    assert all(peak <= share.device.footprint(estimate) for peak, estimate, _ in rows)


def test_campaigns_sharing_the_gpu_end_with_exit_0_or_a_finding_and_its_repro(tmp_path):
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "ci/memory_pressure.py", "--time-budget", "90", "--out", str(tmp_path / "runs"),
                           "--memory-dir", str(tmp_path / "ledger"), "--json", str(tmp_path / "rows.json"),
                           "--kernel", "paged_decode@masked", "--kernel", "split_decode@masked",
                           "--kernel", "paged_decode@unmasked", "--kernel", "split_decode@drops-last-partition"],
                          cwd=ROOT, capture_output=True, text=True, timeout=1800)
    print(proc.stdout[-4000:], f"({time.perf_counter() - started:.0f} s)")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [r["exit"] for r in rows[2:]] == [1, 1] and all(r["repro"] == "on disk" for r in rows[2:])
