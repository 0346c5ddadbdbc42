"""The campaigns of a run of several kernels at once, one process each.

A campaign keeps about one core busy (its worker runs the kernel while its
search waits), so a run of several kernels (the self-check: every built-in)
one after another leaves a machine's other cores idle.  Here up to
``at_once`` campaigns run side by side, each in a process of its
own that runs the ordinary campaign runner (``harness.campaign.runner``) with
the settings, the compile farm's plan and the search seed the run gave it:
the same search as one after another, the same cases.

The caller meets the outcomes in the kernels' order, each as soon as it and
every one before it have ended, so that what it prints reads as a run one
after another would.  An outcome is the campaign, or the ``NanfuzzError`` that
stopped it, or None: a campaign stopped by Ctrl-C or a stop signal before it
had a result.

Ctrl-C, SIGTERM or SIGHUP, to this process or to its whole group: every
campaign under way stops as its own Ctrl-C would stop it (a failure found is
kept, its smallest case so far reported), campaigns not yet started never
start, and a process that does not answer within two seconds is killed.
"""
from __future__ import annotations

import os
import queue
import signal
import time
from dataclasses import dataclass
from typing import Callable, Iterator

from nanfuzz.harness.campaign.settings import Settings
from nanfuzz.harness.device import DeviceProperties
from nanfuzz.harness.launch.isolation import interrupts_held
from nanfuzz.harness.launch.processes import has_ended, interpret_if_cpu, start as start_process
from nanfuzz.reference.errors import NanfuzzError

_INTERRUPT_GRACE = 2.0
_POLL = 0.2


@dataclass(frozen=True)
class CampaignOrders:
    """What campaign ``index`` runs: the kernel (its name, and its import path), its settings, the
    farm's handle for its plan (None: none), the search seed its first cases were drawn ahead with,
    and an event its search waits for (None: none), set once they are drawn."""

    index: int
    kernel_name: str
    kernel_spec: str
    settings: Settings
    farm: object = None
    search_seed: int | None = None
    stands_in_for: DeviceProperties | None = None
    start_after: object = None

    def resolve(self):
        """The kernel, resolved again in this process as the run's was."""
        from nanfuzz.harness.registry import resolve_for_process

        return resolve_for_process(self.kernel_spec, self.settings.sources, self.stands_in_for)


@dataclass(frozen=True)
class _Started:
    """A campaign's process and when it was started (``time.perf_counter``)."""

    process: object
    at: float


@dataclass(frozen=True)
class _Links:
    """What the campaigns share with the run: the ``results`` queue, ``listening[i]`` (campaign i's
    signal handlers are in place), ``examples[i]`` (its examples so far) and the GPU's fp8 skips
    (``encodings.told_gpu_skips``; None under the interpreter)."""

    results: object
    listening: object
    examples: object
    gpu_skips: tuple | None = None


def _run_campaign(orders: CampaignOrders, links: _Links) -> None:
    """A campaign's process: puts ``(index, campaign)``, ``(index, error message)`` or ``(index, None)``."""
    from nanfuzz.harness.campaign.stop_signals import stop_requested, stopping_on_signals

    index = orders.index
    interpret_if_cpu(orders.settings.device)  # before the kernel's module is imported
    from nanfuzz.harness.judge.encodings import told_gpu_skips

    told_gpu_skips(links.gpu_skips)  # a campaign that initialised CUDA could not fork its worker
    try:
        # as the run's own process takes them (the search keeps what it found), but once: the run's
        # Ctrl-C that stops its campaigns may come after the group's SIGTERM
        with stopping_on_signals(once=True):
            links.listening[index] = 1
            from nanfuzz.harness.campaign.runner import Hooks, fuzz

            kernel = orders.resolve()

            def note_example(campaign) -> None:
                links.examples[index] = campaign.examples

            # this process, fresh from the run's fork server, runs no torch op: its worker is a fork of
            # it, where a fork server of its own would import torch again (seconds, beside the others)
            campaign = fuzz(kernel, orders.settings, farm=orders.farm, search_seed=orders.search_seed,
                            hooks=Hooks(on_example=note_example, interrupted=stop_requested),
                            start_after=orders.start_after, prefer_fork=True)
    except NanfuzzError as exc:
        links.results.put((index, str(exc)))
        return
    except KeyboardInterrupt:
        links.results.put((index, None))
        return
    links.results.put((index, campaign))


def default_at_once(device: str, kernels: int, self_check: bool = False) -> int:
    """Campaigns at once by default: under the interpreter one per core (each keeps about one busy);
    on a GPU every one of the self-check's (built-ins, whose memory and compiles were measured that
    way), and one at a time for kernels named, whose production cases and compiles may each want
    the whole device."""
    from nanfuzz.harness.launch.backend import usable_cores

    if device == "cpu":
        return max(1, min(kernels, usable_cores()))
    return max(1, kernels if self_check else 1)


def side_by_side(orders: list[CampaignOrders], at_once: int,
                 on_progress: Callable[[int], None] | None = None,
                 once_started: Callable[[], None] | None = None) -> Iterator[tuple[int, object]]:
    """``(index, outcome)`` of each campaign in ``orders``' order (see the module notes), running up
    to ``at_once`` of them at a time.  ``on_progress(examples)``: told, a few times a second, the
    examples of every campaign so far (a shrink's candidates included).  ``once_started``: called
    here once the first campaigns' processes are started (the self-check draws their first cases
    while they start).  Closing the iterator early ends the campaigns still running."""
    from nanfuzz.harness.judge.encodings import gpu_skips_for
    from nanfuzz.harness.launch.processes import fork_server_context

    # Not fork: a forked child of a process that used CUDA cannot use it.  The fork server has
    # imported torch, Triton and the campaign runner but never touched a GPU.
    context = fork_server_context()
    count = len(orders)
    device = orders[0].settings.device if orders else "cpu"
    links = _Links(results=context.Queue(), listening=context.RawArray("b", count),
                   examples=context.RawArray("q", count), gpu_skips=gpu_skips_for(device))
    processes: dict[int, _Started] = {}
    outcomes: dict[int, object] = {}
    interrupted = False
    next_to_start = next_to_yield = 0

    def stop() -> None:
        _stop_all(processes, outcomes, links, orders)
        for i in range(count):
            outcomes.setdefault(i, None)  # stopped before a result, or never started

    try:
        while next_to_yield < count:
            try:
                if not interrupted:
                    while next_to_start < count and _running(processes, outcomes) < at_once:
                        process = context.Process(target=_run_campaign, daemon=False,
                                                  name=f"nanfuzz-campaign-{next_to_start}",
                                                  args=(orders[next_to_start], links))
                        processes[next_to_start] = _Started(process, time.perf_counter())
                        start_process(process)
                        next_to_start += 1
                    if once_started is not None:
                        then, once_started = once_started, None
                        then()
                _collect_once(processes, links, outcomes, orders)
                if on_progress is not None and processes:
                    on_progress(sum(links.examples))
                while next_to_yield in outcomes:
                    index, next_to_yield = next_to_yield, next_to_yield + 1
                    # a stop while the caller reports this outcome comes here once it is done
                    with interrupts_held():
                        yield index, outcomes[index]
            except KeyboardInterrupt:
                if not interrupted:
                    interrupted = True
                    stop()
    finally:
        _end(processes, outcomes, links, orders)


def _running(processes, outcomes) -> int:
    return sum(1 for i in processes if i not in outcomes)


def _collect_once(processes: dict[int, _Started], links: _Links, outcomes, orders) -> None:
    """The results that came in (waiting up to a poll's time for one); a process gone without one died."""
    try:
        index, payload = links.results.get(timeout=_POLL)
        outcomes[index] = _outcome(payload)
        while True:
            index, payload = links.results.get_nowait()
            outcomes[index] = _outcome(payload)
    except queue.Empty:
        pass
    for i, started in processes.items():
        process = started.process
        if i not in outcomes and has_ended(process) and links.results.empty():
            process.join(timeout=1)
            try:  # a result put just before the exit may still be on its way
                index, payload = links.results.get(timeout=0.5)
                outcomes[index] = _outcome(payload)
                continue
            except queue.Empty:
                pass
            outcomes[i] = _after_its_death(orders[i], process.exitcode, links.examples[i],
                                           time.perf_counter() - started.at)


def _after_its_death(orders: CampaignOrders, exitcode, examples: int, lived: float) -> object:
    """What a campaign whose process died gives.  Its worker is a fork of that process, so a kernel that
    kills the process it runs under takes the campaign with it: the case it was checking, left in the
    campaign's journal, replayed here in a fresh worker, is its failure where it fails again (as a
    dead job's case is, ``harness.campaign.jobs``), met after the ``examples`` the campaign had told,
    ``lived`` seconds after its process started.  Otherwise one line: it died outside the launches."""
    from nanfuzz.harness.campaign.leftovers import recover_leftovers

    try:
        leftover, notes = recover_leftovers(orders.resolve(), orders.settings)
    except NanfuzzError:
        leftover, notes = None, []  # the kernel cannot be resolved here either: the line below says the rest
    if leftover is not None:
        leftover.examples = examples + 1  # the case it died under, never counted there
        leftover.examples_to_first_failure = leftover.examples
        leftover.time_to_first_failure = leftover.elapsed = lived
        return leftover
    where = ("while checking a case that gives no failure replayed in a fresh worker" if notes else
             "outside the kernel's launches")
    return NanfuzzError(f"kernel {orders.kernel_name}: its campaign's process died {where} (exit status "
                        f"{exitcode}); run the kernel alone to see why")


def _outcome(payload):
    return NanfuzzError(payload) if isinstance(payload, str) else payload


def _stop_all(processes: dict[int, _Started], outcomes, links: _Links, orders) -> None:
    """Ctrl-C to every campaign under way, then their results for up to ``_INTERRUPT_GRACE`` seconds."""
    for i, started in processes.items():
        process = started.process
        if i not in outcomes and links.listening[i] and process.exitcode is None and process.pid is not None:
            try:
                os.kill(process.pid, signal.SIGINT)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + _INTERRUPT_GRACE
    while _running(processes, outcomes) and time.monotonic() < deadline:
        try:
            _collect_once(processes, links, outcomes, orders)
        except KeyboardInterrupt:
            break


def _end(processes: dict[int, _Started], outcomes, links: _Links, orders) -> None:
    """Every campaign process ended: those with a result are joined, the rest killed (a worker dies
    with the campaign that started it).  The case a killed one was checking was never judged and no
    kernel ended it: no case for the next run to replay."""
    from nanfuzz.harness.campaign import journal

    for i, started in processes.items():
        process = started.process
        if process.pid is None:
            continue
        process.join(timeout=5 if i in outcomes else 0)
        if process.is_alive():
            process.kill()
            process.join(timeout=5)
            journal.drop(orders[i].settings.state_dir, orders[i].kernel_name, process.pid)
    links.results.cancel_join_thread()
    links.results.close()
