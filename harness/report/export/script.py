"""``nanfuzz export``: a repro as a script, or a regression test, that runs without nanfuzz.

The file opens with what a kernel author reads: the finding, the case as
literals (block tables, lengths, window, the poisoned slots), and the call
the adapter makes.  Below follows the code that builds the tensors and
judges the output, copied from nanfuzz (``export/parts.py``), so that only
torch, Triton, numpy (for Triton's interpreter) and the kernel's library or
adapter are needed.  The script exits 1 while the kernel shows a finding, 0
once it passes, and 2 with one line when the kernel cannot be loaded or run
here (``export/reproduce.py``).  The pytest file holds one test per verdict
and judges the case once, in a fresh process that runs the file itself, so
that nothing it does reaches the session's other tests.
"""
from __future__ import annotations

import ast
import textwrap

from nanfuzz import __version__
from nanfuzz.harness.kernel import Kernel
from nanfuzz.harness.report.export.inline import check_complete
from nanfuzz.harness.report.export.parts import JUDGING, KernelPart, _part, kernel_part, refuse_latent
from nanfuzz.harness.report.picture import picture
from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.case import Case
from nanfuzz.reference.features import poisoned_slots

# Seconds a launch may take before the script calls it a hang (dumping where every thread is):
# nanfuzz's own launch timeouts (harness/campaign/settings.py).
HANG_SECONDS = {"cuda": 60, "cpu": 300}
# Seconds the pytest file's fresh process may take besides its launches: importing torch and Triton
# and building the case take a few on an idle machine; a loaded CI runner may take ten times as long.
FRESH_PROCESS_SECONDS = 120

# One test per verdict the runs can show: (test name, verdict, what it checks).  A CRASH or a HANG
# errors every test.
TESTS = (
    ("output_is_finite_where_the_reference_is", "NONFINITE",
     "no output row holds NaN or Inf where the float64 reference is finite (the poisoned run)"),
    ("identical_launches_give_identical_bits", "NONDETERMINISTIC",
     "a second launch on identical inputs gives the same output bits"),
    ("output_ignores_what_dead_slots_hold", "LEAK",
     "two launches with other finite garbage in the dead slots and margins give the same output bits"),
    ("kernel_writes_only_its_output_rows", "CLOBBER",
     "the kernel writes no input, margin or guard row past its output rows"),
    ("output_is_within_the_bound_of_the_float64_reference", "MISMATCH",
     "every finite output row is within the MISMATCH bound of the float64 reference"),
)


def case_literal(case: Case) -> str:
    """The case as a Python expression over the case model's classes, one sequence a line."""
    g = case.geometry
    sequences = "".join(f"            Sequence(query_len={s.query_len}, seq_len={s.seq_len}, "
                        f"block_table={tuple(s.block_table)!r}),\n" for s in case.sequences)
    kv = case.kv_cache
    return (f"Case(\n"
            f"        geometry=Geometry(num_q_heads={g.num_q_heads}, num_kv_heads={g.num_kv_heads}, "
            f"head_size={g.head_size}, block_size={g.block_size},\n"
            f"                          num_blocks={g.num_blocks}, dtype={g.dtype!r}"
            + (f", head_size_v={g.head_size_v}" if g.diff_kv else "") + "),\n"
            f"        sequences=(\n{sequences}        ),\n"
            f"        sliding_window={case.sliding_window}, causal={case.causal}, sinks={case.sinks}, "
            f"padding_block={case.padding_block}, data_seed={case.data_seed},\n"
            f"        kv_cache=KVCache(dtype={kv.dtype!r}, scales={kv.scales!r}, k_scale={kv.k_scale!r}, "
            f"v_scale={kv.v_scale!r}),\n"
            f"    )")


def poison_literal(case: Case) -> str:
    p = case.poison
    slots = sorted(poisoned_slots(case))
    rows = textwrap.fill(", ".join(f"({b}, {o})" for b, o in slots), width=96, initial_indent=" " * 13,
                         subsequent_indent=" " * 13).strip()
    return (f"POISON = dict(value={p.value!r}, tensors={p.tensors!r}, parts={p.parts!r},\n"
            f"              # (block, offset) of every poisoned dead slot; the other dead slots hold finite garbage\n"
            f"              slots=[{rows}])\n")


def numpy_always(part: KernelPart) -> bool:
    """Does the code copied for ``part`` import numpy as the file is imported (and not only Triton's
    interpreter, which runs a kernel without a GPU)?"""
    tree = ast.parse(part.source + "\n" + part.stand_in)
    modules = [alias.name for node in tree.body if isinstance(node, ast.Import) for alias in node.names]
    modules += [node.module or "" for node in tree.body if isinstance(node, ast.ImportFrom)]
    return any(module.partition(".")[0] == "numpy" for module in modules)


def needs(part: KernelPart) -> str:
    """What the file needs besides Python: torch, Triton, numpy, and the kernel's own."""
    items = ["torch", "Triton", "numpy" if numpy_always(part) else "numpy (for Triton's interpreter, without a GPU)"]
    items += [part.needs] if part.needs else []
    return ", ".join(items[:-1]) + " and " + items[-1]


def _header(record: dict, part: KernelPart, what: str, usage: str) -> str:
    case = record["case"]
    shown = "\n".join("    " + line for line in picture(case).splitlines())
    note = f"\n{textwrap.fill(part.stand_in_note, 110)}" if part.stand_in_note else ""
    return (f'"""{record["kernel_name"]}: {record.get("verdict", "?")}, {what} written by nanfuzz {__version__}.\n\n'
            f"{textwrap.fill(record.get('summary', ''), 96)}\n\n"
            f"{textwrap.fill(f'Needs {needs(part)}; not nanfuzz.', 110)}{note}\n{usage}\n\n{shown}\n"
            f'"""\n').replace("\\", "\\\\")


# Lines each file opens with: torch imported quietly, the device chosen, the interpreter's noise kept out.
TORCH = ('with warnings.catch_warnings():\n'
         '    # without numpy torch warns as it imports; the check below says so in one line\n'
         '    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")\n'
         '    import torch\n\n')
DEVICE = ('DEVICE = ARGS.device or ("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"\n'
          '                         else "cpu")\n')
QUIET_INTERPRETER = ('    # the interpreter evaluates masked-off lanes too, in numpy: their NaN warnings are noise\n'
                     '    warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\\.runtime\\.interpreter")\n')


def _imports(part: KernelPart) -> str:
    loads = "import functools\nimport importlib\n" if part.load is not None else ""
    return (f"from __future__ import annotations\n\nimport argparse\n{loads}import importlib.util\nimport os\n"
            f"import sys\nimport warnings\n")


def _numpy_check(part: KernelPart, *, pytest: bool) -> str:
    """Top-level code: without numpy where the file needs it, one line and exit status 2 (no finding),
    before the code below, which may import it, runs."""
    if numpy_always(part):
        when, why = "", "the layout helpers copied below need it, as Triton's interpreter does"
    else:
        when, why = 'DEVICE == "cpu" and ', "Triton's interpreter, which runs the kernel without a GPU, needs it"
    cannot = f"cannot load the kernel: no module named 'numpy' ({why}: pip install numpy)"
    stop = ('    if __name__ == "__main__":\n        print(_MISSING, file=sys.stderr)\n        sys.exit(2)\n'
            '    pytest.fail(_MISSING, pytrace=False)  # a collection error: the session ends with exit status 2\n'
            ) if pytest else \
        '    print(_MISSING, file=sys.stderr)\n    sys.exit(2)\n'
    return (f"# What the code below needs before it runs; without it, one line and exit status 2 (no finding).\n"
            f'if {when}importlib.util.find_spec("numpy") is None:\n'
            f"    _MISSING = ({cannot[:60]!r}\n                {cannot[60:]!r})\n" + stop)


def _top(record: dict, part: KernelPart, caps: Capabilities) -> str:
    case = record["case"]
    load = ""
    if part.load is not None:
        load = (f"@functools.cache\n"
                f"def load_kernel():\n"
                f"    \"\"\"The adapter's run(batch, out), imported once, before the first launch (a failure to\n"
                f"    import is exit status 2, never a finding).\"\"\"\n"
                f"    {part.load}\n\n\n")
    return (f"KERNEL_NAME = {record['kernel_name']!r}\n"
            f"RECORDED = {record.get('verdict', '?')!r}\n"
            f"PRECISION = {caps.precision!r}  # how the kernel multiplies float32: the MISMATCH bound's yardstick\n"
            f"DETERMINISTIC = {caps.deterministic!r}  # False: two launches may differ (NONDETERMINISTIC skipped)\n\n\n"
            f"def the_case():\n"
            f"    \"\"\"The batch: geometry, each sequence's lengths and block table, window, causality, cache.\"\"\"\n"
            f"    return {case_literal(case)}\n\n\n"
            f"{poison_literal(case)}\n\n"
            f"{load}"
            f"def run_kernel(batch, out):\n"
            f"    \"\"\"The launch as nanfuzz's adapter makes it: ``batch`` holds the canonical inputs\n"
            f"    (caches [num_blocks, block_size, num_kv_heads, head size]), ``out`` the output rows.\"\"\"\n"
            f"    {part.call}\n")


def _main(part: KernelPart, *, pytest: bool) -> str:
    load = "load_kernel" if part.load is not None else "None"
    saved = ('    if json_path is not None:  # the pytest fixture reads it\n'
             '        with open(json_path, "w", encoding="utf-8") as out:\n'
             '            out.write(result.to_json())\n') if pytest else ""
    return ('def main(json_path=None) -> int:\n'
            '    """Run the case: exit status 0 when the kernel passes, 1 for a finding, 2 when it cannot be\n'
            '    loaded or run here."""\n'
            '    case = the_case()\n'
            '    if DEVICE == "cpu" and case.kv_cache.dtype.startswith("fp8"):\n'
            '        # Triton\'s interpreter decodes some fp8 codes (NaN among them) as other numbers than a GPU does\n'
            '        _correct_interpreter_decode()\n'
            f'    result = reproduce(run_kernel, case, POISON, DEVICE, load={load},\n'
            '                       announce=f"{KERNEL_NAME}: recorded {RECORDED}; running on {DEVICE}",\n'
            f'                       precision=PRECISION, deterministic=DETERMINISTIC,\n'
            f'                       hang_seconds={HANG_SECONDS["cpu"]} if DEVICE == "cpu" else {HANG_SECONDS["cuda"]})\n'
            + saved +
            '    print(result.report, file=sys.stderr if result.status == CANNOT_RUN else sys.stdout)\n'
            '    return result.status\n')


def _copied(part: KernelPart) -> str:
    return ("\n\n# " + "=" * 94 + "\n# Everything below is copied from nanfuzz: the kernel and how it is called, the case model,\n"
            "# the float64 oracle and the MISMATCH bound, and how the batch is built and judged.\n# " + "=" * 94 + "\n\n"
            + part.source + "\n\n" + _part(JUDGING) + ("\n\n" + part.stand_in if part.stand_in else ""))


def _checked(text: str, record: dict) -> str:
    check_complete(text, record["kernel_name"])
    ast.parse(text)
    return text


def standalone_script(record: dict, kernel: Kernel, import_path: str, file_name: str) -> str:
    """A script that reproduces ``record``'s finding: exit 1 while it fails, 0 once the kernel passes,
    2 when the kernel cannot be loaded or run here."""
    refuse_latent(record["case"])
    part = kernel_part(kernel, import_path)
    options = "".join(option.argparse_line() + "\n" for option in part.options)
    usage = (f"Run:  python {file_name} [--device cpu|cuda]" + "".join(f" [{o.flag} {o.metavar if not o.choices else 'NAME'}]"
                                                                      for o in part.options) +
             "\nExit 1 while the kernel shows a finding, 0 once it passes, 2 (one line) when it cannot be loaded or run\n"
             "here; without a GPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1).")
    text = (_header(record, part, "a repro", usage) + _imports(part) + "\n" +
            f"_parser = argparse.ArgumentParser(description=\"Reproduce {record['kernel_name']}: {record.get('verdict')}\")\n"
            '_parser.add_argument("--device", choices=("cpu", "cuda"), help="default: the GPU if present")\n'
            f"{options}ARGS = _parser.parse_args()\n\n" + TORCH +
            "# The GPU if there is one, else Triton's interpreter, chosen before Triton is imported.\n" + DEVICE +
            'if DEVICE == "cpu":\n    os.environ["TRITON_INTERPRET"] = "1"\n' + QUIET_INTERPRETER + "\n" +
            _numpy_check(part, pytest=False) + "\n" + _top(record, part, kernel.capabilities) + "\n\n" +
            _main(part, pytest=False) + _copied(part) + '\n\nif __name__ == "__main__":\n    sys.exit(main())\n')
    return _checked(text, record)


def _pytest_usage(record: dict, file_name: str) -> str:
    recorded = record.get("verdict", "?")
    failing = next((f"test_{name}" for name, verdict, _ in TESTS if verdict == recorded), None)
    which = (f"{failing} fails while the kernel shows the recorded {recorded}; each other test fails only if the "
             f"kernel shows its verdict too" if failing else
             f"a {recorded} errors every test")
    return (f"Run:  python -m pytest {file_name}   (on the GPU if there is one, else under Triton's interpreter)\n" +
            textwrap.fill(
                f"Each test checks one property of the kernel's runs of the case below (its docstring says which): "
                f"{which}; all pass once the kernel is fixed.  The runs happen once, in a fresh Python process that "
                f"runs this file (under TRITON_INTERPRET=1 without a GPU), so that nothing here changes the test "
                f"session: no environment variable, no imported kernel.  A launch that raises or a process that dies "
                f"(CRASH) or hangs (HANG) errors every test; a kernel that cannot be loaded or run here (numpy, its "
                f"package or its library's files missing) stops the session with exit status 2 and one line.", 110))


def pytest_file(record: dict, kernel: Kernel, import_path: str, file_name: str) -> str:
    """The same as a regression test: one test per verdict, for the kernel's own test suite."""
    refuse_latent(record["case"])
    part = kernel_part(kernel, import_path)
    defaults = "".join(f"ARGS.{o.dest} = {o.default}\n" for o in part.options)
    timeout = HANG_SECONDS["cpu"] + FRESH_PROCESS_SECONDS, HANG_SECONDS["cuda"] + FRESH_PROCESS_SECONDS
    tests = "".join(f"def test_{name}(verdicts):\n    \"\"\"{verdict}: {checks}.\"\"\"\n" +
                    ("    if not DETERMINISTIC:\n        pytest.skip(\"the kernel is declared nondeterministic: "
                     "identical launches may differ\")\n" if verdict == "NONDETERMINISTIC" else "") +
                    f"    found = _found(verdicts, {verdict!r})\n    assert not found, found\n\n\n"
                    for name, verdict, checks in TESTS)
    text = (_header(record, part, "a regression test", _pytest_usage(record, file_name)) + _imports(part) +
            "\nimport pytest\n\n"
            "# What the script's options would say: the recorded variant, or where the library's files are.\n"
            f"ARGS = argparse.Namespace(device=None)\n{defaults}\n" + TORCH +
            "# The GPU if there is one, else Triton's interpreter: the case runs in a fresh process (the fixture\n"
            "# below), which its parent starts under TRITON_INTERPRET=1 on the CPU; this one is left as it was.\n"
            + DEVICE + 'if DEVICE == "cpu" and __name__ == "__main__":\n' + QUIET_INTERPRETER + "\n" +
            _numpy_check(part, pytest=True) + "\n" + _top(record, part, kernel.capabilities) + "\n\n" +
            _main(part, pytest=True) + "\n\n"
            "@pytest.fixture(scope=\"module\")\n"
            "def verdicts():\n"
            "    \"\"\"The findings of every run of the case (poisoned, repeated, on other finite garbage), judged once\n"
            "    in a fresh process that runs this file.  A CRASH or a HANG errors every test; a kernel that cannot\n"
            "    be loaded or run here stops the session with exit status 2.\"\"\"\n"
            f"    result = in_a_fresh_process(__file__, DEVICE, timeout={timeout[0]} if DEVICE == \"cpu\" else {timeout[1]})\n"
            "    if result.status == CANNOT_RUN:\n"
            "        pytest.exit(result.report, returncode=2)\n"
            "    ended = [f for f in result.findings if f.verdict in (\"CRASH\", \"HANG\")]\n"
            "    if ended:\n"
            "        pytest.fail(f\"{ended[0].verdict}: {ended[0].message}\", pytrace=False)\n"
            "    return result.findings\n\n\n"
            "def _found(findings, verdict):\n"
            "    return \"\\n\".join(f.message for f in findings if f.verdict == verdict)\n\n\n"
            + tests.rstrip("\n") + "\n" + _copied(part) +
            '\n\nif __name__ == "__main__":  # the fixture\'s fresh process: python THIS_FILE --json PATH\n'
            '    sys.exit(main(json_path=sys.argv[sys.argv.index("--json") + 1]))\n')
    return _checked(text, record)
