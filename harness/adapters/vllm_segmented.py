"""vLLM's ROCm segmented attention as a nanfuzz kernel: ``vllm:rocm_segmented_attn``.

The ROCM_SEGMENTED_ATTN backend (``vllm/v1/attention/backends/rocm_segmented_attn.py``) calls
``segmented_attention()`` (``vllm/v1/attention/ops/segmented_attention.py``) with the layer's
separate key and value caches ``[num_blocks, block_size, num_kv_heads, head_size]`` (fp8 ones
viewed as the platform's fp8, per-tensor ``k_scale``/``v_scale``), the block table, the
sequence lengths, ``sliding_window = W - 1`` (-1 for none), the layer's sinks, the batch's
causality, no softcap, its persistent split scratch and ``use_tuned_config`` off (autotuning is
an opt-in of the kernel config).  The dispatcher runs the token-major ``_segmented_attention_stage``
(and, when its configuration splits the keys, ``_segmented_attention_reduce``) where
``can_use_segmented_attention`` and the RDNA checks allow, and ``unified_attention`` otherwise.

The adapter calls it so, with three things in place for the call:

- the platform is RDNA (``vllm.platforms.rocm``'s ``on_gfx1x``/``on_gfx12x``, the loader's
  stand-in), so the segmented kernels are the ones under test on every device; a case the
  dispatcher still sends to ``unified_attention`` raises instead of silently running another kernel;
- the split scratch comes from the workspace-manager branch of ``run_segmented_attention``,
  in the shapes the launch asks for, holding NaN (stale scratch made hostile);
- under Triton's interpreter, where every tensor is on the host, the dispatcher's own
  eligibility check runs with tensors answering ``is_cuda`` yes, so all its other conditions decide.

On NVIDIA GPUs the launches leave out the AMD-only ``waves_per_eu`` option (``launches``).  The
block table reaches the kernel with its rows a power of two entries apart: the kernel takes the
table's row stride as a compile-time constant, and vLLM's persistent table has one width per
deployment, not one per batch.  The entries past each row hold the trap block, as the redzone
columns of the case's own table do.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch

from nanfuzz.harness.adapters import launches, vllm_loader
from nanfuzz.harness.kernel import Kernel
from nanfuzz.reference.batch import PagedBatch
from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.redzones import TABLE_EXTRA_COLUMNS
from nanfuzz.reference.windows import window_left

NAME = "vllm:rocm_segmented_attn"
# The backend takes any multiple of 16 (MultipleOf(16), from ROCM_ATTN); 48 stands for the non-powers of two.
BLOCK_SIZES = (16, 32, 64, 48)
# A compile per head count, head and block size, window, causality, sinks, table width bucket and
# configuration: a GPU campaign covers this many of the first six.
POOL = 16
# segmented_attention.MAX_QUERY_LEN: longer queries go to unified_attention.
MAX_QUERY_LEN = 8192

CAPABILITIES = Capabilities(
    dtypes=("float16", "bfloat16"),  # RocmSegmentedAttentionBackend.supported_dtypes
    head_sizes=(64, 128, 256),       # get_supported_head_sizes and can_use_segmented_attention
    block_sizes=BLOCK_SIZES,
    max_query_len=MAX_QUERY_LEN,
    causal=True,
    non_causal=True,
    sliding_window=True,
    # the kernel windows only keys before the query (ns >= prefix + qpos - WINDOW), as decoder layers need
    non_causal_window=False,
    sinks=True,
    max_group=16,                    # can_use_segmented_attention: 1 <= q heads per KV head <= 16
    specialisation_pool=POOL,
)
NOTES = ("autotuned configurations (enable_rocm_segmented_attn_autotune, off by default): not driven",
         "windows on non-causal attention: left out (the kernel windows only keys before the query)",
         "ROCm runs it on RDNA (gfx1x; gfx12 for fp8) only: every device answers as RDNA here; on NVIDIA "
         "the AMD-only waves_per_eu launch option is left out")


class _StaleScratch:
    """vLLM's workspace manager as ``run_segmented_attention`` asks it for split scratch: NaN buffers."""

    def __init__(self, device: torch.device):
        self.device = device

    def get_simultaneous(self, *shapes_and_dtypes):
        return [torch.full(shape, float("nan"), dtype=dtype, device=self.device) for shape, dtype in shapes_and_dtypes]


def _refuse_fallback(**_kwargs):
    raise RuntimeError("segmented_attention() sent this case to unified_attention(): nanfuzz's "
                       f"{NAME} capabilities drew a case its dispatcher declines")


@contextlib.contextmanager
def _tensors_on_a_gpu() -> Iterator[None]:
    torch.Tensor.is_cuda = property(lambda self: True)
    try:
        yield
    finally:
        del torch.Tensor.is_cuda


def _eligible_off_the_gpu(check):
    """``can_use_segmented_attention`` for tensors on the host: vLLM's own check, with ``is_cuda`` answered yes."""
    @functools.wraps(check)
    def eligible(*args, **kwargs):
        with _tensors_on_a_gpu():
            return check(*args, **kwargs)
    return eligible


def bucketed_table(batch: PagedBatch) -> torch.Tensor:
    """The block table with its rows a power of two apart (at least its width and the redzone's columns),
    every entry past a row at the trap block, the first past the cache, as in the case's own table."""
    table = batch.block_table
    rows, width = table.shape
    stride = 1 << (width + TABLE_EXTRA_COLUMNS - 1).bit_length()
    trap = batch.case.geometry.num_blocks
    wide = torch.full((rows, stride), trap, dtype=table.dtype, device=table.device)
    wide[:, :width] = table
    return wide[:, :width]


def run_rocm_segmented_attn(batch: PagedBatch, out: torch.Tensor, *, source: str | None = None) -> torch.Tensor:
    case = batch.case
    loaded = vllm_loader.load("rocm_segmented_attn", source)
    module = loaded["segmented_attention"]
    device = batch.q.device
    if case.kv_cache.quantized:  # the platform's fp8 (the only one the capabilities take), as the backend views it
        kv_cache_dtype, k_scale, v_scale = "fp8", batch.k_scale, batch.v_scale
    else:
        kv_cache_dtype = "auto"
        k_scale = v_scale = torch.ones(1, dtype=torch.float32, device=device)  # layer._k_scale of an unquantized layer
    overrides = {
        ("segmented_attention", "unified_attention"): _refuse_fallback,
        ("segmented_attention", "is_workspace_manager_initialized"): lambda: True,
        ("segmented_attention", "current_workspace_manager"): lambda: _StaleScratch(device),
        **launches.portable_launches({"segmented_attention": module}),
    }
    if device.type == "cpu":
        overrides[("segmented_attention", "can_use_segmented_attention")] = _eligible_off_the_gpu(
            module.can_use_segmented_attention)
    with loaded.active(overrides):
        module.segmented_attention(
            query=batch.q, key=batch.k, value=batch.v, output=out, kv_cache_dtype=kv_cache_dtype,
            key_cache=batch.key_cache, value_cache=batch.value_cache, block_table=bucketed_table(batch),
            query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens, max_seq_len=case.max_seq_len,
            max_query_len=case.max_query_len, k_scale=k_scale, v_scale=v_scale, sm_scale=case.scale,
            sliding_window=window_left(case), output_scale=None, sinks=batch.sinks, causal=case.causal,
            softcap=0.0, workspace=None, use_tuned_config=False,
        )
    return out


def kernel(name: str, source: str | None = None) -> Kernel:
    """``vllm:rocm_segmented_attn``, with vLLM's kernel files from ``source``."""
    loaded = vllm_loader.load("rocm_segmented_attn", source)
    # the backend's "fp8" / "fp8_e4m3": the platform's fp8, per-tensor scales
    caps = CAPABILITIES.restrict(kv_cache_dtypes=("auto", vllm_loader.platform_fp8(loaded, "segmented_attention")))
    return Kernel(name=name, run=functools.partial(run_rocm_segmented_attn, source=source), capabilities=caps,
                  source=source, notes=NOTES)
