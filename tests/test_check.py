"""Every verdict fires on the defect it names, and a correct kernel passes."""
import pytest

from nanfuzz.harness.check import Verdict, check
from nanfuzz.reference.case import Case, Geometry, Poison, PoisonSite, Sequence
from tests.torch_kernels import torch_kernel

G = Geometry(4, 2, 32, 8, 8, "float32")
# seq 0: decode at position 19, window 6 -> keys 14..19 live; seq 1: chunked prefill
WINDOWED = Case(G, (Sequence(1, 20, (1, 2, 3)), Sequence(3, 11, (4, 5, 7))), sliding_window=6,
                padding_block=7, poison=Poison("nan", "kv", None), data_seed=5).validate()


@pytest.mark.parametrize("bug, verdict", [
    (None, Verdict.PASS),
    ("raise", Verdict.CRASH),
    ("mask-multiply", Verdict.NONFINITE),
    ("window-off-by-one", Verdict.MISMATCH),
    ("head-map", Verdict.MISMATCH),
    ("clobber", Verdict.CLOBBER),
    ("clobber-input", Verdict.CLOBBER),
])
def test_verdicts(bug, verdict):
    outcome = check(torch_kernel(bug), WINDOWED, "cpu")
    assert outcome.verdict is verdict, outcome.summary
    assert "\n" not in outcome.summary


def test_leak_is_found_with_finite_poison_only():
    finite = WINDOWED.replace(poison=Poison("garbage", "k", None))
    outcome = check(torch_kernel("additive-mask"), finite, "cpu")
    assert outcome.verdict in (Verdict.LEAK, Verdict.NONFINITE), outcome.summary
    quiet = WINDOWED.replace(poison=Poison("garbage", "v", (PoisonSite(6, 0),)))
    assert check(torch_kernel("additive-mask"), quiet, "cpu").verdict is Verdict.LEAK


def test_nonfinite_evidence_names_rows_and_reachable_poison():
    tail_only = WINDOWED.replace(poison=Poison("nan", "v", (PoisonSite(3, 4),)))  # seq 0: key 20, the tail
    outcome = check(torch_kernel("mask-multiply"), tail_only, "cpu")
    assert outcome.verdict is Verdict.NONFINITE
    assert outcome.evidence["sequences"] == [0]
    assert outcome.evidence["reachable_poison"]["0"] == {"tail": [[3, 4, 4]]}
    assert "tail" in outcome.summary


def test_correct_kernel_output_is_reproducible_bit_for_bit():
    a = check(torch_kernel(), WINDOWED, "cpu")
    b = check(torch_kernel(), WINDOWED, "cpu")
    assert a.verdict is Verdict.PASS and a.output_sha256 == b.output_sha256
