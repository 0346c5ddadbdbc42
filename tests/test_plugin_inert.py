"""The installed pytest plugin changes nothing until a test uses it.

Each test writes a small project into a temporary folder and runs
``python -m pytest`` there, in a fresh process that loads the plugin through
its entry point, as in a user's environment.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap

import pytest

HEAVY = ("torch", "triton", "numpy", "hypothesis")


def _clean_env(**extra: str | None) -> dict[str, str]:
    """The environment without what this project's own session set (TRITON_INTERPRET) or pytest adds."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "PYTHONPATH", "PYTEST_ADDOPTS", "PYTEST_DISABLE_PLUGIN_AUTOLOAD")
           and not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))}
    for key, value in extra.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def _write(folder, files: dict[str, str]) -> None:
    (folder / "pytest.ini").write_text("[pytest]\n")  # the folder is the rootdir, whatever lies above it
    for name, text in files.items():
        (folder / name).write_text(textwrap.dedent(text))


def _pytest(folder, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=300)


def test_the_plugin_is_installed_as_an_entry_point():
    points = importlib.metadata.entry_points(group="pytest11")
    assert [ep.value for ep in points if ep.name == "nanfuzz"] == ["nanfuzz.harness.plugin"]


def test_importing_the_plugin_imports_no_heavy_module(tmp_path):
    code = ("import sys; import nanfuzz.harness.plugin; "
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_clean_env(), capture_output=True,
                          text=True, check=True)
    assert proc.stdout.strip() == "[]"


def test_a_user_s_own_reference_module_is_the_one_imported(tmp_path):
    _write(tmp_path, {
        "reference.py": "def ref_kernel():\n    return 'mine'\n",
        "strategies.py": "OWN = True\n",
        "harness.py": "OWN = True\n",
        "test_own.py": """
            import harness
            import strategies
            from reference import ref_kernel

            def test_own_modules(pytestconfig):
                assert pytestconfig.pluginmanager.has_plugin("nanfuzz")
                assert ref_kernel() == "mine" and strategies.OWN and harness.OWN
            """,
    })
    proc = _pytest(tmp_path, env=_clean_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_nothing_named_reference_strategies_or_harness_is_installed(tmp_path):
    env = _clean_env()
    proc = subprocess.run([sys.executable, "-c", "import reference"], cwd=tmp_path, env=env, capture_output=True,
                          text=True)
    assert proc.returncode == 1 and "No module named 'reference'" in proc.stderr
    code = "import importlib.util; print([n for n in ('reference', 'strategies', 'harness') if importlib.util.find_spec(n)])"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          check=True)
    assert proc.stdout.strip() == "[]"


USER_PROFILE = """
    from hypothesis import settings

    settings.register_profile("dev", max_examples=5)
    settings.load_profile("dev")
    """

# Records what an unrelated test sees; torch is looked for before this test imports it.
UNRELATED_TESTS = """
    import json
    import os
    import sys

    from hypothesis import given, settings, strategies as st

    examples = []


    @given(st.integers())
    def test_with_the_user_s_profile(n):
        examples.append(n)


    def test_record(pytestconfig):
        torch_at_start = "torch" in sys.modules
        import torch
        from threadpoolctl import threadpool_info

        record = {
            "nanfuzz_loaded": pytestconfig.pluginmanager.has_plugin("nanfuzz"),
            "torch_at_start": torch_at_start,
            "triton_interpret": os.environ.get("TRITON_INTERPRET"),
            "torch_threads": torch.get_num_threads(),
            "pools": sorted((pool["internal_api"], pool["num_threads"]) for pool in threadpool_info()),
            "profile": settings.get_current_profile_name(),
            "max_examples": settings.default.max_examples,
            "examples": len(examples),
        }
        with open(os.environ["RECORD"], "w") as out:
            json.dump(record, out)
    """


@pytest.mark.parametrize("interpret", [None, "0"], ids=["TRITON_INTERPRET-unset", "TRITON_INTERPRET=0"])
def test_an_unrelated_session_runs_as_without_nanfuzz(tmp_path, interpret):
    _write(tmp_path, {"conftest.py": USER_PROFILE, "test_unrelated.py": UNRELATED_TESTS})
    records = {}
    for name, args in (("with", ()), ("without", ("-p", "no:nanfuzz"))):
        env = _clean_env(TRITON_INTERPRET=interpret, RECORD=str(tmp_path / f"{name}.json"))
        proc = _pytest(tmp_path, *args, env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        records[name] = json.loads((tmp_path / f"{name}.json").read_text())
    with_, without = records["with"], records["without"]
    assert with_.pop("nanfuzz_loaded") and not without.pop("nanfuzz_loaded")
    assert with_ == without
    assert with_["triton_interpret"] == interpret
    assert with_["torch_at_start"] is False
    assert (with_["profile"], with_["max_examples"]) == ("dev", 5) and 1 <= with_["examples"] <= 5


ORACLE_KERNEL = """
    from nanfuzz import Capabilities, Kernel
    from nanfuzz.reference.oracle import oracle


    def run(batch, out):
        out.copy_(oracle(batch).to(out.dtype))


    KERNEL = Kernel("oracle_kernel:KERNEL", run, Capabilities(dtypes=("float32",), interpreter_dtypes=("float32",)))
    """

CAMPAIGN_TESTS = """
    import os


    def test_campaigns(nanfuzz, monkeypatch):
        import torch

        import nanfuzz.harness.campaign.runner as engine
        from oracle_kernel import KERNEL

        seeds = []

        def spy(*args, **options):
            seeds.append(args[1].seed if len(args) > 1 else options.get("seed"))
            return real(*args, **options)

        real = engine.fuzz
        monkeypatch.setattr(engine, "fuzz", spy)
        assert nanfuzz.fuzz(KERNEL, max_examples=2, use_database=False).examples == 2
        assert nanfuzz.fuzz(KERNEL, max_examples=3, seed=11, use_database=False).examples == 3
        assert seeds == [int(os.environ["EXPECTED_SEED"]), 11]
        assert nanfuzz.device == "cpu" and os.environ["TRITON_INTERPRET"] == "1"
        assert torch.get_num_threads() == 1
    """


def test_a_session_that_uses_nanfuzz_keeps_the_user_s_profile_and_honours_hypothesis_options(tmp_path):
    _write(tmp_path, {"conftest.py": USER_PROFILE, "oracle_kernel.py": ORACLE_KERNEL,
                      "test_a_campaigns.py": CAMPAIGN_TESTS, "test_b_unrelated.py": UNRELATED_TESTS})
    env = _clean_env(RECORD=str(tmp_path / "record.json"), EXPECTED_SEED="7", CUDA_VISIBLE_DEVICES="",
                     HIP_VISIBLE_DEVICES="", NANFUZZ_STATE_DIR=str(tmp_path / "state"))
    proc = _pytest(tmp_path, "--hypothesis-seed", "7", "--hypothesis-show-statistics", env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = json.loads((tmp_path / "record.json").read_text())
    assert (record["profile"], record["max_examples"]) == ("dev", 5) and 1 <= record["examples"] <= 5
    summary = proc.stdout[proc.stdout.index("nanfuzz campaign statistics"):]
    assert "oracle_kernel:KERNEL on cpu: 2 examples (2 PASS)" in summary
    assert "oracle_kernel:KERNEL on cpu: 3 examples (3 PASS)" in summary


def test_nanfuzz_s_hypothesis_profiles_are_there_only_when_asked_for(tmp_path):
    _write(tmp_path, {"test_profile.py": """
        from hypothesis import settings

        def test_profile():
            assert settings.get_current_profile_name() == "nanfuzz-ci"
            assert settings.default.derandomize and settings.default.database is None
        """})
    proc = _pytest(tmp_path, "--hypothesis-profile", "nanfuzz-ci", env=_clean_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr


WRONG_MODE_KERNELS = """
    import triton
    import triton.language as tl


    @triton.jit
    def add_one(X):
        tl.store(X, tl.load(X) + 1)
    """


@pytest.fixture
def kernel_imported_by_a_conftest(tmp_path):
    _write(tmp_path, {"user_kernels.py": WRONG_MODE_KERNELS, "conftest.py": "import user_kernels  # noqa: F401\n",
                      "test_kernel.py": "def test_kernel(nanfuzz_device):\n    assert nanfuzz_device == 'cpu'\n"})
    return tmp_path


def _no_gpu_env(**extra) -> dict[str, str]:
    return _clean_env(CUDA_VISIBLE_DEVICES="", HIP_VISIBLE_DEVICES="", **extra)


def test_a_kernel_imported_before_the_interpreter_was_chosen_is_one_clear_error(kernel_imported_by_a_conftest):
    proc = _pytest(kernel_imported_by_a_conftest, env=_no_gpu_env())
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if "nanfuzz: Triton kernels user_kernels.add_one" in line]
    assert lines, proc.stdout
    assert "were imported before nanfuzz chose Triton's interpreter" in lines[0]
    assert "set TRITON_INTERPRET=1" in lines[0] and "--nanfuzz-device cpu" in lines[0]
    assert "CRASH" not in proc.stdout and "Traceback" not in proc.stdout


def test_with_an_option_the_same_mistake_is_a_usage_error(kernel_imported_by_a_conftest):
    proc = _pytest(kernel_imported_by_a_conftest, "--nanfuzz-device", "cpu", env=_no_gpu_env())
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, proc.stdout + proc.stderr
    error = [line for line in proc.stderr.splitlines() if line.startswith("ERROR: nanfuzz:")]
    assert len(error) == 1 and "user_kernels.add_one" in error[0]
    assert error[0].endswith("set TRITON_INTERPRET=1 in the environment before pytest starts")


def test_a_kernel_imported_under_the_interpreter_is_accepted(kernel_imported_by_a_conftest):
    proc = _pytest(kernel_imported_by_a_conftest, env=_no_gpu_env(TRITON_INTERPRET="1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_importing_the_plugin_imports_nothing_heavy(tmp_path):
    # what makes it cheap (about 5 ms on a loaded 2-core machine): a handful of nanfuzz's own modules
    code = ("import sys, pytest; before = set(sys.modules); import nanfuzz.harness.plugin; "
            "print(' '.join(sorted(set(sys.modules) - before)))")
    imported = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_clean_env(), capture_output=True,
                              text=True, check=True).stdout.split()
    assert "nanfuzz.harness.plugin" in imported
    assert not [m for m in imported if m.split(".")[0] in ("torch", "triton", "hypothesis", "numpy")], imported


# -- what a session that uses nanfuzz gets (in this process, with the backend stubbed) ------------

class _Config:
    def __init__(self, worker: str | None = None):
        from nanfuzz.harness import plugin

        self.stash = pytest.Stash()
        self.stash[plugin._USE] = plugin._Use()
        if worker:
            self.workerinput = {"workerid": worker}

    def getoption(self, name, default=None):
        return default


def test_xdist_worker_n_takes_gpu_n_mod_count(monkeypatch):
    import torch

    from nanfuzz.harness import plugin
    from nanfuzz.harness.launch import backend

    monkeypatch.setattr(backend, "choose_backend", lambda device: "cuda")
    monkeypatch.setattr(backend, "wrong_mode_kernels", lambda device: [])  # this session's kernels are interpreted
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    for worker in ("gw1", "gw6"):
        config = _Config(worker)
        assert plugin._activate(config, early=False) == "cuda"
        config.stash[plugin._USE].undo.close()
    assert chosen == [1, 2]


def test_on_the_cpu_one_host_thread_while_in_use_then_the_user_s_again(monkeypatch):
    import torch

    from nanfuzz.harness import plugin

    session = torch.get_num_threads()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    try:
        torch.set_num_threads(2)
        config = _Config()
        assert plugin._activate(config, early=False) == "cpu"
        assert torch.get_num_threads() == 1
        config.stash[plugin._USE].undo.close()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(session)


def test_a_campaign_s_statistics_reach_the_summary_when_it_has_them():
    from nanfuzz.harness.campaign.result import Campaign
    from nanfuzz.harness.plugin import _campaign_record

    campaign = Campaign(kernel="k", device="cpu", examples=4, verdicts={"PASS": 3, "NONFINITE": 1}, elapsed=1.5)
    assert _campaign_record(campaign)["statistics"] == ""
    from collections import Counter

    from nanfuzz.harness.report.statistics import Statistics

    campaign.statistics = Statistics(examples=4, counts=Counter({"decode": 4, "window": 1}))
    record = _campaign_record(campaign)
    assert record["statistics"] == campaign.statistics.table() and "decode" in record["statistics"]
    assert record["verdicts"] == {"PASS": 3, "NONFINITE": 1}


def test_the_project_s_own_kernels_match_the_mode_this_session_chose():
    from nanfuzz.harness.launch import backend
    from nanfuzz.harness.registry import builtin_kernels

    builtin_kernels()
    from nanfuzz.harness.kernels._common import INTERPRETED

    here, other = ("cpu", "cuda") if INTERPRETED else ("cuda", "cpu")
    assert backend.wrong_mode_kernels(here) == []
    assert "nanfuzz.harness.kernels.paged_decode._paged_decode_kernel" in backend.wrong_mode_kernels(other)
