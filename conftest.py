"""Root conftest: load the nanfuzz pytest plugin unless the installed entry point already did.

The plugin picks the GPU or Triton's interpreter in ``pytest_configure``,
before any test module (and so any ``@triton.jit`` kernel) is imported.
"""
import importlib.metadata
import os


def _entry_point_loads_plugin() -> bool:
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        return False
    return any(ep.value == "nanfuzz.harness.plugin" for ep in importlib.metadata.entry_points(group="pytest11"))


pytest_plugins = [] if _entry_point_loads_plugin() else ["nanfuzz.harness.plugin"]
