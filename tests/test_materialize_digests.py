"""Materialised batches keep their bits: digests pinned for a spread of cases.

Every allocation (the tensor a kernel receives and its redzones), every
encoding and scale cache, the poisoned run and the finite-garbage run of
the LEAK check.  A change to how a batch is built must leave these digests
alone; a change to what a batch holds changes them on purpose.
"""
import hashlib

import pytest
import torch

from nanfuzz.reference.case import KVCache, Poison, PoisonSite
from nanfuzz.reference.materialize import materialize, refill_dead_slots
from tests.cases import consecutive_case

MIXED = ((1, 9), (5, 21), (0, 7), (3, 3))   # (query_len, seq_len): decode, chunked prefill, no query, prefill


def _cases():
    c = consecutive_case
    yield "decode_fp16_nan", c(((1, 17), (1, 5), (1, 33)), dtype="float16", poison=Poison("nan", "kv"))
    yield "mixed_bf16_window_inf_k", c(MIXED, dtype="bfloat16", window=6, block_size=8,
                                       poison=Poison("inf", "k", (PoisonSite(1, 0), PoisonSite(3))), seed=3)
    yield "noncausal_window_fp32_sinks_gqa_bits", c(MIXED, q_heads=8, kv_heads=2, head_size=32, block_size=8,
                                                    dtype="float32", window=5, causal=False, sinks=True,
                                                    poison=Poison("bits", "v"), seed=11)
    yield "prefill_fp16_garbage", c(((7, 7), (4, 30)), dtype="float16", poison=Poison("garbage", "kv"), seed=5)
    yield "max_minus_inf_bs48", c(((2, 50), (1, 1)), block_size=48, head_size=32, dtype="bfloat16",
                                  poison=Poison("-inf", "kv", (PoisonSite(0),)), seed=7)
    yield "fp16_max", c(((1, 12),), dtype="float16", poison=Poison("max", "v"), spare_entries=3)
    for dtype, value, seed in (("fp8_e4m3fn", "nan", 1), ("fp8_e5m2", "inf", 2), ("fp8_e4m3fnuz", "bits", 3),
                               ("fp8_e5m2", "garbage", 4)):
        yield f"per_tensor_{dtype}_{value}", c(MIXED, block_size=8, window=7, seed=seed).replace(
            kv_cache=KVCache(dtype, "tensor", 0.5, 2.0), poison=Poison(value, "kv"))
    for dtype, value, parts, seed in (("fp8_e4m3fn", "nan", "data", 1), ("fp8_e4m3fnuz", "nan", "data+scales", 2),
                                      ("int8", "max", "data", 3), ("int8", "zero", "scales", 4),
                                      ("fp8_e5m2", "bits", "data+scales", 5), ("int8", "garbage", "data+scales", 6)):
        yield f"token_head_{dtype}_{value}_{parts}", c(MIXED, q_heads=4, kv_heads=2, block_size=8, sinks=True,
                                                       seed=seed, dtype="bfloat16").replace(
            kv_cache=KVCache(dtype, "token-head"),
            poison=Poison(value, "kv" if seed % 2 else "v", (PoisonSite(6),) if seed > 4 else None, parts))


CASES = dict(_cases())


def batch_digest(batch) -> str:
    """sha256 over every allocation: its name, dtype, shape, view and bytes."""
    h = hashlib.sha256()
    for name in sorted(batch.allocations):
        a = batch.allocations[name]
        base = a.base.contiguous().cpu()
        h.update(f"{name}|{base.dtype}|{tuple(base.shape)}|{a.index}".encode())
        h.update(base.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


EXPECTED = {  # (poisoned, finite garbage of seed 1)
    'decode_fp16_nan': ('bb691724c87e9168ca5354fd32894d81c954d382236908f8b1244d893352f9c0',
        '6456541fc5e1a89452d69009343bc84fe1861fa76ffa45b9b17cb7271c92c056'),
    'fp16_max': ('614ba54e157238a36f3963fbd3db89df54e7357874a7c2ee8ac8ed8723e0f494',
        '4b1c03ef9c26e83e91e9a6c3cb4f247bd83b66ec2e63b744b435e8f31ec3a36f'),
    'max_minus_inf_bs48': ('46163adf0ffb02ee5e2c9dda7f19666c05ca6560583fbf752cfdc5035f7e9343',
        '1c9496a5f60fc33bc2af581c3851ae37c6fc860575af70a4708c3db93b4ea026'),
    'mixed_bf16_window_inf_k': ('a91c73ae3a7b1475039278dd882d6d442ac239e72fc9ab54841fd46f18cf3471',
        '750fd6488dc43043fb410d4c654883bdc2f53c2b06c49dd8e97f7039718f8d9f'),
    'noncausal_window_fp32_sinks_gqa_bits': ('e411fe8a1ff6cb9ad14c34b2f17cde56dae5acbe44f4bc732fc05ac243569eb0',
        'a3794d95678e845a571dae168f4de76ea43c4cb9b265b9faa1202106ddc33c09'),
    'per_tensor_fp8_e4m3fn_nan': ('2d0c7e12e59ba2d87a663e5ffa269186622bcd7c73cfaf8d26f405edd8363b00',
        'c4f8c833f8f1ab94adaad9193fdf6768472feb0bbfd35ff9356f6482872c66b9'),
    'per_tensor_fp8_e4m3fnuz_bits': ('2138655d80b59f2c065e5c4b2596d387942a29b2d1da583f334fc7ecdbee43d7',
        'a7d08a02c67a3e77c4ba9ac1593183039ef48b94797034ce2253cdcf1b6bf4e5'),
    'per_tensor_fp8_e5m2_garbage': ('202030e1f3e59c240bb55add68e093a52369ad8e49ea5f5017a1c2059fac7b6e',
        '6e91fc9ebe8108b2652c6cfd348b1ba5f9e69565297f77f068247df7004464e1'),
    'per_tensor_fp8_e5m2_inf': ('eedff181efbc59e400346a91d929e072202f0f831232c281bf0f7124c96bda5d',
        '4b03ac118a8e73ca5f38c5b89a1363b50af87027a9ec504e13e49bcdc6bf202a'),
    'prefill_fp16_garbage': ('7dc3900ae050ed5b4183c7852da3544661a450a188d40b9c7b154e33cd36885c',
        'ac29f9ad23bfeb5766173a4254f9f24361e7bd867244d633ce7c9b5003511ffa'),
    'token_head_fp8_e4m3fn_nan_data': ('bfbf9895060a05bdb8be20007e9e5e7a1ae720279645c75b73cba45a9b571ddf',
        '10edfed3f067876497f7b2c00c386f44451cf7b62387e2ec592a266ce4d10029'),
    'token_head_fp8_e4m3fnuz_nan_data+scales': ('15504b2fbafc521970758b275379d951d7128d18e3c674defb56c6641f77b285',
        '8759d4cc4f8fc4bf38439660bde3a2a76dbc05c6fc66d7fdc6869ee45aa670f3'),
    'token_head_fp8_e5m2_bits_data+scales': ('a4b78912a1e3c9fb8e945a775eb3285047b6df34e2b9d92b1aad281d89a134c6',
        'e164a17238d9360b54ee81d6315ed3a06be1adee3460bb808027dbeb2fa22759'),
    'token_head_int8_garbage_data+scales': ('fd6c53a313acaf28d80f8baf2fae070bfea426d3aff8c7c0c1bdf61e9f4b4850',
        '011869acd9c6c8b8b8f5daad1c9b0d60546bd31d73448f8ef950bd85920e5121'),
    'token_head_int8_max_data': ('760411d53442e58a35c479ec03b706c1fbb319031eab4581cf62f6d068fa6cd9',
        '70e712bc5b00fe67ed44f7e318cab82baa23482930699498999087967882c752'),
    'token_head_int8_zero_scales': ('5402b425233393ca5769ef90aa9397962ac364496217463353525331930dd4ec',
        'f910621ad2732bc273ee2165eecfeb7b6bb9308854193dd55a82ea04a01a5701'),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_materialised_bits_are_pinned(name):
    case = CASES[name].validate()
    poisoned, clean = EXPECTED[name]
    assert batch_digest(materialize(case)) == poisoned
    assert batch_digest(materialize(case, garbage_seed=1, poisoned=False)) == clean


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_finite_garbage_run_refilled_from_the_poisoned_batch_has_the_same_bits(name):
    """The check builds the LEAK run's batch from the poisoned one (``refill_dead_slots``): its
    redzones and dead slots must hold what a fresh build with that garbage holds, bit for bit."""
    case = CASES[name].validate()
    assert batch_digest(refill_dead_slots(materialize(case), garbage_seed=1)) == EXPECTED[name][1]
