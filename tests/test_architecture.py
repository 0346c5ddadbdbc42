"""The house: layers point one way, modules import in no cycle, and docs/architecture.md is true.

Layers, top to bottom: the front doors (harness/*.py that a user calls), the
campaign, the report, the launch, the judge, the kernels (the contract, the
registry, built-in kernels and library adapters), strategies, reference.  A
module may import its own layer and the layers below it, never one above,
whether at import time or inside a function (``if TYPE_CHECKING:`` blocks
excepted: they never run).
"""
import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = (
    ("front doors", ("harness.cli", "harness.api", "harness.plugin", "harness.bench", "harness.perf",
                     "harness.replay", "harness.scaling", "harness.gate")),
    ("campaign", ("harness.campaign",)),
    ("report", ("harness.report",)),
    ("launch", ("harness.launch",)),
    ("judge", ("harness.judge",)),
    ("kernels", ("harness.kernel", "harness.device", "harness.registry", "harness.import_path", "harness.kernels",
                 "harness.adapters")),
    ("strategies", ("strategies",)),
    ("reference", ("reference",)),
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    found = {}
    for folder in ("harness", "strategies", "reference"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.relative_to(ROOT).as_posix() != "harness/__init__.py":  # empty: the package alone
                found[_module_name(path)] = path
    return found


def layer(module: str) -> int:
    for index, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    raise AssertionError(f"{module} belongs to no layer: add it to LAYERS")


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return isinstance(test, ast.Name) and test.id == "TYPE_CHECKING" or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules ``path`` imports anywhere but under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()

    def visit(node):
        if isinstance(node, ast.If) and _type_checking_only(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nanfuzz."):
            base = node.module[len("nanfuzz."):]
            for alias in node.names:
                whole = f"{base}.{alias.name}"
                found.add(whole if whole in known else base)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("nanfuzz."):
                    found.add(alias.name[len("nanfuzz."):])
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {name for name in found if name in known}


GRAPH = {name: imports(path, modules()) for name, path in modules().items()}


def test_every_module_belongs_to_a_layer():
    for name in GRAPH:
        layer(name)


def test_layers_point_one_way():
    upward = [f"{name} ({LAYERS[layer(name)][0]}) imports {dep} ({LAYERS[layer(dep)][0]})"
              for name, deps in GRAPH.items() for dep in sorted(deps) if layer(dep) < layer(name)]
    assert not upward, "\n".join(upward)


def test_no_import_cycle():
    state: dict[str, int] = {}
    cycles = []

    def walk(name, trail):
        state[name] = 1
        for dep in sorted(GRAPH[name]):
            if dep == name or dep not in GRAPH:
                continue
            if state.get(dep) == 1:
                cycles.append(" -> ".join(trail[trail.index(dep):] + [dep]))
            elif dep not in state:
                walk(dep, trail + [dep])
        state[name] = 2

    for name in sorted(GRAPH):
        if name not in state:
            walk(name, [name])
    assert not cycles, "\n".join(cycles)


def test_the_layer_test_sees_an_upward_import(tmp_path):
    # sensitivity: a judge module that imports the campaign is caught
    probe = ROOT / "harness" / "judge" / "check.py"
    source = probe.read_text() + "\nfrom nanfuzz.harness.campaign.settings import Settings\n"
    copy = tmp_path / "check.py"
    copy.write_text(source)
    assert "harness.campaign.settings" in imports(copy, modules())
    assert layer("harness.campaign.settings") < layer("harness.judge.check")


ARCHITECTURE = ROOT / "docs" / "architecture.md"


def test_the_architecture_page_names_only_modules_that_exist():
    text = ARCHITECTURE.read_text()
    named = set(re.findall(r"`((?:harness|reference|strategies)/[\w/]+\.py)`", text))
    assert len(named) > 20, "the page names the modules a reader looks for"
    missing = sorted(p for p in named if not (ROOT / p).is_file())
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"
    folders = set(re.findall(r"`((?:harness|reference|strategies)/[\w/]*)/`", text))
    assert all((ROOT / f).is_dir() for f in folders), folders


@pytest.mark.parametrize("folder", ["harness/campaign", "harness/launch", "harness/judge", "harness/report",
                                    "harness/kernels", "harness/adapters", "reference", "strategies"])
def test_the_architecture_page_has_a_paragraph_for_every_folder(folder):
    assert f"`{folder}/`" in ARCHITECTURE.read_text()


def test_a_checkout_runs_uninstalled(tmp_path):
    """``python -m nanfuzz`` from a source checkout on sys.path, with no install mapping the folders."""
    hide_install = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f)]; "
                    f"sys.path.insert(0, {str(ROOT)!r}); import runpy; sys.argv = ['nanfuzz', 'list']; "
                    "runpy.run_module('nanfuzz', run_name='__main__')")
    run = subprocess.run([sys.executable, "-c", hide_install], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "paged_decode" in run.stdout
