"""Which path a library kernel took: a spy that records each launch's grid."""
from __future__ import annotations

from triton.runtime.jit import JITFunction

from nanfuzz.harness.adapters.launches import WithoutAmdOptions, compiles_for_amd


class LaunchSpy:
    """Stands in for a ``@triton.jit`` kernel in its module and records each launch grid.  It takes
    the kernel's place after the adapter has made its launches portable, so on a GPU that does not
    compile for AMD it leaves out AMD-only launch options as the adapter's own wrapper would."""

    def __init__(self, kernel):
        portable = isinstance(kernel, JITFunction) and not compiles_for_amd()
        self.kernel = WithoutAmdOptions(kernel) if portable else kernel
        self.grids: list[tuple] = []

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def record(*args, **kwargs):
            self.grids.append(tuple(grid))
            return launch(*args, **kwargs)

        return record
