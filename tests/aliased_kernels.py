"""Test-only Triton decode kernels that call Triton builtins by names of their own, as lmdeploy's do.

The module keeps ``tl_exp = tl.exp`` and ``tl_where = tl.where``, imports ``maximum`` from
``triton.language``, and (``FLAVOUR``) calls builtins of ``triton.language.extra``: libdevice's
``exp`` instead of ``tl.exp``, grid dependency control (PDL) around the loop, or inline assembly,
which Triton's interpreter has no implementation of.  ``MASK_V`` off loads V unmasked (0 * NaN).
On a GPU each compiles; under the interpreter each runs once nanfuzz has made it (but the inline
assembly, which nanfuzz names as the interpreter's limit).
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language import maximum

from nanfuzz.harness.kernel import Kernel
from nanfuzz.reference.capabilities import Capabilities

tl_exp = tl.exp
tl_where = tl.where
libdevice_exp = tl.extra.cuda.libdevice.exp

PLAIN, LIBDEVICE, PDL, INLINE_ASM = 0, 1, 2, 3


@triton.jit
def _decode(Q, K, V, TABLE, SEQ_LENS, STARTS, OUT, scale, table_stride, stride_block, stride_slot, stride_head,
            q_per_kv, BLOCK: tl.constexpr, HEAD: tl.constexpr, FLAVOUR: tl.constexpr, MASK_V: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    start = tl.load(STARTS + seq)
    if tl.load(STARTS + seq + 1) - start == 0:
        return
    if FLAVOUR == PDL:
        tl.extra.cuda.gdc_wait()
    seq_len = tl.load(SEQ_LENS + seq)
    dims = tl.arange(0, HEAD)
    offsets = tl.arange(0, BLOCK)
    q = tl.load(Q + (start * tl.num_programs(1) + head) * HEAD + dims).to(tl.float32)
    m = -float("inf")
    l = 0.0
    acc = tl.zeros([HEAD], dtype=tl.float32)
    for j in range(0, tl.cdiv(seq_len, BLOCK)):
        block = tl.load(TABLE + seq * table_stride + j).to(tl.int64)
        live = j * BLOCK + offsets < seq_len
        base = block * stride_block + offsets[:, None] * stride_slot + (head // q_per_kv) * stride_head + dims[None, :]
        k = tl.load(K + base, mask=live[:, None], other=0.0).to(tl.float32)
        if MASK_V:
            v = tl.load(V + base, mask=live[:, None], other=0.0).to(tl.float32)
        else:
            v = tl.load(V + base).to(tl.float32)  # the planted bug: p = 0 times a dead slot's V
        s = tl_where(live, tl.sum(k * q[None, :], 1) * scale, -float("inf"))
        m_new = maximum(m, tl.max(s, 0))
        if FLAVOUR == LIBDEVICE:
            alpha = libdevice_exp(m - m_new)
            p = libdevice_exp(s - m_new)
        else:
            alpha = tl_exp(m - m_new)
            p = tl_exp(s - m_new)
        if FLAVOUR == INLINE_ASM:
            p = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [p], dtype=tl.float32, is_pure=True, pack=1)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        l = l * alpha + tl.sum(p, 0)
        m = m_new
    tl.store(OUT + (start * tl.num_programs(1) + head) * HEAD + dims, (acc / l).to(OUT.dtype.element_ty))
    if FLAVOUR == PDL:
        tl.extra.cuda.gdc_launch_dependents()


def _run(batch, out, flavour: int = PLAIN, mask_v: bool = True):
    case = batch.case
    g = case.geometry
    kc = batch.key_cache
    _decode[(len(case.sequences), g.num_q_heads)](
        batch.q, kc, batch.value_cache, batch.block_table, batch.seq_lens, batch.query_start_loc, out, case.scale,
        batch.block_table.stride(0), kc.stride(0), kc.stride(1), kc.stride(2), g.queries_per_kv,
        BLOCK=g.block_size, HEAD=g.head_size, FLAVOUR=flavour, MASK_V=mask_v)


CAPS = Capabilities(dtypes=("float16", "float32"), head_sizes=(32,), block_sizes=(16,), max_query_len=1,
                    sliding_window=False, specialisation_pool=0)


def _kernel(attr: str, **options) -> Kernel:
    return Kernel(f"aliased@{attr.replace('_', '-')}", lambda b, o: _run(b, o, **options), CAPS,
                  spec=f"tests.aliased_kernels:{attr}")


plain = _kernel("plain")
libdevice = _kernel("libdevice", flavour=LIBDEVICE)
pdl = _kernel("pdl", flavour=PDL)
inline_asm = _kernel("inline_asm", flavour=INLINE_ASM)
unmasked_v = _kernel("unmasked_v", mask_v=False)
