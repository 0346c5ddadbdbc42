"""Plain-torch kernels over caches with zero points, packed codes and rotations, each with one planted bug.

They read the caches as the formats below say, written here from the formats' definitions and
not with nanfuzz's reference code: unsigned codes unpacked from the bytes, (code - zero) x scale
or code x scale + zero, a zero point in a float32 scale's low 4 bits, q rotated by a Hadamard
transform with signs from torch's generator and the output rotated back.  The correct kernel
masks every dead slot's dequantized K and V; each bug reads one field of a dead slot, or one
live field wrongly:

- ``zero-point``: masks a slot's codes and scale but not its zero point (a NaN zero reaches P @ V);
- ``scale``: masks its codes and zero point but not its scale;
- ``nibble``: takes a byte's high nibble for its low one;
- ``rotation``: leaves q unrotated against a rotated cache;
- ``past-window``: reads one key past the window's start with its weight.

``bf16-rotations`` is correct but rotates q and un-rotates its output in bfloat16, as vLLM's INT4
attention does on GPUs (``single_rht``): within the bound, no bug.

``raw_codes`` computes as vLLM's INT4 attention does with float32 queries on NVIDIA GPUs: q and
P x V's scale dotted with the raw codes in TF32 (the operands truncated to 10 mantissa bits), the
zero points' share subtracted afterwards in float32.
"""
from __future__ import annotations

import torch

from nanfuzz.harness.kernel import Kernel
from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.case import CacheSide, KVCache
from nanfuzz.reference.materialize import token_layout

# vLLM's INT4 per-token-head cache; lmdeploy's int4 and int8 caches; TurboQuant's fp8 keys and 4-bit values.
VLLM_INT4 = KVCache("uint4", "token-head", zero_points="code", scale_format="float32-zp4", rotation="hadamard",
                    rotation_seed=0x9E3779B9)
LMDEPLOY_INT4 = KVCache("uint4", "token-head", zero_points="code", scale_format="dtype", packing="halves")
LMDEPLOY_INT8 = KVCache("uint8", "token-head", zero_points="code", scale_format="dtype")
TURBOQUANT_K8V4 = KVCache("fp8_e4m3fn", value=CacheSide("uint4", "token-head", "offset", "float16"))
TURBOQUANT_K8V3 = KVCache("fp8_e4m3fn", value=CacheSide("uint3", "token-head", "offset", "float16"))
FORMATS = (VLLM_INT4, LMDEPLOY_INT4, LMDEPLOY_INT8, TURBOQUANT_K8V4, TURBOQUANT_K8V3)
BITS = {"uint8": 8, "uint4": 4, "uint3": 3}


def _codes(rows: torch.Tensor, side: CacheSide, head_size: int, swap: bool) -> torch.Tensor:
    """int64 codes ``[..., head_size]`` of uint8 rows ``[..., bytes]``, bit by bit."""
    bits = BITS[side.dtype]
    data = rows.to(torch.int64)
    if bits == 8:
        return data
    if side.packing == "halves":
        low, high = data & 0xF, data >> 4
        return torch.cat((high, low) if swap else (low, high), dim=-1)
    stream = ((data[..., None] >> torch.arange(8)) & 1).flatten(-2)[..., :head_size * bits]
    codes = (stream.view(*data.shape[:-1], head_size, bits) << torch.arange(bits)).sum(-1)
    if swap:  # each byte's two codes the other way round
        codes = codes.view(*codes.shape[:-1], head_size // 2, 2).flip(-1).reshape(codes.shape)
    return codes


def _parameters(scales: torch.Tensor, zeros: torch.Tensor | None, side: CacheSide):
    """(float64 scale, float64 zero) per row from the stored scale and zero caches."""
    if side.scale_format == "float32-zp4":
        words = scales.contiguous().view(torch.int32)
        return (words & ~0xF).view(torch.float32).double(), (words & 0xF).double()
    return scales.double(), zeros.double()


def _values(batch, which: str, slots: torch.Tensor, ok: torch.Tensor, bug: str | None) -> torch.Tensor:
    """float64 ``[len(slots), heads, its head size]`` of cache ``which`` at the slots; dead ones (``~ok``) 0,
    but for what the bug leaves unmasked."""
    case = batch.case
    g = case.geometry
    side = case.kv_cache.side(which)
    head_size = g.head_size if which == "k" else g.v_head_size
    cache = batch.key_cache if which == "k" else batch.value_cache
    rows = cache.reshape(-1, g.num_kv_heads, cache.shape[-1])[slots]
    live = ok[:, None, None]
    if side.dtype not in BITS:  # fp8 with a per-tensor scale
        scale = (batch.k_scale if which == "k" else batch.v_scale).double()
        return torch.where(live, rows.double() * scale, 0.0)
    codes = _codes(rows.view(torch.uint8), side, head_size, bug == "nibble").double()
    scale_cache = batch.k_scale_cache if which == "k" else batch.v_scale_cache
    zero_cache = batch.k_zero_cache if which == "k" else batch.v_zero_cache
    scale, zero = _parameters(scale_cache.reshape(-1, g.num_kv_heads)[slots],
                              None if zero_cache is None else zero_cache.reshape(-1, g.num_kv_heads)[slots], side)
    scale, zero = scale[..., None], zero[..., None]
    codes = torch.where(live, codes, 0.0)
    if bug != "scale":
        scale = torch.where(live, scale, 0.0)
    if bug != "zero-point":
        zero = torch.where(live, zero, 0.0)
    values = (codes - zero) * scale if side.zero_points == "code" else codes * scale + zero
    return values if bug in ("scale", "zero-point") else torch.where(live, values, 0.0)


def _rotation(kv: KVCache, head_size: int):
    """(rotate, unrotate, norm) of the cache's Hadamard rotation, by butterflies, per run of b entries."""
    if kv.rotation == "none":
        return (lambda x: x), (lambda y: y), 1
    b = head_size & -head_size
    generator = torch.Generator().manual_seed(kv.rotation_seed)
    signs = (2.0 * torch.bernoulli(torch.full((b,), 0.5), generator=generator) - 1.0).double()

    def hadamard(x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, b)
        h = 1
        while h < b:
            pairs = x.view(-1, b // (2 * h), 2, h)
            x = torch.stack((pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]), dim=2).reshape(-1, b)
            h *= 2
        return x.reshape(shape)

    def runs(f):
        return lambda x: f(x.reshape(*x.shape[:-1], -1, b)).reshape(x.shape)

    return runs(lambda x: hadamard(x * signs)), runs(lambda y: hadamard(y) * signs / b), b


def _bfloat16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).double()


def attention(batch, out, *, bug: str | None = None):
    case = batch.case
    g = case.geometry
    rotate, _, norm = _rotation(case.kv_cache, g.head_size)
    _, unrotate, _ = _rotation(case.kv_cache, g.v_head_size)  # V's rows, and the output's, by V's head size
    if bug == "rotation":
        rotate = lambda x: x  # noqa: E731
    if bug == "bf16-rotations":  # the query dtype after each: rounded through bfloat16 in between
        exact_rotate, exact_unrotate = rotate, unrotate
        rotate = lambda x: _bfloat16(exact_rotate(_bfloat16(x))).to(out.dtype).double()  # noqa: E731
        unrotate = lambda y: _bfloat16(exact_unrotate(_bfloat16(y.to(out.dtype)))).to(out.dtype)  # noqa: E731
    seq_of, pos_of = token_layout(case)
    width = batch.block_table.shape[1] * g.block_size
    keys = torch.arange(width)
    for t, (s, p) in enumerate(zip(seq_of, pos_of)):
        seq = case.sequences[s]
        slots = batch.block_table[s].long()[keys // g.block_size] * g.block_size + keys % g.block_size
        ok = (keys < seq.seq_len) & (keys <= p)
        if case.sliding_window:
            ok &= p - keys < case.sliding_window + (bug == "past-window")
        k, v = _values(batch, "k", slots, ok, bug), _values(batch, "v", slots, ok, bug)
        for h in range(g.num_q_heads):
            kv = h // g.queries_per_kv
            scores = (k[:, kv] @ rotate(batch.q[t, h].double())) * (case.scale / norm)
            scores = torch.where(ok, scores, float("-inf"))
            m = scores.max()
            if batch.sinks is not None:
                m = torch.maximum(m, batch.sinks[h].double())
            weights = torch.exp(scores - m)
            denom = weights.sum() + (torch.exp(batch.sinks[h].double() - m) if batch.sinks is not None else 0.0)
            out[t, h] = unrotate((weights @ v[:, kv]) / denom).to(out.dtype)
    return out


def _truncated_to_tf32(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` with its low 13 mantissa bits cleared, as Triton's TF32 ``tl.dot`` reads an operand on NVIDIA."""
    return (x.contiguous().view(torch.int32) & ~0x1FFF).view(torch.float32)


def _raw(batch, which: str, slots: torch.Tensor, ok: torch.Tensor):
    """float32 (codes ``[keys, heads, head size]``, scales ``[keys, heads]``, zero points in code units) of
    cache ``which`` at the slots, each 0 at a dead one (``~ok``)."""
    case = batch.case
    g = case.geometry
    side = case.kv_cache.side(which)
    assert side.dtype in BITS and side.zero_points == "code", side
    head_size = g.head_size if which == "k" else g.v_head_size
    cache = batch.key_cache if which == "k" else batch.value_cache
    rows = cache.reshape(-1, g.num_kv_heads, cache.shape[-1])[slots]
    codes = _codes(rows.view(torch.uint8), side, head_size, False)
    scale_cache = batch.k_scale_cache if which == "k" else batch.v_scale_cache
    zero_cache = batch.k_zero_cache if which == "k" else batch.v_zero_cache
    scale, zero = _parameters(scale_cache.reshape(-1, g.num_kv_heads)[slots],
                              None if zero_cache is None else zero_cache.reshape(-1, g.num_kv_heads)[slots], side)
    live = ok[:, None]
    return (torch.where(live[..., None], codes, 0).float(), torch.where(live, scale, 0.0).float(),
            torch.where(live, zero, 0.0).float())


def raw_code_attention(batch, out, *, plant: str | None = None):
    """Attention over a cache of unsigned codes with zero points in code units, as vLLM's INT4 kernel
    computes it on NVIDIA GPUs with float32 queries (int4_per_token_head.py): ``S = (tf32(q) . codes -
    sum(q) x zero) x scale x k_scale``; ``acc = tf32(P x v_scale) . codes - sum(P x v_scale x zero)``;
    everything else float32, in one pass over a row's keys.  ``plant`` "zero-point": V's zero points
    subtracted one code short (each value one quantization step off); "drop-key": each row skips its
    first allowed key."""
    case = batch.case
    g = case.geometry
    rotate, _, norm = _rotation(case.kv_cache, g.head_size)
    _, unrotate, _ = _rotation(case.kv_cache, g.v_head_size)
    seq_of, pos_of = token_layout(case)
    width = batch.block_table.shape[1] * g.block_size
    keys = torch.arange(width)
    heads = torch.arange(g.num_q_heads) // g.queries_per_kv          # each query head's KV head
    for t, (s, p) in enumerate(zip(seq_of, pos_of)):
        seq = case.sequences[s]
        slots = batch.block_table[s].long()[keys // g.block_size] * g.block_size + keys % g.block_size
        ok = (keys < seq.seq_len) & (keys <= p)
        if case.sliding_window:
            ok &= p - keys < case.sliding_window
        if plant == "drop-key":
            ok &= keys != int(ok.int().argmax())
        k_codes, k_scale, k_zero = (x[:, heads] for x in _raw(batch, "k", slots, ok))   # [keys, hq, ...]
        v_codes, v_scale, v_zero = (x[:, heads] for x in _raw(batch, "v", slots, ok))
        if plant == "zero-point":
            v_zero = v_zero - 1
        q = rotate(batch.q[t].double()).float()                                          # [hq, d]
        # -- scores: TF32 q against the raw codes, the zero point's share taken off ---
        raw = torch.einsum("hd,khd->hk", _truncated_to_tf32(q), k_codes)
        scores = (raw - q.sum(dim=-1)[:, None] * k_zero.T) * ((case.scale / norm) * k_scale.T)
        scores = torch.where(ok, scores, float("-inf"))
        m = scores.amax(dim=-1, keepdim=True)
        if batch.sinks is not None:
            m = torch.maximum(m, batch.sinks.float()[:, None])
        weights = torch.exp(scores - m)                                                  # [hq, keys]
        denom = weights.sum(dim=-1, keepdim=True)
        if batch.sinks is not None:
            denom = denom + torch.exp(batch.sinks.float()[:, None] - m)
        # -- P x v_scale against the raw codes in TF32, the zero points' share in float32 --
        scaled = weights * v_scale.T
        acc = torch.einsum("hk,khe->he", _truncated_to_tf32(scaled), v_codes)
        acc = acc - (scaled * v_zero.T).sum(dim=-1, keepdim=True)
        out[t] = unrotate((acc / denom).double()).to(out.dtype)
    return out


BUGS = (None, "zero-point", "scale", "nibble", "rotation", "past-window", "bf16-rotations")
# The formats each kernel reads: a NaN zero point needs one stored as a float; a rotation, a rotated cache.
_FORMATS = {None: FORMATS, "zero-point": (LMDEPLOY_INT4, TURBOQUANT_K8V4), "scale": (LMDEPLOY_INT8, VLLM_INT4),
            "nibble": (VLLM_INT4, LMDEPLOY_INT4), "rotation": (VLLM_INT4,), "past-window": (VLLM_INT4,),
            "bf16-rotations": (VLLM_INT4,)}
# How the bugless kernels rotate: in bfloat16, declared (Capabilities.rotation_dtype).
_ROTATION_DTYPE = {"bf16-rotations": "bfloat16"}


def _kernel(bug: str | None) -> Kernel:
    attr = (bug or "correct").replace("-", "_")
    # plain torch compiles nothing per case (specialisation_pool=0); float64 arithmetic, so "ieee"
    # V of its own head size too (Geometry.head_size_v): each side packed and rotated by its width
    caps = Capabilities(dtypes=("float16", "float32"), head_sizes=(32, 48, 64), diff_kv=((48, 32),),
                        block_sizes=(8, 16), sinks=True, kv_cache_dtypes=(), cache_formats=_FORMATS[bug],
                        precision="ieee", specialisation_pool=0, rotation_dtype=_ROTATION_DTYPE.get(bug))
    caught = bug not in (None, *_ROTATION_DTYPE)
    return Kernel(name=f"quantized@{bug or 'correct'}", run=lambda b, o: attention(b, o, bug=bug), capabilities=caps,
                  expect="caught" if caught else "pass", spec=f"tests.quantized_subjects:{attr}")


_KERNELS = {bug: _kernel(bug) for bug in BUGS}
globals().update({(bug or "correct").replace("-", "_"): kernel for bug, kernel in _KERNELS.items()})
PLANTED = tuple(bug for bug, kernel in _KERNELS.items() if kernel.expect == "caught")


def quantized_kernel(bug: str | None = None) -> Kernel:
    return _KERNELS[bug]


def raw_code_kernel(plant: str | None = None) -> Kernel:
    """``raw_code_attention`` as a float32 kernel of TF32 products over caches with zero points in code units."""
    caps = Capabilities(dtypes=("float32",), head_sizes=(32, 64), block_sizes=(16,), sinks=True, kv_cache_dtypes=(),
                        cache_formats=(VLLM_INT4, LMDEPLOY_INT4, LMDEPLOY_INT8), precision="tf32",
                        specialisation_pool=0)
    return Kernel(name=f"quantized@raw-codes{'-' + plant if plant else ''}", capabilities=caps,
                  run=lambda b, o: raw_code_attention(b, o, plant=plant), expect="caught" if plant else "pass")
