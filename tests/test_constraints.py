"""Constraints real kernels have: the narrowest window, one query length per batch, and the decline hook."""
from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, find, settings

from nanfuzz.harness.campaign.runner import fuzz
from nanfuzz.harness.judge.check import check
from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.errors import NanfuzzError
from nanfuzz.strategies import paged_cases
from nanfuzz.strategies.cases import campaign_pool
from tests import planted_errors
from tests.cases import drawn_cases

FIND = settings(database=None, max_examples=2000, suppress_health_check=list(HealthCheck))


def _drawn(caps: Capabilities, n: int = 150) -> list:
    return drawn_cases(caps, n)


def _scheduled_query_lens(case) -> set[int]:
    return {s.query_len for s in case.sequences if s.query_len}


def test_min_window_leaves_narrower_windows_out_and_shrinks_to_the_narrowest():
    caps = Capabilities(min_window=2, non_causal=True)
    windows = [c.sliding_window for c in _drawn(caps)]
    assert 1 not in windows and 2 in windows and max(windows) > 2
    assert find(paged_cases(caps, interpreter=True), lambda c: c.sliding_window > 0, settings=FIND).sliding_window == 2
    # sensitivity: without the constraint the one-key window is drawn, and is where shrinking goes
    assert 1 in [c.sliding_window for c in _drawn(Capabilities())]
    assert find(paged_cases(Capabilities(), interpreter=True), lambda c: c.sliding_window > 0,
                settings=FIND).sliding_window == 1


def test_a_pool_holds_no_window_narrower_than_min_window():
    pool = campaign_pool(Capabilities(min_window=3, non_causal=True), 16, seed=4)
    assert {entry.window for entry in pool} - {0} and min(entry.window for entry in pool if entry.window) == 3


def test_uniform_query_len_gives_every_scheduled_sequence_one_query_length_and_still_shrinks():
    caps = Capabilities(uniform_query_len=True, max_query_len=4)
    cases = _drawn(caps)
    assert all(len(_scheduled_query_lens(c)) == 1 for c in cases)
    assert {q for c in cases for q in _scheduled_query_lens(c)} == {1, 2, 3, 4}
    assert any(s.query_len == 0 for c in cases for s in c.sequences)  # padding sequences still come
    several = find(paged_cases(caps, interpreter=True),
                   lambda c: sum(1 for s in c.sequences if s.query_len) >= 2 and c.max_query_len >= 2, settings=FIND)
    assert [s.query_len for s in several.sequences] == [2, 2]
    # sensitivity: without it, batches mix query lengths
    assert any(len(_scheduled_query_lens(c)) > 1 for c in _drawn(Capabilities(max_query_len=4)))


@pytest.mark.parametrize("uniform", [False, True], ids=["any-query-len", "uniform-query-len"])
def test_small_cases_stay_within_max_seq_len_and_max_sequences(uniform):
    caps = Capabilities(max_seq_len=20, max_sequences=2, uniform_query_len=uniform)
    drawn = _drawn(caps, 100)
    assert max(c.max_seq_len for c in drawn) <= 20 and max(len(c.sequences) for c in drawn) <= 2
    assert max(c.max_seq_len for c in _drawn(Capabilities(), 100)) > 20  # sensitivity: longer without the limit


def test_capabilities_say_why_a_case_breaks_a_constraint():
    wide, one_key = _drawn(Capabilities(), 150), None
    one_key = next(c for c in wide if c.sliding_window == 1)
    assert "window 1 (at least 2)" in Capabilities(min_window=2).unsupported(one_key)
    mixed = next(c for c in wide if len(_scheduled_query_lens(c)) > 1)
    assert "one query length per batch" in Capabilities(uniform_query_len=True).unsupported(mixed)
    with pytest.raises(NanfuzzError, match=r"min_window=0"):
        Capabilities(min_window=0)


# -- the decline hook -------------------------------------------------------------------

def _declining(declines, reason: str = "odd data seed"):
    """The exact kernel, declining the cases ``declines(case)`` picks."""
    return replace(planted_errors.exact, name="exact, declining", spec="",
                   supports=lambda case: reason if declines(case) else None)


def test_a_kernel_that_declines_often_is_counted_and_noted():
    campaign = fuzz(_declining(lambda c: c.data_seed % 2 == 1), device="cpu", max_examples=30, seed=3, use_database=False, isolation=False)
    assert not campaign.failed and campaign.examples == 30
    declined = campaign.statistics.declined["odd data seed"]
    assert declined > 5
    assert campaign.statistics.to_dict()["declined"] == {"odd data seed": declined}
    assert f"{declined} drawn cases declined" in campaign.statistics.table().splitlines()[0]
    assert any("of the cases drawn were declined by its supports(): odd data seed" in n for n in campaign.notes)


def test_a_kernel_that_declines_rarely_gets_no_note():
    campaign = fuzz(_declining(lambda c: c.data_seed == 12345), device="cpu", max_examples=30, seed=3, use_database=False, isolation=False)
    assert not campaign.failed and not any("declined" in n for n in campaign.notes)


def test_declining_everything_or_raising_in_supports_is_a_usage_error():
    with pytest.raises(NanfuzzError, match="declined every case drawn"):
        fuzz(_declining(lambda c: True), device="cpu", max_examples=5, seed=3, use_database=False, isolation=False)
    broken = replace(planted_errors.exact, spec="", supports=lambda case: 1 / 0)
    with pytest.raises(NanfuzzError, match=r"supports\(\) raised ZeroDivisionError"):
        fuzz(broken, device="cpu", max_examples=5, seed=3, use_database=False, isolation=False)
    odd = replace(planted_errors.exact, spec="", supports=lambda case: 7)
    with pytest.raises(NanfuzzError, match=r"supports\(\) returned 7"):
        fuzz(odd, device="cpu", max_examples=5, seed=3, use_database=False, isolation=False)


def test_a_declined_case_given_to_check_is_a_usage_error():
    case = _drawn(Capabilities(), 1)[0]
    with pytest.raises(NanfuzzError, match="declines this case .*: odd data seed"):
        check(_declining(lambda c: True), case, "cpu")


def test_a_kernel_that_declares_no_pool_gets_the_default_one_on_a_gpu_and_none_under_the_interpreter():
    from nanfuzz.harness.campaign.scope import campaign_pool_of
    from nanfuzz.harness.campaign.settings import Settings

    caps = Capabilities(dtypes=("float16",))
    pool, _ = campaign_pool_of(caps, Settings(device="cuda"))
    assert len(pool) == 16
    assert campaign_pool_of(caps, Settings(device="cpu"))[0] is None
    assert campaign_pool_of(caps.restrict(specialisation_pool=0), Settings(device="cuda"))[0] is None
    assert len(campaign_pool_of(caps, Settings(device="cuda", pool_size=4))[0]) == 4


def test_a_leftover_case_the_kernel_now_declines_is_a_note_not_an_error(tmp_path):
    import json

    from nanfuzz.harness.campaign.journal import safe_name

    kernel = _declining(lambda c: c.data_seed == 77, reason="seed 77")
    case = drawn_cases(Capabilities(), 1)[0].replace(data_seed=77)
    journal = tmp_path / "journal" / f"{safe_name(kernel.name)}.99999.dead.json"
    journal.parent.mkdir(parents=True)
    journal.write_text(json.dumps({"kernel": kernel.name, "case": case.to_dict()}))  # a campaign killed mid-case
    campaign = fuzz(kernel, device="cpu", max_examples=2, seed=1, use_database=False, isolation=False,
                    state_dir=tmp_path)
    assert not campaign.failed and any("no longer takes (seed 77)" in n for n in campaign.notes)
