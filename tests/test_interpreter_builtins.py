"""Kernels that call Triton builtins by names of their own run under Triton's interpreter as they
compile on a GPU; what the interpreter cannot run is one usage error naming it, never a CRASH."""
from __future__ import annotations

import contextlib
import textwrap

import pytest

from nanfuzz import load_kernel_files
from nanfuzz.harness.adapters import interpreter_builtins
from nanfuzz.harness.cli import main
from nanfuzz.harness.judge import runs
from nanfuzz.harness.judge.check import check
from nanfuzz.harness.kernels._common import INTERPRETED
from nanfuzz.reference.errors import NanfuzzError
from tests import aliased_kernels
from tests.cases import consecutive_case

pytestmark = pytest.mark.skipif(not INTERPRETED, reason="Triton's interpreter's limits: a CPU run")

CASE = consecutive_case(seqs=[(1, 20), (1, 16)], q_heads=2, kv_heads=1, head_size=32)


@pytest.mark.parametrize("name", ["plain", "libdevice", "pdl"])
def test_aliases_libdevice_math_and_pdl_run_under_the_interpreter(name):
    """``tl_exp = tl.exp`` (and ``from triton.language import maximum``) in an imported module,
    libdevice's exp, grid dependency control: each PASSes as it would on a GPU."""
    outcome = check(getattr(aliased_kernels, name), CASE, "cpu")
    assert outcome.verdict.value == "PASS", outcome.summary


def test_without_the_rebinding_the_same_launch_is_refused_naming_the_builtin(monkeypatch):
    """The subject really calls builtins by names the interpreter never patches; unmade, that is the
    interpreter's limit (a usage error naming the builtin), not the kernel's CRASH."""
    import importlib

    monkeypatch.setattr(runs, "interpretable_launches", lambda interpreter: contextlib.nullcontext())
    bare = importlib.reload(aliased_kernels)  # its names as they were imported
    try:
        with pytest.raises(NanfuzzError, match=r"cannot run under Triton's interpreter: tl\.core\.where is called by "
                                               r"a name the interpreter does not patch"):
            check(bare.plain, CASE, "cpu")
    finally:
        importlib.reload(aliased_kernels)


def test_a_bug_behind_aliases_is_still_caught():
    outcome = check(aliased_kernels.unmasked_v, CASE, "cpu")
    assert outcome.verdict.value == "NONFINITE" and "tail" in outcome.summary


def test_what_the_interpreter_cannot_run_is_a_usage_error_naming_it(tmp_path, monkeypatch, capsys):
    with pytest.raises(NanfuzzError, match=r"cannot run under Triton's interpreter: inline_asm not supported"):
        check(aliased_kernels.inline_asm, CASE, "cpu")
    monkeypatch.chdir(tmp_path)
    code = main(["fuzz", "--kernel", "tests.aliased_kernels:inline_asm", "--device", "cpu", "--max-examples", "3",
                 "--seed", "1", "--no-isolation"])
    err = capsys.readouterr().err
    assert code == 2 and "cannot run under Triton's interpreter" in err and "CRASH" not in err
    assert not list(tmp_path.rglob("*.json"))  # no repro: it is no finding


def test_a_kernel_s_own_error_stays_its_crash():
    """Only the interpreter's refusals are usage errors: a ValueError of the kernel's own is its CRASH."""
    def raises(batch, out):
        raise ValueError("the kernel's own bug")

    from nanfuzz.harness.kernel import Kernel

    outcome = check(Kernel("raises", raises, aliased_kernels.CAPS), CASE, "cpu")
    assert outcome.verdict.value == "CRASH" and "the kernel's own bug" in outcome.summary


def test_load_kernel_files_makes_a_module_s_aliases_run(tmp_path):
    """A file loaded by the public loader runs under the interpreter outside nanfuzz's launches too."""
    package = tmp_path / "mylib" / "ops"
    package.mkdir(parents=True)
    (package / "scale.py").write_text(textwrap.dedent("""
        import triton
        import triton.language as tl

        tl_exp2 = tl.exp2

        @triton.jit
        def _kernel(X, Y):
            offsets = tl.arange(0, 16)
            tl.store(Y + offsets, tl_exp2(tl.load(X + offsets)))

        def exp2(x, y):
            _kernel[(1,)](x, y)
    """))
    import torch

    files = load_kernel_files(tmp_path, ["mylib.ops.scale"])
    x, y = torch.arange(16, dtype=torch.float32) / 4, torch.empty(16)
    with files.active():
        files["mylib.ops.scale"].exp2(x, y)
    assert torch.allclose(y, torch.exp2(x))
    assert files["mylib.ops.scale"].tl_exp2 is not __import__("triton").language.exp2


def test_libdevice_and_ocml_names_map_to_numpy_s_functions():
    for symbol, name in (("__nv_tanhf", "tanh"), ("__nv_tanh", "tanh"), ("__nv_fast_fdividef", "fdivide"),
                         ("__ocml_tanh_f32", "tanh"), ("__nv_expf", "exp")):
        assert interpreter_builtins._math_name(symbol) == name and name in interpreter_builtins.LIBDEVICE_MATH
    assert interpreter_builtins._math_name("__nv_erfinvf") not in interpreter_builtins.LIBDEVICE_MATH


def test_a_scalar_held_in_a_one_element_array_indexes_as_its_element(monkeypatch):
    # Triton 3.6's interpreter converts a scalar used as an integer with int() of its array, which
    # NumPy 2.4 refuses for a one-element array (lmdeploy's prefill loops over range(loop_start, ...))
    import operator
    import types
    import warnings

    import numpy as np
    from triton.runtime import interpreter

    def like_triton_3_6(tensor, scope):
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", like_triton_3_6)

    class Scalar:
        def __init__(self, data):
            self.handle = types.SimpleNamespace(data=data)

    scope = interpreter._LangPatchScope()
    with warnings.catch_warnings(), interpreter_builtins.interpretable_launches():
        warnings.simplefilter("error")  # an older NumPy only warns
        interpreter._patch_lang_tensor(Scalar, scope)
        try:
            assert operator.index(Scalar(np.array([5], dtype=np.int32))) == 5
            assert list(range(Scalar(np.array(2)), Scalar(np.array([4])))) == [2, 3]
        finally:
            scope.restore()
    assert interpreter._patch_lang_tensor is like_triton_3_6  # put back after the launches
