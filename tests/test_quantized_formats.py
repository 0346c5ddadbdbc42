"""Caches with zero points, packed sub-byte codes and rotations: the model, its poison, its oracle, its strategies."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from hypothesis import HealthCheck, find, given, settings

from nanfuzz.harness.campaign.runner import fuzz
from nanfuzz.harness.judge.check import Verdict, check
from nanfuzz.reference import packing, rotation
from nanfuzz.reference.asymmetric import word_fields
from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.case import Case, CaseError, Geometry, KVCache, Poison, PoisonSite, Sequence
from nanfuzz.reference.device_build import build_on_device
from nanfuzz.reference.errors import NanfuzzError
from nanfuzz.reference.materialize import live_mask, materialize, refill_dead_slots, token_layout
from nanfuzz.reference.oracle import attend_and_measure, oracle
from nanfuzz.reference.precision import FLOAT64
from nanfuzz.reference.quantization import live_values
from nanfuzz.strategies import Size, paged_cases
from tests import quantized_subjects as subjects
from tests.quantized_subjects import FORMATS, LMDEPLOY_INT4, LMDEPLOY_INT8, TURBOQUANT_K8V3, VLLM_INT4

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:overflow encountered:RuntimeWarning")
NAMES = {VLLM_INT4: "vllm-int4", LMDEPLOY_INT4: "lmdeploy-int4", LMDEPLOY_INT8: "lmdeploy-int8",
         subjects.TURBOQUANT_K8V4: "turboquant-k8v4", TURBOQUANT_K8V3: "turboquant-k8v3"}


@pytest.fixture(autouse=True)
def private_state(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def windowed(kv: KVCache, poison: Poison | None = None, **changes) -> Case:
    """A decode over 3 blocks of 8 with a window of 5 (block 1 expired, a tail in block 3) and a
    chunked prefill of 3 over blocks 4 and 5; head size 48 (a rotation's runs of 16)."""
    case = Case(Geometry(4, 2, 48, 8, 6, "float16"),
                (Sequence(1, 21, (1, 2, 3)), Sequence(3, 10, (4, 5, 0))), sliding_window=5,
                poison=poison or Poison("max", "kv", None), kv_cache=kv, data_seed=7)
    return case.replace(**changes).validate()


# -- the case --------------------------------------------------------------------------

@pytest.mark.parametrize("kv", FORMATS, ids=NAMES.get)
def test_a_format_round_trips_and_an_old_cache_reads_as_before(kv):
    case = windowed(kv, Poison("bits", "v", None, "data+scales+zeros"))
    again = Case.from_json(case.to_json())
    assert again == case and again.to_json() == case.to_json()
    old = json.loads(windowed(KVCache("int8", "token-head")).to_json())["kv_cache"]
    assert old == {"dtype": "int8", "scales": "token-head", "k_scale": 1.0, "v_scale": 1.0}


@pytest.mark.parametrize("kv, poison, message", [
    (KVCache("uint4", "token-head"), Poison("max"), "needs per-token-head scales and zero points"),
    (KVCache("int8", "token-head", zero_points="code"), Poison("max"), "zero_points='code' needs unsigned codes"),
    (KVCache("uint8", "token-head", zero_points="code", packing="halves"), Poison("max"), "packs nibbles"),
    (KVCache("uint4", "token-head", zero_points="offset", scale_format="float32-zp4"), Poison("max"),
     "holds a zero point in code units"),
    (KVCache("fp8_e4m3fn", rotation_seed=3), Poison(), "rotation_seed needs a rotation"),
    (KVCache(rotation="hadamard", value=VLLM_INT4.side("v")), Poison(), "rotation needs both caches quantized"),
    (LMDEPLOY_INT4, Poison("nan"), "poison value='nan' in a uint4 cache is not one of"),
    (VLLM_INT4, Poison("nan", "v", None, "zeros"), "in float32-zp4 zero points is not one of"),
    (KVCache("fp8_e4m3fn", "token-head"), Poison("nan", "v", None, "zeros"), "needs a cache with zero points"),
    (TURBOQUANT_K8V3, Poison("nan", "k", None, "scales"), "needs a cache with per-token-head scales"),
])
def test_invalid_formats_and_poison_are_named_in_one_line(kv, poison, message):
    with pytest.raises(CaseError, match=message) as info:
        windowed(KVCache()).replace(kv_cache=kv, poison=poison).validate()
    assert "\n" not in str(info.value)


def test_a_rotation_or_halves_needs_an_even_head_size_on_each_side():
    case = windowed(VLLM_INT4)
    with pytest.raises(CaseError, match=r"kv_cache.rotation needs an even head_size_v \(head_size_v=33 has no"):
        case.replace(geometry=dataclasses.replace(case.geometry, head_size_v=33)).validate()
    halves_v = KVCache("fp8_e4m3fn", value=LMDEPLOY_INT4.key)
    with pytest.raises(CaseError, match="kv_cache packing 'halves' needs an even head_size_v, not 33"):
        case.replace(kv_cache=halves_v, geometry=dataclasses.replace(case.geometry, head_size_v=33)).validate()
    with pytest.raises(NanfuzzError, match=r"hadamard, whose rows need an even head size .* give \[33\]"):
        Capabilities(head_sizes=(32,), diff_kv=((32, 33),), cache_formats=(VLLM_INT4,))


# -- packing and rotation --------------------------------------------------------------------

def test_packed_codes_sit_in_the_bytes_each_packing_names():
    codes = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 0]])
    assert packing.pack_codes(codes, 4, "interleaved").tolist() == [[0x21, 0x43, 0x65, 0x07]]  # the even code low
    assert packing.pack_codes(codes, 4, "halves").tolist() == [[0x51, 0x62, 0x73, 0x04]]       # code j + 4 high
    # 3 bits: codes as one little-endian bit string, the third straddling bytes 0 and 1
    assert packing.pack_codes(codes, 3, "interleaved").tolist() == [[0b11010001, 0b01011000, 0b00011111]]
    for bits, head in ((4, 48), (3, 48), (3, 13), (8, 5)):
        data = torch.randint(0, 1 << bits, (6, head))
        for way in ("interleaved", "halves") if bits == 4 else ("interleaved",):
            packed = packing.pack_codes(data, bits, way)
            assert packed.shape[-1] == packing.row_bytes(head, bits)
            assert torch.equal(packing.unpack_codes(packed, bits, way, head), data)


def test_a_rotation_is_undone_and_scales_dot_products_by_its_block():
    kv = VLLM_INT4
    q, k = torch.randn(3, 48, dtype=torch.float64), torch.randn(3, 48, dtype=torch.float64)
    assert torch.allclose(rotation.unrotate(rotation.rotate(q, kv), kv), q)
    assert torch.allclose((rotation.rotate(q, kv) * rotation.rotate(k, kv)).sum(-1), 16 * (q * k).sum(-1))
    assert set(rotation.rotation_signs(16, kv.rotation_seed).tolist()) == {-1.0, 1.0}


def test_the_rotation_is_vllms_single_rht(vllm_source):
    from nanfuzz.harness.adapters import vllm_loader

    loaded = vllm_loader.load("triton_attn_int4", str(vllm_source))
    x = torch.randn(4, 96, dtype=torch.float64)
    with loaded.active():
        theirs = loaded["int4_per_token_head"].single_rht(x.float()).double()
    torch.testing.assert_close(rotation.rotate(x, VLLM_INT4), theirs, rtol=0, atol=1e-5)


# -- materialisation -------------------------------------------------------------------

@pytest.mark.parametrize("kv", FORMATS, ids=NAMES.get)
def test_only_dead_slots_change_and_the_leak_run_refills_them_as_materialise_would(kv):
    case = windowed(kv, Poison("bits", "kv", None, "data+scales+zeros"))
    poisoned, clean = materialize(case), materialize(case, poisoned=False)
    live = live_mask(case, "cpu")
    for name in ("key_cache", "value_cache", "k_scale_cache", "v_scale_cache", "k_zero_cache", "v_zero_cache"):
        a, b = getattr(poisoned, name), getattr(clean, name)
        if a is None:
            continue
        bytes_a, bytes_b = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
        assert torch.equal(bytes_a[live], bytes_b[live]), name
        assert not torch.equal(bytes_a[~live], bytes_b[~live]), name
    refilled, fresh = refill_dead_slots(poisoned, garbage_seed=1), materialize(case, garbage_seed=1, poisoned=False)
    for name, tensor in fresh.bases().items():
        assert torch.equal(tensor.contiguous().view(torch.uint8), refilled.bases()[name].contiguous().view(torch.uint8))
    # the same seeded values as an unquantized case, quantized (4-bit codes: within a few steps of 2 / 15)
    plain = oracle(materialize(case.replace(kv_cache=KVCache(), poison=Poison())))
    assert (oracle(poisoned) - plain).abs().max() < 0.3
    assert torch.equal(oracle(poisoned), oracle(clean))


@pytest.mark.parametrize("part, value", [("scales", "nan"), ("zeros", "max"), ("scales+zeros", "zero")])
def test_a_zp4_words_scale_bits_and_zero_point_bits_are_poisoned_apart(part, value):
    case = windowed(VLLM_INT4, Poison(value, "v", (PoisonSite(1),), part))
    scale, zero = word_fields(materialize(case).v_scale_cache[1])
    clean_scale, clean_zero = word_fields(materialize(case, poisoned=False).v_scale_cache[1])
    poisoned_scale = {"nan": torch.isnan(scale), "zero": scale == 0}.get(value, scale == clean_scale)
    assert poisoned_scale.all() and (torch.isfinite(clean_scale) & (clean_scale > 0)).all()
    assert torch.equal(zero, torch.full_like(zero, {"max": 15, "zero": 0}[value]) if "zeros" in part else clean_zero)


def test_a_float_zero_point_holds_the_poison_in_the_zero_cache_only():
    case = windowed(LMDEPLOY_INT4, Poison("nan", "v", (PoisonSite(1, 2),), "zeros"))
    batch = materialize(case)
    assert torch.isnan(batch.v_zero_cache).sum() == 2 and torch.isnan(batch.v_zero_cache[1, 2]).all()
    assert batch.v_zero_cache.dtype == torch.float16 and torch.isfinite(batch.v_scale_cache).all()
    assert torch.isfinite(batch.k_zero_cache).all()


@pytest.mark.parametrize("kv", FORMATS, ids=NAMES.get)
def test_a_case_built_on_its_device_holds_what_the_host_build_holds(kv):
    case = windowed(kv, Poison("garbage", "kv", (PoisonSite(1), PoisonSite(3, 7)), "scales"))
    host, device = materialize(case), build_on_device(case, "cpu")
    ids = device.ids
    for name, compact in device.caches.items():
        full = getattr(host, name)
        assert torch.equal(compact.contiguous().view(torch.uint8), full[ids].contiguous().view(torch.uint8)), name
    assert torch.equal(device.oracle_batch().k, host.k) and torch.equal(device.oracle_batch().v, host.v)


# -- the oracle ------------------------------------------------------------------------

@pytest.mark.parametrize("kv", FORMATS, ids=NAMES.get)
def test_the_oracle_matches_an_independent_dequantize_and_attend(kv):
    """The correct subject reads the bytes its own way, in float64: it and the oracle agree to rounding."""
    for case in (windowed(kv), windowed(kv, sinks=True, sliding_window=0, data_seed=3)):
        batch = materialize(case)
        g = case.geometry
        out = torch.empty(case.num_tokens, g.num_q_heads, g.head_size, dtype=torch.float64)
        subjects.attention(batch, out)
        torch.testing.assert_close(oracle(batch), out, rtol=1e-9, atol=1e-12)


def _offset_share_by_hand(batch) -> torch.Tensor:
    """``sum_k p_k |z_k|`` per row, ``z_k`` what V's code x scale adds to key k's value: the subject's
    reading of K and the scales, float64 weights, a loop over rows."""
    case = batch.case
    g = case.geometry
    side = case.kv_cache.side("v")
    rotate, _, norm = subjects._rotation(case.kv_cache, g.head_size)
    share = torch.zeros(case.num_tokens, g.num_q_heads, dtype=torch.float64)
    keys = torch.arange(batch.block_table.shape[1] * g.block_size)
    for t, (s, p) in enumerate(zip(*token_layout(case))):
        slots = batch.block_table[s].long()[keys // g.block_size] * g.block_size + keys % g.block_size
        ok = (keys < case.sequences[s].seq_len) & (keys <= p) & (p - keys < (case.sliding_window or len(keys) + 1))
        k = subjects._values(batch, "k", slots[ok], torch.ones(int(ok.sum()), dtype=torch.bool), None)
        zeros = None if batch.v_zero_cache is None else batch.v_zero_cache.reshape(-1, g.num_kv_heads)[slots[ok]]
        scale, zero = subjects._parameters(batch.v_scale_cache.reshape(-1, g.num_kv_heads)[slots[ok]], zeros, side)
        offset = zero * scale if side.zero_points == "code" else -zero                       # [keys, heads]
        for h in range(g.num_q_heads):
            kv = h // g.queries_per_kv
            weights = torch.softmax(k[:, kv] @ rotate(batch.q[t, h].double()) * (case.scale / norm), dim=0)
            share[t, h] = (weights * offset[:, kv].abs()).sum()
    return share


@pytest.mark.parametrize("kv", FORMATS, ids=NAMES.get)
def test_the_offset_share_weighs_what_each_key_s_code_times_scale_adds_to_its_values(kv):
    batch = materialize(windowed(kv))
    _, summands = attend_and_measure(batch, (FLOAT64,))
    expected = _offset_share_by_hand(batch)
    assert expected.min() > 0
    torch.testing.assert_close(summands.offset_share, expected, rtol=1e-5, atol=0)


@pytest.mark.parametrize("kv", [KVCache(), KVCache("fp8_e4m3fn", "tensor", 0.5, 2.0), KVCache("int8", "token-head")],
                         ids=["unquantized", "fp8", "int8"])
def test_a_cache_of_centred_codes_has_no_offset_share(kv):
    _, summands = attend_and_measure(materialize(windowed(kv, Poison("max", "kv", None))), (FLOAT64,))
    assert summands.keys.max() > 1 and not summands.offset_share.any()


@pytest.mark.parametrize("kv", FORMATS, ids=NAMES.get)
def test_each_cache_packs_and_rotates_rows_of_its_own_head_size(kv):
    """K's rows of 48 entries and V's of 32 (``Geometry.head_size_v``): each side's codes, built on the host
    and on the device alike, read back as the independent subject reads them."""
    case = windowed(kv, Poison("bits", "kv", (PoisonSite(1), PoisonSite(3, 7)), "data+scales+zeros"))
    case = case.replace(geometry=dataclasses.replace(case.geometry, head_size_v=32)).validate()
    batch, device = materialize(case), build_on_device(case, "cpu")
    assert batch.key_cache.shape[-1] == kv.side("k").row_bytes(48)
    assert batch.value_cache.shape[-1] == kv.side("v").row_bytes(32) and batch.v.shape[-1] == 32
    for name, compact in device.caches.items():
        full = getattr(batch, name)[device.ids]
        assert torch.equal(compact.contiguous().view(torch.uint8), full.contiguous().view(torch.uint8)), name
    refilled, fresh = refill_dead_slots(batch, garbage_seed=1), materialize(case, garbage_seed=1, poisoned=False)
    for name, tensor in fresh.bases().items():
        assert torch.equal(tensor.contiguous().view(torch.uint8), refilled.bases()[name].contiguous().view(torch.uint8))
    out = torch.empty(case.num_tokens, 4, 32, dtype=torch.float64)
    subjects.attention(batch, out)
    torch.testing.assert_close(oracle(batch), out, rtol=1e-9, atol=1e-12)


def test_new_tokens_hold_the_caches_values_unrotated():
    case = windowed(VLLM_INT4)
    batch = materialize(case)
    g = case.geometry
    slot = 3 * g.block_size + 4  # sequence 0's query: key 20, in physical block 3 at offset 4
    k, v = live_values(batch, torch.tensor([slot]))
    torch.testing.assert_close(batch.k[0].double(), k[0], rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(batch.v[0].double(), v[0], rtol=2e-3, atol=2e-3)


# -- strategies ------------------------------------------------------------------------

TINY = Size(max_sequences=3, max_blocks_per_sequence=3, max_query_len=4, max_kv_heads=2, max_q_heads=4)
OPTIONS = dict(settings=settings(database=None, max_examples=400, derandomize=True,
                                 suppress_health_check=list(HealthCheck)))


def test_formats_come_after_the_simpler_caches_and_shrink_toward_nan_in_v_scales():
    caps = Capabilities(head_sizes=(32,), kv_cache_dtypes=("auto",), cache_formats=(LMDEPLOY_INT8, VLLM_INT4))
    strategy = paged_cases(caps, interpreter=True, size=TINY)
    assert find(strategy, lambda c: True, **OPTIONS).kv_cache == KVCache()
    assert find(strategy, lambda c: c.kv_cache.quantized, **OPTIONS).kv_cache == LMDEPLOY_INT8
    poison = find(strategy, lambda c: c.kv_cache == VLLM_INT4 and c.poison.value == "nan", **OPTIONS).poison
    assert (poison.tensors, poison.parts) == ("v", "scales")


def test_drawn_poison_fits_each_format_and_reaches_every_part():
    caps = Capabilities(head_sizes=(32, 48), kv_cache_dtypes=(), cache_formats=FORMATS)
    seen = set()

    # derandomized, and 300: random runs of 150 met NaN in TurboQuant's fp8 keys 1 to 20 times, and
    # now and then never
    @settings(max_examples=300, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(paged_cases(caps, interpreter=True, size=TINY))
    def drawn(case):
        assert case.kv_cache in FORMATS  # validated as drawn: every value fits every part it fills
        seen.add((case.poison.value == "nan", case.poison.hits_scales, case.poison.hits_zeros,
                  case.kv_cache.side(case.poison.tensors[-1]).dtype))

    drawn()
    assert (True, True, False, "uint4") in seen and any(nan and zeros for nan, _, zeros, _ in seen)
    assert (True, False, False, "fp8_e4m3fn") in seen  # NaN in TurboQuant's fp8 keys


# -- catching what a kernel reads ----------------------------------------------------------

def _subject_case(kv: KVCache, parts: str, value: str = "nan") -> Case:
    """One decode over two blocks of 8 (keys 0-12) with a window of 4: block 1 expired, its slots read
    by a kernel that reads the whole table; the poison in V's ``parts`` of slot (1, 0)."""
    return Case(Geometry(2, 1, 32, 8, 3, "float16"), (Sequence(1, 13, (1, 2)),), sliding_window=4,
                poison=Poison(value, "v", (PoisonSite(1, 0),), parts), kv_cache=kv, data_seed=5).validate()


@pytest.mark.parametrize("bug, kv, parts, verdict", [
    ("zero-point", LMDEPLOY_INT4, "zeros", Verdict.NONFINITE),
    ("zero-point", subjects.TURBOQUANT_K8V4, "zeros", Verdict.NONFINITE),
    ("scale", LMDEPLOY_INT8, "scales", Verdict.NONFINITE),
    ("scale", VLLM_INT4, "scales", Verdict.NONFINITE),
    ("nibble", LMDEPLOY_INT4, "data", Verdict.MISMATCH),
    ("nibble", VLLM_INT4, "data", Verdict.MISMATCH),
    ("rotation", VLLM_INT4, "data", Verdict.MISMATCH),
])
def test_each_planted_read_is_caught_and_the_correct_kernel_passes_the_same_case(bug, kv, parts, verdict):
    case = _subject_case(kv, parts, "nan" if verdict is Verdict.NONFINITE else "max")
    outcome = check(subjects.quantized_kernel(bug), case, "cpu")
    assert outcome.verdict is verdict, outcome.summary
    if verdict is Verdict.NONFINITE:
        assert "out-of-window (poison in V " + {"zeros": "zero points", "scales": "scales"}[parts] in outcome.summary
    assert check(subjects.quantized_kernel(None), case, "cpu").verdict is Verdict.PASS


def test_a_kernel_that_weights_a_dead_slot_is_a_leak_where_its_4_bit_zero_point_holds_no_nan():
    """Key 8, just past the window, poisoned in its zero point (a code 0..15 in the scale word)."""
    case = _subject_case(VLLM_INT4, "zeros", "max").replace(poison=Poison("max", "v", (PoisonSite(2, 0),), "zeros"))
    outcome = check(subjects.quantized_kernel("past-window"), case.validate(), "cpu")
    assert outcome.verdict is Verdict.LEAK, outcome.summary
    assert check(subjects.quantized_kernel(None), case, "cpu").verdict is Verdict.PASS


@pytest.mark.parametrize("bug", subjects.PLANTED)
def test_a_campaign_finds_each_planted_read(bug):
    campaign = fuzz(subjects.quantized_kernel(bug), device="cpu", max_examples=40, seed=1, shrink=False,
                    use_database=False)
    assert campaign.failed, f"quantized@{bug} passed 40 examples"


def test_rotations_in_bfloat16_stay_within_the_bound_and_a_forgotten_rotation_does_not():
    """vLLM's INT4 attention rotates in bfloat16 on GPUs; declared, the reference and the floor allow it."""
    campaign = fuzz(subjects.quantized_kernel("bf16-rotations"), device="cpu", max_examples=30, seed=3,
                    use_database=False)
    assert not campaign.failed, f"{campaign.failure.summary}\n{campaign.failing_case.to_json()}"
    assert check(subjects.quantized_kernel("rotation"), _subject_case(VLLM_INT4, "data", "max"),
                 "cpu").verdict is Verdict.MISMATCH


def test_a_campaign_of_the_correct_kernel_passes():
    """Every format on its own cases: ``test_the_oracle_matches_an_independent_dequantize_and_attend``."""
    campaign = fuzz(subjects.quantized_kernel(None), device="cpu", max_examples=40, seed=2, use_database=False)
    assert not campaign.failed, f"{campaign.failure.summary}\n{campaign.failing_case.to_json()}"
    assert len({f"kv:{kv.label()}" for kv in FORMATS} & set(campaign.statistics.counts)) >= 3
    assert campaign.statistics.counts["poison:zero-point"] and campaign.statistics.counts["poison-value:nan"]


@pytest.mark.parametrize("kv, bug, parts", [(VLLM_INT4, None, "scales"), (VLLM_INT4, "scale", "scales"),
                                            (subjects.TURBOQUANT_K8V4, None, "zeros"),
                                            (subjects.TURBOQUANT_K8V4, "zero-point", "zeros")],
                         ids=["vllm-int4", "vllm-int4-scale", "turboquant", "turboquant-zero-point"])
def test_a_case_built_large_gives_the_small_builds_verdict(kv, bug, parts, monkeypatch):
    """Built on its device into the pooled caches (scale words, fp16 zero caches beside the codes)."""
    from nanfuzz.reference import case as case_module

    case = _subject_case(kv, parts)
    small = check(subjects.quantized_kernel(bug), case, "cpu")
    monkeypatch.setattr(case_module, "LARGE_ELEMENTS", 0)
    assert case.large
    large = check(subjects.quantized_kernel(bug), case, "cpu")
    assert large.verdict is small.verdict, (large.summary, small.summary)
    assert large.output_sha256 == small.output_sha256
