"""``nanfuzz export``: repros a kernel's author runs without nanfuzz.

Each exported script and pytest file runs in a process where ``import
nanfuzz`` fails (a package of that name that raises, first on the path, and
no plugin autoload), under Triton's interpreter: it must fail on the
recorded kernel and pass on the fixed one, the built-in's fixed variant, a
vLLM or AITER tree with the loads masked, or (AITER) the recorded kernel on a
case outside the bug's geometry.
"""
from __future__ import annotations

import ast
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nanfuzz.harness.cli import main as cli
from nanfuzz.harness.report.export.inline import missing_names

ROOT = Path(__file__).resolve().parents[1]
REGRESSIONS = ROOT / "tests" / "regressions"
# (repro, the fixed variant): every old built-in variant, and quantized caches of each family
BUILTIN = [
    ("paged_decode-tail-past-seq-len", "masked"),               # paged_decode@unmasked
    ("paged_decode-freed-block-below-window", "masked"),        # paged_decode@tail-masked
    ("prefix_prefill-expired-and-live-in-one-block", "masked"),  # prefix_prefill@unmasked
    ("unified-non-causal-overshoot", "masked"),                  # unified@overshoot
]
QUANTIZED = [
    ("paged_decode-fnuz-nan-code-0x80-in-tail", "masked"),      # fp8 e4m3fnuz, per-tensor scales
    ("unified-overshoot-nan-scale-in-tail", "masked"),          # per-token-head scale caches
]


def _imports_nanfuzz(text: str) -> bool:
    nodes = ast.walk(ast.parse(text))
    return any(isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "nanfuzz" or
               isinstance(n, ast.Import) and any(a.name.split(".")[0] == "nanfuzz" for a in n.names) for n in nodes)


def _without_nanfuzz(tmp_path: Path, *argv: str, path: tuple[Path, ...] = (),
                     gpu: bool = False) -> subprocess.CompletedProcess:
    """``python *argv`` where nanfuzz does not import, under Triton's interpreter unless ``gpu``;
    ``path``: folders on sys.path after the shadow."""
    shadow = tmp_path / "shadow" / "nanfuzz"
    shadow.mkdir(parents=True, exist_ok=True)
    (shadow / "__init__.py").write_text('raise ImportError("nanfuzz is not importable here")\n')
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("NANFUZZ_", "PYTEST_")) and k not in ("VLLM_SRC", "AITER_SRC")}
    env.update(PYTHONPATH=os.pathsep.join(map(str, (shadow.parent, *path))), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1",
               TRITON_INTERPRET="1")
    if gpu:
        del env["TRITON_INTERPRET"]
    return subprocess.run([sys.executable, *argv], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)


def _export(tmp_path: Path, repro: str, *options: str) -> Path:
    copy = tmp_path / f"{repro}.json"
    shutil.copyfile(REGRESSIONS / f"{repro}.json", copy)
    assert cli(["export", str(copy), *options]) == 0
    stem = repro.replace("-", "_")
    kind = {"--pytest": f"test_{stem}.py", "--markdown": f"{stem}.md"}
    return tmp_path / next((kind[o] for o in options if o in kind), f"{stem}_standalone.py")


def _pytest_both(tmp_path: Path, test_file: Path, fix, gpu: bool = False) -> None:
    """The exported test file as recorded (every NONFINITE test fails) and fixed (all pass), in one run."""
    fixed = test_file.with_name(test_file.stem + "_fixed.py")
    fixed.write_text(fix(test_file.read_text()))
    proc = _without_nanfuzz(tmp_path, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", test_file.name,
                            fixed.name, gpu=gpu)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    failed = [line for line in lines if line.startswith("FAILED")]
    assert any("::test_output_is_finite_where_the_reference_is" in line for line in failed), proc.stdout[-3000:]
    assert all(line.startswith(f"FAILED {test_file.name}::") for line in failed), proc.stdout[-3000:]
    assert "error" not in lines[-1], proc.stdout[-3000:]


@pytest.mark.parametrize("repro, fixed", BUILTIN + QUANTIZED)
def test_a_builtin_repro_exports_a_script_that_fails_until_the_fix(tmp_path, repro, fixed):
    script = _export(tmp_path, repro)
    text = script.read_text()
    assert not _imports_nanfuzz(text) and not missing_names(text)
    assert "@triton.jit" in text  # the kernel's own source travels with it
    bug = _without_nanfuzz(tmp_path, script.name)
    assert bug.returncode == 1, bug.stdout + bug.stderr[-3000:]
    assert "NONFINITE:" in bug.stdout and "token 0 (sequence 0) head 0: kernel [nan" in bug.stdout
    fix = _without_nanfuzz(tmp_path, script.name, "--variant", fixed)
    assert fix.returncode == 0, fix.stdout + fix.stderr[-3000:]
    assert fix.stdout.splitlines()[-1].startswith("PASS")


# The pytest file runs the script's code in a process of its own: two kernels show it does.
PYTEST_BUILTIN = [BUILTIN[0], BUILTIN[3]]  # paged_decode@unmasked, unified@overshoot


@pytest.mark.parametrize("repro, fixed", PYTEST_BUILTIN)
def test_a_builtin_repro_exports_a_pytest_file_that_fails_until_the_fix(tmp_path, repro, fixed):
    test_file = _export(tmp_path, repro, "--pytest")
    assert test_file.name.startswith("test_") and not _imports_nanfuzz(test_file.read_text())
    _pytest_both(tmp_path, test_file, lambda text: text.replace("ARGS.variant = ", f"ARGS.variant = {fixed!r}  # ", 1))


@pytest.mark.gpu
def test_on_a_gpu_a_builtin_repro_s_script_and_test_fail_until_the_fix(tmp_path):
    repro, fixed = BUILTIN[0]
    script = _export(tmp_path, repro)
    bug = _without_nanfuzz(tmp_path, script.name, gpu=True)
    assert bug.returncode == 1 and "running on cuda" in bug.stdout and "NONFINITE:" in bug.stdout, \
        bug.stdout + bug.stderr[-3000:]
    fix = _without_nanfuzz(tmp_path, script.name, "--variant", fixed, gpu=True)
    assert fix.returncode == 0 and fix.stdout.splitlines()[-1].startswith("PASS"), fix.stdout + fix.stderr[-3000:]
    test_file = _export(tmp_path, repro, "--pytest")
    _pytest_both(tmp_path, test_file, lambda text: text.replace("ARGS.variant = ", f"ARGS.variant = {fixed!r}  # ", 1),
                 gpu=True)


# The fix of vLLM 0.33.0's decode kernel: its K/V loads masked by the window as well as by seq_len.
VLLM_FIX = (
    "        if j == num_blocks - 1:\n            kv_load_mask = abs_token_idx < seq_len\n",
    "        if True:\n            kv_load_mask = (abs_token_idx < seq_len) & ((SLIDING_WINDOW <= 0) | "
    "(seq_len - 1 - abs_token_idx < SLIDING_WINDOW))\n",
)


@pytest.fixture
def fixed_vllm(tmp_path, vllm_source):
    tree = tmp_path / "vllm-fixed"
    shutil.copytree(vllm_source, tree)
    kernel = tree / "vllm" / "v1" / "attention" / "ops" / "chunked_prefill_paged_decode.py"
    text = kernel.read_text()
    assert text.count(VLLM_FIX[0]) == 1
    kernel.write_text(text.replace(*VLLM_FIX))
    return tree


def test_a_vllm_rocm_attn_repro_exports_a_script_and_a_test_that_fail_until_the_fix(tmp_path, vllm_source,
                                                                                     fixed_vllm):
    repro = "vllm_rocm_attn-window-freed-v"
    script = _export(tmp_path, repro, "--vllm-src", str(vllm_source))
    text = script.read_text()
    assert not _imports_nanfuzz(text) and "def run_rocm_attn(" in text and "chunked_prefill_paged_decode" in text
    bug = _without_nanfuzz(tmp_path, script.name, "--vllm-src", str(vllm_source))
    assert bug.returncode == 1 and "NONFINITE:" in bug.stdout, bug.stdout + bug.stderr[-3000:]
    fix = _without_nanfuzz(tmp_path, script.name, "--vllm-src", str(fixed_vllm))
    assert fix.returncode == 0 and fix.stdout.splitlines()[-1].startswith("PASS"), fix.stdout + fix.stderr[-3000:]

    missing = _without_nanfuzz(tmp_path, script.name, "--vllm-src", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "cannot load the kernel" in missing.stderr, missing.stderr[-2000:]

    test_file = _export(tmp_path, repro, "--pytest", "--vllm-src", str(vllm_source))
    default = "ARGS.vllm_src = os.environ.get('VLLM_SRC')"
    test_file.write_text(test_file.read_text().replace(default, f"ARGS.vllm_src = {str(vllm_source)!r}"))
    _pytest_both(tmp_path, test_file, lambda text: text.replace(str(vllm_source), str(fixed_vllm)))


def test_a_vllm_segmented_repro_exports_a_script_that_fails_until_the_fix(tmp_path, vllm_source):
    from tests.test_vllm_segmented import MODULE, TILE_BOUNDS, TILE_BOUNDS_IN_WINDOW

    fixed = tmp_path / "vllm-fixed"
    shutil.copytree(vllm_source, fixed)
    kernel = fixed / MODULE
    kernel.write_text(kernel.read_text().replace(TILE_BOUNDS, TILE_BOUNDS_IN_WINDOW))
    script = _export(tmp_path, "vllm_rocm_segmented_attn-window-first-tile-loads-expired-v", "--vllm-src",
                     str(vllm_source))
    text = script.read_text()
    assert not _imports_nanfuzz(text) and not missing_names(text) and "def run_rocm_segmented_attn(" in text
    bug = _without_nanfuzz(tmp_path, script.name, "--vllm-src", str(vllm_source))
    assert bug.returncode == 1 and "NONFINITE:" in bug.stdout, bug.stdout + bug.stderr[-3000:]
    fix = _without_nanfuzz(tmp_path, script.name, "--vllm-src", str(fixed))
    assert fix.returncode == 0 and fix.stdout.splitlines()[-1].startswith("PASS"), fix.stdout + fix.stderr[-3000:]


def test_a_vllm_diffkv_case_exports_a_script_that_tells_a_v_tile_from_below_the_window(tmp_path, vllm_source):
    """No finding of the released diffkv kernel is on file: its repro here is a passing case, which a
    copy without the kernel's zeroing of V below the window fails."""
    from nanfuzz.harness.judge.check import check
    from nanfuzz.harness.registry import resolve
    from nanfuzz.harness.report.repro import write_repro
    from nanfuzz.reference.case import Poison
    from tests.cases import consecutive_case
    from tests.test_vllm_diffkv import MODULE, V_WINDOW_ZEROING

    mutated = tmp_path / "vllm-mutated"
    shutil.copytree(vllm_source, mutated)
    kernel_file = mutated / MODULE
    kernel_file.write_text(kernel_file.read_text().replace(V_WINDOW_ZEROING,
                                                           V_WINDOW_ZEROING.replace("if SLIDING_WINDOW:", "if False:")))
    kernel = resolve("vllm:triton_attn_diffkv@2d", vllm_src=str(vllm_source))
    case = consecutive_case([(1, 40)], head_size=64, head_size_v=32, window=5, poison=Poison("nan", "v"))
    [record, *_] = write_repro(kernel, case, check(kernel, case, "cpu"), tmp_path / "found", "cpu")
    assert cli(["export", str(record), "--vllm-src", str(vllm_source)]) == 0
    script = next((tmp_path / "found").glob("*_standalone.py"))
    assert not _imports_nanfuzz(script.read_text()) and "head_size_v=32" in script.read_text()
    released = _without_nanfuzz(script.parent, script.name, "--vllm-src", str(vllm_source))
    assert released.returncode == 0 and released.stdout.splitlines()[-1].startswith("PASS"), released.stdout
    broken = _without_nanfuzz(script.parent, script.name, "--vllm-src", str(mutated))
    assert broken.returncode == 1 and "NONFINITE:" in broken.stdout, broken.stdout + broken.stderr[-3000:]


# The fix of AITER's unified_attention: every tile's K/V loads masked at the longest prefix, as the
# tiles that are not one whole block already are (a tile of one block is loaded unmasked, tail included).
AITER_FIX = (
    "        if TILE_SIZE == BLOCK_SIZE:\n            tile_mask = tl.full((1,), 1, dtype=tl.int1)\n",
    "        if False:\n            tile_mask = tl.full((1,), 1, dtype=tl.int1)\n",
)


@pytest.fixture
def fixed_aiter(tmp_path, aiter_source):
    tree = tmp_path / "aiter-fixed"
    shutil.copytree(aiter_source, tree)
    kernel = tree / "aiter" / "ops" / "triton" / "_triton_kernels" / "unified_attention.py"
    text = kernel.read_text()
    assert text.count(AITER_FIX[0]) == 2  # the 2D and the 3D kernel
    kernel.write_text(text.replace(*AITER_FIX))
    return tree


def test_an_aiter_unified_attention_repro_exports_a_script_and_a_test_that_fail_until_the_fix(tmp_path, aiter_source,
                                                                                              fixed_aiter):
    repro = "aiter_unified_attention-decode-tail-past-seq-len"
    script = _export(tmp_path, repro, "--aiter-src", str(aiter_source))
    text = script.read_text()
    assert not _imports_nanfuzz(text) and not missing_names(text)
    assert "def prepare_unified(" in text
    assert "return prepare_unified(batch, out, path=None, source=ARGS.aiter_src)()" in text
    bug = _without_nanfuzz(tmp_path, script.name, "--aiter-src", str(aiter_source))
    assert bug.returncode == 1, bug.stdout + bug.stderr[-3000:]
    assert "NONFINITE:" in bug.stdout and "token 0 (sequence 0) head 0: kernel [nan" in bug.stdout
    fix = _without_nanfuzz(tmp_path, script.name, "--aiter-src", str(fixed_aiter))
    assert fix.returncode == 0 and fix.stdout.splitlines()[-1].startswith("PASS"), fix.stdout + fix.stderr[-3000:]

    # an installed aiter whose runtime does not import (here: the bare kernel tree on sys.path) gives its files
    installed = _without_nanfuzz(tmp_path, script.name, path=(aiter_source,))
    assert installed.returncode == 1 and "NONFINITE:" in installed.stdout, installed.stdout + installed.stderr[-3000:]
    if importlib.util.find_spec("aiter") is None:
        missing = _without_nanfuzz(tmp_path, script.name)
        assert missing.returncode == 2 and "cannot load the kernel: no aiter package" in missing.stderr, missing.stderr
    nowhere = _without_nanfuzz(tmp_path, script.name, "--aiter-src", str(tmp_path / "nowhere"))
    assert nowhere.returncode == 2 and "cannot load the kernel" in nowhere.stderr, nowhere.stderr[-2000:]

    test_file = _export(tmp_path, repro, "--pytest", "--aiter-src", str(aiter_source))
    default = "ARGS.aiter_src = os.environ.get('AITER_SRC')"
    test_file.write_text(test_file.read_text().replace(default, f"ARGS.aiter_src = {str(aiter_source)!r}"))
    _pytest_both(tmp_path, test_file, lambda text: text.replace(str(aiter_source), str(fixed_aiter)))

    report = _export(tmp_path, repro, "--markdown", "--aiter-src", str(aiter_source)).read_text()
    assert report.startswith("# aiter:unified_attention: NONFINITE") and "return prepare_unified(" in report


# (repro, a change to the exported case that leaves the bug's geometry): the script fails as recorded,
# and its copy with the change passes on the same AITER tree.
AITER_OUTSIDE = [
    # context_attention_fwd loads keys below the window; no window, nothing expires
    ("aiter_pa_prefill-window-expired-slots-of-a-live-block", ("sliding_window=1,", "sliding_window=0,")),
    ("aiter_chunked_pa_prefill-prefill-window-expired-slots", ("sliding_window=1,", "sliding_window=0,")),
]


# Every aiter:* name and path, exported from a repro of its kernel (the call is the adapter's, pinned path and all).
AITER_NAMES = [
    ("aiter_unified_attention-decode-tail-past-seq-len", "aiter:unified_attention@2d", "path='2d'"),
    ("aiter_unified_attention-3d-tail-past-seq-len", "aiter:unified_attention@3d", "path='3d'"),
    ("aiter_pa_decode-v1-gqa-block-48-crash", "aiter:pa_decode", "path=None"),
    *(("aiter_pa_decode-v2-block-48-padding-lanes-mismatch", f"aiter:pa_decode@{p}", f"path={p!r}")
      for p in ("v1", "v2", "v1-per-token", "v2-per-token")),
    ("aiter_pa_prefill-window-expired-slots-of-a-live-block", "aiter:pa_prefill", "source=ARGS.aiter_src)()"),
    ("aiter_chunked_pa_prefill-decode-tail-past-seq-len", "aiter:chunked_pa_prefill", "source=ARGS.aiter_src)()"),
]


@pytest.mark.parametrize("repro, name, call", AITER_NAMES, ids=[n for _, n, _ in AITER_NAMES])
def test_every_aiter_kernel_exports_a_script_a_test_and_a_report(tmp_path, aiter_source, repro, name, call):
    for kind in ((), ("--pytest",), ("--markdown",)):
        text = _export(tmp_path, repro, *kind, "--kernel", name, "--aiter-src", str(aiter_source)).read_text()
        assert call in text, text[:3000]
        if kind != ("--markdown",):
            assert not _imports_nanfuzz(text) and not missing_names(text)
            assert "def launchers(" in text and "class LibraryFiles" in text and "def get_num_sms(" in text


@pytest.mark.parametrize("repro, change", AITER_OUTSIDE, ids=[r for r, _ in AITER_OUTSIDE])
def test_an_aiter_repro_exports_a_script_that_fails_only_in_the_bug_s_geometry(tmp_path, aiter_source, repro, change):
    script = _export(tmp_path, repro, "--aiter-src", str(aiter_source))
    text = script.read_text()
    assert not _imports_nanfuzz(text) and not missing_names(text) and text.count(change[0]) == 1
    recorded = json.loads((REGRESSIONS / f"{repro}.json").read_text())["verdict"]
    bug = _without_nanfuzz(tmp_path, script.name, "--aiter-src", str(aiter_source))
    assert bug.returncode == 1 and f"{recorded}:" in bug.stdout, bug.stdout + bug.stderr[-3000:]
    outside = script.with_name(script.stem + "_outside.py")
    outside.write_text(text.replace(*change))
    run = _without_nanfuzz(tmp_path, outside.name, "--aiter-src", str(aiter_source))
    assert run.returncode == 0 and run.stdout.splitlines()[-1].startswith("PASS"), run.stdout + run.stderr[-3000:]


def test_the_markdown_report_holds_the_verdict_the_picture_and_the_call(tmp_path):
    report = _export(tmp_path, "paged_decode-tail-past-seq-len", "--markdown").read_text()
    assert report.startswith("# paged_decode@unmasked: NONFINITE")
    assert "logical  0 -> block   1 [oTtttttttttttttt]" in report  # the picture
    assert "return paged_decode(batch, out, variant=ARGS.variant)" in report  # the call
    assert "torch 2." in report and "paged_decode_tail_past_seq_len_standalone.py" in report


def test_export_usage_errors_are_one_line(tmp_path, capsys):
    assert cli(["export", str(tmp_path / "missing.json")]) == 2
    assert "cannot read repro" in capsys.readouterr().err
    copy = tmp_path / "r.json"
    shutil.copyfile(REGRESSIONS / "paged_decode-tail-past-seq-len.json", copy)
    assert cli(["export", str(copy), "--pytest", "--markdown"]) == 2
    assert "give one of them" in capsys.readouterr().err


def test_a_scripts_pass_line_names_what_it_checked_and_claims_no_traced_read():
    from nanfuzz.harness.report.export.runtime import Finding, Verdicts

    line = Verdicts([]).report()
    assert line.startswith("PASS: the output is finite wherever the float64 reference is;")
    assert "a second launch on identical inputs gave the same bits" in line and "dead slot read" not in line
    assert line.endswith("(the kernel's loads are not traced here, so a read of a dead slot that leaves the output "
                         "unchanged is not seen)")
    nondeterministic = Verdicts([], compared_repeats=False).report()
    assert "second launch" not in nondeterministic and "identical launches not compared" in nondeterministic
    assert Verdicts([Finding("LEAK", "the output changes")]).report() == "LEAK: the output changes"


def test_a_repro_of_a_cache_with_zero_points_packed_codes_and_a_rotation_is_refused_in_one_line(tmp_path, capsys,
                                                                                                  vllm_source):
    copy = tmp_path / "r.json"
    shutil.copyfile(REGRESSIONS / "vllm_triton_attn_int4-nan-v-scale-below-window.json", copy)
    assert cli(["export", str(copy), "--vllm-src", str(vllm_source)]) == 2
    err = capsys.readouterr().err.strip()
    assert "no standalone script for a uint4/token-head/code-zero/float32-zp4/hadamard cache yet" in err
    assert "\n" not in err and not list(tmp_path.glob("*.py"))
