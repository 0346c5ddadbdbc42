"""Three adapters for layouts unlike vLLM's, written against the public contract alone, pass campaigns."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from nanfuzz.harness.campaign.runner import fuzz
from nanfuzz.harness.judge.check import Verdict, check
from nanfuzz.harness.report import coverage
from tests.cases import consecutive_case
from tests.contract_adapters import flat_pages, token_index, uniform_decode

FOLDER = Path(__file__).resolve().parent / "contract_adapters"
ADAPTERS = {"token_index": token_index.kernel, "uniform_decode": uniform_decode.kernel, "flat_pages": flat_pages.kernel}
# Under the interpreter an example of the Triton adapters takes a few tenths of a second.
EXAMPLES = 10


@pytest.mark.parametrize("path", sorted(FOLDER.glob("*.py")), ids=lambda p: p.name)
def test_the_adapters_import_only_nanfuzz_s_public_face(path):
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
    assert not {name for name in imported if name.startswith("nanfuzz.")}, imported


@pytest.fixture(scope="module")
def campaigns():
    return {name: fuzz(kernel, device="cpu", max_examples=EXAMPLES, seed=11, use_database=False, isolation=False)
            for name, kernel in ADAPTERS.items()}


@pytest.mark.parametrize("name", ADAPTERS)
def test_each_adapter_passes_a_campaign_without_declines(campaigns, name):
    campaign = campaigns[name]
    assert not campaign.failed, campaign.failure.summary
    assert campaign.examples == EXAMPLES and not campaign.statistics.declined
    assert not any("declined" in note for note in campaign.notes)


def test_the_token_index_adapter_never_meets_a_one_key_window_and_addresses_no_tail_slot(campaigns):
    stats = campaigns["token_index"].statistics
    assert stats.counts["window"] > 0 and stats.counts["window:1"] == 0
    assert stats.counts[coverage.TRACED] == EXAMPLES and stats.counts["poison:tail"] > 0
    assert stats.counts["reads:tail"] == 0  # its layout hands the kernel keys below seq_len only


def test_the_one_key_window_the_token_index_kernel_cannot_say_is_a_real_limit():
    # sensitivity: W = 1 becomes sliding_window_size 0, which the kernel takes for "no window"
    case = consecutive_case([(1, 20)], q_heads=2, kv_heads=1, head_size=32, window=1)
    assert check(token_index.claims_one_key_window, case, "cpu").verdict is Verdict.NONFINITE
    assert check(token_index.kernel, case.replace(sliding_window=2), "cpu").verdict is Verdict.PASS


def test_the_uniform_decode_adapter_meets_several_query_lengths_one_per_batch(campaigns):
    stats = campaigns["uniform_decode"].statistics
    assert stats.counts["decode"] > 0 and stats.counts["prefill"] + stats.counts["chunked-prefill"] > 0
    mixed = consecutive_case([(1, 20), (2, 9)], q_heads=2, kv_heads=1, head_size=32)
    with pytest.raises(Exception, match="one query length per batch"):
        check(uniform_decode.kernel, mixed, "cpu")


def test_the_plain_torch_adapter_takes_every_mode_and_is_not_traced(campaigns):
    stats = campaigns["flat_pages"].statistics
    assert stats.counts["non-causal"] > 0 and stats.counts["sinks"] > 0 and stats.counts["chunked-prefill"] > 0
    assert stats.counts[coverage.TRACED] == 0  # torch's own loads are not Triton's
    assert coverage.claim(stats) == coverage.NOT_MEASURED
