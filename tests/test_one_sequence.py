"""A shrunk failure is cut down to one of its sequences where that one alone fails the same way
(``harness.campaign.one_sequence``), and left as it is otherwise."""
from dataclasses import replace

from hypothesis.database import DirectoryBasedExampleDatabase

from nanfuzz.harness.api import check
from nanfuzz.harness.campaign import known_failures
from nanfuzz.harness.campaign.one_sequence import MOST_TRIED, alone, cut_to_one_sequence
from nanfuzz.harness.campaign.result import Campaign
from nanfuzz.harness.campaign.runner import fuzz
from nanfuzz.harness.judge.outcome import Outcome, Verdict
from nanfuzz.harness.kernel import Kernel
from nanfuzz.harness.launch.worker import Declined
from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.semantics import slot_liveness
from tests import production_kernels
from tests.cases import consecutive_case

SHORT, LONG, PREFILL = (1, 1), (1, 1025), (3, 40)
CASE = consecutive_case((SHORT, LONG, PREFILL), q_heads=1, kv_heads=1, head_size=32)
KERNEL = Kernel("stub", lambda batch, out: None, Capabilities())


def _campaign(verdict: Verdict) -> Campaign:
    return Campaign("stub", "cpu", failure=Outcome(verdict, f"{verdict.name}: found"), failing_case=CASE)


class Stub:
    """A check that fails, with ``verdict``, every case holding the long sequence, and passes the others."""

    def __init__(self, verdict: Verdict, answer=None):
        self.verdict, self.answer, self.cases = verdict, answer, []

    def __call__(self, case):
        self.cases.append(case)
        if self.answer is not None:
            return self.answer
        fails = any(s.seq_len == LONG[1] for s in case.sequences)
        return Outcome(self.verdict, "again") if fails else Outcome(Verdict.PASS, "PASS")


def _lengths(case):
    return [(s.query_len, s.seq_len) for s in case.sequences]


def test_the_sequence_that_fails_alone_becomes_the_repro():
    campaign, check = _campaign(Verdict.MISMATCH), Stub(Verdict.MISMATCH)
    cut_to_one_sequence(campaign, Capabilities(), check, KERNEL, interpreter=True)
    assert _lengths(campaign.failing_case) == [LONG] and campaign.failure.summary == "again"
    assert len(check.cases) == 1  # the longest is tried first
    assert any("sequence 1 of 3 fails alone" in note for note in campaign.notes)
    # the blocks of the sequences left out are dead now, and poisoned as every dead slot is
    live = slot_liveness(campaign.failing_case)
    assert not any(any(live[block]) for block in CASE.sequences[0].block_table[:1] + CASE.sequences[2].block_table[:3])


def test_a_sequence_alone_failing_another_way_leaves_the_failure_as_it_was():
    for answer in (Outcome(Verdict.NONFINITE, "other"), Outcome(Verdict.PASS, "PASS"), Declined("memory")):
        campaign, check = _campaign(Verdict.MISMATCH), Stub(Verdict.MISMATCH, answer)
        cut_to_one_sequence(campaign, Capabilities(), check, KERNEL, interpreter=True)
        assert campaign.failing_case is CASE and campaign.failure.summary == "MISMATCH: found" and not campaign.notes
        assert len(check.cases) == min(3, MOST_TRIED)


def test_nothing_is_tried_for_a_hang_one_sequence_or_a_case_the_kernel_does_not_take():
    hang, check = _campaign(Verdict.HANG), Stub(Verdict.HANG)
    cut_to_one_sequence(hang, Capabilities(), check, KERNEL, interpreter=True)
    one = Campaign("stub", "cpu", failure=Outcome(Verdict.MISMATCH, "x"), failing_case=alone(CASE, 1))
    cut_to_one_sequence(one, Capabilities(), check, KERNEL, interpreter=True)
    declining = Kernel("stub", lambda batch, out: None, Capabilities(), supports=lambda case: "two or more sequences")
    cut_to_one_sequence(_campaign(Verdict.MISMATCH), Capabilities(), check, declining, interpreter=True)
    assert check.cases == [] and hang.failing_case is CASE


def test_a_campaign_s_repro_of_a_long_sequence_bug_is_that_sequence_alone(tmp_path):
    # seed 0's shrunk case keeps a one-key first sequence beside the long one (Hypothesis shrinks them apart)
    campaign = fuzz(production_kernels.drops_long_tail, device="cpu", max_examples=60, seed=0, use_database=True,
                    state_dir=tmp_path / "shrunk")
    assert campaign.failed and _lengths(campaign.failing_case) == [(1, 1025)], _lengths(campaign.failing_case)
    assert any("sequence 1 of 2 fails alone with the same verdict" in note for note in campaign.notes)
    # the next campaign replays both first: the shrunk case, remembered before the cut's runs, and the cut one
    database = DirectoryBasedExampleDatabase(str(tmp_path / "shrunk" / "examples"))
    kept = [_lengths(case) for _, case in known_failures.known(database, known_failures.key(
        production_kernels.drops_long_tail.name, "cpu", ""))]
    assert sorted(kept) == [[(1, 1), (1, 1025)], [(1, 1025)]], kept
    as_found = fuzz(production_kernels.drops_long_tail, device="cpu", max_examples=60, seed=0, use_database=False,
                    state_dir=tmp_path / "unshrunk", shrink=False)
    assert as_found.failed and not any("fails alone" in note for note in as_found.notes)


def test_a_sequence_cut_alone_keeps_its_queries_values():
    # three one-key sequences before the long one, whose failure rests on its numbers: alone under index 0
    # its queries take other values and it passes; under its key from the batch it fails as in the batch
    case = consecutive_case((SHORT, SHORT, SHORT, LONG), q_heads=1, kv_heads=1, head_size=32, seed=0)
    kernel = production_kernels.drops_long_tail

    def judge(c):
        return check(kernel, c, device="cpu")

    found = judge(case)
    assert found.verdict is Verdict.MISMATCH
    assert judge(replace(alone(case, 3), query_keys=None)).verdict is Verdict.PASS
    campaign = Campaign(kernel.name, "cpu", failure=found, failing_case=case)
    cut_to_one_sequence(campaign, kernel.capabilities, judge, kernel, interpreter=True)
    assert _lengths(campaign.failing_case) == [LONG] and campaign.failing_case.query_keys == (3,)
    assert campaign.failure.verdict is Verdict.MISMATCH
    assert any("sequence 3 of 4 fails alone with the same verdict" in note for note in campaign.notes)
