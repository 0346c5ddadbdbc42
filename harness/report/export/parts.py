"""What an exported repro carries: nanfuzz's judging code, and the kernel with the call the adapter makes.

Every script holds the case model, the float64 oracle, the MISMATCH bound
and ``export/runtime.py``.  The kernel part depends on where the kernel
lives: a built-in carries its family's Triton source; a vLLM or AITER kernel
carries the stand-ins for the library's runtime, the loader of its kernel
files and the adapter's own function that calls the library; a user's
adapter is imported from the repository the script runs in, and the script
carries what such an adapter imports from nanfuzz (``export/stand_in.py``).
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field

from nanfuzz.harness.kernel import Kernel
from nanfuzz.harness.registry import builtin_kernels, library_of
from nanfuzz.harness.report.export.inline import extract
from nanfuzz.reference.errors import NanfuzzError

# (module, the names it gives, or None for all of it, names left out), in an order in which
# every statement run at import finds what it needs.
JUDGING = (
    ("reference.errors", None, ()),
    ("reference.case", None, ()),
    ("reference.packing", None, ()),
    ("reference.rotation", None, ()),
    ("reference.asymmetric", None, ()),
    ("reference.quantization", ("Encoding", "ENCODINGS", "_TOKEN_HEAD_RANGE", "_SMALLEST_SCALE", "torch_dtype",
                                "codes_of", "as_encoding", "quantize", "decode", "token_head_scales", "_pick",
                                "finite_codes", "hostile_codes", "garbage_scales", "hostile_scales", "live_values",
                                "stored_values", "values_at", "offsets_at"), ()),
    ("reference.semantics", ("allowed_mask", "live_key_range"), ()),
    ("reference.materialize", ("TORCH_DTYPES", "host_to_device", "token_layout"), ()),
    ("reference.precision", None, ()),
    ("reference.oracle", None, ()),
    ("reference.redzones", None, ()),
    ("reference.batch", None, ()),
    ("harness.judge.tolerance", None, ()),
    ("harness.judge.encodings", ("TRITON_TYPES", "_every_code", "_correct_interpreter_decode"), ()),
    ("harness.report.export.runtime", None, ()),
    ("harness.report.export.reproduce", None, ()),
)
# What a user's adapter may import from nanfuzz, for the stand-in that takes nanfuzz's place where it is
# not installed: the kernel contract, the device it stands in for, and the layout and window helpers
# (``stand_in.GIVEN``).
USER_PARTS = (
    ("reference.capabilities", None, ()),
    ("reference.layouts", ("KEYS", "Scheduled", "scheduled", "live_key_ranges", "TokenIndices", "token_indices",
                           "_pages", "req_to_token", "dead_pages", "_padded_length"), ()),
    ("reference.windows", None, ()),
    ("harness.device", None, ()),
    ("harness.kernel", ("Kernel",), ()),
    ("harness.report.export.stand_in", None, ()),
)
# The layout helpers tell nanfuzz's statistics what their index buffers point at (``layouts._note``,
# read only while a check records them); a script keeps no statistics.
USER_GLUE = '''def _note(case, pages, page_size):
    """What an index buffer points at, for statistics this script does not keep."""
'''

# What a library kernel's script needs besides the adapter's call: the stand-ins and the loader.
LIBRARY_PARTS = {
    "vllm": (
        ("reference.layouts", ("Scheduled", "scheduled"), ()),
        ("reference.windows", ("window_size", "window_left"), ()),
        ("harness.device", None, ()),
        ("harness.adapters.standins", None, ()),
        ("harness.adapters.vllm_standins", None, ()),
        ("harness.adapters.loader", ("KernelModule",), ()),
        ("harness.adapters.vllm_loader", ("GROUPS", "_native_call_modules"), ()),
        ("harness.adapters.launches", None, ()),
        ("harness.report.export.library_files", None, ()),
    ),
    "aiter": (
        ("reference.layouts", ("Scheduled", "scheduled"), ()),
        ("reference.windows", ("window_size",), ()),
        ("harness.device", None, ()),
        ("harness.adapters.standins", None, ()),
        ("harness.adapters.aiter_standins", None, ()),
        ("harness.adapters.loader", ("KernelModule",), ()),
        ("harness.adapters.aiter_loader", ("_kernel_module", "_PA_PREFILL", "GROUPS", "launchers"), ()),
        ("harness.adapters.launches", None, ()),
        ("harness.report.export.library_files", None, ()),
    ),
}
# The names each adapter call needs from its module, the call itself last.
ADAPTER_CALLS = {
    "run_rocm_attn": ("rocm_key_cache", "rocm_value_cache", "run_rocm_attn"),
    "run_triton_attn": ("SOFTMAX_SEGMENTS", "SCALE_ELEMENTS", "offers_split_k",
                        "packed_token_head_caches", "token_head_views", "run_triton_attn"),
    "run_triton_attn_diffkv": ("SOFTMAX_SEGMENTS", "packed_cache", "run_triton_attn_diffkv"),
    "run_rocm_segmented_attn": ("NAME", "_StaleScratch", "_refuse_fallback", "_tensors_on_a_gpu",
                                "_eligible_off_the_gpu", "bucketed_table", "run_rocm_segmented_attn"),
    # AITER's adapters build the launch in prepare_*() and the script calls what it returns
    "prepare_unified": ("_unit_scale", "_overrides", "prepare_unified"),
    "prepare_pa_decode": ("_COMPUTE_TYPES", "_unit_scale", "_overrides", "pa_decode_cache", "prepare_pa_decode"),
    "prepare_pa_prefill": ("_unit_scale", "_overrides", "prepare_pa_prefill"),
    "prepare_chunked": ("_unit_scale", "_overrides", "prepare_chunked"),
}
# What an adapter call takes from another adapter's module, copied before it.
ADAPTER_BORROWS = {
    "prepare_pa_prefill": (("harness.adapters.vllm", ("rocm_key_cache", "rocm_value_cache"), ()),),
    "prepare_chunked": (("harness.adapters.vllm", ("rocm_key_cache", "rocm_value_cache"), ()),),
}
# How the script names the library's loader and where a source tree comes from.
LIBRARY_GLUE = {
    "vllm": '''import types

vllm_standins = types.SimpleNamespace(build=build, rocm_platform_module=rocm_platform_module)
vllm_loader = LibraryFiles("vllm", "vllm.v1.attention.ops", GROUPS, build, _native_call_modules,
                           env_var="VLLM_SRC", option="--vllm-src")
launches = types.SimpleNamespace(portable_launches=portable_launches)
''',
    "aiter": '''import types

aiter_loader = types.SimpleNamespace(
    load=LibraryFiles("aiter", "aiter.ops.triton", GROUPS, build, dict, env_var="AITER_SRC",
                      option="--aiter-src").load,
    launchers=launchers)
launches = types.SimpleNamespace(portable_launches=portable_launches)
''',
}
LIBRARY_NEEDS = {"vllm": "vLLM's kernel files: a folder that holds vllm/ (a checkout or an unpacked wheel) "
                         "given as --vllm-src DIR or VLLM_SRC=DIR, or an installed vllm",
                 "aiter": "AITER's Triton kernel files: a folder that holds aiter/ (a checkout or an unpacked "
                          "amd-aiter wheel) given as --aiter-src DIR or AITER_SRC=DIR, or an installed aiter"}


@dataclass
class KernelPart:
    """The kernel's code for the script, the body of ``run_kernel(batch, out)``, and what it needs."""

    source: str
    call: str
    needs: str | None  # what the kernel needs besides torch, Triton and numpy (None: nothing)
    constants: list[tuple[str, str, str]] = field(default_factory=list)  # (name, literal, comment)
    options: list[Option] = field(default_factory=list)  # the script's options beside --device
    library: str | None = None
    # The body of ``load_kernel()``, which imports the kernel before the first launch; None: nothing to
    # import apart (a library's files load on the first call, and failing to is an ImportError too).
    load: str | None = None
    # Code placed after the judging parts, whose definitions it may use at import (a user's stand-in
    # for nanfuzz), and what the header says of it.
    stand_in: str = ""
    stand_in_note: str = ""


@dataclass(frozen=True)
class Option:
    """One option of the script: its flag, its default (a Python expression), its choices, its help."""

    flag: str
    default: str
    help: str
    choices: tuple[str, ...] | None = None
    metavar: str = "DIR"

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    def argparse_line(self) -> str:
        choices = f", choices={self.choices!r}" if self.choices else f", metavar={self.metavar!r}"
        return f"_parser.add_argument({self.flag!r}{choices}, default={self.default},\n                     help={self.help!r})"


def _part(entries) -> str:
    return "\n\n".join(extract(module, names, drop) for module, names, drop in entries)


def kernel_part(kernel: Kernel, import_path: str) -> KernelPart:
    library = library_of(import_path)
    if import_path in builtin_kernels():
        return _builtin(kernel, import_path)
    if library in LIBRARY_PARTS and getattr(_adapter_call(kernel), "__name__", None) in ADAPTER_CALLS:
        return _library(kernel, library)
    if library is not None:
        raise NanfuzzError(f"nanfuzz export writes no standalone script for {import_path} yet (vllm:rocm_attn, "
                           "vllm:triton_attn, vllm:triton_attn_diffkv, vllm:rocm_segmented_attn, aiter:* and the "
                           "built-in kernels only); `nanfuzz replay` and the "
                           "repro's own .py run it")
    return _user(import_path)


def refuse_latent(case) -> None:
    """A latent (MLA) cache, or a cache with zero points, packed codes or a rotation, has no standalone
    script yet: one line, before anything is written."""
    if case.geometry.latent:
        raise NanfuzzError("nanfuzz export writes no standalone script for a latent (MLA) cache yet; "
                           "`nanfuzz replay` and the repro's own .py run it")
    if case.kv_cache.extended:
        raise NanfuzzError(f"nanfuzz export writes no standalone script for a {case.kv_cache.label()} cache yet "
                           "(zero points, packed codes, rotations); `nanfuzz replay` and the repro's own .py run it")


def _builtin(kernel: Kernel, name: str) -> KernelPart:
    run = kernel.run
    assert isinstance(run, functools.partial) and "variant" in run.keywords, name
    family, variant = name.split("@")
    fixed = next(k.name.split("@")[1] for k in builtin_kernels().values()
                 if k.name.startswith(family + "@") and k.expect == "pass")
    source = _part((("harness.kernels._common", None, ("family_kernels",)),
                    (f"harness.kernels.{family}", None, ("CAPABILITIES", "KERNELS"))))
    return KernelPart(
        source=source, call=f"return {run.func.__name__}(batch, out, variant=ARGS.variant)",
        needs=None,
        options=[Option("--variant", repr(variant), f"the kernel's variant (recorded: {variant}; the fixed one: {fixed})",
                        choices=tuple(_variants(family)))])


def _variants(family: str) -> list[str]:
    return [k.name.split("@")[1] for k in builtin_kernels().values() if k.name.startswith(family + "@")]


def _adapter_call(kernel: Kernel):
    """The adapter's function the script calls: AITER's run is ``_run(prepare=...)``, which calls what
    ``prepare`` returns; the others' run is the function itself, its options bound."""
    run = kernel.run
    if not isinstance(run, functools.partial):
        return run
    return run.keywords.get("prepare") or run.func


def _library(kernel: Kernel, library: str) -> KernelPart:
    run = kernel.run
    assert isinstance(run, functools.partial), kernel.name
    options = dict(run.keywords)
    prepare = options.pop("prepare", None)
    function = _adapter_call(kernel)
    name = function.__name__
    module = inspect.getmodule(function).__name__.removeprefix("nanfuzz.")
    source = _part(LIBRARY_PARTS[library]) + "\n\n" + LIBRARY_GLUE[library] + "\n\n" + \
        _part(ADAPTER_BORROWS.get(name, ())) + "\n\n" + extract(module, ADAPTER_CALLS[name])
    keywords = ", ".join(f"{k}={v!r}" for k, v in options.items() if k != "source")
    launch = "()" if prepare else ""
    call = f"return {name}(batch, out, {keywords + ', ' if keywords else ''}source=ARGS.{library}_src){launch}"
    option = Option(f"--{library}-src", f"os.environ.get({library.upper() + '_SRC'!r})",
                    f"the folder that holds {library}/ (default ${library.upper()}_SRC; none: the installed {library})")
    return KernelPart(source=source, call=call, needs=LIBRARY_NEEDS[library],
                      options=[option], library=library)


def _user(spec: str) -> KernelPart:
    module, _, attr = spec.partition(":")
    load = (f"if os.getcwd() not in sys.path:  # the adapter imports from the repository root, as under python -m\n"
            f"        sys.path.insert(0, os.getcwd())\n"
            f"    provide_nanfuzz()  # for the adapter's `from nanfuzz import ...` where nanfuzz is not installed\n"
            f"    kernel = importlib.import_module({module!r})\n"
            f"    for part in {attr.split('.')!r}:\n"
            f"        kernel = getattr(kernel, part)\n"
            f"    return kernel.run if hasattr(kernel, 'run') else kernel")
    package = module.partition(".")[0]
    return KernelPart(source="", stand_in=_part(USER_PARTS) + "\n\n" + USER_GLUE, load=load,
                      call=f"return load_kernel()(batch, out)  # the adapter's run(batch, out): {spec}",
                      needs=f"your adapter {spec} (run this from the folder {package} is imported from)",
                      stand_in_note="Where nanfuzz is not installed, the adapter's `from nanfuzz import ...` gets "
                                    "the script's stand-in for it (`provide_nanfuzz`): the kernel contract and its "
                                    "layout and window helpers, copied from nanfuzz.")
