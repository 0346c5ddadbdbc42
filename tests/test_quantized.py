"""Quantized KV caches: the case, materialisation, the oracle, strategies, kernels, the command line."""
from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, find, given, settings

from nanfuzz.harness.judge import encodings
from nanfuzz.harness.judge.check import Verdict, check
from nanfuzz.harness.cli import main
from nanfuzz.harness.campaign.focus import Focus
from nanfuzz.harness.campaign.runner import fuzz
from nanfuzz.harness.report.picture import picture
from nanfuzz.harness.registry import builtin_kernels
from nanfuzz.reference import materialize as materialize_module
from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.case import FP8_DTYPES, Case, CaseError, Geometry, KVCache, Poison, PoisonSite, Sequence
from nanfuzz.reference.materialize import live_mask, materialize, refill_dead_slots
from nanfuzz.reference.oracle import oracle
from nanfuzz.reference.quantization import ENCODINGS, codes_of
from nanfuzz.strategies import Size, paged_cases
from tests.brute_force import brute_force

KERNELS = builtin_kernels()
# The masking families; split_decode draws production sizes only and has tests of its own
# (tests/test_kernel_split_decode.py): its bug is a lost partition, not a dead slot read.
OLD = sorted(name for name, k in KERNELS.items() if k.expect == "caught" and k.size != "production")
FIXED = sorted(name for name, k in KERNELS.items() if k.expect == "pass" and k.size != "production")

PER_TENSOR = [KVCache(d, "tensor", 0.25, 0.0078125) for d in FP8_DTYPES]
TOKEN_HEAD = [KVCache(d, "token-head") for d in (*FP8_DTYPES, "int8")]
QUANTIZED = PER_TENSOR + TOKEN_HEAD

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:overflow encountered:RuntimeWarning")


@pytest.fixture(autouse=True)
def private_state(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def windowed(kv: KVCache, poison: Poison | None = None, **changes) -> Case:
    """Two sequences, one decode with a window of 5 over 3 blocks of 8 (block 1 freed, tail in block 3)."""
    value = "max" if kv.dtype == "int8" else "nan"
    case = Case(Geometry(4, 2, 32, 8, 6, "float16"),
                (Sequence(1, 21, (1, 2, 3)), Sequence(3, 10, (4, 5, 0))), sliding_window=5,
                poison=poison or Poison(value, "kv", None), kv_cache=kv, data_seed=7)
    return case.replace(**changes).validate()


# -- the case --------------------------------------------------------------------------

def test_an_unquantized_case_reads_and_writes_the_json_it_always_did():
    case = windowed(KVCache())
    record = json.loads(case.to_json())
    assert "kv_cache" not in record and "parts" not in record["poison"]
    assert Case.from_json(case.to_json()) == case


@pytest.mark.parametrize("kv", QUANTIZED, ids=lambda kv: kv.label())
def test_a_quantized_case_round_trips_exactly(kv):
    case = windowed(kv, Poison("bits", "v", None, "data+scales" if kv.token_head else "data"))
    record = json.loads(case.to_json())
    assert record["kv_cache"]["dtype"] == kv.dtype
    again = Case.from_json(case.to_json())
    assert again == case and again.to_json() == case.to_json()


@pytest.mark.parametrize("kv, poison, message", [
    (KVCache("int8"), Poison(), "needs per-token-head scales"),
    (KVCache("fp8_e4m3fn", k_scale=0.1), Poison(), "is not a float32 value"),
    (KVCache("fp8_e4m3fn", v_scale=0.0), Poison(), "must be a finite scale"),
    (KVCache("fp8_e4m3fn", "token-head", k_scale=0.5), Poison(), "per-token-head scales has no per-tensor scale"),
    (KVCache("auto", "token-head"), Poison(), "needs a quantized kv_cache.dtype"),
    (KVCache("fp8_e4m3fn"), Poison("inf"), "in a fp8_e4m3fn cache is not one of"),
    (KVCache("fp8_e4m3fnuz"), Poison("-inf"), "in a fp8_e4m3fnuz cache is not one of"),
    (KVCache("int8", "token-head"), Poison("nan"), "in a int8 cache is not one of"),
    (KVCache("fp8_e5m2", "token-head"), Poison("nan", "v", None, "bogus"), "poison parts=.bogus. is not one of"),
    (KVCache("fp8_e5m2"), Poison("nan", "v", None, "scales"), "needs a cache with per-token-head scales"),
    (KVCache("fp8_e5m2", "token-head"), Poison("zero"), "in a fp8_e5m2 cache is not one of"),
    (KVCache("fp8_e5m2", "fp8"), Poison(), "kv_cache.scales='fp8' is not one of"),
])
def test_invalid_quantized_cases_are_named_in_one_line(kv, poison, message):
    with pytest.raises(CaseError, match=message) as info:
        windowed(KVCache()).replace(kv_cache=kv, poison=poison).validate()
    assert "\n" not in str(info.value)


def test_hand_written_json_is_checked_field_by_field():
    record = json.loads(windowed(PER_TENSOR[0]).to_json())
    record["kv_cache"]["k_scale"] = "big"
    with pytest.raises(CaseError, match="kv_cache.k_scale='big' must be a number"):
        Case.from_dict(record)
    record["kv_cache"] = {"dtype": "fp8_e5m2", "k_scale": 2}  # scales default to per-tensor, ints are numbers
    assert Case.from_dict(record).kv_cache == KVCache("fp8_e5m2", "tensor", 2.0, 1.0)
    record["kv_cache"]["bogus"] = 1
    with pytest.raises(CaseError, match="unknown fields"):
        Case.from_dict(record)


# -- materialisation -------------------------------------------------------------------

@pytest.mark.parametrize("kv", QUANTIZED, ids=lambda kv: kv.label())
def test_live_codes_hold_the_seeded_values_and_only_dead_slots_change(kv):
    case = windowed(kv)
    poisoned, clean = materialize(case), materialize(case, poisoned=False)
    assert poisoned.key_cache.dtype == ENCODINGS[kv.dtype].torch_dtype
    live = live_mask(case, "cpu")
    for a, b in ((poisoned.key_cache, clean.key_cache), (poisoned.value_cache, clean.value_cache)):
        assert torch.equal(codes_of(a)[live], codes_of(b)[live])
        assert not torch.equal(codes_of(a)[~live], codes_of(b)[~live])
    unquantized = oracle(materialize(case.replace(kv_cache=KVCache(), poison=Poison())))
    # the same seeded values, quantized: within the encoding's rounding of the unquantized case
    assert (oracle(poisoned) - unquantized).abs().max() < 0.15
    again = materialize(case)
    assert all(torch.equal(x.view(torch.uint8) if x.element_size() == 1 else x.nan_to_num(),
                           y.view(torch.uint8) if y.element_size() == 1 else y.nan_to_num())
               for x, y in zip(poisoned.bases().values(), again.bases().values()))


@pytest.mark.parametrize("dtype", ["fp8_e4m3fn", "fp8_e4m3fnuz", "fp8_e5m2"])
def test_dead_slots_get_every_hostile_code_of_the_encoding(dtype):
    enc = ENCODINGS[dtype]
    codes = {}
    for value in ("nan", "inf", "-inf", "max"):
        if value in ("inf", "-inf") and enc.inf_codes is None:
            continue
        case = windowed(KVCache(dtype), Poison(value, "v", None))
        dead = ~live_mask(case, "cpu")
        codes[value] = set(codes_of(materialize(case).value_cache)[dead].flatten().tolist())
    assert codes["nan"] == set(enc.nan_codes)  # e4m3fnuz: 0x80 alone, negative zero's bits elsewhere
    assert codes["max"] == {enc.max_code}
    if enc.inf_codes:
        assert codes["inf"] == {enc.inf_codes[0]} and codes["-inf"] == {enc.inf_codes[1]}
    # the finite garbage of unpoisoned dead slots holds no NaN or Inf code
    garbage = codes_of(materialize(windowed(KVCache(dtype)), poisoned=False).value_cache)
    decoded = garbage.view(enc.torch_dtype).double()
    assert torch.isfinite(decoded).all()


@pytest.mark.parametrize("value, check_scale", [
    ("nan", torch.isnan), ("inf", torch.isposinf), ("max", lambda s: s == torch.finfo(torch.float32).max),
    ("zero", lambda s: s == 0)])
def test_poisoned_scales_sit_in_dead_slots_of_the_scale_cache_only(value, check_scale):
    kv = KVCache("int8", "token-head")
    case = windowed(kv, Poison(value, "v", (PoisonSite(1),), "scales"))
    batch = materialize(case)
    scales = batch.v_scale_cache
    assert check_scale(scales[1]).all()                         # the poisoned freed block
    assert torch.isfinite(batch.k_scale_cache).all()
    assert torch.isfinite(scales[2:]).all() and (scales[2:] > 0).all()
    clean_codes = codes_of(materialize(case, poisoned=False).value_cache)
    assert torch.equal(codes_of(batch.value_cache), clean_codes)  # the codes hold no poison


@pytest.mark.parametrize("kv", [KVCache("fp8_e4m3fnuz"), KVCache("int8", "token-head")], ids=lambda kv: kv.label())
def test_materialisation_writes_every_element_it_allocates(kv, monkeypatch):
    """Allocations filled with 0xFF bytes first give the same tensors: nothing is left unwritten."""
    case = windowed(kv, Poison("bits", "v", (PoisonSite(2, 0),), "data" if not kv.token_head else "data+scales"))
    reference = materialize(case)
    real_empty = torch.empty

    def filled_empty(*args, **kwargs):
        tensor = real_empty(*args, **kwargs)
        tensor.view(torch.uint8).fill_(0xFF)
        return tensor

    monkeypatch.setattr(materialize_module.torch, "empty", filled_empty)
    again = materialize(case)
    for name, tensor in reference.bases().items():
        assert torch.equal(tensor.contiguous().view(torch.uint8), again.bases()[name].contiguous().view(torch.uint8)), name


@pytest.mark.parametrize("kv", QUANTIZED, ids=lambda kv: kv.label())
def test_the_leak_run_refills_dead_codes_and_scales_as_materialise_would(kv):
    case = windowed(kv)
    refilled = refill_dead_slots(materialize(case), garbage_seed=1)
    fresh = materialize(case, garbage_seed=1, poisoned=False)
    for name, tensor in fresh.bases().items():
        assert torch.equal(tensor.contiguous().view(torch.uint8), refilled.bases()[name].contiguous().view(torch.uint8)), name


def test_the_picture_names_the_cache_and_the_poisoned_scales():
    text = picture(windowed(KVCache("int8", "token-head"), Poison("nan", "v", (PoisonSite(1),), "scales")))
    assert "int8 cache with per-token-head scales" in text and "(nan in V scales)" in text
    assert "fp8_e4m3fn cache (k_scale 0.25, v_scale 0.0078125)" in picture(windowed(PER_TENSOR[0]))


# -- the oracle ------------------------------------------------------------------------

TINY = Size(max_sequences=3, max_blocks_per_sequence=3, max_query_len=5, max_kv_heads=2, max_q_heads=4)


@pytest.mark.parametrize("kv", QUANTIZED, ids=lambda kv: kv.label())
def test_oracle_matches_a_dequantize_then_attend_loop(kv):
    caps = Capabilities(non_causal=True, sinks=True, head_sizes=(32,), kv_cache_dtypes=(),
                        token_head_dtypes=(kv.dtype,) if kv.token_head else ())
    caps = caps if kv.token_head else caps.restrict(kv_cache_dtypes=(kv.dtype,))

    @settings(max_examples=8, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(paged_cases(caps, interpreter=True, size=TINY))
    def agree(case):
        assert case.kv_cache.dtype == kv.dtype and case.kv_cache.token_head == kv.token_head
        batch = materialize(case)
        g = case.geometry
        expected = torch.tensor(brute_force(batch), dtype=torch.float64).reshape(case.num_tokens, g.num_q_heads, -1)
        torch.testing.assert_close(oracle(batch), expected, rtol=1e-12, atol=1e-12)
        # and no poison, codes or scales, reaches it
        assert torch.equal(oracle(materialize(case, poisoned=False, garbage_seed=3)), oracle(batch))

    agree()


# -- strategies ------------------------------------------------------------------------

UNIFIED_CAPS = KERNELS["unified@masked"].capabilities


def test_cases_shrink_toward_no_quantization_then_per_tensor_then_per_token_head():
    strategy = paged_cases(UNIFIED_CAPS, interpreter=True)
    options = dict(settings=settings(database=None, max_examples=500, derandomize=True,
                                     suppress_health_check=list(HealthCheck)))
    assert find(strategy, lambda c: True, **options).kv_cache == KVCache()
    assert find(strategy, lambda c: c.kv_cache.quantized, **options).kv_cache == KVCache("fp8_e4m3fn")
    token_head = find(strategy, lambda c: c.kv_cache.token_head, **options)
    assert token_head.kv_cache == KVCache("fp8_e4m3fn", "token-head") and token_head.poison.parts == "data"
    scales = find(strategy, lambda c: c.poison.hits_scales, **options)
    assert scales.poison.parts == "scales" and scales.poison.value == "nan"


def test_a_kernel_without_quantized_caches_gets_none():
    @settings(max_examples=30, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(paged_cases(Capabilities(), interpreter=True))
    def unquantized(case):
        assert case.kv_cache == KVCache() and case.poison.parts == "data"

    unquantized()


# -- where encodings run ----------------------------------------------------------------

def _skip_on_gpu(device: str) -> None:
    if device != "cpu":
        pytest.skip("about Triton's interpreter")


def _skip_unless_runs(kv: KVCache, device: str) -> None:
    why = encodings.skipped(device).get(kv.dtype)
    if why:
        pytest.skip(f"{kv.dtype} caches do not run here: {why}")


def test_the_interpreter_decodes_every_fp8_code_as_torch_does(nanfuzz_device):
    _skip_on_gpu(nanfuzz_device)
    assert encodings.skipped("cpu") == {}
    assert encodings._wrong_decodes() == {}


def test_a_process_asks_triton_for_the_gpu_s_fp8_skips_once_and_not_at_all_when_told(monkeypatch):
    asked = []
    monkeypatch.setattr(encodings, "_known_gpu_skips", [])
    monkeypatch.setattr(encodings, "_ask_triton", lambda: asked.append(1) or (("fp8_e5m2", "asked"),))
    assert encodings.skipped("cuda") == encodings.skipped("cuda") == {"fp8_e5m2": "asked"}
    assert asked == [1]
    encodings.told_gpu_skips(None)  # nothing told: what it knows stands
    assert encodings.skipped("cuda") == {"fp8_e5m2": "asked"}
    monkeypatch.setattr(encodings, "_known_gpu_skips", [])
    encodings.told_gpu_skips((("fp8_e4m3fnuz", "told"),))
    assert encodings.skipped("cuda") == {"fp8_e4m3fnuz": "told"} and asked == [1]
    assert encodings.gpu_skips_for("cpu") is None


def test_an_encoding_the_device_cannot_run_is_left_out_with_a_note(monkeypatch, nanfuzz_device):
    why = "Triton 9.9 has no fp8e4b8 type on this GPU (cuda 90); e4m3fnuz is native on MI300-class GPUs only"
    monkeypatch.setattr(encodings, "skipped", lambda device: {"fp8_e4m3fnuz": why})
    caps, notes = encodings.runnable(UNIFIED_CAPS, nanfuzz_device)
    assert "fp8_e4m3fnuz" not in caps.kv_cache_dtypes + caps.token_head_dtypes
    assert notes == [f"fp8_e4m3fnuz caches skipped: {why}"]
    campaign = fuzz(KERNELS["unified@masked"], device=nanfuzz_device, max_examples=2, use_database=False)
    assert f"unified@masked: fp8_e4m3fnuz caches skipped: {why}" in campaign.notes
    with pytest.raises(Exception, match="this case's fp8_e4m3fnuz cache cannot run here: Triton 9.9"):
        check(KERNELS["unified@masked"], windowed(KVCache("fp8_e4m3fnuz")), nanfuzz_device)


# -- the built-in kernels ----------------------------------------------------------------

def _caches(name: str) -> list[KVCache]:
    caps = KERNELS[name].capabilities
    return ([KVCache(d) for d in caps.kv_cache_dtypes if d != "auto"]
            + [KVCache(d, "token-head") for d in caps.token_head_dtypes])


OLD_RUNS = [(name, kv) for name in OLD for kv in _caches(name)]
FIXED_RUNS = [(name, kv) for name in FIXED for kv in _caches(name)]


def _focus(kv: KVCache) -> Focus:
    return Focus(kv_cache_dtype=kv.dtype, kv_scales=kv.scales)


@pytest.mark.parametrize("name, kv", OLD_RUNS, ids=[f"{n}-{kv.label()}" for n, kv in OLD_RUNS])
def test_old_variants_are_caught_with_each_cache(name, kv, nanfuzz_device):
    _skip_unless_runs(kv, nanfuzz_device)
    campaign = fuzz(KERNELS[name], device=nanfuzz_device, max_examples=150, seed=1, shrink=False, use_database=False,
                    focus=_focus(kv))
    assert campaign.failed, f"{name} passed 150 examples with {kv.label()} caches"
    assert campaign.failing_case.kv_cache.label() == kv.label()
    assert campaign.failure.verdict in (Verdict.NONFINITE, Verdict.LEAK), campaign.failure.summary


@pytest.mark.parametrize("name, kv", FIXED_RUNS, ids=[f"{n}-{kv.label()}" for n, kv in FIXED_RUNS])
def test_fixed_variants_pass_with_each_cache(name, kv, nanfuzz_device):
    _skip_unless_runs(kv, nanfuzz_device)
    campaign = fuzz(KERNELS[name], device=nanfuzz_device, max_examples=15, seed=2, use_database=False, focus=_focus(kv))
    assert not campaign.failed, f"{campaign.failure.summary}\n{campaign.failing_case.to_json()}"
    assert campaign.examples >= 15 and campaign.statistics.counts[f"kv:{kv.label()}"] == campaign.examples


@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3fnuz"])
def test_a_nan_scale_in_one_dead_scale_slot_is_the_only_poison_and_catches_the_old_variant(dtype, nanfuzz_device):
    """Non-causal prefill of 2 keys in a block of 16: unified@overshoot loads the tail, whose codes and
    scales are finite garbage except the V scale of key 2."""
    case = Case(Geometry(1, 1, 32, 16, 2, "float16"), (Sequence(2, 2, (1,)),), causal=False,
                poison=Poison("nan", "v", (PoisonSite(1, 2),), "scales"),
                kv_cache=KVCache(dtype, "token-head")).validate()
    _skip_unless_runs(case.kv_cache, nanfuzz_device)
    batch = materialize(case)
    decoded = [batch.key_cache.double(), batch.value_cache.double()]
    assert all(torch.isfinite(x).all() for x in decoded) and torch.isfinite(batch.k_scale_cache).all()
    assert torch.isnan(batch.v_scale_cache).sum() == 1 and torch.isnan(batch.v_scale_cache[1, 2, 0])
    old = check(KERNELS["unified@overshoot"], case, nanfuzz_device)
    assert old.verdict is Verdict.NONFINITE and "poison in V scales" in old.summary
    assert check(KERNELS["unified@masked"], case, nanfuzz_device).verdict is Verdict.PASS


# -- the command line ------------------------------------------------------------------------

def _one_line_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("nanfuzz: ") and "\n" not in err, err
    return err


def test_kv_cache_options_that_fit_no_cache_of_the_kernel_are_usage_errors(capsys, nanfuzz_device):
    _skip_on_gpu(nanfuzz_device)
    err = _one_line_error(capsys, ["fuzz", "--kernel", "paged_decode@masked", "--kv-scales", "token-head",
                                   "--device", "cpu"])
    assert "--kv-scales token-head: kernel paged_decode@masked takes kv auto,fp8_e4m3fn,fp8_e5m2,fp8_e4m3fnuz" in err
    err = _one_line_error(capsys, ["fuzz", "--kernel", "unified@masked", "--kv-cache-dtype", "auto",
                                   "--kv-scales", "token-head", "--device", "cpu"])
    assert "--kv-cache-dtype auto --kv-scales token-head" in err


def test_fuzz_one_cache_dtype_and_list_what_each_kernel_takes(capsys, nanfuzz_device):
    _skip_on_gpu(nanfuzz_device)
    assert main(["fuzz", "--kernel", "unified@masked", "--kv-cache-dtype", "fp8_e5m2", "--max-examples", "4",
                 "--device", "cpu", "--summary-json", "summary.json", "--no-isolation"]) == 0
    (record,) = json.load(open("summary.json"))["kernels"]
    kv = record["statistics"]["groups"]["kv caches"]
    assert set(kv) <= {"kv:fp8_e5m2", "kv:fp8_e5m2/token-head"} and sum(e["count"] for e in kv.values()) == 4
    capsys.readouterr()
    assert main(["list", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "kv auto,fp8_e4m3fn,fp8_e5m2,fp8_e4m3fnuz per-tensor; fp8_e4m3fn,int8,fp8_e5m2,fp8_e4m3fnuz per-token-head" in out
    assert "fp8_e4m3fn, fp8_e4m3fnuz, fp8_e5m2, int8, uint8, uint4, uint3 run here" in out


def test_the_pytest_plugin_aims_campaigns_at_one_cache(tmp_path, nanfuzz_device):
    _skip_on_gpu(nanfuzz_device)
    import os
    import subprocess
    import sys
    import textwrap

    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_kv.py").write_text(textwrap.dedent("""
        def test_kv(nanfuzz):
            campaign = nanfuzz.fuzz("paged_decode@masked", max_examples=3, use_database=False)
            assert {n for n in campaign.statistics.counts if n.startswith("kv:")} == {"kv:fp8_e5m2"}
    """))
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH", "PYTEST_ADDOPTS")
           and not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--nanfuzz-device", "cpu",
                           "--nanfuzz-kv-cache-dtype", "fp8_e5m2", "--nanfuzz-kv-scales", "tensor"],
                          cwd=tmp_path, env={**env, "NANFUZZ_STATE_DIR": str(tmp_path / "state")},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_an_interpreter_whose_decode_cannot_be_checked_runs_no_fp8(monkeypatch, nanfuzz_device):
    _skip_on_gpu(nanfuzz_device)
    def broken():
        raise KeyError("_decode")

    monkeypatch.setattr(encodings, "_wrong_decodes", broken)
    encodings._interpreter_state.cache_clear()
    try:
        gone = encodings.skipped("cpu")
        assert set(gone) == set(FP8_DTYPES) and "could not decode fp8 codes for the check (KeyError" in gone["fp8_e5m2"]
        with pytest.raises(Exception, match="cache cannot run here"):
            check(KERNELS["unified@masked"], windowed(KVCache("fp8_e5m2")))
    finally:
        encodings._interpreter_state.cache_clear()
