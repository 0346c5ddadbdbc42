"""Statistics: what share of a campaign's examples met each situation."""
from __future__ import annotations

import json
import pickle
import re
import time

from hypothesis import HealthCheck, given, settings

from nanfuzz.harness.report import statistics as statistics_module
from nanfuzz.harness.report.statistics import OTHER, Statistics, features
from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.case import Poison
from nanfuzz.strategies import paged_cases
from tests.cases import consecutive_case

# one decode query, window 4 over 20 keys: block 1 expired, block 2 holds the live keys and a tail
DECODE = consecutive_case([(1, 20)], window=4)
PREFILL = consecutive_case([(8, 8)], q_heads=2, kv_heads=2, head_size=32, block_size=8, dtype="float32",
                           poison=Poison(value="inf", tensors="k"))


def _stats(*cases) -> Statistics:
    stats = Statistics()
    for case in cases:
        stats.add(case)
    return stats


def test_shares_and_counts():
    stats = _stats(DECODE, DECODE, PREFILL)
    assert stats.examples == 3
    assert stats.share("decode") == 2 / 3 and stats.share("prefill") == 1 / 3
    assert stats.counts["window"] == 2 and stats.counts["expired-block"] == 2
    assert stats.counts["block:16"] == 2 and stats.counts["block:8"] == 1
    assert stats.counts["head:64"] == 2 and stats.counts["gqa"] == 2
    assert stats.counts["poison-value:inf"] == 1 and stats.counts["poison-tensors:k"] == 1
    assert stats.share("sinks") == 0.0 and Statistics().share("decode") == 0.0
    assert "block:16" in features(DECODE) and "head:32" in features(PREFILL)


def test_to_dict_groups_situations_and_survives_json():
    stats = _stats(DECODE, DECODE, PREFILL)
    data = json.loads(json.dumps(stats.to_dict()))
    assert data["examples"] == 3
    groups = data["groups"]
    assert list(groups) == ["kinds of sequence", "kinds of batch", "masks and windows", "poisoned dead slots",
                            "blocks", "heads", "sizes", "dtypes", "kv caches", "block sizes", "head sizes",
                            "poison values"]
    assert groups["kinds of batch"]["batch:decode"]["count"] == 2 and groups["kinds of batch"]["batch:mixed"][
        "count"] == 0
    assert groups["sizes"]["seq-len>=32768"]["count"] == 0  # listed, never reached
    assert groups["kv caches"] == {"kv:auto": {"count": 3, "share": 1.0}}
    assert groups["kinds of sequence"]["decode"] == {"count": 2, "share": round(2 / 3, 6)}
    assert groups["poisoned dead slots"]["poison:single-slot"]["count"] == 0  # listed, never reached
    assert list(groups["block sizes"]) == ["block:8", "block:16"]  # numeric order
    assert list(groups["dtypes"]) == ["dtype:float16", "dtype:float32"]
    again = Statistics.from_dict(data)
    assert again.examples == 3 and again.counts == +stats.counts


def test_merge_is_the_same_as_one_tally_and_it_pickles():
    whole = _stats(DECODE, PREFILL, PREFILL)
    merged = _stats(DECODE).merge(_stats(PREFILL, PREFILL))
    assert (merged.examples, merged.counts) == (whole.examples, whole.counts)
    copy = pickle.loads(pickle.dumps(merged))
    assert copy == merged


def test_table_is_aligned():
    table = _stats(DECODE, DECODE, PREFILL).table()
    header, *rows = table.splitlines()
    assert header == "what the campaign exercised (3 examples)"
    assert rows[0].split() == ["kinds", "of", "sequence", "decode", "2", "66.7%"]
    assert all(re.search(r"\d+\.\d%$", row) for row in rows)
    assert len({len(row) for row in rows}) == 1  # counts and shares right-aligned to one column
    columns = {row.rindex(" " + row.split()[-2] + " ") + 1 + len(row.split()[-2]) for row in rows}
    assert len(columns) == 1
    assert any(row.split()[:2] == ["poisoned", "dead"] for row in rows)
    assert Statistics().table() == "what the campaign exercised (0 examples)"


def test_a_situation_no_group_names_is_listed_under_other(monkeypatch):
    monkeypatch.setattr(statistics_module, "case_features", lambda case: {"decode", "brand-new"})
    stats = _stats(DECODE)
    assert stats.to_dict()["groups"][OTHER] == {"brand-new": {"count": 1, "share": 1.0}}
    assert stats.table().splitlines()[-1].split() == [OTHER, "brand-new", "1", "100.0%"]


def test_every_generated_situation_has_a_group_and_costs_little():
    cases = []

    @settings(max_examples=60, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(paged_cases(Capabilities(non_causal=True, sinks=True)))
    def collect(case):
        cases.append(case)

    collect()
    stats = Statistics()
    start = time.perf_counter()
    for case in cases:
        stats.add(case)
    assert OTHER not in stats.to_dict()["groups"], stats.to_dict()["groups"].get(OTHER)
    # what it costs is counted (about 0.2 ms a case, GPU-sized batches, on a loaded 2-core machine;
    # the summary JSON carries it), within the time its calls took
    assert 0 < stats.seconds <= time.perf_counter() - start


def test_statistics_list_only_the_situations_the_kernel_takes():
    from nanfuzz.harness.report.statistics import Statistics
    from nanfuzz.reference.capabilities import Capabilities
    from nanfuzz.reference.case import Geometry, Sequence, Case

    decode_only = Capabilities(max_query_len=1, sliding_window=False, sinks=False)
    stats = Statistics.for_capabilities(decode_only)
    first_token = Case(Geometry(1, 1, 32, 16, 2, "float16"), (Sequence(1, 1, (1,)),))
    stats.add(first_token)
    listed = {name for _, rows in stats.groups() for name, _ in rows}
    assert "decode" in listed and stats.counts["decode"] == 1  # a first token is a decode, not a prefill
    assert not listed & {"prefill", "chunked-prefill", "window", "sinks", "non-causal"}
    again = Statistics.from_dict(stats.to_dict())
    assert again.excluded == stats.excluded and Statistics().merge(again).excluded == stats.excluded
    plain = Statistics()  # a kernel that takes everything: every situation listed, the unseen at 0
    plain.add(first_token)
    assert {"prefill", "window", "sinks"} <= {name for _, rows in plain.groups() for name, _ in rows}
