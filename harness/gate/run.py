"""nanfuzz PR gate: fuzz kernels on every GPU of a runner, one pytest-xdist worker per GPU.

    nanfuzz gate [--kernel K ...] [--time-budget SECONDS] [--profile pr-gate|nightly]
    nanfuzz gate merge [--out DIR] RUNNER_OUTPUT ...

Each kernel's campaign is cut into one shard per worker (different seeds,
one shared Hypothesis example database, so a failure found once is replayed
first next time).  Without a GPU the workers run Triton's interpreter on the
CPU.  Writes a Markdown summary (also to ``$GITHUB_STEP_SUMMARY``), JUnit
XML and every repro into one folder.  Exit 0: every shard passed; 1: a
finding; 2: a usage or configuration error; 3: no finding, but no pass either
(a shard that did not finish, a kernel under its floor of examples).

A fleet of runners shares one example database on a server (``--example-db
redis://HOST:PORT/DB``), each runner takes its shard of the work (``--shard
I/N``), and ``nanfuzz gate merge`` merges their outputs into one report.
"""
from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from nanfuzz.harness.adapters.sources import add_source_options, environment_variable, given_trees_in_environment
from nanfuzz.harness.gate.plan import PLAN_ENV, SLOT_ENV, Plan
from nanfuzz.reference.errors import NanfuzzError, UnsupportedHere

# the pytest module each worker runs: one test per kernel (harness.gate.campaigns)
CAMPAIGN_TESTS = Path(__file__).resolve().parent / "campaigns.py"
DEFAULT_OUT = "nanfuzz-gate"
VLLM_KERNELS = ("vllm:rocm_attn", "vllm:triton_attn", "vllm:triton_mla", "vllm:triton_attn_diffkv",
                "vllm:rocm_segmented_attn")
AITER_KERNELS = ("aiter:unified_attention", "aiter:pa_decode", "aiter:pa_prefill", "aiter:chunked_pa_prefill")
SGLANG_KERNELS = ("sglang:decode", "sglang:extend")
FA_KERNELS = ("fa_amd:kvcache",)
LMDEPLOY_KERNELS = ("lmdeploy:decode", "lmdeploy:decode@block", "lmdeploy:prefill")
# A kernel library's source tree: the option (its variable is ``environment_variable(option)``), the
# kernels it adds by default.
LIBRARY_SOURCES = (("vllm_src", VLLM_KERNELS), ("aiter_src", AITER_KERNELS), ("sglang_src", SGLANG_KERNELS),
                   ("fa_src", FA_KERNELS), ("lmdeploy_src", LMDEPLOY_KERNELS))
MIN_BUDGET = 5.0  # seconds; below it not even one example fits beside the workers' start-up


class GateUsageError(NanfuzzError):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, like the nanfuzz command
        raise GateUsageError(f"{message} (see --help)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = _Parser(prog="nanfuzz gate", description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernel", action="append", default=[], metavar="NAME",
                   help="kernel to gate (repeatable): family@variant, vllm:rocm_attn, aiter:unified_attention (see "
                        "nanfuzz list) or package.module:callable (default: the fixed built-in variants, plus vllm:*, "
                        "aiter:*, sglang:*, fa_amd:* and lmdeploy:* when that library's source is configured)")
    add_source_options(p)
    p.add_argument("--profile", choices=("pr-gate", "nightly"), default="pr-gate",
                   help="campaign profile (default pr-gate)")
    p.add_argument("--time-budget", type=float, metavar="SECONDS",
                   help="wall time for the whole gate (default: the profile's, 900 s for pr-gate)")
    p.add_argument("--max-examples", type=int, metavar="N", help="also stop a shard after N examples")
    p.add_argument("--size", choices=("small", "production", "mixed"),
                   help="the size tier every shard draws (default: each kernel's own, else mixed on a GPU and small "
                        "under the interpreter)")
    p.add_argument("--window-only", action="store_true",
                   help="every shard draws only cases with a sliding window (name the kernels that take one with "
                        "--kernel)")
    p.add_argument("--min-examples", type=int, metavar="N",
                   help="examples each kernel must reach, over its shards, for a PASS; fewer is INCOMPLETE, not green "
                        "(default: 300 on a GPU, 10 under the interpreter, at most what --max-examples allows)")
    p.add_argument("--grace", type=float, metavar="SECONDS",
                   help="how long past the budget the gate waits before it stops the workers and reports the "
                        "in-flight cases as hangs (default: a quarter of the budget, at least 120 s)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="cuda: one worker per GPU (ROCm or CUDA); cpu: Triton's interpreter (default: GPU if present)")
    p.add_argument("--workers", type=int, metavar="N",
                   help="CPU: number of workers (default: cores, at most 8); GPU: use at most N GPUs")
    p.add_argument("--workers-per-gpu", type=int, default=1, metavar="N",
                   help="GPU: campaigns per GPU, one worker process each (default 1); a campaign is mostly Python, "
                        "so with spare CPU cores several per GPU find more per minute")
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR", help=f"output folder (default {DEFAULT_OUT}/)")
    p.add_argument("--repro-dir", metavar="DIR", help="where every repro is gathered (default OUT/repros)")
    p.add_argument("--junitxml", metavar="FILE", help="JUnit XML report (default OUT/junit.xml)")
    p.add_argument("--summary", metavar="FILE", help="Markdown summary (default OUT/summary.md; also appended to "
                                                     "$GITHUB_STEP_SUMMARY when set)")
    p.add_argument("--state-dir", metavar="DIR",
                   help="example database and worker state, kept between runs (default $NANFUZZ_STATE_DIR or .nanfuzz)")
    p.add_argument("--example-db", metavar="URL",
                   help="example database: a folder (default STATE/examples), redis://HOST:PORT/DB (a Redis or Valkey "
                        "server the fleet shares, with STATE/examples in front of it), or readonly:STORE to read a "
                        "server or folder without writing to it (default $NANFUZZ_EXAMPLE_DB)")
    p.add_argument("--shard", metavar="I/N", type=_shard,
                   help="this runner is shard I of N runners: it takes its share of the kernels and fuzzes "
                        "specialisation pools no other runner does; merge the runners' outputs with nanfuzz gate merge")
    p.add_argument("--runner-name", metavar="NAME",
                   help="this runner's name in a merged report (default $RUNNER_NAME, else the host name)")
    args = p.parse_args(argv)
    for flag, value in (("--time-budget", args.time_budget), ("--grace", args.grace)):
        if value is not None and not math.isfinite(value):
            raise GateUsageError(f"{flag}={value:g} must be a finite number of seconds")
    if args.time_budget is not None and args.time_budget < MIN_BUDGET:
        raise GateUsageError(f"--time-budget={args.time_budget:g} is too small; give at least {MIN_BUDGET:g} seconds")
    if args.grace is not None and args.grace <= 0:
        raise GateUsageError(f"--grace={args.grace:g} must be > 0 seconds")
    if args.min_examples is not None and args.min_examples < 0:
        raise GateUsageError(f"--min-examples={args.min_examples} must be >= 0")
    if args.max_examples is not None and args.max_examples < 1:
        raise GateUsageError(f"--max-examples={args.max_examples} must be >= 1")
    return args


def _shard(text: str) -> tuple[int, int]:
    index, _, count = text.partition("/")
    if not (index.isdigit() and count.isdigit() and 1 <= int(index) <= int(count)):
        raise argparse.ArgumentTypeError(f"{text!r} is not I/N with 1 <= I <= N (e.g. 2/4)")
    return int(index), int(count)


# -- planning -------------------------------------------------------------------------

def deal(kernels: list[str], shard: int, shards: int) -> list[str]:
    """Runner ``shard`` of ``shards``' kernels: dealt round like cards, so each kernel goes to one
    runner; with more runners than kernels the deal goes round again, every runner gets one, and the
    runners that share a kernel fuzz different pools with different seeds."""
    if len(kernels) >= shards:
        return kernels[shard - 1::shards]
    return [kernels[(shard - 1) % len(kernels)]]


def finish_reserve(budget: float) -> float:
    """Seconds kept at the end of the budget for shrinking a late failure and writing the reports."""
    return min(60.0, 0.05 * budget)


def default_grace(budget: float) -> float:
    """How long past the budget the gate waits before it stops the workers (shrinking, a slow last example)."""
    return max(120.0, 0.25 * budget)


def choose_kernels(names: list[str], device: str) -> list[str]:
    """The kernels to gate, each resolved here once (a user's module imported first in a probe
    process, within the default launch timeout: an import that never ends ends the gate)."""
    from nanfuzz.harness.campaign.settings import DEFAULT_LAUNCH_TIMEOUT
    from nanfuzz.harness.launch.import_probe import import_first
    from nanfuzz.harness.registry import builtin_kernels, is_user_spec, resolve

    defaults = not names
    if defaults:
        names = [k.name for k in builtin_kernels().values() if k.expect == "pass"]
        names += [name for option, kernels in LIBRARY_SOURCES if os.environ.get(environment_variable(option))
                  for name in kernels]
    chosen = []
    for name in dict.fromkeys(names):
        if is_user_spec(name):
            import_first(name, device, DEFAULT_LAUNCH_TIMEOUT[device], timeout_source="the default launch timeout")
        try:
            kernel = resolve(name, **library_sources())
        except UnsupportedHere as exc:
            if not defaults:
                raise
            print(f"nanfuzz gate: left out {name}: {exc}", file=sys.stderr, flush=True)
            continue
        caps = kernel.capabilities
        if device == "cpu" and not caps.runnable_dtypes(interpreter=True):
            raise GateUsageError(f"kernel {name}: no dtype of {', '.join(caps.dtypes)} runs under Triton's "
                                 "interpreter; run the gate on a GPU runner or leave this kernel out")
        chosen.append(name)  # the name as given: the workers resolve it again
    return chosen


def library_sources() -> dict[str, str | None]:
    """Each kernel library's source tree, as ``resolve()`` takes them, from the environment the workers share."""
    return {option: os.environ.get(environment_variable(option)) or None for option, _ in LIBRARY_SOURCES}


def prepare_state(state_dir: Path, slots: list[str]) -> None:
    """The shared database at STATE/examples; each slot's NANFUZZ_STATE_DIR links to it."""
    shared = state_dir / "examples"
    shared.mkdir(parents=True, exist_ok=True)
    for slot in slots:
        slot_dir = state_dir / "workers" / slot
        slot_dir.mkdir(parents=True, exist_ok=True)
        link = slot_dir / "examples"
        if link.is_symlink():
            link.unlink()
        elif link.is_dir():  # a copy that lost its link (an archive that followed links): fold it back in
            shutil.copytree(link, shared, dirs_exist_ok=True)
            shutil.rmtree(link)
        link.symlink_to(Path("..") / ".." / "examples", target_is_directory=True)


# -- running pytest --------------------------------------------------------------------

def pytest_command(plan: Plan, workers, junit: Path, restarts: int) -> list[str]:
    from nanfuzz.harness.gate.devices import default_cpu_workers, usable_cores

    specs = []
    threads = max(1, default_cpu_workers() // len(workers.slots))
    compile_jobs = max(1, usable_cores() // len(workers.slots))  # each GPU worker's share of the cores
    for slot in workers.slots:
        env = {SLOT_ENV: slot.name, "NANFUZZ_STATE_DIR": str(plan.slot_state_dir(slot.name)), **slot.env}
        if plan.device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = str(threads)
        if plan.device == "cuda" and "NANFUZZ_COMPILE_JOBS" not in os.environ:
            env["NANFUZZ_COMPILE_JOBS"] = str(compile_jobs)  # for its compile farm (harness.launch.farm)
        if any("//" in v for v in env.values()):
            raise GateUsageError(f"a worker's environment cannot carry '//' (execnet's separator): {env}")
        specs += ["--tx", "popen" + "".join(f"//env:{k}={v}" for k, v in env.items())]
    # --rootdir and --confcutdir at the gate's own folder: the repository under test keeps its
    # conftest.py files and its pytest configuration to itself; importlib mode leaves sys.path alone
    here = str(CAMPAIGN_TESTS.parent)
    command = [sys.executable, "-m", "pytest", str(CAMPAIGN_TESTS), "--rootdir", here, "--confcutdir", here,
               "--import-mode=importlib",
               "--dist", "each", *specs, f"--max-worker-restart={restarts}",
               "--nanfuzz-device", plan.device, "-p", "no:cacheprovider", "-o", "addopts=",
               "-q", "-rfE", f"--junitxml={junit}"]
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        command[3:3] = ["-p", "xdist.plugin", "-p", "nanfuzz.harness.plugin"]
    elif not plugin_installed():
        command[3:3] = ["-p", "nanfuzz.harness.plugin"]  # nanfuzz from a checkout on PYTHONPATH
    return command


def plugin_installed() -> bool:
    """Whether pytest loads nanfuzz's plugin by itself: through the entry point an installed nanfuzz
    declares (a checkout on PYTHONPATH declares none, and pytest would refuse --nanfuzz-device)."""
    from importlib.metadata import entry_points

    return any(ep.value == "nanfuzz.harness.plugin" for ep in entry_points(group="pytest11"))


def run_pytest(command: list[str], env: dict, log_path: Path, hard_stop: float) -> tuple[int, bool, float]:
    """Run pytest, echoing and logging its output; stop its process group at ``hard_stop``.

    Returns (exit code, stopped at the deadline, when it ended)."""
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   start_new_session=True)

        def pump():
            for line in process.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
                log.write(line)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        stopped = False
        try:
            process.wait(timeout=max(1.0, hard_stop - time.time()))
        except subprocess.TimeoutExpired:
            stopped = True
            print("\nnanfuzz gate: past the deadline; stopping pytest and its workers", flush=True)
            _stop_group(process)
        except KeyboardInterrupt:
            _stop_group(process)
            raise
        ended = time.time()
        reader.join(timeout=10)
    return process.returncode, stopped, ended


def _stop_group(process: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(path: Path, lines: int = 5) -> str:
    text = path.read_text(errors="replace").strip().splitlines() if path.exists() else []
    return " | ".join(line.strip() for line in text[-lines:] if line.strip())


# -- main ------------------------------------------------------------------------------

def _terminated(signum, frame):
    raise KeyboardInterrupt  # a cancelled CI job: stop the workers too, they run in their own session


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _terminated)
    try:
        args = parse_args(argv)
        with given_trees_in_environment(args):
            return _gate(args)
    except NanfuzzError as exc:
        print(f"nanfuzz gate: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("nanfuzz gate: interrupted", file=sys.stderr)
        return 130


def _gate(args) -> int:
    started = time.time()
    from nanfuzz.harness.gate.devices import detect

    workers = detect(args.device, args.workers, per_gpu=args.workers_per_gpu)
    if workers.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before any @triton.jit module is imported
    for option, _ in LIBRARY_SOURCES:  # main() has set each as its variable, which the workers read
        given = getattr(args, option)
        if given and not Path(given).is_dir():
            flag = "--" + option.replace("_", "-")
            raise GateUsageError(f"{flag}={given!r} is not a directory; point it at a source checkout "
                                 "or an unpacked wheel")

    from nanfuzz.harness.gate.floor import apply_floor, floor
    from nanfuzz.harness.gate.outputs import append_step_summary, write_junit, write_summary, write_summary_json
    from nanfuzz.harness.gate.report import consolidate, junit_xml, markdown, remember_paths, summary_json
    from nanfuzz.harness.campaign.profiles import get_profile

    from nanfuzz.harness.campaign.example_db import check as check_example_db

    profile = get_profile(args.profile)
    shard, shards = args.shard or (1, 1)
    kernels = deal(choose_kernels(args.kernel, workers.device), shard, shards)
    budget = args.time_budget or profile.time_budget or 900.0
    example_db = args.example_db or os.environ.get("NANFUZZ_EXAMPLE_DB") or None
    store = check_example_db(example_db)  # a bad URL or a server that does not answer: exit 2 before anything runs
    runner = args.runner_name or os.environ.get("RUNNER_NAME") or socket.gethostname()

    out = Path(args.out).resolve()
    work = out / "internals"
    repro_dir = Path(args.repro_dir).resolve() if args.repro_dir else out / "repros"
    junit = Path(args.junitxml).resolve() if args.junitxml else out / "junit.xml"
    summary = Path(args.summary).resolve() if args.summary else out / "summary.md"
    state_dir = Path(args.state_dir or os.environ.get("NANFUZZ_STATE_DIR") or ".nanfuzz").resolve()
    shutil.rmtree(work, ignore_errors=True)
    if not args.repro_dir:
        shutil.rmtree(repro_dir, ignore_errors=True)
    for folder in (work, repro_dir, junit.parent, summary.parent):
        folder.mkdir(parents=True, exist_ok=True)
    slots = [s.name for s in workers.slots]
    prepare_state(state_dir, slots)

    plan = Plan(device=workers.device, profile=profile.name, kernels=kernels, slots=slots,
                deadline=started + budget - finish_reserve(budget), max_examples=args.max_examples,
                state_dir=str(state_dir), work_dir=str(work), example_db=example_db, shard=shard, shards=shards,
                runner=runner, size=args.size, window_only=args.window_only)
    plan_path = work / "plan.json"
    plan.write(plan_path)
    database = (f"{store.shown}, with {plan.examples_dir} in front" if store is not None and store.layered
                else store.location if store is not None else plan.examples_dir)
    fleet = f"runner {runner}, shard {shard}/{shards}; " if shards > 1 else ""
    print(f"nanfuzz gate: {fleet}{len(kernels)} kernel(s) x {len(slots)} shard(s) on {workers.description}; "
          f"profile {profile.name}, budget {budget:.0f} s\n"
          f"  kernels: {', '.join(kernels)}\n  example database: {database}", flush=True)

    env = dict(os.environ)
    env[PLAN_ENV] = str(plan_path)
    # the repository the gate runs in: its kernels import as package.module:callable
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd()] + [p for p in [env.get("PYTHONPATH")] if p])
    pytest_junit = work / "pytest-junit.xml"
    log = work / "pytest.log"
    command = pytest_command(plan, workers, pytest_junit, restarts=len(slots) * len(kernels))
    grace = args.grace or default_grace(budget)
    rc, stopped, ended = run_pytest(command, env, log, hard_stop=started + budget + grace)

    if rc == 4 and not stopped:
        raise GateUsageError(f"pytest rejected the gate's command line (exit 4): {_tail(log, 3)}")
    if rc == 5 and not stopped:
        raise GateUsageError(f"pytest ran no gate test (exit 5): {_tail(log, 2)}; look for -k, -m or --deselect in "
                             f"PYTEST_ADDOPTS, or see {log}")
    result = consolidate(plan, repro_dir, stopped_at_deadline=stopped, stop_time=ended, pytest_junit=pytest_junit,
                         sources=library_sources())
    apply_floor(result, floor(args.min_examples, plan.device, args.max_examples, len(slots)))
    remember_paths(result, state_dir)
    if stopped:
        result.problems.append(f"the gate stopped pytest {grace:.0f} s past its time budget")
    elif rc not in (0, 1):
        result.problems.append(f"pytest ended with exit code {rc}: {_tail(log, 3)}")
    elif rc == 1 and not any(r.failed for r in result.rows):
        result.problems.append(f"pytest reported a failure that no shard explains; see {log}")
    exit_code = result.exit_code

    wall = time.time() - started
    replay = "nanfuzz replay" if shutil.which("nanfuzz") else f"{Path(sys.executable).name} -m nanfuzz replay"
    text = markdown(result, plan, workers=workers.description, budget=budget, wall=wall, replay_prefix=replay)
    write_summary(summary, text)
    write_summary_json(out / "summary.json", summary_json(result, plan, exit_code=exit_code, wall=wall))
    write_junit(junit, junit_xml(result, {"profile": plan.profile, "device": plan.device}, replay_prefix=replay))
    append_step_summary(text)
    print("\n" + text, flush=True)
    print(f"nanfuzz gate: {'PASS' if result.passed else 'FAIL'} in {wall:.0f} s; summary {summary}, "
          f"JUnit {junit}, repros {repro_dir}", flush=True)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
