"""Which path a library kernel took: a spy that records each launch's grid."""
from __future__ import annotations


class LaunchSpy:
    """Stands in for a ``@triton.jit`` kernel in its module and records each launch grid."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.grids: list[tuple] = []

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def record(*args, **kwargs):
            self.grids.append(tuple(grid))
            return launch(*args, **kwargs)

        return record
