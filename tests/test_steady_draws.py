"""A seed draws the same cases whatever the process has imported (``strategies.steady``):
Hypothesis otherwise mixes in constants from the source of local modules, such as a user's adapter
or a library's kernel files loaded from a folder."""
import importlib
import sys

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from nanfuzz.harness.scaling import drawn
from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.strategies import paged_cases
from nanfuzz.strategies.steady import steady_draws

# constants Hypothesis finds in a freshly imported local module, each a valid draw of a wide integer
CONSTANTS = range(1001, 1081)
SOURCE = "CONSTANTS = (" + ", ".join(str(n) for n in CONSTANTS) + ")\n"


def _integers() -> list[int]:
    found = []

    @settings(max_examples=300, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(st.integers(0, 2**32 - 1))
    def collect(n):
        found.append(n)

    collect()
    return found


def _import_local_module(tmp_path, name: str) -> None:
    (tmp_path / f"{name}.py").write_text(SOURCE)
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
