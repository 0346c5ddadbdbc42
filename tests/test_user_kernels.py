"""User kernels by import path: imported from the current directory, never called to get one."""
from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from nanfuzz.harness.import_path import import_user_module
from nanfuzz.harness.registry import import_path, resolve
from nanfuzz.reference.errors import NanfuzzError

ADAPTER = '''\
from nanfuzz import Capabilities, Kernel

CALLS = []


def _run(batch, out):
    CALLS.append("run")


kernel = Kernel("shown name", _run, Capabilities(max_query_len=1))


def make_kernel():
    CALLS.append("make_kernel")
    return kernel


def run_with_caps(batch, out):
    pass


run_with_caps.capabilities = Capabilities()
'''


@pytest.fixture
def repo(tmp_path, monkeypatch, request):
    """A repository root holding ``<package>/adapter.py``, as the current directory, off sys.path."""
    package = f"userpkg_{request.node.name.replace('[', '_').replace(']', '').replace('-', '_')}"
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / package / "adapter.py").write_text(ADAPTER)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    yield package
    for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
        del sys.modules[name]


def test_a_kernel_resolves_from_the_current_directory(repo):
    kernel = resolve(f"{repo}.adapter:kernel")
    assert kernel.name == "shown name"
    assert kernel.spec == kernel.resolvable == import_path(kernel) == f"{repo}.adapter:kernel"
    assert sys.path[0] == str(Path.cwd())


def test_a_callable_with_capabilities_is_a_kernel(repo):
    kernel = resolve(f"{repo}.adapter:run_with_caps")
    assert kernel.name == kernel.spec == f"{repo}.adapter:run_with_caps"


def test_a_factory_is_refused_and_never_called(repo):
    with pytest.raises(NanfuzzError) as info:
        resolve(f"{repo}.adapter:make_kernel")
    message = str(info.value)
    assert "\n" not in message
    assert f"module '{repo}.adapter'" in message and "make_kernel = <function make_kernel" in message
    assert "not a nanfuzz Kernel" in message and "never calls it" in message
    assert sys.modules[f"{repo}.adapter"].CALLS == []


@pytest.mark.parametrize("spec, module, found", [
    ("os:getcwd", "module 'os'", "getcwd = <built-in function getcwd>"),
    ("sys:exit", "module 'sys' (built-in)", "exit = <built-in function exit>"),
])
def test_standard_library_functions_are_refused_not_run(spec, module, found):
    with pytest.raises(NanfuzzError) as info:
        resolve(spec)  # sys:exit called would raise SystemExit, not NanfuzzError
    message = str(info.value)
    assert "\n" not in message and module in message and found in message


@pytest.mark.parametrize("spec, expected", [
    ("no_such_pkg_xyz.mod:kernel", "cannot import module 'no_such_pkg_xyz.mod' (ModuleNotFoundError"),
    ("os:no_such_attr", "module 'os' ("),
    ("has space.mod:kernel", "is not an import path"),
    ("mod:", "is not an import path"),
])
def test_bad_import_paths_are_one_line_errors(spec, expected):
    with pytest.raises(NanfuzzError) as info:
        resolve(spec)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_an_adapter_that_fails_to_import_says_why(repo, tmp_path):
    (tmp_path / repo / "broken.py").write_text(textwrap.dedent('''\
        raise RuntimeError("needs a GPU library\\nsecond line")
    '''))
    with pytest.raises(NanfuzzError) as info:
        resolve(f"{repo}.broken:kernel")
    assert str(info.value).endswith("cannot import module '%s.broken' (RuntimeError: needs a GPU library)" % repo)


def test_an_unresolved_kernel_object_is_found_where_it_lives(repo):
    module = import_user_module(f"{repo}.adapter")  # as a test that imports its adapter itself
    assert import_path(module.kernel) == f"{repo}.adapter:kernel"


def test_a_built_in_kernel_object_is_known_by_its_name():
    from nanfuzz.harness.registry import builtin_kernels

    kernel = builtin_kernels()["paged_decode@masked"]
    assert not kernel.spec and import_path(kernel) == "paged_decode@masked"


TREE_READER = '''\
import os

from nanfuzz import Kernel
from tests.torch_kernels import CAPS, attention

TREE = os.environ.get("NANFUZZ_AITER_SRC")  # read when imported, as tests/past_findings.py does
if TREE != os.environ["EXPECTED_TREE"]:
    raise RuntimeError(f"NANFUZZ_AITER_SRC is {TREE!r}")


def _run(batch, out):
    assert os.environ.get("NANFUZZ_AITER_SRC") == TREE, "the worker was not handed the tree"
    attention(batch, out)


kernel = Kernel("reads its tree", _run, CAPS)
multiplies_its_mask = Kernel("reads its tree, multiplies its mask",
                             lambda batch, out: attention(batch, out, bug="mask-multiply"), CAPS)
'''


@pytest.fixture
def tree_reader(tmp_path):
    """A folder holding ``reads_tree.py`` and an ``aiter-tree/``, and the environment to run nanfuzz
    there in: no NANFUZZ_AITER_SRC of its own."""
    import os

    (tmp_path / "reads_tree.py").write_text(TREE_READER)
    (tmp_path / "aiter-tree").mkdir()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
           "EXPECTED_TREE": str((tmp_path / "aiter-tree").resolve())}
    env.pop("NANFUZZ_AITER_SRC", None)
    env.pop("CI", None)
    return tmp_path, env


@pytest.mark.parametrize("isolation", [[], ["--no-isolation"]], ids=["in-workers", "in-process"])
def test_a_tree_given_on_the_command_line_reaches_a_user_module_and_every_process_it_runs_in(tree_reader, isolation):
    import subprocess

    folder, env = tree_reader
    command = [sys.executable, "-m", "nanfuzz", "fuzz", "--kernel", "reads_tree:kernel", "--device", "cpu",
               "--max-examples", "4", "--state-dir", "state", *isolation]
    bare = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=300)
    assert bare.returncode == 2 and "NANFUZZ_AITER_SRC is None" in bare.stderr, bare.stdout + bare.stderr
    given = subprocess.run(command + ["--aiter-src", "aiter-tree"], cwd=folder, env=env, capture_output=True,
                           text=True, timeout=300)
    assert given.returncode == 0, given.stdout + given.stderr
    assert "PASS" in given.stdout, given.stdout + given.stderr


def test_the_replay_line_of_a_user_module_names_the_trees_it_ran_with(tree_reader):
    import subprocess

    folder, env = tree_reader
    found = subprocess.run([sys.executable, "-m", "nanfuzz", "fuzz", "--kernel", "reads_tree:multiplies_its_mask",
                            "--device", "cpu", "--state-dir", "state", "--aiter-src", "aiter-tree"],
                           cwd=folder, env=env, capture_output=True, text=True, timeout=600)
    assert found.returncode == 1, found.stdout + found.stderr
    (line,) = [line for line in found.stdout.splitlines() if line.startswith("replay: ")]
    assert line.endswith(" --aiter-src aiter-tree"), line
    replayed = subprocess.run(line.removeprefix("replay: ").split(), cwd=folder, env=env, capture_output=True,
                              text=True, timeout=300)
    assert replayed.returncode == 1, replayed.stdout + replayed.stderr
