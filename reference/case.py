"""The case model: one paged-attention batch, small, frozen and JSON-exact.

A case holds no tensors.  Everything a kernel sees is rebuilt from it by
``reference.materialize``, so a case is also the repro: a few hundred bytes
of JSON that replay bit for bit.
"""
from __future__ import annotations

import dataclasses
import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any

from nanfuzz.reference.errors import CaseError

# The JSON format of a case.  2: ``geometry.head_size_v`` (V's head size where it differs from K's);
# every version in READABLE_SCHEMA_VERSIONS still reads (a field it lacks takes its default).
SCHEMA_VERSION = 2
READABLE_SCHEMA_VERSIONS = (1, 2)

DTYPES = ("float16", "bfloat16", "float32")
PRECISIONS = ("ieee", "tf32")   # how a kernel multiplies float32 operands (``reference.precision``)
POISON_VALUES = ("nan", "inf", "-inf", "max", "garbage", "bits")
POISON_TENSORS = ("v", "k", "kv")
# How a cache stores its elements: "auto" is the query dtype, unquantized;
# the others are codes read as code x scale, or with a zero point (see ``KVCache``).
# The unsigned codes are asymmetric: uint8 a byte, uint4 and uint3 packed several to a byte.
KV_CACHE_DTYPES = ("auto", "fp8_e4m3fn", "fp8_e4m3fnuz", "fp8_e5m2", "int8", "uint8", "uint4", "uint3")
FP8_DTYPES = ("fp8_e4m3fn", "fp8_e4m3fnuz", "fp8_e5m2")
UNSIGNED_DTYPES = ("uint8", "uint4", "uint3")
CODE_BITS = {"uint8": 8, "uint4": 4, "uint3": 3}
SCALE_MODES = ("tensor", "token-head")
# Where an unsigned code's zero point goes: "code" value = (code - zero) x scale, the zero in
# code units; "offset" value = code x scale + zero, the zero in value units.
ZERO_POINTS = ("none", "code", "offset")
# How a per-token-head scale (and a zero point beside it) is stored: a float of that dtype, of the
# query's dtype ("dtype": the model's), or "float32-zp4": one float32 word whose 4 low mantissa
# bits hold the zero point (an integer code 0..15) and whose other bits are the scale.
SCALE_FORMATS = ("float32", "float16", "bfloat16", "dtype", "float32-zp4")
# How sub-byte codes share bytes: "interleaved", a head's codes as one little-endian bit string
# (code i in bits [i x bits, (i + 1) x bits)); "halves" (uint4): byte j holds code j in its low
# nibble and code j + head_size / 2 in its high one.
PACKINGS = ("interleaved", "halves")
# What a cache holds may be rotated: "hadamard", each (slot, head) row x stored as H_b (s * x) in
# every run of b entries, b the largest power of two dividing head_size, H_b unnormalised
# (H_b H_b^T = b I) and s a +-1 sign vector (``KVCache.rotation_seed``).
ROTATIONS = ("none", "hadamard")
# The hostile values each cache dtype can hold: e4m3fn and e4m3fnuz have no
# Inf, the integer codes neither Inf nor NaN.
DATA_POISON_VALUES = {
    "auto": POISON_VALUES,
    "fp8_e4m3fn": ("nan", "max", "garbage", "bits"),
    "fp8_e4m3fnuz": ("nan", "max", "garbage", "bits"),
    "fp8_e5m2": POISON_VALUES,
    "int8": ("max", "garbage", "bits"),
    "uint8": ("max", "garbage", "bits"),
    "uint4": ("max", "garbage", "bits"),
    "uint3": ("max", "garbage", "bits"),
}
# What a poisoned dead slot of a per-token-head cache holds hostile: its
# codes, its scales (the scale-cache entries of the same slot), its zero
# points, or several of them.  The parts after the first three exist only
# where a cache has zero points.
POISON_PARTS = ("data", "scales", "data+scales", "zeros", "data+zeros", "scales+zeros", "data+scales+zeros")
SCALE_POISON_VALUES = POISON_VALUES + ("zero",)
# A zero point stored as a float holds any float hostile; one of 4 bits (float32-zp4) any of its
# 16 codes: the largest, the upper half, any, or 0.
ZERO_POISON_VALUES = POISON_VALUES
ZP4_POISON_VALUES = ("max", "garbage", "bits", "zero")
# Per-tensor scales: positive normal float32 values in this range.
SCALE_RANGE = (2.0 ** -24, 2.0 ** 24)
NULL_BLOCK = 0

# Bounds above any case the strategies generate (production size included: caches of
# millions of slots, 128k-key sequences at block size 1), checked before anything is
# computed or allocated, so a hand-edited repro cannot hang or exhaust memory.
LIMITS = {"num_q_heads": 1024, "num_kv_heads": 1024, "head_size": 1024, "block_size": 4096, "num_blocks": 1 << 23}
MAX_SLOTS = 1 << 25
MAX_SEQUENCES = 1 << 12
MAX_TABLE_WIDTH = 1 << 18
MAX_TABLE_ENTRIES = 1 << 22
# A case whose caches and queries hold more elements than this (about 32 MiB of fp16) is
# large: built on its device, only the blocks holding live keys written (``reference.device_build``).
LARGE_ELEMENTS = 1 << 24
# Tables with more entries than this are written to JSON without their padding (``table_width``
# gives it back), and validated in numpy: a production case's table is hundreds of thousands.
LARGE_TABLE = 1 << 12
# What a sequence does in this step (``Sequence.kind``).
DECODE, PREFILL, CHUNKED_PREFILL, PADDING = "decode", "prefill", "chunked-prefill", "padding-sequence"
SEQUENCE_KINDS = (DECODE, PREFILL, CHUNKED_PREFILL, PADDING)


@dataclass(frozen=True)
class Geometry:
    """``head_size`` is K's (and q's) head size.  ``head_size_v`` > 0 gives V a head size of its
    own (separate K and V caches of different widths, as MiMo's DiffKV layers have); the output
    has ``v_head_size`` columns.

    ``latent_rank`` > 0 makes the cache an MLA latent cache instead: one KV head whose row of
    ``head_size`` = kv_lora_rank + rope_dim entries is K, and whose first ``latent_rank``
    entries are V (DeepSeek's absorbed MLA decode)."""

    num_q_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    num_blocks: int
    dtype: str
    latent_rank: int = 0
    head_size_v: int = 0  # 0: V as wide as K

    @property
    def queries_per_kv(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def latent(self) -> bool:
        return self.latent_rank > 0

    @property
    def rope_dim(self) -> int:
        """The entries of a latent row past V (its rotary part); 0 without a latent cache."""
        return self.head_size - self.latent_rank if self.latent else 0

    @property
    def diff_kv(self) -> bool:
        """Do separate K and V caches have different head sizes?"""
        return self.head_size_v > 0

    @property
    def v_head_size(self) -> int:
        """V's width, and the output's: ``latent_rank`` for a latent cache, ``head_size_v`` where
        it is given, else ``head_size``."""
        if self.latent:
            return self.latent_rank
        return self.head_size_v or self.head_size

    @property
    def slot_width(self) -> int:
        """The entries one slot holds per KV head over the caches: K's and V's, or a latent cache's one row."""
        return self.head_size if self.latent else self.head_size + self.v_head_size

    def cache_head_size(self, which: str) -> int:
        """The head size of cache ``which`` ("k" or "v"); a latent cache's "k" is its whole row."""
        return self.head_size if which == "k" else self.v_head_size


@dataclass(frozen=True)
class Sequence:
    """One request: ``seq_len`` keys in the cache, the last ``query_len`` of them new.

    ``block_table`` maps logical block j to a physical block id; entries at
    and past ``ceil(seq_len / block_size)`` are padding.
    """

    query_len: int
    seq_len: int
    block_table: tuple[int, ...]

    @property
    def context_len(self) -> int:
        return self.seq_len - self.query_len

    @property
    def kind(self) -> str:
        """DECODE: one new token (a sequence's first one too, with no key before it); PREFILL: every
        key new, more than one; CHUNKED_PREFILL: new tokens after a context; PADDING: no query."""
        if self.query_len == 0:
            return PADDING
        if self.query_len == 1:
            return DECODE
        return PREFILL if self.context_len == 0 else CHUNKED_PREFILL

    def used_blocks(self, block_size: int) -> int:
        """Table entries that map keys (``ceil(seq_len / block_size)``); the rest are padding."""
        return -(-self.seq_len // block_size)

    def live_range(self, window: int) -> tuple[int, int]:
        """The keys some query of this sequence may read under a ``window`` (0 = none),
        as a half-open range ``[lo, hi)``; empty for a sequence without a query.

        The union of the queries' allowed sets is contiguous: every query reads
        its own position, and the window reaches back from the first query.
        """
        if self.query_len == 0:
            return 0, 0
        lo = max(0, self.context_len - window + 1) if window > 0 else 0
        return lo, self.seq_len

    def live_blocks(self, window: int, block_size: int) -> dict[int, range]:
        """Logical block j -> the offsets in it that hold keys of ``live_range``;
        blocks holding none are absent."""
        lo, hi = self.live_range(window)
        return {j: range(max(lo, j * block_size) - j * block_size, min(hi, (j + 1) * block_size) - j * block_size)
                for j in range(lo // block_size, -(-hi // block_size))}


@dataclass(frozen=True)
class CacheSide:
    """How one cache, K's or V's, holds an element (``KVCache.side``).

    ``dtype`` "auto": the query dtype, unquantized.  A quantized side holds
    codes read as code x scale (fp8, int8), or, for the unsigned codes, with
    a zero point (``zero_points``): (code - zero) x scale or code x scale +
    zero.  The scale is per tensor (``scales`` "tensor") or one per (slot,
    KV head) in a paged scale cache ``[num_blocks, block_size, num_kv_heads]``
    stored as ``scale_format`` says, a zero point likewise in a zero cache
    of the same shape (or inside the scale, "float32-zp4").  Sub-byte codes
    are packed as ``packing`` says, ``ceil(head_size x bits / 8)`` bytes a row.
    """

    dtype: str = "auto"
    scales: str = "tensor"
    zero_points: str = "none"
    scale_format: str = "float32"
    packing: str = "interleaved"

    @property
    def quantized(self) -> bool:
        return self.dtype != "auto"

    @property
    def token_head(self) -> bool:
        return self.scales == "token-head"

    @property
    def bits(self) -> int:
        """Bits a code takes: 8 but for the packed unsigned codes."""
        return CODE_BITS.get(self.dtype, 8)

    @property
    def packed(self) -> bool:
        return self.bits < 8

    @property
    def zero_cache(self) -> bool:
        """Does this side have a zero cache of its own (zero points not hidden in the scale)?"""
        return self.zero_points != "none" and self.scale_format != "float32-zp4"

    def row_bytes(self, head_size: int) -> int:
        """Elements of a (slot, head) row of the cache: head_size, or the bytes its packed codes take."""
        return -(-head_size * self.bits // 8) if self.packed else head_size

    def label(self) -> str:
        """``int8/token-head``, ``uint4/token-head/code-zero/dtype/halves``: the side in a word."""
        if not self.quantized:
            return self.dtype
        extras = [f"{self.zero_points}-zero"] if self.zero_points != "none" else []
        extras += [self.scale_format] if self.scale_format != "float32" else []
        extras += [self.packing] if self.packed and self.packing != "interleaved" else []
        return self.dtype + ("/token-head" if self.token_head else "") + "".join("/" + e for e in extras)

    def validate(self, where: str) -> None:
        for name, allowed in (("dtype", KV_CACHE_DTYPES), ("scales", SCALE_MODES), ("zero_points", ZERO_POINTS),
                              ("scale_format", SCALE_FORMATS), ("packing", PACKINGS)):
            value = getattr(self, name)
            _check(value in allowed, f"{where}.{name}={value!r} is not one of {allowed}")
        if not self.quantized:
            _check(not self.token_head, f"{where}.scales='token-head' needs a quantized {where}.dtype")
        if self.dtype == "int8":
            _check(self.token_head, f"{where}.dtype='int8' needs per-token-head scales ({where}.scales 'token-head')")
        unsigned = self.dtype in UNSIGNED_DTYPES
        if unsigned:
            _check(self.token_head and self.zero_points != "none",
                   f"{where}.dtype={self.dtype!r} needs per-token-head scales and zero points "
                   f"({where}.scales 'token-head', {where}.zero_points 'code' or 'offset')")
        else:
            _check(self.zero_points == "none", f"{where}.zero_points={self.zero_points!r} needs unsigned codes "
                                               f"({', '.join(UNSIGNED_DTYPES)}), not {where}.dtype={self.dtype!r}")
        _check(self.scale_format == "float32" or unsigned,
               f"{where}.scale_format={self.scale_format!r} needs unsigned codes ({', '.join(UNSIGNED_DTYPES)})")
        _check(self.scale_format != "float32-zp4" or self.zero_points == "code",
               f"{where}.scale_format='float32-zp4' holds a zero point in code units ({where}.zero_points 'code')")
        _check(self.packing == "interleaved" or self.dtype == "uint4",
               f"{where}.packing={self.packing!r} packs nibbles: it needs {where}.dtype 'uint4'")


_SIDE_DEFAULTS = CacheSide()


@dataclass(frozen=True)
class KVCache:
    """How the paged cache stores keys and values.

    ``dtype`` "auto": in the query dtype, unquantized.  Otherwise each cached
    element is a code of ``dtype`` whose value is code x scale, with one
    float32 ``k_scale`` / ``v_scale`` per tensor (``scales`` "tensor"), or
    one float32 scale per (slot, KV head) in paged scale caches
    ``[num_blocks, block_size, num_kv_heads]`` (``scales`` "token-head";
    ``k_scale`` and ``v_scale`` are then 1 and unused).

    Unsigned codes add a zero point per (slot, KV head), packing and a
    scale format (``CacheSide``); ``dtype`` to ``packing`` describe K's
    cache, and V's unless ``value`` gives V a format of its own (fp8 keys
    beside 4-bit values).  ``rotation`` "hadamard" rotates what both caches
    hold (``ROTATIONS``), with the signs of ``rotation_seed`` (None: all +1;
    else ``torch.Generator`` seeded with it draws ``bernoulli(0.5)`` over b
    entries on the CPU, as 2 x draw - 1).
    """

    dtype: str = "auto"
    scales: str = "tensor"
    k_scale: float = 1.0
    v_scale: float = 1.0
    zero_points: str = "none"
    scale_format: str = "float32"
    packing: str = "interleaved"
    rotation: str = "none"
    rotation_seed: int | None = None
    value: CacheSide | None = None

    @property
    def key(self) -> CacheSide:
        return CacheSide(self.dtype, self.scales, self.zero_points, self.scale_format, self.packing)

    def side(self, which: str) -> CacheSide:
        """K's ("k") or V's ("v") format."""
        if which == "v" and self.value is not None:
            return self.value
        return self.key

    @property
    def quantized(self) -> bool:
        return self.key.quantized or self.side("v").quantized

    @property
    def token_head(self) -> bool:
        """Are K's scales per token and head (and V's, unless V has a format of its own)?"""
        return self.scales == "token-head"

    @property
    def extended(self) -> bool:
        """Does it use more than fp8/int8 codes with per-tensor or per-token-head float32 scales
        (zero points, unsigned or packed codes, other scale formats, a rotation, V's own format)?"""
        return (self.key.dtype in UNSIGNED_DTYPES or self.value is not None or self.rotation != "none"
                or (self.zero_points, self.scale_format, self.packing)
                != (_SIDE_DEFAULTS.zero_points, _SIDE_DEFAULTS.scale_format, _SIDE_DEFAULTS.packing))

    def sides_with(self, part: str) -> tuple[str, ...]:
        """The caches ("k", "v") that have ``part``: "data" (quantized or not), "scales" (per-token-head
        scale caches) or "zeros" (zero points)."""
        def has(side: CacheSide) -> bool:
            return {"data": True, "scales": side.token_head, "zeros": side.zero_points != "none"}[part]
        return tuple(which for which in ("k", "v") if has(self.side(which)))

    def label(self) -> str:
        """``auto``, ``fp8_e4m3fn`` (per-tensor), ``int8/token-head``, and for an extended cache
        each side's label and the rotation: ``k=fp8_e4m3fn,v=uint4/token-head/offset-zero/float16``."""
        if not self.extended:
            return self.dtype + ("/token-head" if self.token_head else "")
        key, value = self.key.label(), self.side("v").label()
        text = key if key == value else f"k={key},v={value}"
        return text + (f"/{self.rotation}" if self.rotation != "none" else "")

    def validate(self) -> None:
        self.key.validate("kv_cache")
        if self.value is not None:
            self.value.validate("kv_cache.value")
            _check(self.value != self.key, "kv_cache.value repeats K's format; leave it out")
        _check(self.rotation in ROTATIONS, f"kv_cache.rotation={self.rotation!r} is not one of {ROTATIONS}")
        if self.rotation == "none":
            _check(self.rotation_seed is None, "kv_cache.rotation_seed needs a rotation (kv_cache.rotation 'hadamard')")
        else:
            # the rotation is applied as a cache is quantized: an unquantized side would hold its rows
            # unrotated while the oracle reads both in the rotated frame
            _check(self.key.quantized and self.side("v").quantized,
                   "kv_cache.rotation needs both caches quantized (a rotation is applied as a cache is quantized)")
        seed = self.rotation_seed
        _check(seed is None or (type(seed) is int and 0 <= seed < 1 << 63),
               f"kv_cache.rotation_seed={seed!r} must be null or a whole number in 0..2^63-1")
        for name, which in (("k_scale", "k"), ("v_scale", "v")):
            value = getattr(self, name)
            side = self.side(which)
            if not side.quantized or side.token_head:
                _check(value == 1.0, f"kv_cache.{name}={value!r} must be 1.0: "
                                     f"{'an unquantized cache' if not side.quantized else 'per-token-head scales'} "
                                     "has no per-tensor scale")
                continue
            low, high = SCALE_RANGE
            _check(math.isfinite(value) and low <= value <= high,
                   f"kv_cache.{name}={value!r} must be a finite scale in [{low:g}, {high:g}]")
            _check(_float32(value) == value,
                   f"kv_cache.{name}={value!r} is not a float32 value (the kernel receives float32 scales); "
                   f"use {_float32(value)!r}")

    def to_dict(self) -> dict[str, Any]:
        """The fields that differ from their defaults (an old cache reads as it always did); ``dtype``
        and ``scales`` always."""
        record = {"dtype": self.dtype, "scales": self.scales, "k_scale": self.k_scale, "v_scale": self.v_scale}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name not in record and value != f.default:
                record[f.name] = dataclasses.asdict(value) if f.name == "value" else value
        return record


@dataclass(frozen=True)
class PoisonSite:
    """A dead slot (``offset`` set) or a whole physical block (``offset`` None)."""

    block: int
    offset: int | None = None


@dataclass(frozen=True)
class Poison:
    """What goes into dead slots.

    ``sites`` None means every dead slot; otherwise only the listed sites get
    ``value`` and every other dead slot holds finite garbage.  ``parts``
    (caches with per-token-head scales only) says whether the slots' codes,
    their scale-cache entries, their zero points or several of them hold it.
    """

    value: str = "nan"
    tensors: str = "v"
    sites: tuple[PoisonSite, ...] | None = None
    parts: str = "data"

    @property
    def hits_k(self) -> bool:
        return "k" in self.tensors

    @property
    def hits_v(self) -> bool:
        return "v" in self.tensors

    @property
    def hits_data(self) -> bool:
        return "data" in self.parts

    @property
    def hits_scales(self) -> bool:
        return "scales" in self.parts

    @property
    def hits_zeros(self) -> bool:
        return "zeros" in self.parts

    def part_names(self) -> tuple[str, ...]:
        """``parts`` as a tuple: ("data",), ("scales", "zeros"), ..."""
        return tuple(self.parts.split("+"))


@dataclass(frozen=True)
class Case:
    geometry: Geometry
    sequences: tuple[Sequence, ...]
    sliding_window: int = 0  # W keys including the query's own position; 0 = none
    causal: bool = True
    sinks: bool = False
    padding_block: int = NULL_BLOCK  # where block-table padding entries point
    poison: Poison = field(default_factory=Poison)
    data_seed: int = 0
    kv_cache: KVCache = field(default_factory=KVCache)
    # the key each sequence's query values are hashed under; None: its index in the batch (a case cut
    # down to some of its sequences keeps their keys, so their queries keep their values)
    query_keys: tuple[int, ...] | None = None

    # -- derived ---------------------------------------------------------------
    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.geometry.head_size)

    @property
    def num_tokens(self) -> int:
        return sum(s.query_len for s in self.sequences)

    @property
    def table_width(self) -> int:
        return len(self.sequences[0].block_table) if self.sequences else 0

    @property
    def large(self) -> bool:
        """Built on its device, only the cache blocks holding live keys (and the blocks poison sites
        name) written; every other block holds NaN in every run (``reference.device_build``)."""
        g = self.geometry
        caches = g.num_blocks * g.block_size * g.num_kv_heads * g.slot_width
        return caches + self.num_tokens * g.num_q_heads * g.head_size > LARGE_ELEMENTS

    @property
    def max_query_len(self) -> int:
        return max((s.query_len for s in self.sequences), default=0)

    @property
    def max_seq_len(self) -> int:
        return max((s.seq_len for s in self.sequences), default=0)

    def query_start_loc(self) -> list[int]:
        starts = [0]
        for s in self.sequences:
            starts.append(starts[-1] + s.query_len)
        return starts

    def replace(self, **changes: Any) -> "Case":
        return dataclasses.replace(self, **changes)

    # -- JSON ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data.  A field at its default that older nanfuzz lacked
        (an unquantized cache, poison in the codes) is left out, so such a
        case reads exactly as it did before quantized caches existed.  A large
        table leaves out each row's padding entries and says ``table_width``."""
        g = self.geometry
        compact = len(self.sequences) * self.table_width > LARGE_TABLE
        record = {
            # a field at its default is left out: such a geometry reads as it did before the field existed
            "geometry": {name: value for name, value in dataclasses.asdict(g).items()
                         if name not in ("latent_rank", "head_size_v") or value},
            "sequences": [
                {"query_len": s.query_len, "seq_len": s.seq_len,
                 "block_table": list(s.block_table[:s.used_blocks(g.block_size)] if compact else s.block_table)}
                for s in self.sequences
            ],
            "sliding_window": self.sliding_window,
            "causal": self.causal,
            "sinks": self.sinks,
            "padding_block": self.padding_block,
            "poison": {
                "value": self.poison.value,
                "tensors": self.poison.tensors,
                "sites": None
                if self.poison.sites is None
                else [[p.block, p.offset] for p in self.poison.sites],
            },
            "data_seed": self.data_seed,
        }
        if compact:
            record["table_width"] = self.table_width
        if self.poison.parts != "data":
            record["poison"]["parts"] = self.poison.parts
        if self.kv_cache != KVCache():
            record["kv_cache"] = self.kv_cache.to_dict()
        if self.query_keys is not None:
            record["query_keys"] = list(self.query_keys)
        return record

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Case":
        """The case a ``to_dict()`` record describes; CaseError (one line, naming the field) for anything else."""
        data = _object(data, "case")
        poison = _object(_field(data, "poison"), "poison")
        geometry = _object(_field(data, "geometry"), "geometry")
        unknown = set(geometry) - {f.name for f in dataclasses.fields(Geometry)}
        _check(not unknown, f"geometry has unknown fields {sorted(unknown)}")
        sites = _field(poison, "sites", "poison.")
        _check(sites is None or isinstance(sites, list), f"poison.sites={sites!r} must be null or a list")
        sequences = _field(data, "sequences")
        _check(isinstance(sequences, list), f"sequences={sequences!r} must be a list")
        width = _typed(data, "table_width", int) if "table_width" in data else None
        _check(width is None or 0 <= width <= MAX_TABLE_WIDTH, f"table_width={width} must lie in 0..{MAX_TABLE_WIDTH}")
        padding_block = _typed(data, "padding_block", int)
        rows = tuple(_sequence(s, i) for i, s in enumerate(sequences))
        if width is not None:  # a compact record: each row without its padding entries
            _check(all(len(s.block_table) <= width for s in rows), f"a block table is longer than table_width={width}")
            rows = tuple(dataclasses.replace(s, block_table=s.block_table + (padding_block,) * (width - len(s.block_table)))
                         for s in rows)
        optional = {f.name for f in dataclasses.fields(Geometry) if f.default is not dataclasses.MISSING}
        case = cls(
            geometry=Geometry(**{name: _typed(geometry, name, str if name == "dtype" else int, "geometry.")
                                 for name in (f.name for f in dataclasses.fields(Geometry))
                                 if name in geometry or name not in optional}),
            sequences=rows,
            sliding_window=_typed(data, "sliding_window", int),
            causal=_typed(data, "causal", bool),
            sinks=_typed(data, "sinks", bool),
            padding_block=padding_block,
            poison=Poison(
                value=_typed(poison, "value", str, "poison."),
                tensors=_typed(poison, "tensors", str, "poison."),
                sites=None if sites is None else tuple(_site(site, i) for i, site in enumerate(sites)),
                parts=_typed(poison, "parts", str, "poison.") if "parts" in poison else "data",
            ),
            data_seed=_typed(data, "data_seed", int),
            kv_cache=_kv_cache(data["kv_cache"]) if "kv_cache" in data else KVCache(),
            query_keys=_query_keys(data["query_keys"]) if "query_keys" in data else None,
        )
        case.validate()
        return case

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "Case":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CaseError(f"case is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise CaseError(f"case JSON must be an object, got {type(data).__name__}")
        return cls.from_dict(data)

    # -- validity --------------------------------------------------------------
    def validate(self) -> "Case":
        """Raise CaseError naming the first rule this case breaks."""
        g = self.geometry
        _check(g.dtype in DTYPES, f"dtype={g.dtype!r} is not one of {DTYPES}")
        for name in ("num_q_heads", "num_kv_heads", "head_size", "block_size", "num_blocks"):
            _check(getattr(g, name) >= 1, f"{name}={getattr(g, name)} must be >= 1")
            _check(getattr(g, name) <= LIMITS[name], f"{name}={getattr(g, name)} is beyond nanfuzz's bound of "
                                                       f"{LIMITS[name]} (a case is a small batch)")
        _check(g.num_blocks * g.block_size <= MAX_SLOTS,
               f"num_blocks x block_size = {g.num_blocks * g.block_size} slots is beyond nanfuzz's bound of {MAX_SLOTS}")
        _check(len(self.sequences) <= MAX_SEQUENCES,
               f"{len(self.sequences)} sequences is beyond nanfuzz's bound of {MAX_SEQUENCES}")
        if self.query_keys is not None:
            _check(len(self.query_keys) == len(self.sequences),
                   f"query_keys has {len(self.query_keys)} entries for {len(self.sequences)} sequences")
            _check(all(0 <= k < MAX_SEQUENCES for k in self.query_keys),
                   f"query_keys={list(self.query_keys)} must lie in 0..{MAX_SEQUENCES - 1}")
        _check(g.num_q_heads % g.num_kv_heads == 0,
               f"num_q_heads={g.num_q_heads} is not a multiple of num_kv_heads={g.num_kv_heads}")
        if g.latent_rank:
            _check(0 < g.latent_rank < g.head_size,
                   f"latent_rank={g.latent_rank} must lie in 1..head_size-1={g.head_size - 1} (kv_lora_rank, "
                   "with a rotary part after it)")
            _check(g.num_kv_heads == 1, f"a latent cache has one KV head, not num_kv_heads={g.num_kv_heads}")
            _check(self.kv_cache == KVCache(), "a latent cache is unquantized (kv_cache.dtype 'auto')")
        if g.head_size_v:
            _check(1 <= g.head_size_v <= LIMITS["head_size"],
                   f"head_size_v={g.head_size_v} must lie in 1..{LIMITS['head_size']} (0: V as wide as K)")
            _check(g.head_size_v != g.head_size,
                   f"head_size_v={g.head_size_v} equals head_size; leave it out (0) for V as wide as K")
            _check(not g.latent, "head_size_v and latent_rank exclude each other (a latent cache's V is its "
                                 "first latent_rank entries)")
        _check(len(self.sequences) >= 1, "a case needs at least one sequence")
        _check(self.sliding_window >= 0, f"sliding_window={self.sliding_window} must be >= 0 (0 = no window)")
        _check(0 <= self.padding_block < g.num_blocks,
               f"padding_block={self.padding_block} is outside 0..{g.num_blocks - 1}")
        width = self.table_width
        _check(len(self.sequences) * width <= MAX_TABLE_ENTRIES,
               f"{len(self.sequences)} sequences x {width} table entries is beyond nanfuzz's bound of {MAX_TABLE_ENTRIES}")
        for i, s in enumerate(self.sequences):
            _check(0 <= s.query_len <= s.seq_len,
                   f"sequence {i}: query_len={s.query_len} must lie in 0..seq_len={s.seq_len}")
            _check(len(s.block_table) == width,
                   f"sequence {i}: block table has {len(s.block_table)} entries, sequence 0 has {width}")
            used = s.used_blocks(g.block_size)
            _check(used <= width, f"sequence {i}: seq_len={s.seq_len} needs {used} blocks, table has {width}")
        if len(self.sequences) * width > LARGE_TABLE:
            is_live = self._validate_large_tables()
        else:
            is_live = self._validate_tables()
        _check(not is_live(self.padding_block),
               f"padding_block={self.padding_block} holds live keys; padding must point at a dead block")
        self._validate_kv_cache()
        p = self.poison
        _check(p.tensors in POISON_TENSORS, f"poison tensors={p.tensors!r} is not one of {POISON_TENSORS}")
        _check(p.parts in POISON_PARTS, f"poison parts={p.parts!r} is not one of {POISON_PARTS}")
        _validate_poison_parts(self.kv_cache, p)
        if p.sites is not None:
            for site in p.sites:
                _check(0 <= site.block < g.num_blocks, f"poison site block={site.block} is outside the cache")
                if site.offset is None:
                    _check(not is_live(site.block), f"poison site block {site.block} holds live keys; only dead slots may be poisoned")
                else:
                    _check(0 <= site.offset < g.block_size, f"poison site offset={site.offset} is outside 0..{g.block_size - 1}")
                    _check(not is_live(site.block, site.offset),
                           f"poison site ({site.block}, {site.offset}) is live; only dead slots may be poisoned")
        return self

    def _validate_tables(self):
        """Every table entry in the cache, padding at the padding block, no live key in the null
        block; returns ``is_live(block, offset=None)``."""
        g = self.geometry
        live: dict[int, list[range]] = {}  # physical block -> offsets that hold live keys
        for i, s in enumerate(self.sequences):
            used = s.used_blocks(g.block_size)
            live_blocks = s.live_blocks(self.sliding_window, g.block_size)
            for j, b in enumerate(s.block_table):
                _check(0 <= b < g.num_blocks, f"sequence {i}: block_table[{j}]={b} is outside 0..{g.num_blocks - 1}")
                if j >= used:
                    _check(b == self.padding_block,
                           f"sequence {i}: padding entry block_table[{j}]={b} must point at padding_block={self.padding_block}")
                if j in live_blocks:
                    _check(b != NULL_BLOCK, f"sequence {i}: block_table[{j}] holds live keys but points at the null block 0")
                    live.setdefault(b, []).append(live_blocks[j])

        def is_live(block: int, offset: int | None = None) -> bool:
            if offset is None:
                return block in live
            return any(offset in offsets for offsets in live.get(block, ()))
        return is_live

    def _validate_large_tables(self):
        """``_validate_tables`` in numpy, for a production-size table."""
        import numpy as np

        g = self.geometry
        table = np.array([s.block_table for s in self.sequences], dtype=np.int64)
        columns = np.arange(table.shape[1])
        bad = np.argwhere((table < 0) | (table >= g.num_blocks))
        if bad.size:
            i, j = bad[0].tolist()
            _check(False, f"sequence {i}: block_table[{j}]={table[i, j]} is outside 0..{g.num_blocks - 1}")
        used = np.array([s.used_blocks(g.block_size) for s in self.sequences])
        bad = np.argwhere((columns[None, :] >= used[:, None]) & (table != self.padding_block))
        if bad.size:
            i, j = bad[0].tolist()
            _check(False, f"sequence {i}: padding entry block_table[{j}]={table[i, j]} must point at "
                          f"padding_block={self.padding_block}")
        live_entries = []  # per sequence: (first live logical block, its live table entries)
        for i, s in enumerate(self.sequences):
            live_blocks = s.live_blocks(self.sliding_window, g.block_size)
            if live_blocks:
                first = min(live_blocks)
                entries = table[i, first:first + len(live_blocks)]
                nulls = np.flatnonzero(entries == NULL_BLOCK)
                _check(not nulls.size, f"sequence {i}: block_table[{first + int(nulls[0]) if nulls.size else 0}] "
                                       "holds live keys but points at the null block 0")
                live_entries.append((i, first, entries))
        held = np.zeros(g.num_blocks, dtype=bool)
        for _, _, entries in live_entries:
            held[entries] = True

        def is_live(block: int, offset: int | None = None) -> bool:
            if offset is None or not held[block]:
                return bool(held[block])
            for i, first, entries in live_entries:  # the few sites of a poison, each against the tables
                lo, hi = self.sequences[i].live_range(self.sliding_window)
                for j in (first + np.flatnonzero(entries == block)).tolist():
                    if lo <= j * g.block_size + offset < hi:
                        return True
            return False
        return is_live

    def _validate_kv_cache(self) -> None:
        kv, g = self.kv_cache, self.geometry
        kv.validate()
        # each cache's rows by its own head size: K's, and V's where it has one
        for which, name in (("k", "head_size"), ("v", "head_size_v" if g.diff_kv else "head_size")):
            size = g.cache_head_size(which)
            if kv.rotation != "none":
                _check(size & -size > 1, f"kv_cache.rotation needs an even {name} ({name}={size} "
                                         "has no Hadamard block)")
            _check(kv.side(which).packing != "halves" or size % 2 == 0,
                   f"kv_cache packing 'halves' needs an even {name}, not {size}")


def poison_values_for(kv: KVCache, which: str, part: str) -> tuple[str, ...]:
    """The poison values cache ``which``'s ``part`` ("data", "scales", "zeros") can hold hostile."""
    side = kv.side(which)
    if part == "data":
        return DATA_POISON_VALUES[side.dtype]
    if part == "scales":
        return SCALE_POISON_VALUES
    return ZP4_POISON_VALUES if side.scale_format == "float32-zp4" else ZERO_POISON_VALUES


def poison_landings(kv: KVCache, poison: Poison) -> tuple[tuple[str, str], ...]:
    """The (cache, part) pairs a poison fills: its tensors' caches that have each of its parts."""
    sides = tuple(which for which in ("k", "v") if which in poison.tensors)
    return tuple((which, part) for part in poison.part_names() for which in sides if which in kv.sides_with(part))


def _validate_poison_parts(kv: KVCache, p: Poison) -> None:
    """Poison in scales or zero points only where the cache has them, and a value each part it fills can hold."""
    for part, needs in (("scales", "per-token-head scales (kv_cache.scales 'token-head')"),
                        ("zeros", "zero points (kv_cache.zero_points)")):
        if part in p.part_names():
            _check(any(w in p.tensors for w in kv.sides_with(part)),
                   f"poison parts={p.parts!r} needs a cache with {needs} in poison tensors={p.tensors!r}")
    for which, part in poison_landings(kv, p):
        allowed = poison_values_for(kv, which, part)
        side = kv.side(which)
        if part == "data":
            what = "" if side.dtype == "auto" else f" in a {side.dtype} cache"
        elif part == "zeros":
            what = f" in {side.scale_format} zero points"
        else:
            what = ""
        _check(p.value in allowed, f"poison value={p.value!r}{what} is not one of {allowed}")


def _object(value: Any, what: str) -> dict:
    _check(isinstance(value, dict), f"{what} must be a JSON object, not {type(value).__name__}")
    return value


def _field(data: dict, name: str, where: str = "") -> Any:
    _check(name in data, f"case JSON lacks {where}{name} (expected the fields of Case.to_dict())")
    return data[name]


def _typed(data: dict, name: str, kind: type, where: str = "") -> Any:
    """``data[name]``, which must be exactly of ``kind`` (JSON's true is no integer, "false" no boolean)."""
    value = _field(data, name, where)
    names = {int: "an integer", bool: "true or false", str: "a string"}
    _check(type(value) is kind, f"{where}{name}={value!r} must be {names[kind]}")
    return value


def _sequence(data: Any, index: int) -> Sequence:
    data = _object(data, f"sequences[{index}]")
    where = f"sequences[{index}]."
    table = _field(data, "block_table", where)
    _check(isinstance(table, list), f"{where}block_table must be a list")
    _check(len(table) <= MAX_TABLE_WIDTH, f"{where}block_table has {len(table)} entries; at most {MAX_TABLE_WIDTH}")
    return Sequence(_typed(data, "query_len", int, where), _typed(data, "seq_len", int, where),
                    tuple(_typed({"block_table entry": b}, "block_table entry", int, where) for b in table))


def _query_keys(value: Any) -> tuple[int, ...]:
    _check(isinstance(value, list) and all(isinstance(k, int) and not isinstance(k, bool) for k in value),
           f"query_keys={value!r} must be a list of integers")
    return tuple(value)


def _site(value: Any, index: int) -> PoisonSite:
    ok = isinstance(value, list) and len(value) == 2 and type(value[0]) is int and (
        value[1] is None or type(value[1]) is int)
    _check(ok, f"poison.sites[{index}]={value!r} must be [block, offset or null]")
    return PoisonSite(value[0], value[1])


def _kv_cache(data: Any) -> KVCache:
    data = _object(data, "kv_cache")
    unknown = set(data) - {f.name for f in dataclasses.fields(KVCache)}
    _check(not unknown, f"kv_cache has unknown fields {sorted(unknown)}")
    scales = {}
    for name in ("k_scale", "v_scale"):
        value = data.get(name, 1.0)
        _check(type(value) in (int, float), f"kv_cache.{name}={value!r} must be a number")
        scales[name] = float(value)
    side = _cache_side(data, "kv_cache.", required=("dtype",))
    seed = data.get("rotation_seed")
    _check(seed is None or type(seed) is int, f"kv_cache.rotation_seed={seed!r} must be null or a whole number")
    value = None
    if "value" in data:
        record = _object(data["value"], "kv_cache.value")
        unknown = set(record) - {f.name for f in dataclasses.fields(CacheSide)}
        _check(not unknown, f"kv_cache.value has unknown fields {sorted(unknown)}")
        value = CacheSide(**_cache_side(record, "kv_cache.value.", required=("dtype", "scales")))
    rotation = _typed(data, "rotation", str, "kv_cache.") if "rotation" in data else "none"
    return KVCache(**side, **scales, rotation=rotation, rotation_seed=seed, value=value)


def _cache_side(data: dict, where: str, required: tuple[str, ...]) -> dict[str, str]:
    """The ``CacheSide`` fields of a JSON record: strings, each at its default where absent."""
    return {f.name: _typed(data, f.name, str, where) for f in dataclasses.fields(CacheSide)
            if f.name in data or f.name in required}


def _float32(value: float) -> float:
    """``value`` rounded to the nearest float32."""
    try:
        return struct.unpack("<f", struct.pack("<f", value))[0]
    except OverflowError:
        return math.inf


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise CaseError(message)
