"""Read coverage: which dead slots a kernel's loads addressed, traced under Triton's interpreter."""
from __future__ import annotations

import json

import pytest

from nanfuzz.harness.campaign.runner import fuzz
from nanfuzz.harness.judge import reads
from nanfuzz.harness.judge.check import Verdict, check
from nanfuzz.harness.registry import resolve
from nanfuzz.harness.report import coverage
from nanfuzz.harness.report.statistics import Statistics
from nanfuzz.reference.errors import NanfuzzError
from nanfuzz.reference.semantics import slot_reasons
from tests import read_subjects
from tests.cases import consecutive_case, drawn_cases

# One decode query over 20 keys of 16-slot blocks, a window of 9: keys 11..19 live, 12 tail slots in the
# last block, 11 expired keys in the first, and the table's padding entry on the null block.
CASE = consecutive_case([(1, 20)], q_heads=2, kv_heads=1, head_size=32, window=9)


def _runnable(kernel):
    """The kernel's capabilities less the cache encodings this Triton's interpreter cannot run."""
    from nanfuzz.harness.campaign.scope import campaign_capabilities
    from nanfuzz.harness.campaign.settings import Settings

    return campaign_capabilities(kernel, Settings(device="cpu"))[0]


def _statistics(kernel, cases) -> Statistics:
    stats = Statistics()
    for case in cases:
        stats.add(case, observed=coverage.observed(check(kernel, case, "cpu")))
    return stats


def test_the_old_decode_kernel_addresses_tail_slots_of_v_and_the_fixed_one_none():
    unmasked, masked = resolve("paged_decode@unmasked"), resolve("paged_decode@masked")
    old = check(unmasked, CASE, "cpu").reads
    assert old["traced"] and old["addressed"]["value_cache"]["tail"] == 12
    assert old["addressed"]["value_cache"]["out-of-window"] == 11
    block, slot = old["examples"]["value_cache"][0]
    assert slot_reasons(CASE)[block][slot]  # the slots it names are dead
    new = check(masked, CASE, "cpu").reads
    assert new["traced"] and new["addressed"] == {} and new["dead_slots"] == 0

    cases = drawn_cases(_runnable(unmasked), 6, at=5)
    old_stats, new_stats = _statistics(unmasked, cases), _statistics(masked, cases)
    assert old_stats.counts["reads:value_cache:tail"] > 0 and new_stats.counts["reads:value_cache:tail"] == 0
    assert new_stats.counts["poison:tail"] > 0 and new_stats.counts[coverage.TRACED] == 6
    table = coverage.table(new_stats)  # the poisoned share beside the share addressed, input by input
    header, tail = table.splitlines()[1], next(line for line in table.splitlines() if line.split()[:1] == ["tail"])
    assert header.split()[:5] == ["class", "poisoned", "addressed", "key_cache", "value_cache"]
    assert tail.split()[1] == f"{100 * new_stats.share('poison:tail'):.1f}%" and tail.split()[2:] == ["0.0%"] * 3
    assert "tail (key_cache, value_cache)" in coverage.claim(old_stats) or "tail (value_cache)" in coverage.claim(old_stats)
    assert "no dead slot" in coverage.claim(new_stats)


def test_tracing_changes_no_output_bit():
    kernel = resolve("paged_decode@unmasked")
    for case in drawn_cases(_runnable(kernel), 4, at=9):
        traced, plain = check(kernel, case, "cpu"), check(kernel, case, "cpu", trace_reads=False)
        assert (traced.verdict, traced.output_sha256, traced.summary) == (plain.verdict, plain.output_sha256, plain.summary)
        assert plain.reads is None and traced.reads["traced"]


def test_a_kernel_that_zeroes_the_product_of_dead_v_passes_with_a_note_and_fails_under_strict_reads():
    zeroed = check(read_subjects.zeroed, CASE, "cpu")
    assert zeroed.verdict is Verdict.PASS
    assert zeroed.reads["addressed"] == {"value_cache": {"tail": 12, "out-of-window": 11}}  # both blocks whole
    assert check(read_subjects.masked, CASE, "cpu").reads["addressed"] == {}

    campaign = fuzz(read_subjects.zeroed, device="cpu", max_examples=4, seed=2, use_database=False, isolation=False)
    assert not campaign.failed
    assert any("value_cache tail" in n and "--strict-reads" in n for n in campaign.notes)
    quiet = fuzz(read_subjects.masked, device="cpu", max_examples=4, seed=2, use_database=False, isolation=False)
    assert not any(coverage.UNUSED_NOTE in n for n in quiet.notes)

    strict = check(read_subjects.zeroed, CASE, "cpu", strict_reads=True)
    assert strict.verdict is Verdict.DEAD_READ and "value_cache: tail 12" in strict.summary
    assert check(read_subjects.masked, CASE, "cpu", strict_reads=True).verdict is Verdict.PASS


def test_strict_reads_on_the_command_line_is_a_finding_with_a_repro_that_replays(tmp_path, capsys):
    from nanfuzz.harness.cli import main

    repros = tmp_path / "repros"
    code = main(["fuzz", "--kernel", "tests.read_subjects:zeroed", "--device", "cpu", "--max-examples", "10",
                 "--seed", "1", "--strict-reads", "--repro-dir", str(repros), "--state-dir", str(tmp_path / "state")])
    out = capsys.readouterr().out
    assert code == 1 and "DEAD_READ" in out
    repro = next(repros.glob("*.json"))
    record = json.loads(repro.read_text())
    assert record["verdict"] == "DEAD_READ" and record["evidence"]["addressed"]["value_cache"]
    assert main(["replay", str(repro), "--device", "cpu"]) == 1  # strict again: the finding exists only so
    assert main(["replay", str(repro), "--device", "cpu", "--kernel", "tests.read_subjects:masked"]) == 0
    passing = main(["fuzz", "--kernel", "tests.read_subjects:zeroed", "--device", "cpu", "--max-examples", "4",
                    "--seed", "1", "--state-dir", str(tmp_path / "state2")])
    assert passing == 0 and "dead slots its loads addressed" in capsys.readouterr().out


def test_loads_from_a_copy_of_the_cache_are_traced_back_to_its_slots():
    direct = check(read_subjects.zeroed, CASE, "cpu").reads
    copied = check(read_subjects.zeroed_on_a_copy, CASE, "cpu").reads
    assert copied["addressed"] == direct["addressed"] and copied["unmapped_loads"] == 0
    # a copy whose bytes are not the cache's (converted to float32) spells no slot: unmapped, never misread
    converted = check(read_subjects.zeroed_on_float32, CASE, "cpu").reads
    assert converted["addressed"] == {} and converted["unmapped_loads"] > 0


def test_probe_batches_spell_every_slot_in_bytes_no_float_reads_as_nan():
    import torch

    from nanfuzz.reference.materialize import materialize

    batch = materialize(CASE)
    keys, values = (batch.allocations[name].base for name in ("key_cache", "value_cache"))
    slots = values.shape[0] * values.shape[1]
    number = torch.zeros(slots, dtype=torch.long)
    for r in range(reads.probe_rounds(batch)):
        raw = reads.probe_batch(batch, r).allocations["value_cache"].base.view(torch.uint8).view(slots, -1)
        assert (raw == raw[:, :1]).all()  # every byte of a slot alike
        digit = raw[:, 0].long() - reads._BANDS[r % 2]  # bands alternate, and skip 0: zeroed memory spells nothing
        assert int(digit.min()) >= 0 and int(digit.max()) < reads._DIGIT_BASE
        number += digit * reads._DIGIT_BASE ** r
    first = keys.shape[0] * keys.shape[1]  # value_cache's slots are numbered after key_cache's
    assert number.tolist() == list(range(first, first + slots))
    assert torch.isfinite(reads.probe_batch(batch, 1).value_cache).all()


def test_a_triton_without_the_hook_points_traces_nothing_and_says_why(monkeypatch):
    import types

    import triton.runtime
    from triton.runtime import interpreter

    # what nanfuzz sees of an interpreter without GridExecutor (the interpreter itself keeps running)
    monkeypatch.setattr(triton.runtime, "interpreter", types.SimpleNamespace(
        interpreter_builder=interpreter.interpreter_builder))
    assert "GridExecutor._init_args_hst" in reads.unavailable()
    outcome = check(resolve("paged_decode@masked"), CASE, "cpu")
    assert outcome.verdict is Verdict.PASS and outcome.reads == {"traced": False, "why_not": reads.unavailable()}
    campaign = fuzz(read_subjects.masked, device="cpu", max_examples=2, seed=1, use_database=False, isolation=False)
    assert any("read coverage not measured" in n for n in campaign.notes)
    assert coverage.table(campaign.statistics) == coverage.NOT_MEASURED
    with pytest.raises(NanfuzzError, match="--strict-reads needs"):
        fuzz(read_subjects.masked, device="cpu", max_examples=2, seed=1, use_database=False, isolation=False,
             strict_reads=True)


def test_a_plain_torch_kernel_makes_no_traced_load():
    from tests import planted_errors

    outcome = check(planted_errors.exact, CASE, "cpu")
    assert not outcome.reads["traced"] and "no Triton launch" in outcome.reads["why_not"]
