"""A finding that hangs on one declared capability names the field: a wrong declaration is told from a bug."""
from __future__ import annotations

import dataclasses
import json

import nanfuzz
from nanfuzz.harness.cli import main
from nanfuzz.harness.kernel import Kernel
from tests.torch_kernels import CAPS, attention


def _ignores_windows(batch, out):
    """A kernel without windows, declared as if it had them (the default)."""
    unwindowed = dataclasses.replace(batch, case=dataclasses.replace(batch.case, sliding_window=0))
    return attention(unwindowed, out)


IGNORES_WINDOWS = Kernel("torch@ignores-windows", _ignores_windows, CAPS)
MASK_MULTIPLY = Kernel("torch@mask-multiply", lambda b, o: attention(b, o, bug="mask-multiply"), CAPS)


def test_a_kernel_that_ignores_windows_is_told_to_declare_none():
    campaign = nanfuzz.fuzz(IGNORES_WINDOWS, device="cpu", max_examples=200, seed=2, isolation=False,
                            use_database=False)
    # it reads the expired slots (NONFINITE) or weighs them (MISMATCH, LEAK): windowed cases only
    assert campaign.failed and campaign.failure.evidence["capability"] == "sliding_window"
    assert any("declare Capabilities(sliding_window=False)" in note for note in campaign.notes)


def test_on_a_variant_expected_to_be_caught_the_note_explains_the_bug_and_advises_nothing():
    old_variant = dataclasses.replace(IGNORES_WINDOWS, expect="caught")
    campaign = nanfuzz.fuzz(old_variant, device="cpu", max_examples=200, seed=2, isolation=False,
                            use_database=False)
    assert campaign.failed and campaign.failure.evidence["capability"] == "sliding_window"
    assert not any("declare Capabilities(" in note for note in campaign.notes), campaign.notes
    assert any("fails only with sliding windows: the same case without them passes, so what this variant gets "
               "wrong is its handling of sliding windows" in note for note in campaign.notes), campaign.notes


def test_a_bug_that_is_no_capability_s_names_none():
    campaign = nanfuzz.fuzz(MASK_MULTIPLY, device="cpu", max_examples=200, seed=2, isolation=False,
                            use_database=False)
    assert campaign.failed and "capability" not in campaign.failure.evidence


def test_a_kernel_that_declines_the_case_without_its_window_keeps_its_finding_and_repro(tmp_path, capsys):
    state = tmp_path / "state"
    argv = ["fuzz", "--kernel", "tests.subjects:windowed_only_ignores_windows", "--device", "cpu", "--max-examples",
            "200", "--seed", "2", "--state-dir", str(state), "--summary-json", str(tmp_path / "summary.json")]
    assert main(argv) == 1, capsys.readouterr().err  # its supports() turns down the hint's window-less case
    (entry,) = json.loads((tmp_path / "summary.json").read_text())["kernels"]
    assert entry["repro"] and (state / "repros").is_dir() and "capability" not in entry["evidence"]
