"""Known bugs stay caught: each repro in tests/regressions/ keeps its verdict on
its old kernel, and the fixed sibling of a built-in family passes it."""
from pathlib import Path

import pytest

from nanfuzz.harness.campaign.settings import Settings
from nanfuzz.harness.judge import encodings
from nanfuzz.harness.judge.check import check
from nanfuzz.harness.judge.runs import case_bytes
from nanfuzz.harness.launch.subjects import check_once
from nanfuzz.harness.registry import builtin_kernels, library_of, resolve, source_key
from nanfuzz.harness.report.repro import load_repro
from nanfuzz.reference.errors import UnsupportedHere
from nanfuzz.reference.features import size_features
from nanfuzz.strategies.aims import HUGE_OFFSETS
from nanfuzz.strategies.production import production_size

REPROS = sorted((Path(__file__).parent / "regressions").glob("*.json"))


def _fixed_sibling(name: str) -> str | None:
    if "@" not in name:
        return None
    family = name.split("@")[0]
    return f"{family}@masked" if f"{family}@masked" in builtin_kernels() else None


@pytest.mark.parametrize("path", REPROS, ids=[p.stem for p in REPROS])
def test_regression_keeps_its_verdict(path, nanfuzz_device, request):
    record = load_repro(path)
    # a library's kernels come from the release the repro was found in (tests/conftest.py pins it)
    library = library_of(record["kernel"])
    sources = {source_key(library): str(request.getfixturevalue(f"{library}_source"))} if library else {}
    try:
        kernel = resolve(record["kernel"], **sources)
    except UnsupportedHere as exc:  # a kernel this Triton cannot run at all: its repros run where it can
        pytest.skip(str(exc))
    why = _cache_not_here(kernel, record["case"], nanfuzz_device) or _gpu_resource_limit(record, nanfuzz_device)
    if why:
        pytest.skip(why)
    outcome = _judge(kernel, record, nanfuzz_device)
    assert outcome.verdict.value == record["verdict"], outcome.summary
    sibling = _fixed_sibling(record["kernel"])
    if sibling:
        fixed = check(resolve(sibling, **sources), record["case"], nanfuzz_device)
        assert not fixed.failed, f"{sibling}: {fixed.summary}"


def _judge(kernel, record: dict, device: str):
    """The repro's outcome here.  A CRASH on a GPU is judged in a worker process, as a campaign
    judges it: a kernel that faults its device (an illegal address) leaves the context of the
    process it ran in unusable, and this one runs every test after it."""
    if device != "cuda" or record["verdict"] != "CRASH":
        return check(kernel, record["case"], device)
    return check_once(kernel, Settings(device=device), record["case"])


def _gpu_resource_limit(record: dict, device: str) -> str | None:
    """A CRASH for a GPU's shared memory or registers (Triton's OutOfResources when it loads the
    compiled kernel) has nothing to replay under the interpreter, which has no such limit."""
    error = (record.get("evidence") or {}).get("error", "")
    if device == "cpu" and record["verdict"] == "CRASH" and error.startswith("OutOfResources"):
        return f"{record['kernel']}: {error.split(' Reducing')[0].rstrip('.')}: a GPU's limit: it runs on GPU runners"
    return None


def _cache_not_here(kernel, case, device: str) -> str | None:
    """Why a repro cannot run here: a huge cache under the interpreter (block offsets past 2^31
    elements, which a CPU campaign never draws), a bfloat16 repro under the interpreter (which has
    no bfloat16 arithmetic): such repros come from GPU campaigns and run on GPU runners; the device
    lacks its fp8 type, or (vLLM's kernels) the platform's fp8 is another one."""
    huge_here = production_size(interpreter=True).huge_cache_bytes
    if device == "cpu" and HUGE_OFFSETS in size_features(case) and case_bytes(case) > huge_here:
        return (f"{kernel.name}: caches of {case_bytes(case) / (1 << 30):.1f} GiB whose block offsets pass 2^31 "
                "elements, which the interpreter never draws (a check holds them at least twice in host memory): "
                "it runs on GPU runners")
    reason = kernel.capabilities.unsupported(case, interpreter=device == "cpu")
    if device == "cpu" and reason and "under the interpreter" in reason:
        return f"{kernel.name}: {reason}"
    kv = case.kv_cache
    if not kv.quantized:
        return None
    skipped = encodings.skipped(device).get(kv.dtype)
    if skipped:
        return f"{kv.dtype} caches: {skipped}"
    reason = kernel.capabilities.unsupported(case, interpreter=device == "cpu")
    return f"{kernel.name} here takes no {reason}" if reason and "caches" in reason else None


def test_the_known_bugs_are_on_file():
    kernels = {load_repro(p)["kernel"] for p in REPROS}
    assert {"paged_decode@unmasked", "paged_decode@tail-masked", "prefix_prefill@unmasked",
            "unified@overshoot", "vllm:rocm_attn", "vllm:triton_attn", "aiter:unified_attention",
            "aiter:unified_attention@3d", "aiter:pa_decode@v1", "aiter:pa_decode@v2", "aiter:pa_prefill",
            "aiter:chunked_pa_prefill", "fa_amd:kvcache", "fa_amd:kvcache@contiguous",
            "vllm:rocm_segmented_attn", "lmdeploy:decode", "lmdeploy:prefill", "vllm:triton_attn_int4"} <= kernels
