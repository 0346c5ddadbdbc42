"""What a kernel accepts.  Strategies generate only cases inside it."""
from __future__ import annotations

from dataclasses import dataclass, replace

from nanfuzz.reference.case import DTYPES, PRECISIONS, Case, KVCache
from nanfuzz.reference.errors import NanfuzzError

# Triton's interpreter has no bfloat16 arithmetic.
INTERPRETER_DTYPES = ("float16", "float32")
DEFAULT_HEAD_SIZES = (32, 64, 80, 96, 128)
# 48 stands for the non-power-of-two block sizes hybrid (mamba) models use.
DEFAULT_BLOCK_SIZES = (16, 8, 32, 64, 48)


@dataclass(frozen=True)
class Capabilities:
    dtypes: tuple[str, ...] = DTYPES
    head_sizes: tuple[int, ...] = DEFAULT_HEAD_SIZES
    block_sizes: tuple[int, ...] = DEFAULT_BLOCK_SIZES
    max_query_len: int | None = None  # 1 = decode only
    min_query_len: int = 0            # >1 = prefill only (padding sequences still allowed)
    causal: bool = True
    non_causal: bool = False
    sliding_window: bool = True
    non_causal_window: bool = True    # a window on non-causal attention (|p - k| < W)
    # Every case has a sliding window: a kernel of windowed attention alone, or a campaign aimed at
    # window bugs (--window-only); only the modes that take a window are drawn.
    window_only: bool = False
    sinks: bool = False
    # -- limits: what the strategies never pass (None: no limit of the kernel's own) --------
    max_q_heads: int = 128
    max_group: int | None = None      # widest GQA group (query heads per KV head)
    max_seq_len: int | None = None    # longest sequence, in keys
    max_sequences: int | None = None  # most sequences in one batch
    max_blocks: int | None = None     # most physical blocks a cache may have
    # The narrowest window the kernel's window argument can express: 2 for a kernel whose
    # "window W - 1 = 0" means no window (W = 1 is then left out); windows below it are never drawn.
    min_window: int = 1
    # Every scheduled sequence of a batch (those with a query) has the same query length:
    # a kernel that takes one query length for the whole batch (speculative decode).
    uniform_query_len: bool = False
    # dtypes this kernel runs under Triton's interpreter (see runnable_dtypes)
    interpreter_dtypes: tuple[str, ...] = INTERPRETER_DTYPES
    # Kernels that compile one program per window width, head count, head and
    # block size fuzz a pool of this many such combinations per campaign on
    # the GPU (see strategies.specialisations); None = the default pool (16, as the
    # built-in kernels'), 0 = draw them freely (a kernel that compiles nothing per case).
    specialisation_pool: int | None = None
    # False for a kernel whose output may legitimately differ between identical
    # launches (atomics, split-K reductions in arrival order): skips NONDETERMINISTIC.
    deterministic: bool = True
    # How the kernel multiplies float32 operands: "tf32" (Triton's tl.dot default on
    # GPU matrix units) or "ieee" (tl.dot(..., input_precision="ieee"), or no tl.dot).
    # MISMATCH holds float32 outputs to a reference computed the same way; under
    # Triton's interpreter every product is IEEE whatever this says.
    precision: str = "tf32"

    # -- quantized KV caches (see reference.quantization) ------------------------
    # Cache dtypes read with per-tensor k_scale / v_scale; "auto" is unquantized.
    # Strategies shrink toward the first.
    kv_cache_dtypes: tuple[str, ...] = ("auto",)
    # Cache dtypes read with per-token-head scale caches (fp8 or "int8").
    token_head_dtypes: tuple[str, ...] = ()
    # Every other cache the kernel reads, each exactly as it reads it (``KVCache.extended``:
    # zero points, unsigned or packed codes, a scale format, a rotation, V's own format;
    # k_scale and v_scale as the kernel takes them).  Strategies draw them after the others,
    # in this order.
    cache_formats: tuple[KVCache, ...] = ()
    # The dtype a kernel reading a rotated cache rotates q and un-rotates its output in, where that
    # is not the query's (vLLM's INT4 cache: bfloat16 on GPUs); its same-precision reference does so too.
    rotation_dtype: str | None = None
    # -- MLA latent caches (Geometry.latent_rank) ----------------------------------
    # (kv_lora_rank, rope_dim) pairs: the kernel reads one latent cache of rows of
    # kv_lora_rank + rope_dim entries, K the whole row and V its first kv_lora_rank,
    # with one KV head for every query head; every case it gets is such a case, and
    # head_sizes follows (each pair's sum).  Empty: separate K and V caches.
    mla: tuple[tuple[int, int], ...] = ()
    # -- V head sizes other than K's (Geometry.head_size_v) ------------------------
    # (K head size, V head size) pairs, the two different, that the kernel takes in separate
    # K and V caches, besides every one of head_sizes with V as wide as K.
    diff_kv: tuple[tuple[int, int], ...] = ()

    def __post_init__(self):
        if self.mla:
            pairs = tuple(tuple(pair) for pair in self.mla)
            if not all(len(pair) == 2 and all(type(x) is int and x > 0 for x in pair) for pair in pairs):
                raise NanfuzzError(f"Capabilities(mla={self.mla!r}) must be (kv_lora_rank, rope_dim) pairs of "
                                   "positive whole numbers, e.g. ((512, 64),)")
            sums = [rank + rope for rank, rope in pairs]
            if len(set(sums)) != len(sums):
                raise NanfuzzError(f"Capabilities(mla={self.mla!r}): two pairs give one row width; a latent case "
                                   "is named by its row width and rank, so give each width once")
            object.__setattr__(self, "mla", pairs)
            object.__setattr__(self, "head_sizes", tuple(sums))
        if self.diff_kv:
            pairs = tuple(tuple(pair) for pair in self.diff_kv)
            if not all(len(pair) == 2 and all(type(x) is int and x > 0 for x in pair) and pair[0] != pair[1]
                       for pair in pairs):
                raise NanfuzzError(f"Capabilities(diff_kv={self.diff_kv!r}) must be (K head size, V head size) pairs "
                                   "of different positive whole numbers, e.g. ((192, 128),)")
            if self.mla:
                raise NanfuzzError("Capabilities(diff_kv=..., mla=...): a latent cache's V is part of its one row; "
                                   "give one of them")
            object.__setattr__(self, "diff_kv", tuple(sorted(set(pairs))))
        if type(self.min_window) is not int or self.min_window < 1:
            raise NanfuzzError(f"Capabilities(min_window={self.min_window!r}) must be a whole number >= 1: "
                               "the narrowest sliding window, in keys, the kernel takes")
        if self.window_only and not self.modes():
            raise NanfuzzError("Capabilities(window_only=True) needs a mode that takes a sliding window "
                               "(sliding_window=True, and causal=True or non_causal_window=True)")
        for kv in self.cache_formats:
            if not isinstance(kv, KVCache) or not kv.extended:
                raise NanfuzzError(f"Capabilities(cache_formats=...) holds {kv!r}: each must be a KVCache with zero "
                                   "points, unsigned codes, a rotation or V's own format (the others go in "
                                   "kv_cache_dtypes / token_head_dtypes)")
            kv.validate()
        halved = [kv.label() for kv in self.cache_formats
                  if kv.rotation != "none" or "halves" in (kv.side("k").packing, kv.side("v").packing)]
        odd = sorted({size for pair in self.head_size_pairs() for size in pair if size % 2})
        if halved and odd:
            raise NanfuzzError(f"Capabilities(cache_formats=...) holds {halved[0]}, whose rows need an even head size "
                               f"(a Hadamard block, or nibbles in halves); head_sizes / diff_kv give {odd}")
        if self.rotation_dtype not in (None, *DTYPES):
            raise NanfuzzError(f"Capabilities(rotation_dtype={self.rotation_dtype!r}) must be None or one of {DTYPES}")
        if self.precision not in PRECISIONS:
            raise NanfuzzError(f"Capabilities(precision={self.precision!r}) is not one of {PRECISIONS}: "
                               "'tf32' for tl.dot's default on GPUs, 'ieee' for input_precision='ieee'")

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1

    def latent_rank(self, head_size: int) -> int:
        """The kv_lora_rank of a case of ``head_size`` for an MLA kernel (``mla``); 0 for any other."""
        return next((rank for rank, rope in self.mla if rank + rope == head_size), 0)

    def head_size_pairs(self) -> tuple[tuple[int, int], ...]:
        """Every (K, V) head-size pair a case may have, simplest first: V as wide as K for each of
        ``head_sizes`` (smallest first), then the ``diff_kv`` pairs, so shrinking moves toward V as wide as K."""
        return tuple((h, h) for h in sorted(self.head_sizes)) + self.diff_kv

    def kv_head_limit(self, limit: int) -> int:
        """The most KV heads a case may have, at most ``limit``: one for an MLA kernel."""
        return 1 if self.mla else min(limit, self.max_q_heads)

    def windowed(self, causal: bool) -> bool:
        """May a case in this mode have a sliding window?"""
        return self.sliding_window and (causal or self.non_causal_window)

    def runnable_dtypes(self, interpreter: bool) -> tuple[str, ...]:
        """The dtypes this kernel takes where it runs: every one of ``dtypes`` on a
        GPU; under Triton's interpreter, those also in ``interpreter_dtypes``."""
        if not interpreter:
            return self.dtypes
        return tuple(d for d in self.dtypes if d in self.interpreter_dtypes)

    def modes(self) -> list[bool]:
        """The causal flags this kernel accepts, causal first (with ``window_only``, those that take a window)."""
        return [flag for flag, ok in ((True, self.causal), (False, self.non_causal))
                if ok and (not self.window_only or self.windowed(flag))]

    def restrict(self, **changes) -> "Capabilities":
        return replace(self, **changes)

    def unsupported(self, case: Case, *, interpreter: bool = False) -> str | None:
        """Why this kernel cannot take ``case``, or None when it can."""
        g = case.geometry
        dtypes = self.runnable_dtypes(interpreter)
        if g.dtype not in dtypes:
            where = " under the interpreter" if interpreter else ""
            return f"dtype {g.dtype} (supported{where}: {', '.join(dtypes)})"
        if g.diff_kv:
            if (g.head_size, g.head_size_v) not in self.diff_kv:
                return (f"head sizes K {g.head_size} / V {g.head_size_v} (supported: "
                        f"{self.describe_diff_kv() or 'V as wide as K'})")
        elif g.head_size not in self.head_sizes:
            return f"head_size {g.head_size} (supported: {self.head_sizes})"
        if self.mla and (g.latent_rank, g.head_size - g.latent_rank) not in self.mla:
            return (f"a cache that is not an MLA latent cache of {self.describe_mla()}" if not g.latent else
                    f"latent rank {g.latent_rank} + rope {g.rope_dim} (supported: {self.describe_mla()})")
        if g.latent and not self.mla:
            return "an MLA latent cache (one cache, V its first kv_lora_rank entries)"
        if g.block_size not in self.block_sizes:
            return f"block_size {g.block_size} (supported: {self.block_sizes})"
        if g.num_q_heads > self.max_q_heads:
            return f"{g.num_q_heads} query heads (at most {self.max_q_heads})"
        if self.max_group is not None and g.queries_per_kv > self.max_group:
            return f"a GQA group of {g.queries_per_kv} query heads per KV head (at most {self.max_group})"
        if self.max_seq_len is not None and case.max_seq_len > self.max_seq_len:
            return f"seq_len {case.max_seq_len} (at most {self.max_seq_len})"
        if self.max_sequences is not None and len(case.sequences) > self.max_sequences:
            return f"{len(case.sequences)} sequences (at most {self.max_sequences})"
        if self.max_blocks is not None and g.num_blocks > self.max_blocks:
            return f"a cache of {g.num_blocks} blocks (at most {self.max_blocks})"
        if self.max_query_len is not None and case.max_query_len > self.max_query_len:
            return f"query_len {case.max_query_len} (at most {self.max_query_len})"
        if self.min_query_len > 1 and any(0 < s.query_len < self.min_query_len for s in case.sequences):
            return f"query_len below {self.min_query_len} (prefill only)"
        if case.causal and not self.causal:
            return "causal attention"
        if not case.causal and not self.non_causal:
            return "non-causal attention"
        if case.sliding_window and not self.sliding_window:
            return "a sliding window"
        if case.sliding_window and not case.causal and not self.non_causal_window:
            return "a sliding window on non-causal attention"
        if self.window_only and not case.sliding_window:
            return "no sliding window (only windowed cases)"
        if 0 < case.sliding_window < self.min_window:
            return f"window {case.sliding_window} (at least {self.min_window})"
        if self.uniform_query_len and len({s.query_len for s in case.sequences if s.query_len}) > 1:
            return "query lengths that differ between sequences (one query length per batch)"
        if case.sinks and not self.sinks:
            return "attention sinks"
        kv = case.kv_cache
        if kv.extended:
            return None if kv in self.cache_formats else (
                f"a {kv.label()} cache (supported: {self.describe_kv_cache().removeprefix('kv ')})")
        if kv.token_head and kv.dtype not in self.token_head_dtypes:
            return f"{kv.dtype} caches with per-token-head scales (supported: {', '.join(self.token_head_dtypes) or 'none'})"
        if not kv.token_head and kv.dtype not in self.kv_cache_dtypes:
            return f"{kv.dtype} caches (supported: {', '.join(self.kv_cache_dtypes) or 'none'})"
        return None

    def describe_kv_cache(self) -> str:
        """What caches the kernel reads, e.g. ``kv auto,fp8_e4m3fn per-tensor; int8 per-token-head``."""
        parts = []
        if self.kv_cache_dtypes:
            quantized = [d for d in self.kv_cache_dtypes if d != "auto"]
            parts.append(",".join(self.kv_cache_dtypes) + (" per-tensor" if quantized else ""))
        if self.token_head_dtypes:
            parts.append(",".join(self.token_head_dtypes) + " per-token-head")
        parts += [kv.label() for kv in self.cache_formats]
        return "kv " + "; ".join(parts)

    def describe_mla(self) -> str:
        """``512+64,128+64``: the latent caches an MLA kernel reads (rank + rope)."""
        return ",".join(f"{rank}+{rope}" for rank, rope in self.mla)

    def describe_diff_kv(self) -> str:
        """``192/128,128/64``: the (K / V) head sizes the kernel takes besides V as wide as K."""
        return ",".join(f"{k}/{v}" for k, v in self.diff_kv)

    def describe(self) -> str:
        parts = [
            "/".join(d.replace("float", "fp").replace("bfp16", "bf16") for d in self.dtypes),
            "decode" if self.decode_only else ("prefill" if self.min_query_len > 1 else "decode+prefill"),
            "+".join(x for x, on in (("causal", self.causal), ("non-causal", self.non_causal)) if on),
        ]
        if self.sliding_window:
            parts.append("window" + ("-only" if self.window_only else "")
                         + (f">={self.min_window}" if self.min_window > 1 else ""))
        if self.uniform_query_len:
            parts.append("uniform-query-len")
        if self.sinks:
            parts.append("sinks")
        if "float32" in self.dtypes:
            parts.append(f"fp32-products {self.precision}")
        parts.append(f"mla {self.describe_mla()}" if self.mla else "heads " + ",".join(map(str, self.head_sizes)))
        if self.diff_kv:
            parts.append(f"k/v-heads {self.describe_diff_kv()}")
        limits = [f"{label} {value}" for label, value in (("max-group", self.max_group), ("max-seq", self.max_seq_len),
                                                          ("max-seqs", self.max_sequences),
                                                          ("max-blocks", self.max_blocks)) if value is not None]
        parts += limits
        parts.append("blocks " + ",".join(map(str, self.block_sizes)))
        if self.kv_cache_dtypes != ("auto",) or self.token_head_dtypes or self.cache_formats:
            parts.append(self.describe_kv_cache())
        if self.rotation_dtype:
            parts.append(f"rotations in {self.rotation_dtype.replace('float', 'fp').replace('bfp16', 'bf16')}")
        return " ".join(parts)
