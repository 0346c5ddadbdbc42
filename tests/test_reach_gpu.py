"""On a GPU, production campaigns of the built-in kernels meet every target they declare a few times,
prefills included, each case built and checked: huge caches, 32k-key sequences, 128 sequences."""
import pytest

from nanfuzz.harness.campaign import reach
from nanfuzz.harness.campaign.focus import Focus
from nanfuzz.harness.campaign.runner import Hooks, fuzz
from nanfuzz.harness.registry import builtin_kernels

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name, focus", [("paged_decode@masked", Focus()), ("unified@masked", Focus(causal_only=True)),
                                         ("prefix_prefill@masked", Focus(prefill_only=True))],
                         ids=["decode", "unified-causal", "prefill-only"])
def test_a_production_campaign_of_a_built_in_meets_every_target_within_reach(name, focus, tmp_path):
    met = {}

    def note(campaign):
        stats = campaign.statistics
        met["all"] = bool(stats.targets) and not reach.unmet(stats.targets, stats)

    campaign = fuzz(builtin_kernels()[name], device="cuda", size="production", focus=focus, max_examples=600, seed=5,
                    use_database=False, state_dir=tmp_path, hooks=Hooks(on_example=note, should_stop=lambda: met.get("all")))
    stats = campaign.statistics
    assert not campaign.failed, campaign.failure and campaign.failure.summary
    assert not reach.unmet(stats.targets, stats), stats.unreached_line()
    assert any(name.endswith("offsets>2^31") for name in stats.targets.within_reach())
    assert campaign.declined_for_memory == 0
