"""Hand-built cases for kernel tests."""
from nanfuzz.reference.case import Case, Geometry, Poison, Sequence


def consecutive_case(seqs, *, q_heads=4, kv_heads=2, head_size=64, block_size=16, dtype="float16", window=0,
                     causal=True, sinks=False, spare_entries=1, seed=0, poison=Poison(), latent_rank=0,
                     head_size_v=0) -> Case:
    """Sequences ``(query_len, seq_len)`` on consecutive fresh blocks from 1; every table
    has ``spare_entries`` padding columns, and padding points at the null block 0
    (``latent_rank``: an MLA latent cache of rows of ``head_size``, one KV head; ``head_size_v``:
    V's head size where it differs from K's)."""
    width = max(-(-seq_len // block_size) for _, seq_len in seqs) + spare_entries
    tables, next_block = [], 1
    for _, seq_len in seqs:
        used = -(-seq_len // block_size)
        tables.append(tuple(range(next_block, next_block + used)) + (0,) * (width - used))
        next_block += used
    geometry = Geometry(q_heads, kv_heads, head_size, block_size, next_block + 1, dtype, latent_rank, head_size_v)
    sequences = tuple(Sequence(q, seq_len, table) for (q, seq_len), table in zip(seqs, tables))
    return Case(geometry, sequences, sliding_window=window, causal=causal, sinks=sinks,
                poison=poison, data_seed=seed).validate()


def drawn_cases(capabilities, count: int, at: int = 0) -> list[Case]:
    """The first ``count`` cases a Hypothesis run seeded ``at`` draws from ``paged_cases`` under the interpreter."""
    from hypothesis import HealthCheck, given, seed, settings

    from nanfuzz.strategies import paged_cases

    drawn = []

    @seed(at)
    @settings(max_examples=count, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(paged_cases(capabilities, interpreter=True))
    def collect(case):
        drawn.append(case)

    collect()
    return drawn
