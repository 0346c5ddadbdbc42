"""How far a correct kernel's output may sit from the float64 oracle, row by row: the error model.

Each (token, head) row is judged on its own, so a finding names its row.  With
errors taken as the largest over the row's head dimension:

    ratio = |out - oracle| / (|reference - oracle| + allowance)

The **reference** is the row computed in the kernel's own precision
(reference/precision.py): the same gather of live keys, float32 sums, P rounded
to V's dtype, the output rounded to the kernel's.  Its error is what rounding
does to this very row.  But a kernel does not sum the way the reference does:
it walks the keys a tile at a time with an online softmax, rescaling its float32
running sums whenever the maximum moves; it rounds P against each tile's own
maximum; it may scale q, or dequantize a cache, in its input dtype; a split-KV
kernel may store each split's output in the output dtype before merging them.
Each of these is another draw of the same kind of rounding, and any one draw can
be far smaller than another on one row (a reference that lands within 2**-30 of
the oracle), so a bare ratio against the reference grows with the number of
rows compared and with the length of each row's sum.  The **allowance** bounds
those differences from what the row sums (``reference.oracle.Summands``, each
per element d of the row, ``o`` the oracle's row, ``u`` the arithmetic's unit
roundoff, ``u32`` float32's):

    allowance = u x max|o| x (FLOOR + SPLIT if the row sums more than one key)    the output's last roundings
              + max_d [ u x WEIGHTS x rounded_spread                                P rounded tile by tile
                        + SCORES x ((u + u32 x sqrt(products))                      q or K rounded, and each
                                     x score_scale x score_spread                   score a float32 sum
                                    + u x value_spread if the cache is quantized)   V dequantized in the dtype
                        + u32 x SUMS x weighted_abs ]                               the float32 running sums
              + u32 x TILES x sqrt(keys / 16) x max|o|                              the running denominator
              + u x OFFSET_SHARE x offset_share                                     P against uncentred codes

- A spread is ``sqrt(sum_k p_k^2 x_k^2)`` of the row's terms: independent
  relative roundings of its terms move the row by about that much.  P's excludes
  the largest weight (``exp(s - max)`` is exactly 1 there), so a row of one key
  has none, and only a quantized cache's values can be rounded differently.
- A second output rounding: a split's partial output stored in the output dtype
  and merged is rounded twice; a row of one key is exact in every split.  A
  rotated cache's row un-rotated in a coarser dtype takes one whole rounding of
  that dtype as its first (``ROTATION_FLOOR``); its summands are measured in the
  cache's frame.
- ``offset_share``: a kernel over unsigned codes with zero points may dot P (times the
  scale) with the raw codes, code = value / scale + zero, and subtract the zero points'
  share ``sum_k p_k zero_k scale_k`` afterwards in float32 (vLLM's INT4 attention does).
  Its operands are then all positive, and a rounding that moves each the same way (TF32
  truncates) moves the row by about one unit of ``sum_k p_k (v_k + z_k)``: the ``v`` part
  is the output's own rounding, the zero points' part ``offset_share`` is not, and being
  of one sign it does not average out over a long row as the reference's roundings do.
  It is a fraction of a percent of a quantization step; 0 for any other cache.
- ``sqrt(keys / 16)``: the running denominator of a kernel with 16-key tiles (the
  smallest ``tl.dot`` takes) is rounded once a tile, and those relative roundings
  add up like a random walk; the running numerator's stay the size of one.

Nothing in the allowance grows with the number of rows in a batch: each term is
a rounding's size on its own row, so a correct kernel's ratio has the same
distribution on a row of a 10^4-row production batch as on a small one, and the
tail the bound must cover does not widen with batch size.  What the allowance
lets pass is rounding: a unit or two of the output's last place on short rows,
``sqrt(keys)`` float32 units on long ones.  A lost key, a wrong scale or a 0.1%
error on a float32 row is far above it; so is a 1% error on a float16 row of any
length, or on a bfloat16 row of one key (tests/test_tolerance.py,
ci/tolerance_survey.py).  On a long row over unsigned codes the zero points' term is the
largest, and a lost key may be below it; a wrong zero point is far above it
(tests/test_error_model.py).

The factors and BOUND come from measurement; see CALIBRATION and docs/error-model.md.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nanfuzz.reference.oracle import Summands
from nanfuzz.reference.precision import arithmetic_name

# The unit roundoff of each arithmetic's operands: P, q and K (their dtype, or TF32's for float32
# on matrix units) and the output's last rounding (TF32's for float32/tf32: its P is TF32).
UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32/ieee": 2.0**-24, "float32/tf32": 2.0**-11}
_FLOAT32 = 2.0**-24   # the running sums' (every arithmetic accumulates in float32)
TILE_KEYS = 16        # the fewest keys a tile of a tl.dot holds: the most roundings of the running sums

# CALIBRATION.  The factors: tests/tiled_attention.py, correct kernels of the arithmetics above
# (16- to 128-key tiles, 8 KV splits with partial outputs rounded to the output dtype, exp2 with
# the scale folded in, q prescaled and fp8 codes dequantized in the input dtype), on rows of 1 to
# 131,072 keys, float16/bfloat16/float32 over unquantized and fp8 caches (30,000 rows,
# ci/tolerance_survey.py --tiled): each factor is the smallest that keeps its kind of row's worst
# ratio within about a third of BOUND, so the bound keeps a margin of three over what those
# kernels do (worst ratios 0.93 float16, 0.92 bfloat16, 1.4 float32/ieee, 0.6 float32/tf32).
# BOUND: the worst row of correct kernels on an H200, at every size tier (docs/error-model.md:
# the calibration table), times at least two.
BOUND = {"float16": 2.5, "bfloat16": 2.5, "float32/ieee": 12.0, "float32/tf32": 10.0}
FLOOR = 0.5     # the output rounded once to its dtype: half a unit of its last place
SPLIT = 0.5     # and once more as a split's partial output
WEIGHTS = 0.5   # P rounded tile by tile: half the spread, about three standard deviations of the worst element
SCORES = 0.25   # q or K rounded in the input dtype
SUMS = 2.0      # the float32 running numerator: a few roundings of the row's magnitude
TILES = 1.0     # the float32 running denominator: one rounding a tile, a random walk
# P (times V's scale) rounded against uncentred codes: truncation's mean relative error is one unit of
# TF32 (2^-11; a truncation loses 0 to 2^-10 of an operand), and every term rounds the same way.  A
# plain-torch kernel of vLLM's INT4 arithmetic (tests/quantized_subjects.py raw_code_attention) over
# its rotated cache came to 27.8x at worst on rows of 8,192 keys and 50.9x on 32,768 without this
# term, 0.76x at worst with it on rows of 64 to 32,768 keys (docs/error-model.md).
OFFSET_SHARE = 1.0
# A rotated cache's row un-rotated through a coarser dtype (vLLM's INT4 cache: bfloat16 on GPUs) carries
# a rounding of that dtype in each entry and, through the inverse rotation, a sum of the roundings of
# the rotated output's: the last rounding is one whole rounding of that dtype.  A plain-torch kernel
# with INT4's GPU arithmetic against the float16 reference (3,103 rows; tests/quantized_subjects.py's
# "bf16-rotations") came to 1.76x at worst with this floor, 2.42x with FLOOR's half.
ROTATION_FLOOR = 1.0


@dataclass(frozen=True)
class RowErrors:
    """Per (token, head) row, all ``[num_tokens, num_q_heads]`` float64: the kernel's
    error, the same-precision reference's error, the ratio's denominator (the
    reference's error plus the allowance) and the ratio itself (inf where the output
    is not finite)."""

    arithmetic: str
    kernel: torch.Tensor
    reference: torch.Tensor
    denominator: torch.Tensor
    ratio: torch.Tensor

    @property
    def bound(self) -> float:
        return BOUND[self.arithmetic]

    def off(self) -> torch.Tensor:
        """Rows beyond the bound."""
        return self.ratio > self.bound

    def allowed_change(self) -> torch.Tensor:
        """How far two launches' rows may differ when each is within the bound (twice the
        bound's width, by the triangle inequality), ``[tokens, heads, 1]``."""
        return (2 * self.bound * self.denominator)[..., None]


def effective_precision(precision: str, interpreter: bool) -> str:
    """Triton's interpreter multiplies float32 in plain IEEE whatever the kernel asks for."""
    return "ieee" if interpreter else precision


def allowance(oracle: torch.Tensor, summands: Summands, arithmetic: str, quantized: bool,
              rotation_dtype: str | None = None) -> torch.Tensor:
    """The rounding a correct kernel may add beyond the reference's, per row ``[tokens, heads]`` (see the notes)."""
    unit = UNIT_ROUNDOFF[arithmetic]
    s = summands
    largest = oracle.abs().amax(dim=-1)
    floor = FLOOR * unit
    if rotation_dtype:
        floor = max(floor, ROTATION_FLOOR * UNIT_ROUNDOFF.get(rotation_dtype, 0.0))
    last = largest * (floor + SPLIT * unit * (s.keys > 1))
    # a score is rounded as a q or K operand (``unit``) and as a float32 sum of ``products`` terms
    score_unit = unit + _FLOAT32 * s.products.sqrt()
    scores = score_unit[..., None] * s.score_scale[..., None] * s.score_spread
    scores = scores + (unit * s.value_spread if quantized else 0.0)
    terms = unit * WEIGHTS * s.rounded_spread + SCORES * scores + _FLOAT32 * SUMS * s.weighted_abs
    denominator = _FLOAT32 * TILES * (s.keys / TILE_KEYS).ceil().sqrt() * largest
    zero_points = unit * OFFSET_SHARE * s.offset_share
    return last + terms.amax(dim=-1) + denominator + zero_points


@dataclass(frozen=True)
class Yardstick:
    """What each row's error is measured against, before the kernel's output is known: the
    same-precision reference's error and the ratio's denominator (that error plus the allowance),
    ``[tokens, heads]`` float64 each."""

    arithmetic: str
    reference: torch.Tensor
    denominator: torch.Tensor


def yardstick(oracle: torch.Tensor, reference: torch.Tensor, summands: Summands, dtype: str, precision: str,
              quantized: bool = False, rotation_dtype: str | None = None) -> Yardstick:
    """``oracle`` and ``reference`` float64 ``[tokens, heads, head_size]``, ``summands`` the oracle's measure
    of each row; ``quantized``: the case's cache is; ``rotation_dtype``: what a rotated cache's output is
    un-rotated in, where the case has one."""
    name = arithmetic_name(dtype, precision)
    reference_error = (reference - oracle).abs().amax(dim=-1)
    denominator = reference_error + allowance(oracle, summands, name, quantized, rotation_dtype)
    return Yardstick(name, reference_error, denominator.clamp_min(torch.finfo(torch.float64).tiny))


def errors_against(result: torch.Tensor, oracle: torch.Tensor, yard: Yardstick) -> RowErrors:
    """The kernel's ``result`` (float64, as ``oracle``) row by row against ``yard``."""
    kernel_error = (result - oracle).abs().nan_to_num(float("inf")).amax(dim=-1)
    return RowErrors(yard.arithmetic, kernel_error, yard.reference, yard.denominator, kernel_error / yard.denominator)


def row_errors(result: torch.Tensor, oracle: torch.Tensor, reference: torch.Tensor, summands: Summands,
               dtype: str, precision: str, quantized: bool = False, rotation_dtype: str | None = None) -> RowErrors:
    """``result``, ``oracle`` and ``reference`` are float64 ``[tokens, heads, head_size]``: the
    :func:`yardstick` of ``oracle`` and ``reference``, and ``result`` against it."""
    return errors_against(result, oracle, yardstick(oracle, reference, summands, dtype, precision, quantized,
                                                    rotation_dtype))
