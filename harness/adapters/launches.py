"""AMD-only launch options, left out where the kernel does not compile for AMD.

AITER's launchers pass options that only Triton's AMD backend knows
(``waves_per_eu``: how many wavefronts a SIMD should hold, an occupancy hint
for register allocation).  Triton's NVIDIA backend refuses an unknown launch
option, so there the launch drops them.  They steer scheduling and register
use, never what a program computes, so the kernel under test is the same.
Under Triton's interpreter nothing is compiled and every option is ignored.
"""
from __future__ import annotations

import dataclasses
import functools
import types

import triton
from triton.runtime.jit import JITFunction


@functools.cache
def amd_only_options() -> frozenset[str]:
    """Launch options Triton's AMD backend takes and its NVIDIA backend does not."""
    try:
        from triton.backends.amd.compiler import HIPOptions
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # a Triton built with one backend only: the options AITER's attention launchers use
        return frozenset({"waves_per_eu", "matrix_instr_nonkdim", "kpack"})
    return frozenset(f.name for f in dataclasses.fields(HIPOptions)) - {f.name for f in dataclasses.fields(CUDAOptions)}


class WithoutAmdOptions:
    """A ``@triton.jit`` kernel whose launches leave out AMD-only options the kernel itself does not take."""

    def __init__(self, kernel: JITFunction):
        self.kernel = kernel
        self.dropped = amd_only_options() - set(kernel.arg_names)

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            return launch(*args, **{k: v for k, v in kwargs.items() if k not in self.dropped})

        return run

    def __getattr__(self, name: str):
        return getattr(self.kernel, name)


def compiles_for_amd() -> bool:
    return triton.runtime.driver.active.get_current_target().backend == "hip"


def portable_launches(modules: dict[str, types.ModuleType]) -> dict[tuple[str, str], object]:
    """For ``LoadedKernels.active(overrides=...)``: every compiled kernel the launcher ``modules``
    (name -> module) launch, wrapped to leave out AMD-only options; nothing on AMD or under the interpreter."""
    kernels = {(name, attr): value for name, module in modules.items()
               for attr, value in vars(module).items() if isinstance(value, JITFunction)}
    if not kernels or compiles_for_amd():
        return {}
    return {key: WithoutAmdOptions(kernel) for key, kernel in kernels.items()}
