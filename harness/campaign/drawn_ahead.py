"""The first cases of a run's campaigns, drawn ahead all at once: a process each.

A compile farm builds each campaign's first cases before its search meets them
(``harness.campaign.compile_ahead``), so it has nothing to do until they are
drawn.  Drawing them (``CampaignRunner.first_cases``) is Hypothesis's work on
one core: a few milliseconds a small case, tens a production one, so one
campaign after another the self-check's nine took seconds while every farm
process waited.  Here each campaign's are drawn in a process of the fork
server's of its own, which resolves the kernel again and draws with the
campaign's settings and search seed: what a seed draws depends on neither the
process nor what it imported (``harness.campaign.upcoming``), so they are the
cases the campaign's search then meets.  A campaign whose process fails to
draw or to report is drawn here instead, one after another, as before.
"""
from __future__ import annotations

import queue
import time
from dataclasses import dataclass

from nanfuzz.harness.campaign.settings import Settings
from nanfuzz.harness.device import DeviceProperties
from nanfuzz.reference.case import Case

# How long the run waits for a drawing process before it draws that campaign's cases itself.
DRAW_WAIT = 60.0
# Fewer cores than this, and the processes' start costs more than drawing them side by side saves
# (on 2 cores the self-check's nine took 3.6 s at once against 2.9 s one after another).
LEAST_CORES = 4


@dataclass(frozen=True)
class DrawOrders:
    """Campaign ``number``'s first ``count`` cases: its kernel (by import path), settings and search seed."""

    number: int
    kernel_spec: str
    settings: Settings
    search_seed: int
    count: int
    stands_in_for: DeviceProperties | None = None


def _draw(orders: DrawOrders, results) -> None:
    """A drawing process: puts ``(number, cases)``, or ``(number, None)`` where it could not draw them."""
    try:
        from nanfuzz.harness.campaign.runner import CampaignRunner, Hooks
        from nanfuzz.harness.registry import resolve_for_process

        kernel = resolve_for_process(orders.kernel_spec, orders.settings.sources, orders.stands_in_for)
        runner = CampaignRunner(kernel, orders.settings, Hooks(), seed=orders.search_seed)
        results.put((orders.number, runner.first_cases(orders.count)))
    except BaseException:  # the run draws these itself, and meets whatever stopped this
        results.put((orders.number, None))


def draw_at_once(orders: list[DrawOrders], draw_here, wait: float = DRAW_WAIT) -> dict[int, tuple[Case, ...]]:
    """Each order's cases by its number, drawn in processes of their own at once (where the host
    has ``LEAST_CORES`` or more); ``draw_here(number)`` draws those of a campaign whose process
    did not give them."""
    from nanfuzz.harness.launch.backend import usable_cores

    drawn = _drawn_in_processes(orders, wait) if usable_cores() >= LEAST_CORES else {}
    return {order.number: drawn[order.number] if drawn.get(order.number) is not None else draw_here(order.number)
            for order in orders}


def _drawn_in_processes(orders: list[DrawOrders], wait: float) -> dict[int, tuple[Case, ...] | None]:
    """What the orders' processes drew, by number, within ``wait`` seconds (None: one that could not)."""
    from nanfuzz.harness.launch.processes import fork_server_context, start

    drawn: dict[int, tuple[Case, ...] | None] = {}
    processes = []
    try:
        context = fork_server_context()
        results = context.Queue()
        for order in orders:
            process = context.Process(target=_draw, args=(order, results), name="nanfuzz-draw", daemon=True)
            start(process)
            processes.append(process)
        deadline = time.monotonic() + wait
        while len(drawn) < len(processes) and time.monotonic() < deadline:
            try:
                number, cases = results.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                if not any(p.is_alive() for p in processes):
                    break  # every process ended, some without a word
                continue
            drawn[number] = cases
    except (OSError, EOFError, ValueError):  # no process to draw in (or no more): the rest are drawn here
        pass
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join(timeout=5)
    return drawn
