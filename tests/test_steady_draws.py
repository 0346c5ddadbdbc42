"""A seed draws the same cases whatever the process has imported (``strategies.steady``):
Hypothesis otherwise mixes in constants from the source of local modules, such as a user's adapter
or a library's kernel files loaded from a folder.  Every draw nanfuzz makes is steady: the fixed
draws, a seeded campaign's search, and the cases it meets first, drawn ahead for the compile farm."""
import importlib
import sys

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from nanfuzz.harness.campaign.runner import CampaignRunner, Hooks, fuzz
from nanfuzz.harness.campaign.settings import Settings
from nanfuzz.harness.scaling import drawn
from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.strategies import paged_cases
from nanfuzz.strategies.steady import steady_draws
from tests.draw_only import DrawOnly, kernel_like

# constants Hypothesis finds in a freshly imported local module, each a valid draw of a wide integer
CONSTANTS = range(1001, 1081)
SOURCE = "CONSTANTS = (" + ", ".join(str(n) for n in CONSTANTS) + ")\n"
# and small ones, each a valid block size, sequence length or head count of a small case (even, then odd:
# each import adds constants the process has not seen)
EVEN_SIZES = "SIZES = (" + ", ".join(str(n) for n in range(2, 600, 2)) + ")\n"
ODD_SIZES = "SIZES = (" + ", ".join(str(n) for n in range(1, 600, 2)) + ")\n"


def _integers() -> list[int]:
    found = []

    @settings(max_examples=300, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(st.integers(0, 2**32 - 1))
    def collect(n):
        found.append(n)

    collect()
    return found


def _import_local_module(tmp_path, name: str, source: str = SOURCE) -> None:
    (tmp_path / f"{name}.py").write_text(source)
    sys.path.insert(0, str(tmp_path))
    try:
        importlib.import_module(name)
    finally:
        sys.path.remove(str(tmp_path))


def test_a_local_module_s_constants_change_plain_draws_and_not_steady_ones(tmp_path):
    with steady_draws():
        with steady_draws():  # nested: still in force after the inner one ends
            pass
        before = _integers()
    plain_before = _integers()
    _import_local_module(tmp_path, "an_adapter_with_constants")
    plain_after = _integers()
    with steady_draws():
        assert _integers() == before
    assert plain_after != plain_before  # what steady_draws keeps out


def test_the_draws_nanfuzz_calls_the_same_on_every_run_ignore_them(tmp_path):
    strategy = paged_cases(Capabilities(), tier="production")
    before = drawn(strategy, 40)
    _import_local_module(tmp_path, "another_adapter_with_constants")
    assert drawn(strategy, 40) == before


def _searched(tmp_path, name: str) -> list:
    """The cases a seeded CPU campaign (every case passing) meets, in order."""
    subject = DrawOnly()
    fuzz(kernel_like("drawn", Capabilities()), device="cpu", max_examples=60, seed=11, use_database=False,
         state_dir=tmp_path / name, subject=subject, check_leftovers=False)
    return subject.cases


def test_a_seeded_campaign_searches_the_same_cases_whatever_was_imported(tmp_path):
    before = _searched(tmp_path, "before")
    _import_local_module(tmp_path, "a_kernel_file_with_constants", EVEN_SIZES)
    after = _searched(tmp_path, "after")
    assert len(before) == 60 and after == before


def test_the_cases_a_campaign_meets_first_are_drawn_as_its_search_draws_them(tmp_path):
    runner = CampaignRunner(kernel_like("drawn", Capabilities()), Settings(device="cpu", max_examples=60, seed=11,
                            use_database=False, state_dir=tmp_path / "ahead", check_leftovers=False), Hooks(), DrawOnly())
    ahead = runner.first_cases(20)
    _import_local_module(tmp_path, "one_more_kernel_file", ODD_SIZES)  # between the look ahead and the search
    assert _searched(tmp_path, "search")[:20] == list(ahead)
