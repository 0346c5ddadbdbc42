"""A campaign aimed at windowed cases only (``--window-only``, ``window_only=True``, and
``--poison out-of-window`` alone), and ``nanfuzz.fuzz``'s keywords: the command line's options."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import nanfuzz
from nanfuzz.harness.campaign.focus import Focus
from nanfuzz.harness.campaign.options import KEYWORDS, split_options
from nanfuzz.harness.cli import main
from nanfuzz.harness.gate.run import parse_args
from nanfuzz.harness.kernels._common import INTERPRETED
from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.errors import NanfuzzError
from nanfuzz.strategies.production import wide_entries
from nanfuzz.strategies.specialisations import specialisation_pool
from tests.cases import drawn_cases
from tests.torch_kernels import CAPS

# a kernel that windows only its causal mode, as lmdeploy's prefill and ROCM_ATTN do
CAUSAL_WINDOWS = Capabilities(non_causal=True, non_causal_window=False)


def test_window_only_draws_a_window_in_every_case_and_only_modes_that_take_one():
    aimed = Focus(window_only=True).apply(CAUSAL_WINDOWS, "k")
    cases = drawn_cases(aimed, 40)
    assert all(c.sliding_window >= 1 and c.causal for c in cases)
    everything = drawn_cases(CAUSAL_WINDOWS, 40)  # sensitivity: unaimed, the same search draws both
    assert any(c.sliding_window == 0 for c in everything) and any(not c.causal for c in everything)
    assert "window-only" in aimed.describe() and aimed.unsupported(everything[0].replace(sliding_window=0))


def test_pools_and_production_entries_follow_it():
    aimed = Focus(window_only=True).apply(CAPS, "k")
    assert all(entry.window for entry in specialisation_pool(aimed, 8, seed=3, interpreter=True))
    assert all(entry.window for entry in wide_entries(aimed, 6, seed=3, interpreter=True))
    assert any(not entry.window for entry in specialisation_pool(CAPS, 8, seed=3, interpreter=True))


def test_poisoning_out_of_window_slots_alone_implies_it():
    assert Focus(poison_classes=("out-of-window",)).apply(CAPS, "k").window_only
    assert not Focus(poison_classes=("out-of-window", "tail")).apply(CAPS, "k").window_only
    with pytest.raises(NanfuzzError, match=r"--no-window and --poison out-of-window .* exclude each other"):
        Focus(poison_classes=("out-of-window",), no_window=True).apply(CAPS, "k")
    with pytest.raises(NanfuzzError, match="--window-only: kernel k takes no sliding window in the modes asked for"):
        Focus(window_only=True, non_causal_only=True).apply(CAUSAL_WINDOWS, "k")


def test_fuzz_takes_the_command_line_s_options_by_keyword():
    """``poison=`` was a TypeError; now every focus option is a keyword, checked like the CLI's."""
    campaign = nanfuzz.fuzz("tests.torch_kernels:correct", device="cpu", poison="out-of-window", max_examples=6,
                            seed=2, isolation=False, use_database=False)
    assert not campaign.failed and campaign.examples == 6
    # every case windowed; those whose window reaches back to key 0 have no out-of-window slot
    assert campaign.statistics.share("window") == 1.0 and campaign.statistics.share("poison:out-of-window") > 0
    assert split_options({"window_only": True, "dtype": "float16"})["focus"] == Focus(window_only=True,
                                                                                       dtype="float16")
    assert {"poison", "window_only", "max_examples", "lmdeploy_src", "kv_cache_dtype"} <= set(KEYWORDS)


def test_an_unknown_keyword_is_one_error_naming_the_known_ones():
    with pytest.raises(NanfuzzError, match=r"nanfuzz.fuzz\(\) takes no option 'poisson' \(did you mean poison\?\); "
                                           r"known: .*window_only"):
        nanfuzz.fuzz("tests.torch_kernels:correct", device="cpu", poisson="tail")
    with pytest.raises(NanfuzzError, match=r"poison='dead' is not a dead-slot class .* known: tail, out-of-window"):
        nanfuzz.fuzz("tests.torch_kernels:correct", device="cpu", poison="dead")


def test_the_command_line_and_the_gate_take_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["fuzz", "--kernel", "tests.torch_kernels:correct", "--window-only", "--no-window"]) == 2
    assert "--no-window and --window-only exclude each other" in capsys.readouterr().err
    assert main(["fuzz", "--kernel", "tests.aliased_kernels:plain", "--window-only", "--device", "cpu"]) == 2
    assert "--window-only: kernel aliased@plain takes no sliding window" in capsys.readouterr().err
    assert parse_args(["--window-only"]).window_only and not parse_args([]).window_only


def test_a_gate_shard_with_the_plan_s_window_only_draws_windows(tmp_path, monkeypatch):
    import time

    from nanfuzz.harness.gate.plan import Plan
    from nanfuzz.harness.gate.shard import run_shard

    monkeypatch.chdir(tmp_path)
    kernel = "tests.torch_kernels:correct"
    plan = Plan(device="cpu", profile="pr-gate", kernels=[kernel], slots=["w0"], deadline=time.time() + 120,
                max_examples=4, state_dir=str(tmp_path / "state"), work_dir=str(tmp_path / "work"), window_only=True)
    record = run_shard(plan, kernel, "w0", "cpu")
    masks = record.statistics["groups"]["masks and windows"]
    assert record.verdict == "PASS" and record.examples == 4 and masks["window"]["share"] == 1.0


@pytest.mark.skipif(not INTERPRETED, reason="a CPU campaign in a pytest of its own")
def test_the_pytest_plugin_aims_campaigns_at_windows(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_windows.py").write_text(textwrap.dedent("""
        def test_windows(nanfuzz):
            campaign = nanfuzz.fuzz("paged_decode@masked", max_examples=3, use_database=False)
            assert campaign.statistics.share("window") == 1.0
    """))
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH", "PYTEST_ADDOPTS")
           and not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--nanfuzz-device", "cpu",
                           "--nanfuzz-window-only"], cwd=tmp_path, env={**env, "NANFUZZ_STATE_DIR": str(tmp_path / "s")},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
