"""The specialisation pool: bounded, reproducible, simplest first, and all cases drawn inside it."""
from hypothesis import given, settings

from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.strategies.cases import paged_cases
from nanfuzz.strategies.geometry import Shape
from nanfuzz.strategies.specialisations import Specialisation, specialisation_pool

CAPS = Capabilities(non_causal=True, non_causal_window=False, sinks=True, block_sizes=(16, 32, 64, 48))
POOL = specialisation_pool(CAPS, 12, seed=3)


def test_the_pool_is_a_function_of_its_seed():
    assert specialisation_pool(CAPS, 12, seed=3) == POOL
    assert specialisation_pool(CAPS, 12, seed=4) != POOL
    assert len(POOL) == 12 and len(set(POOL)) == 12


def test_the_pool_starts_with_the_simplest_of_each_mode():
    smallest = Shape("float16", 1, 1, 32, 16)
    assert POOL[0] == Specialisation(smallest, True, 0, False)
    assert Specialisation(smallest, True, 1, False) in POOL
    assert Specialisation(smallest, False, 0, False) in POOL
    keys = [s.complexity(CAPS) for s in POOL]
    assert keys == sorted(keys)


def test_a_small_pool_keeps_the_simplest_entry_and_draws_the_rest():
    windowed = Capabilities(non_causal=True)  # four simplest entries: each mode, with and without a window
    smallest = Shape("float16", 1, 1, 32, 16)
    for size in (1, 2, 3, 4, 7):
        pool = specialisation_pool(windowed, size, seed=3)
        assert len(pool) == size and pool[0] == Specialisation(smallest, True, 0, False)
        assert sum(s.shape == smallest and not s.sinks for s in pool) <= max(1, size // 2) + 1  # not all the smallest
    assert {Specialisation(smallest, c, w, False) for c in (True, False) for w in (0, 1)} <= set(
        specialisation_pool(windowed, 8, seed=3))


def test_the_pool_respects_the_capabilities():
    assert not any(s.window and not s.causal for s in POOL), "this kernel has no non-causal window"
    for s in specialisation_pool(CAPS.restrict(sliding_window=False, sinks=False), 20, seed=1):
        assert s.window == 0 and not s.sinks
    interp = specialisation_pool(CAPS, 20, seed=1, interpreter=True)
    assert {s.shape.dtype for s in interp} <= set(CAPS.interpreter_dtypes)


def test_a_kernel_that_windows_one_mode_only_meets_windows_as_often_as_one_that_windows_both():
    # ROCM_ATTN windows causal attention only; its drawn entries are windowed as often as TRITON_ATTN's
    from nanfuzz.strategies.specialisations import WINDOW_SHARE

    def windowed_share(caps):
        drawn = [s for seed in range(40) for s in specialisation_pool(caps, 16, seed)
                 if s.shape != Shape("float16", 1, 1, 32, 16)]  # the simplest entries are fixed, not drawn
        return sum(bool(s.window) for s in drawn) / len(drawn)

    one_mode, both_modes = windowed_share(CAPS), windowed_share(CAPS.restrict(non_causal_window=True))
    assert abs(one_mode - WINDOW_SHARE) < 0.08 and abs(both_modes - WINDOW_SHARE) < 0.08, (one_mode, both_modes)


@settings(max_examples=150, deadline=None)
@given(paged_cases(CAPS, pool=POOL))
def test_cases_take_their_compile_time_part_from_the_pool(case):
    g = case.geometry
    drawn = Specialisation(Shape(g.dtype, g.num_q_heads, g.num_kv_heads, g.head_size, g.block_size),
                           case.causal, case.sliding_window, case.sinks)
    assert drawn in POOL
    assert CAPS.unsupported(case) is None


def test_a_campaign_with_a_pool_stays_inside_it_and_still_catches_a_bug(tmp_path, monkeypatch):
    from nanfuzz.harness.campaign.runner import fuzz
    from nanfuzz.harness.kernel import Kernel
    from tests.torch_kernels import CAPS as TORCH_CAPS, attention, torch_kernel

    monkeypatch.chdir(tmp_path)
    from nanfuzz.strategies.cases import campaign_pool

    pool = campaign_pool(TORCH_CAPS, 3, 5, interpreter=True)  # the campaign's own pool
    seen = []

    def spy(batch, out):
        g, case = batch.case.geometry, batch.case
        seen.append(Specialisation(Shape(g.dtype, g.num_q_heads, g.num_kv_heads, g.head_size, g.block_size),
                                   case.causal, case.sliding_window, case.sinks))
        return attention(batch, out)

    campaign = fuzz(Kernel(name="spy", run=spy, capabilities=TORCH_CAPS), device="cpu", max_examples=30,
                    seed=1, use_database=False, pool_size=3, pool_seed=5)
    assert not campaign.failed and len(seen) >= 30 and set(seen) <= set(pool)
    caught = fuzz(torch_kernel("mask-multiply"), device="cpu", max_examples=200, seed=1, use_database=False,
                  pool_size=3, pool_seed=5)
    assert caught.failed
