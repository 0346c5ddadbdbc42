"""Under Triton's interpreter the default campaign draws, at a steady share, batches larger than its
usual ones (more than four sequences, more than 1024 keys), and catches the kernels that are wrong
only in such batches."""
import json
from dataclasses import replace

import pytest

from nanfuzz.harness.campaign.runner import fuzz
from nanfuzz.harness.campaign.scope import campaign_capabilities, campaign_strategy, campaign_tier
from nanfuzz.harness.campaign.search import chunk_seed
from nanfuzz.harness.campaign.settings import Settings
from nanfuzz.harness.campaign.upcoming import upcoming_cases
from nanfuzz.harness.cli import main
from nanfuzz.harness.judge.check import Verdict, check
from nanfuzz.harness.registry import builtin_kernels
from nanfuzz.harness.report.repro import load_repro
from nanfuzz.reference.case import Case, Geometry, Poison, Sequence
from nanfuzz.strategies.batches import Lengths
from nanfuzz.strategies.cases import INTERPRETER_LONG, INTERPRETER_SIZE, _lengthened, paged_cases
from tests import production_kernels


def _long(case: Case) -> bool:
    return len(case.sequences) > 4 and case.max_seq_len > 1000


def _first_cases(kernel_name: str, seed: int, count: int) -> tuple[Case, ...]:
    """The first ``count`` cases a default CPU campaign of ``kernel_name`` with ``seed`` draws."""
    kernel = builtin_kernels()[kernel_name]
    settings = Settings(device="cpu")
    caps, _ = campaign_capabilities(kernel, settings)
    tier = campaign_tier(kernel, settings)
    assert tier == "small"
    return upcoming_cases(campaign_strategy(caps, settings, None, tier), chunk_seed(seed, 0), count, count)


@pytest.mark.parametrize("kernel_name", ["paged_decode@masked", "unified@masked"])
def test_a_default_cpu_campaign_draws_long_batches_at_a_steady_share(kernel_name):
    shares = []
    for seed in range(3):
        cases = _first_cases(kernel_name, seed, 300)
        long = [c for c in cases if _long(c)]
        shares.append(len(long) / len(cases))
        for case in long:  # within what the interpreter runs in seconds
            assert len(case.sequences) <= INTERPRETER_LONG.max_sequences
            assert case.max_seq_len <= INTERPRETER_LONG.max_keys
    # one batch in eight is drawn long, in clumps: measured 3% to 14% of 300 in a run
    assert min(shares) >= 0.02 and sum(shares) / len(shares) >= 0.05, shares


def test_the_usual_batches_alone_never_hold_one():
    from hypothesis import HealthCheck, given, settings

    usual = replace(INTERPRETER_SIZE, long=None)
    seen = []

    @settings(max_examples=300, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(paged_cases(production_kernels.CAPS, interpreter=True, size=usual))
    def collect(case):
        seen.append(case)

    collect()
    assert not any(_long(c) for c in seen) and max(len(c.sequences) for c in seen) <= 4


# decode sequences 0-5 in blocks of their own; sequence 4 holds 1100 keys
_TABLE = ((1,), (2,), (3,), (4,), tuple(range(5, 74)), (74,))
LONG_BATCH = Case(Geometry(2, 1, 32, 16, 76, "float16"),
                  tuple(Sequence(1, 1100 if s == 4 else 9, row + (75,) * (69 - len(row)))
                        for s, row in enumerate(_TABLE)),
                  padding_block=75, poison=Poison("nan", "kv", None), data_seed=2).validate()
USUAL_BATCH = LONG_BATCH.replace(sequences=LONG_BATCH.sequences[:4])


@pytest.mark.parametrize("kernel", [production_kernels.late_sequences, production_kernels.drops_long_tail],
                         ids=lambda k: k.name)
def test_kernels_wrong_only_in_long_batches_pass_the_usual_ones_and_fail_a_long_one(kernel):
    assert check(production_kernels.correct, LONG_BATCH, "cpu").verdict is Verdict.PASS
    assert check(kernel, USUAL_BATCH, "cpu").verdict is Verdict.PASS
    assert check(kernel, LONG_BATCH, "cpu").verdict is not Verdict.PASS


@pytest.mark.parametrize("kernel", [production_kernels.late_sequences, production_kernels.drops_long_tail],
                         ids=lambda k: k.name)
def test_a_default_cpu_campaign_catches_kernels_wrong_only_in_long_batches(kernel, tmp_path):
    default = replace(kernel, size=None)  # the interpreter's default tier, not the kernel's own production one
    campaign = fuzz(default, device="cpu", max_examples=300, seed=0, use_database=False, state_dir=tmp_path)
    assert campaign.failed and campaign.failure.verdict in (Verdict.MISMATCH, Verdict.NONFINITE)
    case = campaign.failing_case
    if kernel is production_kernels.drops_long_tail:  # shrunk within the long batches, then cut to its long one
        assert len(case.sequences) == 1 and 1024 < case.max_seq_len < 1100
        assert any(f"of {INTERPRETER_LONG.min_sequences} fails alone" in note for note in campaign.notes)
    else:  # a bug of late sequences needs them all: shrunk within the long batches, to their fewest sequences
        assert len(case.sequences) == INTERPRETER_LONG.min_sequences


def test_a_long_batch_s_first_sequence_ends_in_the_slot_its_usual_length_ends_in():
    caps = production_kernels.CAPS
    for block_size in (1, 16, 48, 64):
        for keys in (INTERPRETER_LONG.min_keys, 1100, INTERPRETER_LONG.max_keys):
            for usual in (Lengths(1, 37), Lengths(3, 40), Lengths(1, 64)):
                first = _lengthened([usual], keys, [], INTERPRETER_LONG, caps, block_size)[0]
                assert first.seq_len % block_size == usual.seq_len % block_size
                assert INTERPRETER_LONG.min_keys <= first.seq_len <= INTERPRETER_LONG.max_keys


def test_a_tail_bug_met_in_a_long_batch_shrinks_out_of_it(tmp_path, monkeypatch):
    # this seed's campaign meets tail-masked's NaN in a long batch, whose first sequence then ended
    # in another slot than its usual length: the shrink stopped at 1,025 keys (65 once the blocks
    # below its window were cut); with the same tail, the usual batch fails too and the shrink goes on
    monkeypatch.setenv("NANFUZZ_PROFILE", "dev")  # CI's profile derandomizes: every seed is 0
    summary = tmp_path / "summary.json"
    code = main(["fuzz", "--kernel", "paged_decode@tail-masked", "--device", "cpu", "--seed", "1883984659",
                 "--state-dir", str(tmp_path), "--summary-json", str(summary)])
    (entry,) = json.loads(summary.read_text())["kernels"]
    assert code == 1 and entry["verdict"] == "NONFINITE", entry["summary"]
    case = load_repro(next(path for path in entry["repro"] if path.endswith(".json")))["case"]
    assert case.max_seq_len <= 16, case.sequences
    assert not any("cut from the front" in note for note in entry["notes"]), entry["notes"]
