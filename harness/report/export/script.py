"""``nanfuzz export``: a repro as a script, or a regression test, that runs without nanfuzz.

The file opens with what a kernel author reads: the finding, the case as
literals (block tables, lengths, window, the poisoned slots), and the call
the adapter makes.  Below follows the code that builds the tensors and
judges the output, copied from nanfuzz (``export/parts.py``), so that only
torch, Triton and the kernel's library are needed.  The script exits 1 while
the bug is there and 0 once the kernel passes; the pytest file fails and
passes the same way, one test per property.
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


def _header(record: dict, part: KernelPart, usage: str) -> str:
    case = record["case"]
    shown = "\n".join("    " + line for line in picture(case).splitlines())
    return (f'"""{record["kernel_name"]}: {record.get("verdict", "?")}, a repro written by nanfuzz {__version__}.\n\n'
            f"{textwrap.fill(record.get('summary', ''), 96)}\n\n"
            f"Needs {part.needs}; not nanfuzz.\n{usage}\n\n{shown}\n"
            f'"""\n').replace("\\", "\\\\")


def _device_prelude() -> str:
    return ('import torch\n\n'
            '# The GPU if there is one, else Triton\'s interpreter, chosen before Triton is imported.\n'
            'DEVICE = ARGS.device or ("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"\n'
            '                         else "cpu")\n'
            'if DEVICE == "cpu":\n'
            '    os.environ["TRITON_INTERPRET"] = "1"\n'
            '    import warnings\n\n'
            '    # the interpreter evaluates masked-off lanes too, in numpy: their NaN warnings are noise\n'
            '    warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\\.runtime\\.interpreter")\n')


def _top(record: dict, part: KernelPart, caps: Capabilities) -> str:
    case = record["case"]
    return (f"KERNEL_NAME = {record['kernel_name']!r}\n"
            f"RECORDED = {record.get('verdict', '?')!r}\n"
            f"PRECISION = {caps.precision!r}  # how the kernel multiplies float32: the MISMATCH bound's yardstick\n"
            f"DETERMINISTIC = {caps.deterministic!r}  # False: two launches may differ (NONDETERMINISTIC skipped)\n\n\n"
            f"def the_case():\n"
            f"    \"\"\"The batch: geometry, each sequence's lengths and block table, window, causality, cache.\"\"\"\n"
            f"    return {case_literal(case)}\n\n\n"
            f"{poison_literal(case)}\n\n"
            f"def run_kernel(batch, out):\n"
            f"    \"\"\"The launch as nanfuzz's adapter makes it: ``batch`` holds the canonical inputs\n"
            f"    (caches [num_blocks, block_size, num_kv_heads, head size]), ``out`` the output rows.\"\"\"\n"
            f"    {part.call}\n")


def _copied(part: KernelPart) -> str:
    return ("\n\n# " + "=" * 94 + "\n# Everything below is copied from nanfuzz: the kernel and how it is called, the case model,\n"
            "# the float64 oracle and the MISMATCH bound, and how the batch is built and judged.\n# " + "=" * 94 + "\n\n"
            + part.source + "\n\n" + _part(JUDGING))


def _fp8_fix() -> str:
    return ('    if DEVICE == "cpu" and case.kv_cache.dtype.startswith("fp8"):\n'
            '        # Triton\'s interpreter decodes some fp8 codes (NaN among them) as other numbers than a GPU does\n'
            '        _correct_interpreter_decode()\n')


def standalone_script(record: dict, kernel: Kernel, import_path: str, file_name: str) -> str:
    """A script that reproduces ``record``'s finding: exit 1 while it fails, 0 once the kernel passes."""
    refuse_latent(record["case"])
    part = kernel_part(kernel, import_path)
    options = "".join(option.argparse_line() + "\n" for option in part.options)
    usage = (f"Run:  python {file_name} [--device cpu|cuda]" + "".join(f" [{o.flag} {o.metavar if not o.choices else 'NAME'}]"
                                                                      for o in part.options) +
             "\nExit 1 while the kernel shows the finding, 0 once it passes, 2 when it cannot be loaded; without a GPU the kernel runs under\n"
             "Triton's interpreter (TRITON_INTERPRET=1).")
    text = (_header(record, part, usage) +
            "from __future__ import annotations\n\nimport argparse\nimport faulthandler\nimport os\nimport sys\nimport traceback\n\n"
            f"_parser = argparse.ArgumentParser(description=\"Reproduce {record['kernel_name']}: {record.get('verdict')}\")\n"
            '_parser.add_argument("--device", choices=("cpu", "cuda"), help="default: the GPU if present")\n'
            f"{options}ARGS = _parser.parse_args()\n\n" + _device_prelude() + "\n" +
            _top(record, part, kernel.capabilities) + "\n\n" +
            "def main() -> int:\n"
            "    case = the_case()\n" + _fp8_fix() +
            f"    faulthandler.dump_traceback_later({HANG_SECONDS['cpu']} if DEVICE == \"cpu\" else {HANG_SECONDS['cuda']}, "
            f"exit=True)  # a HANG\n"
            '    print(f"{KERNEL_NAME}: recorded {RECORDED}; running on {DEVICE}")\n'
            "    try:\n"
            "        verdicts = judge(run_kernel, case, POISON, DEVICE, precision=PRECISION, deterministic=DETERMINISTIC)\n"
            f"    except {part.setup_errors} as exc:  # the kernel's library is not where it was looked for\n"
            '        print(f"cannot load the kernel: {exc}", file=sys.stderr)\n'
            "        return 2\n"
            "    except Exception:  # the kernel raised: a CRASH\n"
            "        traceback.print_exc()\n"
            '        print("FAIL CRASH: the kernel raised", file=sys.stderr)\n'
            "        return 1\n"
            "    faulthandler.cancel_dump_traceback_later()\n"
            "    print(verdicts.report())\n"
            "    return 1 if verdicts.failed else 0\n" +
            _copied(part) + '\n\nif __name__ == "__main__":\n    sys.exit(main())\n')
    check_complete(text, record["kernel_name"])
    ast.parse(text)
    return text


def pytest_file(record: dict, kernel: Kernel, import_path: str, file_name: str) -> str:
    """The same as a regression test: one test per property, for the kernel's own test suite."""
    refuse_latent(record["case"])
    part = kernel_part(kernel, import_path)
    defaults = "".join(f"ARGS.{o.dest} = {o.default}\n" for o in part.options)
    usage = (f"Run:  python -m pytest {file_name}   (on the GPU if there is one; TRITON_INTERPRET=1 runs the\n"
             "interpreter).  Every test fails while the kernel shows the finding and passes once it is fixed.")
    text = (_header(record, part, usage) +
            "from __future__ import annotations\n\nimport argparse\nimport os\nimport sys\n\nimport pytest\n\n"
            f"# What the script's options would say: the recorded variant, or where the library's files are.\n"
            f"ARGS = argparse.Namespace(device=None)\n{defaults}\n" + _device_prelude() + "\n" +
            _top(record, part, kernel.capabilities) + "\n\n" +
            "@pytest.fixture(scope=\"module\")\n"
            "def verdicts():\n"
            "    \"\"\"Every launch of the case: poisoned, repeated, on other finite garbage (a launch that raises\n"
            "    fails every test).\"\"\"\n"
            "    case = the_case()\n" + _fp8_fix() +
            "    return judge(run_kernel, case, POISON, DEVICE, precision=PRECISION, deterministic=DETERMINISTIC)\n\n\n"
            "def _found(verdicts, verdict):\n"
            "    return \"\\n\".join(f.message for f in verdicts.findings if f.verdict == verdict)\n\n\n"
            + "".join(f"def test_{name}(verdicts):\n    found = _found(verdicts, {verdict!r})\n    assert not found, found\n\n\n"
                      for name, verdict in TESTS) +
            _copied(part))
    check_complete(text, record["kernel_name"])
    ast.parse(text)
    return text


# One test per verdict the runs can show (a CRASH fails them all).
TESTS = (
    ("output_is_finite_where_the_reference_is", "NONFINITE"),
    ("identical_launches_agree", "NONDETERMINISTIC"),
    ("dead_slots_do_not_reach_the_output", "LEAK"),
    ("inputs_and_guard_rows_are_untouched", "CLOBBER"),
    ("output_is_within_the_bound_of_the_float64_reference", "MISMATCH"),
)
