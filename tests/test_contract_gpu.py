"""On a GPU: the three contract adapters pass, a user kernel meets a pool, and read coverage says it is not measured."""
from __future__ import annotations

import pytest

from nanfuzz.harness.campaign.runner import fuzz
from nanfuzz.harness.report import coverage
from nanfuzz.reference.errors import NanfuzzError
from tests.contract_adapters import flat_pages, token_index, uniform_decode

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kernel", [token_index.kernel, uniform_decode.kernel, flat_pages.kernel],
                         ids=lambda k: k.name)
def test_each_contract_adapter_passes_on_the_gpu_and_reads_are_not_measured_there(kernel, tmp_path):
    campaign = fuzz(kernel, device="cuda", max_examples=60, seed=1, use_database=False, state_dir=tmp_path)
    assert not campaign.failed, campaign.failure.summary
    assert campaign.statistics.counts["dtype:bfloat16"] > 0  # bfloat16 runs here, unlike under the interpreter
    assert campaign.statistics.counts[coverage.TRACED] == 0
    assert coverage.table(campaign.statistics) == coverage.NOT_MEASURED


def test_a_user_kernel_compiles_a_pool_not_every_case(tmp_path):
    campaign = fuzz(token_index.kernel, device="cuda", max_examples=80, seed=2, use_database=False, state_dir=tmp_path)
    assert not campaign.failed
    assert campaign.compiles is not None and campaign.compiles <= 16  # one launch a case: at most one compile an entry


def test_strict_reads_on_a_gpu_is_a_usage_error(tmp_path):
    with pytest.raises(NanfuzzError, match="--strict-reads needs"):
        fuzz(token_index.kernel, device="cuda", max_examples=2, use_database=False, state_dir=tmp_path,
             strict_reads=True)
