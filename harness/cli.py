"""The ``nanfuzz`` command: list, fuzz, replay, export, gate, bench, perf.  Exit 0 / 1 (a failure) / 2 (usage)."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import warnings
from pathlib import Path

from nanfuzz.reference.case import DTYPES, KV_CACHE_DTYPES, SCALE_MODES
from nanfuzz.reference.errors import NanfuzzError
from nanfuzz.reference.features import POISON_CLASS_NAMES

# The command's start, near enough: a ``nanfuzz`` command loads this module first (the JSON's timeline)
_BEGAN = time.time()

# strategies.cases.TIERS, named here so that the command line starts without Hypothesis
TIERS = ("small", "production", "mixed")

DEFAULT_REPRO_DIR = ".nanfuzz/repros"
# Examples the self-check gives a kernel whose campaigns draw production sizes only.
SELF_CHECK_PRODUCTION_EXAMPLES = 24
# How many of its first cases the self-check's farm builds for a campaign of an old variant, which fails
# within its first dozen examples (1 to 10 in the interpreter's self-check) and then shrinks, and of a
# fixed one, which passes: all the cases its search draws (None), drawn ahead in milliseconds each, so
# that the farm compiles what the campaign runs and its worker compiles nothing itself (one case per
# entry left the worker of unified@masked a dozen compiles, 15 of its 25 s on an H200); after each
# campaign's first cases, one case of each of its pool entries: its simplest, where a shrink heads,
# and in a campaign of production cases also its production one: the split-KV family's bug needs a
# sequence past one partition, so its shrink heads to each entry's split path, not its simplest case.
SELF_CHECK_FIRST_CASES = {"caught": 16, "pass": None}
SELF_CHECK_SAMPLES = {"small": 1, "mixed": 2, "production": 2}
# The pool a self-check campaign draws from on a GPU, where --pool does not say: compiling its
# entries is most of a cold self-check (16 entries, every variant's own binaries: 134 entries and
# 500 s of compiling over 16 processes, 46 s on one H100; 8: 78 entries, 263 s, 34 s), and a
# variant's bug is in every shape.
SELF_CHECK_POOL = 8
# Seconds a self-check campaign shrinks its failure before the smallest case so far stands: the
# self-check shows that each old variant is caught and shrunk, and its time is its slowest shrink's
# (split_decode@drops-last-partition's MISMATCH, each step a production case to build: 7.5 to 28 s
# on one H100; paged_decode@tail-masked under the interpreter: 43 s of an 89 s self-check on 2 cores).
# A campaign of its own shrinks for Settings.shrink_budget.
SELF_CHECK_SHRINK_BUDGET = 10.0


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2, like every other usage error
        print(f"nanfuzz: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def _parser() -> argparse.ArgumentParser:
    from nanfuzz import __version__
    from nanfuzz.harness.adapters.sources import add_source_options

    parser = _Parser(prog="nanfuzz", description="NaN-poisoning fuzzer for paged-attention Triton kernels")
    parser.add_argument("--version", action="version", version=f"nanfuzz {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{list,fuzz,replay,export,gate,bench,perf}",
                                parser_class=_Parser)

    def common(p):
        p.add_argument("--device", choices=("cpu", "cuda"), help="cuda: the GPU; cpu: Triton's interpreter (default: GPU if present)")
        add_source_options(p)
        p.add_argument("--state-dir", metavar="DIR",
                       help="pending-case journals and the example database (default $NANFUZZ_STATE_DIR or .nanfuzz)")
        p.add_argument("--launch-timeout", type=float, metavar="S",
                       help="a launch that does not return within S seconds is a HANG (compiles excluded; "
                            "default 60 on a GPU, 300 under the interpreter)")
        p.add_argument("--no-isolation", action="store_true",
                       help="run launches in this process, not a supervised worker (for debugging; a kernel that "
                            "kills its process then ends the campaign)")

    def focus_options(p):
        p.add_argument("--decode-only", action="store_true")
        p.add_argument("--prefill-only", action="store_true")
        p.add_argument("--no-window", action="store_true")
        p.add_argument("--window-only", action="store_true",
                       help="only cases with a sliding window (implied by --poison out-of-window alone)")
        p.add_argument("--causal-only", action="store_true")
        p.add_argument("--non-causal-only", action="store_true")
        p.add_argument("--dtype", choices=DTYPES)
        p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES,
                       help="fuzz only this KV-cache dtype (auto: unquantized; fp8 with per-tensor or per-token-head "
                            "scales; int8 with per-token-head scales; uint8, uint4, uint3: unsigned codes with a scale "
                            "and zero point per token and head); default: every one the kernel takes and the "
                            "device runs")
        p.add_argument("--kv-scales", choices=SCALE_MODES,
                       help="quantized caches with per-tensor scales only, or per-token-head scale caches only")
        p.add_argument("--poison", action="append", metavar="CLASS",
                       choices=POISON_CLASS_NAMES,
                       help="poison only this dead-slot class (repeatable): " + ", ".join(POISON_CLASS_NAMES)
                            + "; out-of-window alone draws only windowed cases")

    def size_option(p):
        p.add_argument("--size", choices=TIERS,
                       help="how large cases get: small (fast, shrinks well), production (128k-key sequences, 256 "
                            "sequences, 128 query heads, caches past 2^31 elements), or mixed (mostly small, a steady "
                            "share at production size); default: the kernel's own, else mixed on a GPU and small "
                            "under the interpreter")

    def compile_options(p):
        p.add_argument("--pool", type=int, metavar="N",
                       help="draw each case's compile-time part (shape, causality, window, sinks) from a pool of N "
                            "per campaign; 0: draw freely (default: the kernel's own pool on a GPU, none under the "
                            "interpreter)")
        p.add_argument("--compile-jobs", type=int, metavar="N",
                       help="on a GPU, compile the pool's kernel specialisations ahead of the search in N processes "
                            "(default: one per core; 0: compile each one when the search first meets it)")

    p = sub.add_parser("list", help="kernels, variants, capabilities, where they run")
    common(p)

    p = sub.add_parser("fuzz", help="fuzz one kernel, or self-check every built-in kernel")
    common(p)
    p.add_argument("--kernel", action="append", metavar="KERNEL",
                   help="family@variant, vllm:rocm_attn, aiter:unified_attention (see nanfuzz list) or "
                        "package.module:callable (repeatable: one campaign each, in turn); omit to self-check every "
                        "built-in kernel")
    p.add_argument("--max-examples", type=int, metavar="N", help="examples per kernel (default: from the profile)")
    p.add_argument("--seed", type=int, metavar="S", help="fix Hypothesis's seed")
    p.add_argument("--pool-seed", type=int, metavar="P",
                   help="the specialisation pool's seed (default: the seed, else 0)")
    p.add_argument("--pool-round", type=int, metavar="R",
                   help="the pool's round (default: 0 with --seed or --pool-seed, else the state folder's next "
                        "round of the kernel's pool)")
    p.add_argument("--repro-dir", metavar="D", help=f"where repros go (default STATE/repros: {DEFAULT_REPRO_DIR})")
    p.add_argument("--profile", choices=("dev", "ci", "pr-gate", "nightly"), help="default: ci under CI=true, else dev")
    p.add_argument("--time-budget", type=float, metavar="SECONDS", help="wall-time bound per kernel")
    p.add_argument("--no-shrink", action="store_true", help="report the first failing case without shrinking it")
    p.add_argument("--min-examples", type=int, metavar="N",
                   help="a kernel that passes on fewer than N examples is INCOMPLETE, not a pass (exit 3)")
    focus_options(p)
    p.add_argument("--strict-reads", action="store_true",
                   help="a case whose traced loads address a dead slot is a finding (DEAD_READ) even when its value "
                        "never reaches the output (Triton's interpreter only)")
    p.add_argument("--no-target", action="store_true",
                   help="report nothing to Hypothesis's target() (dead slots addressed, errors nearer the bound, "
                        "rarely launched kernels); production cases still aim at their unmet targets")
    size_option(p)
    p.add_argument("--summary-json", metavar="FILE", help="also write the summary as JSON (with the statistics)")
    p.add_argument("--show-statistics", action="store_true",
                   help="after each kernel, the share of examples that exercised each situation (decode, windows, "
                        "each poison class a launch could reach, reused blocks, GQA, dtypes, block sizes, ...)")
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="campaigns at once on the device, one process each, sharing the examples and the "
                        "specialisation pool (default 1)")
    p.add_argument("--kernels-at-once", type=int, metavar="N",
                   help="with several kernels (the self-check, or --kernel repeated): the campaigns of N of them "
                        "at once, one process each, reported in order (default: one per core under the "
                        "interpreter; on a GPU all of the self-check's, and kernels named one at a time; with "
                        "--jobs, one kernel at a time)")
    p.add_argument("--example-db", metavar="URL",
                   help="the example database that replays known failures first: a folder (default STATE/examples), "
                        "redis://HOST:PORT/DB (a Redis or Valkey server shared by a fleet; needs nanfuzz[redis]), or "
                        "readonly:STORE to read a folder or server without writing to it (default $NANFUZZ_EXAMPLE_DB)")
    compile_options(p)

    p = sub.add_parser("replay", help="re-run a repro; exit 1 while it still fails")
    common(p)
    p.add_argument("file", metavar="FILE.json")
    p.add_argument("--kernel", help="replay against another kernel (e.g. the fixed variant)")

    p = sub.add_parser("export", help="a script (or a pytest file, or a bug report) that reproduces a repro's "
                                      "finding with torch and the kernel's library alone, without nanfuzz")
    common(p)
    p.add_argument("file", metavar="REPRO.json")
    p.add_argument("--pytest", action="store_true", help="a regression test for the kernel's own test suite instead")
    p.add_argument("--markdown", action="store_true", help="a bug report for the kernel's author instead")
    p.add_argument("--kernel", help="the kernel to export the call of (default: the repro's)")
    p.add_argument("-o", "--output", metavar="FILE",
                   help="where to write it (default: beside the repro: NAME_standalone.py, test_NAME.py, NAME.md)")

    # parsed by the gate's own parser (harness.gate.run, harness.gate.merge): this entry is for --help
    sub.add_parser("gate", add_help=False,
                   help="the PR gate: fuzz kernels on every GPU of this runner (nanfuzz gate --help); "
                        "nanfuzz gate merge DIR... merges the reports of a fleet of runners")

    p = sub.add_parser("bench", help="examples per second of the fuzz loop, and time to catch each known-bad kernel")
    common(p)
    p.add_argument("--kernel", action="append", metavar="K", help="kernel to bench (repeatable; default: every built-in kernel)")
    p.add_argument("--examples", type=int, default=100, metavar="N", help="examples per kernel for the throughput (default 100; 0: time to detect only)")
    p.add_argument("--seeds", type=int, default=5, metavar="N",
                   help="campaigns per known-bad kernel for the time to detect (default 5)")
    p.add_argument("--warmup", type=int, default=5, metavar="N", help="warm-up examples per kernel, not measured (default 5)")
    p.add_argument("--detect-examples", type=int, default=300, metavar="N",
                   help="a detection campaign gives up after N examples (default 300)")
    p.add_argument("--detect", action="store_true",
                   help="time to detect for every kernel benched, not only the known-bad built-ins")
    p.add_argument("--scaling", action="store_true",
                   help="the cost of an example against its live keys, at each size tier: milliseconds by phase, "
                        "peak GPU memory, keys per second")
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="throughput of N campaigns at once on the device, one process each (default 1)")
    p.add_argument("--seconds", type=float, metavar="S",
                   help="measure the throughput over S seconds of campaigning instead of a number of examples "
                        "(with --warmup 0 on an empty Triton cache: the cold-start figure)")
    focus_options(p)
    size_option(p)
    compile_options(p)
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--stacks", metavar="FILE",
                   help="sample each measured campaign's search thread every 5 ms and write the stacks seen, "
                        "with the microseconds each was seen for, to FILE (the collapsed lines flame-graph tools "
                        "read); the JSON and the output say where the search was outside the subject's checks")

    p = sub.add_parser("perf", help="is kernel A slower than baseline B on realistic decode and prefill shapes?")
    common(p)
    p.add_argument("--kernel", required=True, metavar="A", help="the kernel under test (e.g. the fixed variant)")
    p.add_argument("--baseline", required=True, metavar="B", help="the kernel to compare against (e.g. the old variant)")
    p.add_argument("--shape", choices=("decode", "prefill", "all"), default="all", help="which shapes (default all)")
    p.add_argument("--threshold", type=float, default=0.03, metavar="T",
                   help="exit 1 when A takes more than (1 + T) times B's time on a shape (default 0.03)")
    p.add_argument("--runs", type=int, default=20, metavar="N", help="interleaved rounds per kernel and shape (default 20)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    from nanfuzz.harness.launch.isolation import outlived_by_nothing

    as_program = argv is None  # called in-process (tests, scripts), the caller's process is not ours to sweep
    argv = sys.argv[1:] if argv is None else list(argv)
    with outlived_by_nothing() if as_program else contextlib.nullcontext():
        if argv[:1] == ["gate"]:
            return _gate(argv[1:])
        from nanfuzz.harness.adapters.sources import given_trees_in_environment
        from nanfuzz.harness.campaign.stop_signals import stopping_on_signals

        args = _parser().parse_args(argv)
        # SIGTERM and SIGHUP stop a campaign as Ctrl-C does
        with stopping_on_signals(), given_trees_in_environment(args):
            return _main(args)


def _main(args) -> int:
    try:
        _check_numbers(args)  # before anything starts
        _check_outputs(args)
        forks = args.command in ("fuzz", "bench") and not args.no_isolation
        if forks:
            from nanfuzz.harness.launch.processes import likely_backend, restart_fork_server, start_fork_server

            guess = likely_backend(args.device)
            if guess is not None:
                start_fork_server(guess)  # its imports of torch and Triton overlap with this process's own
        from nanfuzz.harness.launch.backend import choose_backend

        device = choose_backend(args.device)  # before any @triton.jit import
        if forks and guess != device:
            restart_fork_server()  # or start it: it is not running when there was no guess
        # The interpreter evaluates poisoned lanes in numpy; its NaN warnings are the point, not news.
        warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"triton\.runtime\.interpreter")
        settings = _settings(args, device)
        return {"list": _list, "fuzz": _fuzz, "replay": _replay, "export": _export, "bench": _bench,
                "perf": _perf}[args.command](args, settings)
    except NanfuzzError as exc:
        print(f"nanfuzz: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        from nanfuzz.harness.campaign.stop_signals import describe, exit_status, stop_signal

        print(f"nanfuzz: {describe(stop_signal())}", file=sys.stderr)
        return exit_status(found=False)


# Each numeric option's least value and whether that value itself is allowed (floats must also be
# finite): a NaN launch timeout would switch the watchdog off, a negative budget run no example.
_LEAST = {"--launch-timeout": (0.0, False), "--time-budget": (0.0, False), "--seconds": (0.0, False),
          "--threshold": (0.0, True), "--max-examples": (1, True), "--jobs": (1, True), "--pool": (0, True),
          "--compile-jobs": (0, True), "--examples": (0, True), "--seeds": (0, True), "--warmup": (0, True),
          "--detect-examples": (1, True), "--runs": (1, True), "--min-examples": (0, True),
          "--pool-seed": (0, True), "--pool-round": (0, True), "--kernels-at-once": (1, True)}


def _check_numbers(args) -> None:
    from nanfuzz.harness.campaign.settings import check_number

    for flag, (least, allowed) in _LEAST.items():
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None:
            check_number(flag, value, least, allowed)


def _check_outputs(args) -> None:
    """A file the command writes once its run is over can be written: known now, not after the run."""
    for flag in ("--json", "--summary-json", "--stacks"):
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is None:
            continue
        path = Path(value)
        folder = path.parent if str(path.parent) else Path(".")
        if path.is_dir():
            raise NanfuzzError(f"{flag} {value!r} is a folder; name a file")
        if not folder.is_dir():
            raise NanfuzzError(f"{flag} {value!r}: there is no folder {str(folder)!r}")
        if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
            raise NanfuzzError(f"{flag} {value!r} cannot be written here (permission denied)")


def _write_json(flag: str, path: str, payload) -> None:
    from nanfuzz.harness.report.atomic import write_atomically

    try:
        write_atomically(path, json.dumps(payload, indent=1, default=str))
    except OSError as exc:
        raise NanfuzzError(f"cannot write {flag} {path!r} ({exc.strerror})") from None


def _gate(argv: list[str]) -> int:
    """``nanfuzz gate ...`` and ``nanfuzz gate merge ...``: the gate parses its own options."""
    if argv[:1] == ["merge"]:
        from nanfuzz.harness.gate.merge import main as merge

        return merge(argv[1:])
    from nanfuzz.harness.gate.run import main as gate

    return gate(argv)


def _settings(args, device: str):
    """The one place the command line and the environment become Settings."""
    from nanfuzz.harness.campaign.settings import Settings

    options = dict(device=device, state_dir=_path(args.state_dir), vllm_src=args.vllm_src,
                   aiter_src=args.aiter_src, fa_src=args.fa_src, sglang_src=args.sglang_src,
                   lmdeploy_src=args.lmdeploy_src, launch_timeout=args.launch_timeout, isolation=not args.no_isolation)
    if args.command == "fuzz":
        options.update(repro_dir=_path(args.repro_dir), profile=args.profile, max_examples=args.max_examples,
                       time_budget=args.time_budget, seed=args.seed, shrink=not args.no_shrink,
                       jobs=args.jobs, example_db=args.example_db, strict_reads=args.strict_reads or None,
                       targeting=False if args.no_target else None)
        if args.pool_seed is not None or args.pool_round is not None:  # a pinned pool takes no next round
            options.update(pool_seed=args.pool_seed if args.pool_seed is not None else args.seed or 0,
                           pool_round=args.pool_round or 0)
    if args.command in ("fuzz", "bench"):
        options.update(focus=_focus(args), pool_size=args.pool, compile_jobs=args.compile_jobs, size=args.size)
    if args.command == "bench" and args.stacks:
        from nanfuzz.harness.campaign.stack_samples import INTERVAL

        options.update(sample_stacks=INTERVAL)
    settings = Settings.from_environment(**options)
    if args.command == "fuzz":
        from nanfuzz.harness.campaign.example_db import check

        check(settings.example_db)  # a bad URL or a server that does not answer: one line, exit 2, now
    return settings


def _path(value):
    return Path(value) if value else None


def _list(args, settings) -> int:
    device = settings.device
    from nanfuzz.harness.registry import builtin_kernels

    from nanfuzz.harness.judge import encodings

    rows = [("kernel", "expect", "runs on", "capabilities")]
    for kernel in builtin_kernels().values():
        caps = kernel.capabilities
        where = "gpu, cpu-interpreter (" + "/".join(d.replace("float", "fp") for d in caps.runnable_dtypes(True)) + ")"
        rows.append((kernel.name, kernel.expect, where, caps.describe()))
    from nanfuzz.harness.registry import library_kernel_names, resolve

    unavailable = set()
    for name in library_kernel_names(variants=True):
        if name.partition("@")[0] in unavailable:
            continue  # its variants load the same files
        try:
            kernel = resolve(name, **settings.sources)
            caps = kernel.capabilities
            where = "gpu, cpu-interpreter (" + "/".join(d.replace("float", "fp") for d in caps.runnable_dtypes(True)) + ")"
            rows.append((name, "-", where, "; ".join((caps.describe(), *kernel.notes))))
        except NanfuzzError as exc:
            unavailable.add(name)
            rows.append((name, "-", "unavailable", str(exc)))
    _table(rows)
    print(f"\nbackend now: {'GPU' if device == 'cuda' else 'CPU under Triton interpreter'}; "
          "user kernels: --kernel package.module:callable")
    print(f"kv caches (per-tensor / per-token-head scales): {encodings.describe(device)}")
    return 0


# On a terminal the last column of a table wraps at its width, never narrower than this; a log or a
# pipe gets every cell whole, on one line.
_LAST_COLUMN_MIN = 30


def _table(rows) -> None:
    import shutil
    import textwrap

    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lead = sum(widths[:-1]) + 2 * (len(widths) - 1)
    if sys.stdout.isatty():
        widths[-1] = min(widths[-1], max(_LAST_COLUMN_MIN, shutil.get_terminal_size().columns - lead - 1))
    for n, row in enumerate(rows):
        last = textwrap.wrap(str(row[-1]), widths[-1], break_on_hyphens=False, break_long_words=False) or [""]
        print("  ".join([*(str(c).ljust(w) for c, w in zip(row[:-1], widths)), last[0]]).rstrip())
        for more in last[1:]:
            print(" " * lead + more)
        if n == 0:
            print("  ".join("-" * w for w in widths))


def _focus(args):
    from nanfuzz.harness.campaign.focus import Focus

    return Focus(decode_only=args.decode_only, prefill_only=args.prefill_only, no_window=args.no_window,
                 window_only=args.window_only, causal_only=args.causal_only, non_causal_only=args.non_causal_only,
                 dtype=args.dtype,
                 poison_classes=tuple(args.poison) if args.poison else None,
                 kv_cache_dtype=args.kv_cache_dtype, kv_scales=args.kv_scales)


def _fuzz(args, settings) -> int:
    from nanfuzz.harness.campaign.example_db import parse
    from nanfuzz.harness.campaign.profiles import get_profile
    from nanfuzz.harness.campaign.scope import with_next_pool_round
    from nanfuzz.harness.launch.import_probe import load_kernel
    from nanfuzz.harness.registry import builtin_kernels

    profile = get_profile(settings.profile)
    kernels = [load_kernel(name, settings) for name in args.kernel] if args.kernel else list(builtin_kernels().values())
    self_check = args.kernel is None
    mode = "GPU" if settings.device == "cuda" else "CPU, Triton interpreter"
    isolation = "supervised worker" if settings.isolation else "in-process launches"
    shared = f", example database {parse(settings.example_db).shown}" if settings.example_db else ""
    print(f"nanfuzz fuzz: {len(kernels)} kernel(s), profile {profile.name}, {mode}, {isolation}{shared}", flush=True)
    rows = [("kernel", "expect", "verdict", "examples", "first failure", "shrink", "time", "result")]
    # the self-check fuzzes the pools its farm compiles; a campaign of a kernel named meets the
    # next round of its pool (no --seed: a few shapes the last run did not have)
    runs = [(kernel, _self_check_settings(kernel, settings, profile) if self_check else
             with_next_pool_round(kernel, settings)) for kernel in kernels]
    at_once = _kernels_at_once(args, settings, runs)
    if at_once > 1 and settings.device != "cpu":  # campaigns sharing a GPU: none draws what only one alone may
        runs = [(kernel, run.replace(campaigns_per_device=run.campaigns_per_device * at_once)) for kernel, run in runs]
    # The self-check's kernels are known up front: one farm compiles what their campaigns meet
    # first, in the order they run, while the first campaign starts; their first cases are drawn
    # once the campaigns are started (``_outcomes``).
    ahead = None
    if self_check:
        from nanfuzz.harness.campaign.compile_ahead import compile_ahead

        ahead = compile_ahead(runs, settings, _self_check_first_cases, SELF_CHECK_SAMPLES.__getitem__, at_once,
                              draw_later=True)
    try:
        return _fuzz_kernels(args, settings, profile, runs, at_once, self_check, rows, ahead)
    finally:
        if ahead is not None:
            ahead.close()


def _self_check_first_cases(kernel) -> int | None:
    """How many of a self-check campaign's first cases its farm builds ahead (``SELF_CHECK_FIRST_CASES``)."""
    return SELF_CHECK_FIRST_CASES["caught" if kernel.expect == "caught" else "pass"]


def _self_check_settings(kernel, settings, profile):
    """What the self-check runs a built-in at: a family whose bug and fix live at production size
    draws that size only, with a few dozen examples (each costs ten to a hundred small ones); the
    masking families, whose bugs every size shows, draw small cases, so that their pools compile
    in the time a self-check has; each shrinks for ``SELF_CHECK_SHRINK_BUDGET`` seconds at most."""
    from nanfuzz.harness.campaign.scope import campaign_tier

    if settings.device != "cpu" and settings.pool_size is None:
        settings = settings.replace(pool_size=SELF_CHECK_POOL)
    settings = settings.replace(shrink_budget=min(settings.shrink_budget, SELF_CHECK_SHRINK_BUDGET))
    if settings.size is not None:
        return settings
    if campaign_tier(kernel, settings) == "production":
        examples = settings.max_examples or min(profile.max_examples, SELF_CHECK_PRODUCTION_EXAMPLES)
        return settings.replace(max_examples=examples)
    return settings.replace(size="small")


def _campaign(kernel, kernel_settings, profile, handle, search_seed=None):
    """One kernel's campaign, here or over ``--jobs`` processes, with a progress line (``search_seed``:
    the one its first cases were drawn ahead with, in this process)."""
    from nanfuzz.harness.campaign.runner import Hooks, fuzz
    from nanfuzz.harness.campaign.jobs import fuzz_parallel
    from nanfuzz.harness.campaign.stop_signals import stop_requested
    from nanfuzz.harness.report.progress import Progress

    progress = Progress(kernel.name, target_examples=kernel_settings.max_examples or profile.max_examples,
                        time_budget=kernel_settings.time_budget if kernel_settings.time_budget is not None
                        else profile.time_budget)

    def show(examples: int, shrinking: bool) -> None:
        progress.update(examples, "shrinking" if shrinking else "searching")

    try:
        if kernel_settings.jobs > 1:  # the jobs' examples added up, as one campaign's
            return fuzz_parallel(kernel, kernel_settings, farm=handle, on_progress=show)
        return fuzz(kernel, kernel_settings, farm=handle, search_seed=search_seed,
                    hooks=Hooks(on_example=lambda c: show(c.examples, c.time_to_first_failure is not None),
                                interrupted=stop_requested))
    finally:
        progress.finish()


def _print_coverage(args, kernel, campaign) -> None:
    """The campaign's notes, its read-coverage claim, and with --show-statistics its tables."""
    from nanfuzz.harness.report import coverage
    from nanfuzz.harness.report.failures import print_notes

    print_notes(campaign)
    if not campaign.failed and campaign.statistics.counts[coverage.TRACED]:
        print(f"{kernel.name}: {coverage.claim(campaign.statistics)}", flush=True)
    if args.show_statistics:
        print(f"\n{kernel.name}: {campaign.statistics.table()}", flush=True)
        print(f"{kernel.name}: {coverage.table(campaign.statistics)}", flush=True)
        print(f"{kernel.name}: {campaign.accuracy.table()}", flush=True)


def rerun_options(campaign, kernel_settings, settings=None) -> str:
    """The options that draw ``campaign``'s cases again: its seed, and its pool's seed and round where
    ``--seed`` alone would pick another pool (an unseeded run fuzzes pool 0 in the state folder's
    next round), and its jobs (job i searches with seed + i).  ``settings``: the command's, where the
    self-check gave the campaign a size and examples of its own (then named, with the kernel)."""
    options = [f"--seed {campaign.seed}"]
    if campaign.pool_seed is not None and campaign.pool_seed != campaign.seed:
        options.append(f"--pool-seed {campaign.pool_seed}")
    if campaign.pool_round:
        options.append(f"--pool-round {campaign.pool_round}")
    if kernel_settings.jobs > 1:
        options.append(f"--jobs {kernel_settings.jobs}")
    if settings is not None:
        options.insert(0, f"--kernel {campaign.kernel}")
        if kernel_settings.size != settings.size:
            options.append(f"--size {kernel_settings.size}")
        if kernel_settings.max_examples != settings.max_examples:
            options.append(f"--max-examples {kernel_settings.max_examples}")
        if kernel_settings.pool_size != settings.pool_size:
            options.append(f"--pool {kernel_settings.pool_size}")
    return " ".join(options)


def _since_began(at: float | None) -> float | None:
    return None if at is None else round(at - _BEGAN, 3)


def _timeline(ahead) -> dict:
    """Seconds from the command's start: the self-check's first cases drawn for its farm (its campaigns
    start meanwhile, and begin their searches after), and the summary written; each campaign's
    ``began_s`` is beside them."""
    farm = ahead.farm if ahead is not None else None
    return {"first_cases_drawn_s": _since_began(farm.scheduled_at if farm is not None else None),
            "summary_s": _since_began(time.time())}


def _summary_entry(kernel, campaign, kernel_settings, verdict: str) -> dict:
    """The campaign's entry in --summary-json."""
    from nanfuzz.harness.campaign.scope import campaign_tier
    from nanfuzz.harness.registry import import_path
    from nanfuzz.harness.report import coverage

    return {"kernel": kernel.name, "import_path": import_path(kernel), "expect": kernel.expect,
            "seed": campaign.seed, "pool_seed": campaign.pool_seed, "pool_round": campaign.pool_round,
            "verdict": verdict, "examples": campaign.examples,
            "elapsed_s": round(campaign.elapsed, 3), "time_to_first_failure_s": campaign.time_to_first_failure,
            "examples_to_first_failure": campaign.examples_to_first_failure,
            "shrink_s": campaign.shrink_time, "repro": campaign.repro_paths,
            "summary": campaign.failure.summary if campaign.failed else verdict,
            "evidence": campaign.failure.evidence if campaign.failed else {},
            "notes": campaign.notes, "worker_restarts": campaign.worker_restarts,
            "statistics": campaign.statistics.to_dict(),
            "accuracy": campaign.accuracy.to_dict(),
            "read_coverage": coverage.claim(campaign.statistics),
            "highest_error_ratio": campaign.accuracy.highest(),
            "phase_seconds": {k: round(v, 4) for k, v in campaign.phase_times.items()},
            "cpu_seconds": {"campaign": round(campaign.cpu_seconds, 4),
                            "judging": round(campaign.judging_cpu_seconds, 4)},
            "time_to_first_example_s": campaign.time_to_first_example,
            "compiles": campaign.compiles, "deferred": campaign.deferred, "compile_farm": campaign.farm,
            "size": campaign_tier(kernel, kernel_settings), "paths_missed": campaign.paths_missed,
            "declined_for_memory": campaign.declined_for_memory,
            "judging_out_of_memory": campaign.judging_out_of_memory,
            "memory_waits": campaign.memory_waits, "memory_wait_s": round(campaign.memory_wait_seconds, 3),
            "memory_wait_causes": campaign.memory_wait_causes,
            "early_examples": campaign.early_examples, "past_budget": campaign.past_budget,
            "left_at_budget_end": campaign.left_at_budget_end,
            "began_s": _since_began(campaign.startup.get("started")), "startup_s": campaign.startup_seconds()}


def _fuzz_kernels(args, settings, profile, runs, at_once, self_check, rows, ahead) -> int:
    """Each run's campaign (a kernel and its settings; ``ahead``: the self-check's compile farm),
    ``at_once`` at a time; the table and the exit status."""
    from nanfuzz.harness.report.failures import report_failure

    summary = []
    all_good = True
    any_failure = False
    any_incomplete = False
    interrupted = False
    farm = ahead.farm if ahead is not None else None
    errors = []
    for index, outcome in _outcomes(profile, runs, at_once, ahead):
        kernel, kernel_settings = runs[index]
        if outcome is None:  # stopped before it had a result, or never started
            interrupted = True
            continue
        if isinstance(outcome, NanfuzzError):
            # one after another, the campaigns after it do not run
            later = "; the campaigns after it did not run" if at_once <= 1 and index < len(runs) - 1 else ""
            errors.append((outcome, later))
            all_good = False
            continue
        campaign = outcome
        _print_coverage(args, kernel, campaign)
        # stopped before its examples or time were spent, a campaign without a failure is no pass
        stopped = campaign.interrupted and not campaign.failed
        verdict = campaign.failure.verdict.value if campaign.failed else "STOPPED" if stopped else "PASS"
        incomplete = not campaign.failed and campaign.examples < (args.min_examples or 0)
        if incomplete:
            verdict, any_incomplete = "INCOMPLETE", True
            print(f"nanfuzz: {kernel.name} passed on {campaign.examples} examples, fewer than --min-examples "
                  f"{args.min_examples}: INCOMPLETE, not a pass", file=sys.stderr, flush=True)
        if campaign.failed:
            any_failure = True
            report_failure(kernel, campaign, settings)
        expected = (kernel.expect == "caught") == campaign.failed and not incomplete
        all_good &= expected
        result = "stopped" if stopped else ("ok" if expected else "UNEXPECTED") if self_check else (
            "FAIL" if campaign.failed else "INCOMPLETE" if incomplete else "ok")
        first = f"{campaign.examples_to_first_failure} ex/{campaign.time_to_first_failure:.1f}s" if campaign.failed and campaign.time_to_first_failure is not None else "-"
        shrink = f"{campaign.shrink_time:.1f}s" if campaign.shrink_time is not None else "-"
        rows.append((kernel.name, kernel.expect if self_check else "-", verdict, campaign.examples, first, shrink,
                     f"{campaign.elapsed:.1f}s", result))
        if campaign.seed is not None:
            rerun = rerun_options(campaign, kernel_settings, settings if self_check else None)
            # side by side on a GPU, a campaign drew as one of several on its device
            shared = kernel_settings.campaigns_per_device != settings.campaigns_per_device
            beside = f" with NANFUZZ_CAMPAIGNS_PER_DEVICE={kernel_settings.campaigns_per_device}" if shared else ""
            print(f"{kernel.name}: seed {campaign.seed} ({rerun} runs the same search{beside})", flush=True)
        summary.append(_summary_entry(kernel, campaign, kernel_settings, verdict))
        interrupted |= campaign.interrupted
    if errors and not any_failure:
        raise errors[0][0]
    for error, later in errors:  # a finding stands: its exit status, each kernel's trouble on one line beside it
        print(f"nanfuzz: {str(error).splitlines()[0]}{later}", file=sys.stderr, flush=True)
    print()
    _table(rows)
    compiled = farm.summary() if farm is not None else None
    if compiled:
        built = f"; {compiled['already_built']} built by an earlier run" if compiled["already_built"] else ""
        print(f"\ncompiled ahead: {compiled['compiled']} of {compiled['tasks']} cases of {compiled['entries']} pool entries in "
              f"{compiled['processes']} processes ({compiled['compile_seconds']:.0f} s of compiling{built})")
    if args.summary_json:
        try:
            _write_json("--summary-json", args.summary_json, {"device": settings.device, "profile": profile.name,
                                                              "kernels": summary, "compile_farm": compiled,
                                                              "timeline": _timeline(ahead)})
        except NanfuzzError as exc:  # the findings above stand: their exit status, this one line beside it
            print(f"nanfuzz: {exc}", file=sys.stderr)
    if interrupted:
        from nanfuzz.harness.campaign.stop_signals import describe, exit_status, stop_signal

        print(f"nanfuzz: {describe(stop_signal())}"
              + ("; the failure found before it is reported above" if any_failure else ""), file=sys.stderr)
        return exit_status(any_failure)
    if self_check:
        print("\nself-check: " + ("every old variant caught, every fixed variant passed" if all_good
                                  else "UNEXPECTED results above"))
        return 0 if all_good else 1 if any_failure or not any_incomplete else 3
    return 1 if any_failure else 3 if any_incomplete else 0


def _kernels_at_once(args, settings, runs) -> int:
    """How many of ``runs``' campaigns run at a time: ``--kernels-at-once``, else the device's
    default; one where a campaign has jobs (a run of jobs is its own processes)."""
    from nanfuzz.harness.campaign.side_by_side import default_at_once

    if any(run.jobs > 1 for _, run in runs):
        return 1
    return min(args.kernels_at_once or default_at_once(settings.device, len(runs), self_check=args.kernel is None),
               len(runs))


def _outcomes(profile, runs, at_once, ahead):
    """``(index, campaign or NanfuzzError or None)`` of each run in order: one after another, or
    ``at_once`` at a time, each in a process of its own (``harness.campaign.side_by_side``).
    None: a campaign stopped before it had a result.  One after another, none starts after a campaign
    stopped or raised; side by side, the others go on (a kernel's trouble is its own)."""
    from nanfuzz.harness.campaign.side_by_side import CampaignOrders, side_by_side
    from nanfuzz.harness.campaign.stop_signals import stop_requested
    from nanfuzz.harness.registry import import_path
    from nanfuzz.harness.report.progress import Progress

    if at_once <= 1:
        if ahead is not None:
            ahead.draw_first_cases()
        for index, (kernel, kernel_settings) in enumerate(runs):
            handle, seed = (ahead.handle(index), ahead.seeds[index]) if ahead is not None else (None, None)
            try:
                campaign = _campaign(kernel, kernel_settings, profile, handle, seed)
            except NanfuzzError as exc:
                yield index, exc
                return
            yield index, campaign
            if campaign.interrupted or stop_requested():
                return
        return
    # campaigns whose first cases the farm builds start their workers while those are drawn
    orders = [CampaignOrders(index, kernel.name, import_path(kernel), kernel_settings,
                             ahead.handle(index) if ahead is not None else None,
                             ahead.seeds[index] if ahead is not None else None, kernel.stands_in_for,
                             ahead.drawn if ahead is not None else None)
              for index, (kernel, kernel_settings) in enumerate(runs)]
    progress = Progress(f"{len(runs)} campaigns, {at_once} at once")
    try:
        yield from side_by_side(orders, at_once, on_progress=progress.update,
                                once_started=ahead.draw_first_cases if ahead is not None else None)
    finally:
        progress.finish()


def _replay(args, settings) -> int:
    from nanfuzz.harness.report.picture import picture
    from nanfuzz.harness.replay import replay

    result = replay(args.file, kernel_name=args.kernel, settings=settings)
    print(result.line())
    if result.still_fails:
        from nanfuzz.harness.report.repro import load_repro

        print(picture(load_repro(args.file)["case"]))
    return 1 if result.still_fails else 0


def _export(args, settings) -> int:
    from nanfuzz.harness.launch.import_probe import load_kernel
    from nanfuzz.harness.registry import import_path
    from nanfuzz.harness.report.export.bug_report import bug_report
    from nanfuzz.harness.report.export.script import pytest_file, standalone_script
    from nanfuzz.harness.report.repro import load_repro

    if args.pytest and args.markdown:
        raise NanfuzzError("--pytest and --markdown each choose what to write; give one of them")
    record = load_repro(args.file)
    kernel = load_kernel(args.kernel or record["kernel"], settings)
    source = Path(args.file)
    stem = source.stem.replace("-", "_").replace(".", "_")
    script_name = f"{stem}_standalone.py"
    if args.pytest:
        target, write = f"test_{stem}.py", pytest_file
    elif args.markdown:
        target, write = f"{stem}.md", lambda r, k, p, name: bug_report(r, k, p, script_name)
    else:
        target, write = script_name, standalone_script
    output = Path(args.output) if args.output else source.with_name(target)
    text = write(record, kernel, import_path(kernel), output.name)
    try:
        output.write_text(text, encoding="utf-8", errors="backslashreplace")
    except OSError as exc:
        raise NanfuzzError(f"cannot write {str(output)!r}: {exc.strerror}") from None
    print(f"nanfuzz export: {output}")
    return 0


def _bench(args, settings) -> int:
    device = settings.device
    from nanfuzz.harness.bench import bench, machine, report, table_rows
    from nanfuzz.harness.launch.import_probe import load_kernel
    from nanfuzz.harness.registry import builtin_kernels

    kernels = [load_kernel(name, settings) for name in args.kernel] if args.kernel else list(builtin_kernels().values())
    if args.scaling:
        return _scaling(args, settings, [k for k in kernels if args.kernel or k.expect == "pass"])
    started = machine()
    mode = "GPU" if device == "cuda" else "CPU, Triton interpreter"
    print(f"nanfuzz bench: {len(kernels)} kernel(s), {args.examples} examples each, {args.seeds} seed(s) per "
          f"known-bad kernel, {mode}; load average {started['load_average']}", flush=True)
    start = time.perf_counter()
    results = bench(kernels, settings=settings, examples=args.examples, seeds=args.seeds, warmup=args.warmup,
                    detect_examples=args.detect_examples, skip_unrunnable=not args.kernel, jobs=args.jobs,
                    detect_all=args.detect, seconds=args.seconds,
                    progress=lambda line: print(line, file=sys.stderr, flush=True))
    summary = report(results, device=device, examples=args.examples, seeds=args.seeds, started=started,
                     seconds=time.perf_counter() - start)
    print()
    _table(table_rows(results))
    specs = "each a compile, or a load from Triton's cache" if device == "cuda" else "each would be a compile on a GPU"
    print(f"\nms/ex: milliseconds per example by phase (gen: Hypothesis's drawing and engine; mem wait: for device "
          f"memory; admit: the judging process's time beside its phases, the memory ledger included; handoff: the "
          f"case to the worker and back; tally: statistics and targets after each check; start, close: a campaign's worker and farm started "
          f"(the first cases drawn ahead) and stopped; wait: for a binary "
          f"another process was compiling); new specs: kernel specialisations after the warm-up ({specs}); 1st ex s: seconds to the first "
          f"example; farm s: the compile farm's wall time; load average at the end "
          f"{summary['machine_at_end']['load_average']}")
    if args.stacks:
        _write_stacks(args.stacks, results)
    if args.json:
        _write_json("--json", args.json, summary)
    return 0


def _write_stacks(path: str, results) -> None:
    """``bench --stacks``: the sampled stacks to ``path``, and where each search was between checks."""
    from nanfuzz.harness.bench import where_the_search_was
    from nanfuzz.harness.campaign.stack_samples import collapsed
    from nanfuzz.harness.report.atomic import write_atomically

    sampled = [(r.kernel, r.throughput) for r in results if r.throughput is not None and r.throughput.stacks]
    for kernel, throughput in sampled:
        where = where_the_search_was(throughput.stacks, throughput.examples)
        print(f"\n{kernel}: {where['sampled_s']:.1f} s of the search thread sampled, {where['outside_checks_s']:.1f} s "
              "outside the subject's checks; there, ms/ex in the innermost frames it was in most:")
        for frame, ms in where["ms_per_example_outside_checks"][:8]:
            print(f"  {ms:8.2f}  {frame}")
    try:
        write_atomically(path, "".join(collapsed(t.stacks, kernel) for kernel, t in sampled))
    except OSError as exc:
        raise NanfuzzError(f"cannot write --stacks {path!r} ({exc.strerror})") from None


def _scaling(args, settings, kernels) -> int:
    from nanfuzz.harness.scaling import scaling, table_rows

    print(f"nanfuzz bench --scaling: {len(kernels)} kernel(s), "
          f"{'GPU' if settings.device == 'cuda' else 'CPU, Triton interpreter'}", flush=True)
    results = {}
    for kernel in kernels:
        results[kernel.name] = scaling(kernel, settings, progress=lambda line: print(line, file=sys.stderr, flush=True))
        print(f"\n{kernel.name}")
        _table(table_rows(results[kernel.name]))
    print("\nms/ex: a check's milliseconds (three launches, the oracle, the verdict) after one that compiled; "
          "peak GiB: the device memory a check held at most; huge: cases whose cache passes 2^31 elements")
    if args.json:
        _write_json("--json", args.json, {"device": settings.device, "scaling": results})
    return 0


def _perf(args, settings) -> int:
    device = settings.device
    from nanfuzz.harness.launch.import_probe import load_kernel
    from nanfuzz.harness.perf import perf, table_rows

    kernel, baseline = load_kernel(args.kernel, settings), load_kernel(args.baseline, settings)
    mode = "GPU, triton.testing.do_bench" if device == "cuda" else "CPU, Triton interpreter, tiny shapes, wall clock"
    print(f"nanfuzz perf: {kernel.name} against {baseline.name}, {args.runs} interleaved rounds, {mode}", flush=True)
    result = perf(kernel, baseline, device=device, which=args.shape, threshold=args.threshold, runs=args.runs,
                  progress=lambda line: print(line, file=sys.stderr, flush=True))
    print()
    _table(table_rows(result))
    verdict = (f"{kernel.name} is slower than {baseline.name} by more than {args.threshold:.0%} on: "
               + ", ".join(result["slower"])) if result["slower"] else \
        f"{kernel.name} is within {args.threshold:.0%} of {baseline.name} on every shape"
    print("\n" + verdict)
    if args.json:
        _write_json("--json", args.json, result)
    return result["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
