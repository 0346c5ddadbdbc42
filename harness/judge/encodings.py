"""Which quantized KV-cache encodings run where, and why the others are skipped.

On a GPU, Triton's backend declares the fp8 types it compiles: NVIDIA has
e5m2 and, from sm_89, e4m3fn (``fp8e4nv``) but no e4m3fnuz (``fp8e4b8``,
native on MI300-class GPUs only); AMD's backend has all three.  Where a
type is missing, a kernel reading such a cache fails to compile, which
would be a false CRASH; those encodings are left out of campaigns, with a
note that says so.  int8 runs everywhere.

Under Triton's interpreter every type exists, but its fp8 decode is numpy
bit arithmetic that (Triton 3.9) reads the NaN and Inf codes as finite
numbers (e4m3fn's NaN 0x7F as 480, e4m3fnuz's NaN 0x80 as -0, e5m2's Inf as
65536) and e5m2's subnormals as 0.  A dead slot's poison would then reach a
kernel's arithmetic as a finite number and every masking bug would pass.
So the first time the interpreter's encodings are asked for, every code of
every encoding is decoded by a one-line Triton kernel and compared with
torch's decode; if any is wrong, the interpreter's fp8-to-wider decode is
replaced in this process by torch's table of the 256 values (exact: every
fp8 value is representable in fp16, bf16 and fp32), and checked again.  An
encoding that still decodes wrongly is skipped with the reason.
"""
from __future__ import annotations

import functools

import torch

from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.case import FP8_DTYPES, Case
from nanfuzz.reference.errors import NanfuzzError
from nanfuzz.reference.quantization import ENCODINGS, as_encoding

TRITON_TYPES = {"fp8_e4m3fn": "fp8e4nv", "fp8_e4m3fnuz": "fp8e4b8", "fp8_e5m2": "fp8e5"}
NATIVE = {"fp8_e4m3fnuz": "e4m3fnuz is native on MI300-class (gfx94x) GPUs only"}

def skipped(device: str) -> dict[str, str]:
    """fp8 encodings that cannot run on ``device`` ("cpu": the interpreter) -> why."""
    return dict(_interpreter_state()[0] if device == "cpu" else gpu_skips())


def _dtypes(kv) -> set[str]:
    """The encodings a cache format's sides use."""
    return {kv.side("k").dtype, kv.side("v").dtype}


def runnable(caps: Capabilities, device: str) -> tuple[Capabilities, list[str]]:
    """``caps`` without the cache encodings ``device`` cannot run, and one note per encoding left out
    (a cache format goes with any encoding it uses)."""
    wanted = set(caps.kv_cache_dtypes) | set(caps.token_head_dtypes)
    for kv in caps.cache_formats:
        wanted |= _dtypes(kv)
    if not wanted & set(FP8_DTYPES):
        return caps, []  # nothing to ask the device
    gone = skipped(device)
    notes = [f"{name} caches skipped: {why}" for name, why in gone.items() if name in wanted]
    if not notes:
        return caps, []
    return caps.restrict(kv_cache_dtypes=tuple(d for d in caps.kv_cache_dtypes if d not in gone),
                         token_head_dtypes=tuple(d for d in caps.token_head_dtypes if d not in gone),
                         cache_formats=tuple(kv for kv in caps.cache_formats if not _dtypes(kv) & set(gone))), notes


def require(case: Case, device: str) -> None:
    """NanfuzzError when ``device`` cannot run the case's cache encoding (a usage error, not a verdict)."""
    for name in sorted(_dtypes(case.kv_cache) & set(FP8_DTYPES)):
        why = skipped(device).get(name)
        if why:
            raise NanfuzzError(f"this case's {name} cache cannot run here: {why}")


def describe(device: str) -> str:
    """One line: which encodings run on ``device`` and which are skipped, with why."""
    gone = skipped(device)
    runs = [name for name in ENCODINGS if name not in gone]
    line = ", ".join(runs) + " run here"
    if device == "cpu" and _interpreter_state()[1]:
        line += " (the interpreter's fp8 decode, which reads NaN and Inf codes as numbers, is replaced by torch's)"
    if gone:
        line += "; skipped: " + "; ".join(f"{name} ({why})" for name, why in gone.items())
    return line


# -- GPU ----------------------------------------------------------------------------

# The visible GPU's skips, once known in this process: asked of Triton, or told by the run that started it
_known_gpu_skips: list[tuple[tuple[str, str], ...]] = []


def gpu_skips() -> tuple[tuple[str, str], ...]:
    """fp8 encodings the visible GPU cannot run, with why (``skipped("cuda")``'s items).  Triton asks
    the driver, which initialises CUDA in the asking process."""
    if not _known_gpu_skips:
        _known_gpu_skips.append(_ask_triton())
    return _known_gpu_skips[0]


def gpu_skips_for(device: str) -> tuple[tuple[str, str], ...] | None:
    """What a run on ``device`` tells the processes it starts (``told_gpu_skips``)."""
    return None if device == "cpu" else gpu_skips()


def told_gpu_skips(skips: tuple[tuple[str, str], ...] | None) -> None:
    """In a process fresh from the fork server: the GPU's skips as the run that started it found them
    (None: nothing told), so that its campaign never initialises CUDA to ask.  A process that has
    cannot fork its worker (a fork would copy a CUDA state the worker cannot use) and starts a fork
    server of its own instead, which imports torch and Triton again: seconds beside other campaigns."""
    if skips is not None:
        _known_gpu_skips[:] = [tuple(skips)]


def _ask_triton() -> tuple[tuple[str, str], ...]:
    import triton

    try:
        from triton.compiler.compiler import make_backend
        from triton.runtime import driver

        target = driver.active.get_current_target()
        declared = set(make_backend(target).parse_options({}).supported_fp8_dtypes)
        where = f"{target.backend} {target.arch}"
    except Exception as exc:  # an API this Triton lacks: say so rather than guess
        why = f"cannot ask Triton {triton.__version__} which fp8 types this GPU compiles ({type(exc).__name__})"
        return tuple((name, why) for name in FP8_DTYPES)
    found = []
    for name in FP8_DTYPES:
        if TRITON_TYPES[name] not in declared:
            why = f"Triton {triton.__version__} has no {TRITON_TYPES[name]} type on this GPU ({where})"
            found.append((name, why + (f"; {NATIVE[name]}" if name in NATIVE else "")))
    return tuple(found)


# -- the interpreter ----------------------------------------------------------------------

@functools.cache
def _interpreter_state() -> tuple[tuple[tuple[str, str], ...], bool]:
    """(encodings skipped under the interpreter with why, whether its decode was corrected)."""
    import triton

    try:
        wrong = _wrong_decodes()
        corrected = bool(wrong) and _correct_interpreter_decode()
        if corrected:
            wrong = _wrong_decodes()
    except Exception as exc:  # a Triton whose interpreter works otherwise: no fp8 rather than a false CRASH
        why = (f"Triton {triton.__version__}'s interpreter could not decode fp8 codes for the check "
               f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
        return tuple((name, why) for name in FP8_DTYPES), False

    return tuple((name, f"Triton {triton.__version__}'s interpreter decodes {name} code {code:#04x} as {got} "
                        f"(torch: {expected}), so kernels would compute with other numbers than a GPU does")
                 for name, (code, got, expected) in wrong.items()), corrected


def _decode(Codes, Out):
    """Out[i] = Codes[i] converted to Out's dtype for all 256 codes; run by Triton's interpreter only."""
    import triton.language as tl

    offs = tl.arange(0, 256)
    tl.store(Out + offs, tl.load(Codes + offs).to(Out.dtype.element_ty))


def _decode_kernel():
    """``_decode`` as the interpreter runs it, whatever TRITON_INTERPRET says."""
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(_decode)


def _every_code(name: str) -> torch.Tensor:
    """The 256 codes of encoding ``name``, in code order, as its torch dtype."""
    return as_encoding(torch.arange(256, dtype=torch.int32).to(torch.uint8), name)


def _wrong_decodes() -> dict[str, tuple[int, float, float]]:
    """Encodings whose decode (to fp16, bf16 and fp32) under the interpreter differs from torch's on
    some code, each with its first wrong code, what the interpreter gave and what torch gives."""
    kernel = _decode_kernel()
    wrong = {}
    for name in FP8_DTYPES:
        source = _every_code(name)
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            out = torch.empty(256, dtype=dtype)
            kernel[(1,)](source, out)
            expected = source.to(dtype)
            bits = torch.int16 if dtype.itemsize == 2 else torch.int32
            same = out.view(bits) == expected.view(bits)
            same |= torch.isnan(out) & torch.isnan(expected)
            if not bool(same.all()):
                code = int((~same).nonzero()[0])
                wrong[name] = (code, float(out[code]), float(expected[code]))
                break
    return wrong


def _correct_interpreter_decode() -> bool:
    """Make the interpreter decode fp8 codes into wider floats by torch's table; False where it cannot.

    Every fp8 code is exactly representable in fp16, bf16, fp32 and fp64, so a
    table of the 256 decoded values is the exact conversion; casts into fp8
    are left as they are.
    """
    try:
        import numpy as np
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_convert_float", None)
    if original is None or getattr(original, "nanfuzz_decode_table", False):
        return False
    wide = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}
    as_bits = {2: (torch.int16, np.uint16), 4: (torch.int32, np.uint32), 8: (torch.int64, np.uint64)}
    tables = {}
    for name, triton_type in TRITON_TYPES.items():
        for out_name, dtype in wide.items():
            signed, unsigned = as_bits[dtype.itemsize]
            decoded = _every_code(name).to(dtype).view(signed).numpy()
            tables[triton_type, out_name] = decoded.view(unsigned)

    def convert(input, input_dtype, output_dtype, rounding_mode):
        table = tables.get((getattr(input_dtype, "name", None), getattr(output_dtype, "name", None)))
        if table is None:
            return original(input, input_dtype, output_dtype, rounding_mode)
        return table[np.frombuffer(input.tobytes(), dtype=np.uint8)].reshape(np.shape(input))

    convert.nanfuzz_decode_table = True
    convert.__wrapped__ = original
    interpreter._convert_float = convert
    return True
