"""Hostile subjects: plain-torch adapters that misbehave the ways real kernels under review do.

Each is the correct dense-attention kernel of ``tests.torch_kernels`` plus one
hostility, triggered only by cases with a sliding window, so that a campaign
meets clean cases first and a shrunk repro is one windowed sequence.  Each
lives at an import path, so a supervised worker can rebuild it.
"""
from __future__ import annotations

import os
import sys
import time

import torch

from nanfuzz.harness.kernel import Kernel
from tests.torch_kernels import CAPS, attention


def _windowed(batch) -> bool:
    return batch.case.sliding_window > 0


def _before_windowed_launches(act):
    """The correct kernel, except that a windowed case first meets ``act()``."""
    def run(batch, out):
        if _windowed(batch):
            act()
        return attention(batch, out)
    return run


def _raise_system_exit():
    raise SystemExit("planted exit")


_exits = _before_windowed_launches(lambda: os._exit(3))
_aborts = _before_windowed_launches(os.abort)
_raises_system_exit = _before_windowed_launches(_raise_system_exit)
_calls_sys_exit_zero = _before_windowed_launches(lambda: sys.exit(0))
_hangs = _before_windowed_launches(lambda: time.sleep(3600))


def _hang_once():
    """The first windowed launch in the current folder never returns (it notes ``hung.txt`` first);
    every later one runs at once: a launch held up once by a busy device."""
    try:
        open("hung.txt", "x").close()
    except FileExistsError:
        return
    time.sleep(3600)


_hangs_once = _before_windowed_launches(_hang_once)


_launches = [0]


def _nondeterministic(batch, out):
    attention(batch, out)
    _launches[0] += 1
    if _windowed(batch) and out.numel():
        # alternates between launches by one unit in the last place, as a split-K reduction may
        bits = out.view(-1)[:1].view(torch.int16 if out.element_size() == 2 else torch.int32)
        bits += _launches[0] % 2
    return out


def _reads_past_value_cache(batch, out):
    attention(batch, out)
    if _windowed(batch):
        vc = batch.value_cache
        one_more = vc.as_strided((vc.shape[0] + 1, *vc.shape[1:]), vc.stride(), vc.storage_offset())
        out += one_more[-1].float().sum() * 0.0  # 0 * NaN: what an unmasked tile load past the cache does
    return out


def _writes_past_out(batch, out):
    attention(batch, out)
    if _windowed(batch):
        past = out.as_strided((out.shape[0] + 1, *out.shape[1:]), out.stride(), out.storage_offset())
        past[-1].zero_()
    return out


# The binary ``compiles_elsewhere`` launches, in the Triton cache of its process's environment.
ELSEWHERE_KEY, ELSEWHERE_GROUP = "ANOTHERPROCESSCOMPILESTHIS", "windowed_kernel.json"


def _compiles_elsewhere(batch, out):
    """A windowed case's launch needs a binary, as a Triton launch does: it waits for it while
    another process holds its claim (``harness.launch.shared_compiles``), or compiles it itself."""
    if _windowed(batch):
        from nanfuzz.harness.launch import shared_compiles

        cache = shared_compiles._claiming_class()(ELSEWHERE_KEY)
        if cache.get_group(ELSEWHERE_GROUP) is None:  # ours to compile
            cache.put_group(ELSEWHERE_GROUP, {ELSEWHERE_GROUP: cache.put("{}", ELSEWHERE_GROUP, binary=False)})
    return attention(batch, out)


def _kernel(attr: str, run, **caps) -> Kernel:
    return Kernel(name=f"hostile@{attr}", run=run, capabilities=CAPS.restrict(**caps) if caps else CAPS,
                  expect="caught", spec=f"tests.subjects:{attr}")


exits = _kernel("exits", _exits)
aborts = _kernel("aborts", _aborts)
raises_system_exit = _kernel("raises_system_exit", _raises_system_exit)
calls_sys_exit_zero = _kernel("calls_sys_exit_zero", _calls_sys_exit_zero)
hangs = _kernel("hangs", _hangs)
hangs_once = _kernel("hangs_once", _hangs_once)
nondeterministic = _kernel("nondeterministic", _nondeterministic)
declared_nondeterministic = _kernel("declared_nondeterministic", _nondeterministic, deterministic=False)
reads_past_value_cache = _kernel("reads_past_value_cache", _reads_past_value_cache)
writes_past_out = _kernel("writes_past_out", _writes_past_out)
compiles_elsewhere = _kernel("compiles_elsewhere", _compiles_elsewhere)


# -- kernels that attack their campaign ------------------------------------------------

def _kill_group():
    os.killpg(0, 9)  # SIGKILL to every process of its group: the campaign too, were it shared


def _kill_parent():
    os.kill(os.getppid(), 9)  # a worker's parent is the fork server it was forked from


kills_its_process_group = _kernel("kills_its_process_group", _before_windowed_launches(_kill_group))
kills_the_fork_server = _kernel("kills_the_fork_server", _before_windowed_launches(_kill_parent))


def _kill_parent_once():
    """The first windowed launch in the current folder kills the fork server (noting ``killed.txt``
    first), as the host's out-of-memory killer might; every later one runs."""
    try:
        open("killed.txt", "x").close()
    except FileExistsError:
        return
    _kill_parent()


kills_the_fork_server_once = _kernel("kills_the_fork_server_once", _before_windowed_launches(_kill_parent_once))


_children = []


def _with_a_child(run, noted_in: str):
    """``run``, after starting a process that would sleep for ten minutes (once per worker, its pid
    noted in the file ``noted_in`` of the current folder): a kernel that leaves a process behind."""
    def started(batch, out):
        if not _children:
            import subprocess

            _children.append(subprocess.Popen(["sleep", "600"]))
            with open(noted_in, "a") as f:
                f.write(f"{_children[-1].pid}\n")
        return run(batch, out)
    return started


def _notes_and_exits(batch, out):
    """A windowed case is noted in ``failures.txt`` (one line per case) and ends the worker."""
    if _windowed(batch):
        with open("failures.txt", "a") as f:
            f.write(batch.case.to_json() + "\n")
        os._exit(5)
    return attention(batch, out)


# each notes its children in a file of its own: a test of both side by side waits for each
starts_a_child = _kernel("starts_a_child", _with_a_child(attention, "children.txt"))
starts_a_child_then_exits = _kernel("starts_a_child_then_exits", _with_a_child(_notes_and_exits,
                                                                                "exiting-children.txt"))


def _kill_group_by_pid_zero():
    os.kill(0, 9)  # pid 0: every process of the caller's group


kills_its_group_by_pid_zero = _kernel("kills_its_group_by_pid_zero", _before_windowed_launches(_kill_group_by_pid_zero))


# -- kernels and memory ------------------------------------------------------------------

def _runs_out_of_memory():
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB (planted in the launch)")


runs_out_of_memory = _kernel("runs_out_of_memory", _before_windowed_launches(_runs_out_of_memory))


def _plant_in_the_oracle(every: int):
    """The correct kernel, whose first launch makes every ``every``-th oracle of its process (from
    the first on) raise the allocation failure a GPU under pressure gives: nanfuzz's own OOM."""
    calls = [0]

    def run(batch, out):
        from nanfuzz.harness.judge import check as judge

        if not hasattr(judge.attend_and_measure, "planted"):
            real = judge.attend_and_measure

            def attend_and_measure(*args, **kwargs):
                calls[0] += 1
                if (calls[0] - 1) % every == 0:
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 916.00 MiB (planted in the "
                                                 "oracle)")
                return real(*args, **kwargs)

            attend_and_measure.planted = True
            judge.attend_and_measure = attend_and_measure
        return attention(batch, out)
    return run


oracle_runs_out_of_memory_once = _kernel("oracle_runs_out_of_memory_once", _plant_in_the_oracle(every=2))
oracle_runs_out_of_memory_always = _kernel("oracle_runs_out_of_memory_always", _plant_in_the_oracle(every=1))


def _ignores_windows(batch, out):
    import dataclasses

    unwindowed = dataclasses.replace(batch, case=dataclasses.replace(batch.case, sliding_window=0))
    return attention(unwindowed, out)


# declares windows, ignores them, and declines every case without one: the capability hint's
# window-less case is one its supports() turns down
windowed_only_ignores_windows = Kernel(
    name="hostile@windowed_only_ignores_windows", run=_ignores_windows, capabilities=CAPS, expect="caught",
    spec="tests.subjects:windowed_only_ignores_windows",
    supports=lambda case: None if case.sliding_window else "takes windowed cases only")


def _slowly(run, seconds: float):
    def slow(batch, out):
        time.sleep(seconds)  # holds its case's memory a while, as a long launch on a busy GPU does
        return run(batch, out)
    return slow


slow_correct = _kernel("slow_correct", _slowly(attention, 0.1))
slow_mask_multiply = _kernel("slow_mask_multiply", _slowly(lambda b, o: attention(b, o, bug="mask-multiply"), 0.1))
