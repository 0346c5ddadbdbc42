"""nanfuzz's view of mykernels.paged_decode.

    nanfuzz fuzz --kernel mykernels.nanfuzz_adapter:kernel          # from the repository root
    nanfuzz fuzz --kernel mykernels.nanfuzz_adapter:broken_kernel   # the same kernel, V loads unmasked
"""
import functools

from nanfuzz import Capabilities, Kernel

from mykernels.paged_decode import paged_decode

# What the kernel handles; nanfuzz generates only such cases.  tl.arange needs
# powers of two, so the block size (one tile) and the padded head size are.
CAPABILITIES = Capabilities(
    dtypes=("float16", "float32"),
    head_sizes=(32, 64, 128),
    block_sizes=(8, 16, 32),
    max_query_len=1,       # decode only: one query token per sequence (or none)
    causal=True,
    non_causal=False,
    sliding_window=True,
    sinks=False,
)


def _run(batch, out, *, mask_v=True):
    # The canonical batch is already this kernel's layout, and nanfuzz's
    # window (W keys, the query's own included; 0 = none) is its convention.
    paged_decode(out, batch.q, batch.key_cache, batch.value_cache, batch.block_table, batch.seq_lens,
                 batch.query_start_loc, scale=batch.scale, window=batch.sliding_window, mask_v=mask_v)


kernel = Kernel("my paged decode", _run, CAPABILITIES)
broken_kernel = Kernel("my paged decode, V unmasked", functools.partial(_run, mask_v=False), CAPABILITIES)
