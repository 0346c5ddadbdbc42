"""A large case's stand-in for a compile-only launch: the same binaries, almost none of its memory.

A compile farm process (``harness.launch.farm``) calls the kernel with every Triton launch turned
into a compile-only warm-up: nothing reads the caches.  A large case's caches still took gigabytes
of device memory while each compile ran for seconds, and the campaign's own checks waited for it
(on an 80 GB H100 one detection waited 8.3 s for memory the farm's tasks held).

What picks a Triton binary is a launch's signature: dtypes, constexprs, and the specialisation of
integer arguments (equal to 1, divisible by 16, fitting 32 bits) and of pointers (16-byte
aligned).  None of it depends on how many blocks a cache holds, but for an argument computed from
that count.  The stand-in keeps the case's every other dimension, its sequences, its tables'
width and its tokens, and gives its caches at most 31 blocks, a count with the same remainder
mod 16 (and 1 where the case has 1 block); every block id (tables, the padding block, poison
sites) is taken modulo it.  Blocks then serve several sequences at once, which no kernel reads
in a warm-up.  A signature that does differ costs speed only: the campaign's worker compiles
what it meets unbuilt.
"""
from __future__ import annotations

from dataclasses import replace

from nanfuzz.reference.case import Case, PoisonSite

# Block counts up to this stay as they are: such caches are small already.
SMALL_BLOCK_COUNT = 32


def stand_in_blocks(num_blocks: int) -> int:
    """How many blocks the stand-in's caches hold: ``num_blocks`` where it is small, else a
    count of 16 to 31 with its remainder mod 16."""
    return num_blocks if num_blocks <= SMALL_BLOCK_COUNT else 16 + num_blocks % 16


def compile_stand_in(case: Case) -> Case:
    """``case`` with caches of ``stand_in_blocks`` blocks, for a launch that only compiles."""
    g = case.geometry
    blocks = stand_in_blocks(g.num_blocks)
    if blocks == g.num_blocks:
        return case
    sequences = tuple(replace(s, block_table=tuple(b % blocks for b in s.block_table)) for s in case.sequences)
    sites = case.poison.sites
    if sites is not None:
        sites = tuple(dict.fromkeys(PoisonSite(site.block % blocks, site.offset) for site in sites))
    return case.replace(geometry=replace(g, num_blocks=blocks), sequences=sequences,
                        padding_block=case.padding_block % blocks, poison=replace(case.poison, sites=sites))
