"""A shrunk failure in a windowed sequence loses the dead blocks below its window where it fails the
same without them (``harness.campaign.expired_blocks``), and is left as it is otherwise."""
from nanfuzz.harness.campaign.expired_blocks import cut, drop_expired_blocks
from nanfuzz.harness.campaign.focus import Focus
from nanfuzz.harness.campaign.result import Campaign
from nanfuzz.harness.campaign.runner import fuzz
from nanfuzz.harness.judge.check import check
from nanfuzz.harness.judge.outcome import Outcome, Verdict
from nanfuzz.harness.kernel import Kernel
from nanfuzz.harness.launch.worker import Declined
from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.case import Poison, PoisonSite
from nanfuzz.reference.semantics import liveness
from tests.cases import consecutive_case
from tests.torch_kernels import torch_kernel

# a decode over 1,100 keys whose window of 5 leaves 68 whole dead blocks of 16 below it, beside a
# prefill of 40 keys whose window leaves it two
CASE = consecutive_case(((1, 1100), (3, 40)), q_heads=1, kv_heads=1, head_size=32, window=5)
KERNEL = Kernel("stub", lambda batch, out: None, Capabilities())


def _campaign(verdict: Verdict, case=CASE) -> Campaign:
    return Campaign("stub", "cpu", failure=Outcome(verdict, f"{verdict.name}: found"), failing_case=case)


def _lengths(case):
    return [(s.query_len, s.seq_len) for s in case.sequences]


class Stub:
    """A check that fails, with ``verdict``, every case whose first sequence's length is that of the
    long one modulo ``modulo`` keys (every cut keeps it modulo the block size), and passes the others."""

    def __init__(self, verdict: Verdict, modulo: int = 16, answer=None):
        self.verdict, self.modulo, self.answer, self.cases = verdict, modulo, answer, []

    def __call__(self, case):
        self.cases.append(case)
        if self.answer is not None:
            return self.answer
        fails = case.sequences[0].seq_len % self.modulo == 1100 % self.modulo
        return Outcome(self.verdict, "again") if fails else Outcome(Verdict.PASS, "PASS")


def test_a_cut_moves_every_live_key_up_by_whole_dead_blocks():
    shorter = cut(CASE, 1)
    assert _lengths(shorter) == [(1, 12), (3, 8)]  # 68 and 2 blocks of 16 keys cut
    long, prefill = CASE.sequences
    assert shorter.sequences[0].block_table == long.block_table[68:] + (CASE.padding_block,) * 68
    assert shorter.sequences[1].block_table == prefill.block_table[2:] + (CASE.padding_block,) * 2
    # the same physical slots hold the live keys, at the same offsets in their blocks
    assert (liveness(shorter) == liveness(CASE)).all()
    assert _lengths(cut(CASE, 256)) == [(1, 1100 - 1024), (3, 40)]  # a multiple of 256 keys: 64 blocks
    assert cut(consecutive_case(((1, 1100),), window=0), 1) is None  # no window: nothing is dead below it
    assert cut(consecutive_case(((1, 20),), window=5), 1) is None  # no whole block below the window


def test_a_cut_may_keep_the_dead_blocks_the_poison_sits_in_below_the_window():
    poisoned = consecutive_case(((1, 100),), window=5, poison=Poison(sites=(PoisonSite(block=1, offset=0),)))
    kept = cut(poisoned, 1, keep_poisoned=True)  # 4 of the 5 dead blocks cut, block 1 moved up
    assert _lengths(kept) == [(1, 36)] and kept.sequences[0].block_table[:3] == (1, 6, 7)
    assert kept.poison.sites == poisoned.poison.sites and not liveness(kept)[1].any()
    assert _lengths(cut(poisoned, 1)) == [(1, 20)]  # every dead block: the poisoned one in no table now


def test_the_shortest_cut_that_fails_the_same_becomes_the_repro():
    campaign, stub = _campaign(Verdict.NONFINITE), Stub(Verdict.NONFINITE)
    assert drop_expired_blocks(campaign, Capabilities(), stub, KERNEL, interpreter=True)
    assert _lengths(campaign.failing_case) == [(1, 12), (3, 8)] and campaign.failure.summary == "again"
    assert len(stub.cases) == 1
    assert any("(1140 keys, 20 left)" in note for note in campaign.notes)


def test_a_cut_that_keeps_positions_modulo_a_tile_is_tried_when_the_shortest_passes():
    campaign, stub = _campaign(Verdict.NONFINITE), Stub(Verdict.NONFINITE, modulo=256)
    assert drop_expired_blocks(campaign, Capabilities(), stub, KERNEL, interpreter=True)
    assert _lengths(campaign.failing_case) == [(1, 76), (3, 40)] and len(stub.cases) == 2


def test_a_cut_failing_another_way_passing_or_declined_leaves_the_failure_as_it_was():
    for answer in (Outcome(Verdict.MISMATCH, "other"), Outcome(Verdict.PASS, "PASS"), Declined("memory")):
        campaign, stub = _campaign(Verdict.NONFINITE), Stub(Verdict.NONFINITE, answer=answer)
        assert not drop_expired_blocks(campaign, Capabilities(), stub, KERNEL, interpreter=True)
        assert campaign.failing_case is CASE and campaign.failure.summary == "NONFINITE: found" and not campaign.notes
        assert len(stub.cases) == 2  # each distinct cut once: 68 blocks, then 64 (a multiple of 256 and of 1024)


def test_nothing_is_tried_for_a_hang_a_windowless_case_or_a_cut_the_kernel_does_not_take():
    stub = Stub(Verdict.HANG)
    hang = _campaign(Verdict.HANG)
    assert not drop_expired_blocks(hang, Capabilities(), stub, KERNEL, interpreter=True)
    windowless = _campaign(Verdict.NONFINITE, consecutive_case(((1, 1100),), window=0))
    assert not drop_expired_blocks(windowless, Capabilities(), stub, KERNEL, interpreter=True)
    declining = Kernel("stub", lambda batch, out: None, Capabilities(), supports=lambda case: "long sequences only"
                       if case.max_seq_len < 1000 else None)
    assert not drop_expired_blocks(_campaign(Verdict.NONFINITE), Capabilities(), stub, declining, interpreter=True)
    assert stub.cases == [] and hang.failing_case is CASE


def test_a_kernel_s_window_bug_met_far_from_position_0_keeps_failing_a_few_keys_in():
    kernel = torch_kernel("window-off-by-one")  # each query misses its window's earliest key
    found = check(kernel, CASE)
    assert found.verdict is Verdict.MISMATCH
    campaign = Campaign(kernel.name, "cpu", failure=found, failing_case=CASE)
    assert drop_expired_blocks(campaign, kernel.capabilities, lambda case: check(kernel, case), kernel, True)
    assert _lengths(campaign.failing_case) == [(1, 12), (3, 8)] and campaign.failure.verdict is Verdict.MISMATCH


def test_a_campaign_s_repro_of_a_window_bug_met_in_a_long_batch_is_a_few_blocks_long(tmp_path):
    # seed 3 meets the NaN of a dead block far below a long batch's window, and Hypothesis shrinks that
    # batch only to its floor of 1,025 keys: the block the poison sits in stays, the others go
    campaign = fuzz(torch_kernel("mask-multiply"), device="cpu", max_examples=300, seed=3, use_database=False,
                    state_dir=tmp_path, focus=Focus(poison_classes=("out-of-window",)))
    assert campaign.failed and _lengths(campaign.failing_case) == [(1, 33)], _lengths(campaign.failing_case)
    assert any("(1025 keys, 33 left)" in note for note in campaign.notes), campaign.notes
