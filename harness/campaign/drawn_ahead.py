"""The first cases of a run's campaigns, drawn ahead all at once: a process each.

A compile farm builds each campaign's first cases before its search meets them
(``harness.campaign.compile_ahead``), so it has nothing to do until they are
drawn.  Drawing them (``CampaignRunner.first_cases``) is Hypothesis's work on
one core: a few milliseconds a small case, tens a production one, so one
campaign after another the self-check's nine took seconds while every farm
process waited.  Here each campaign's are drawn in a process of the fork
server's of its own, which resolves the kernel again from the campaign's orders
(``harness.campaign.side_by_side.CampaignOrders``, as its campaign will) and draws with its
settings and search seed: what a seed draws depends on neither the
process nor what it imported (``harness.campaign.upcoming``), so they are the
cases the campaign's search then meets.  A campaign whose process fails to
draw or to report is drawn here instead, one after another, as before.
"""
from __future__ import annotations

import queue
import time

from nanfuzz.harness.campaign.side_by_side import CampaignOrders
from nanfuzz.reference.case import Case

# How long the run waits for a drawing process before it draws that campaign's cases itself.
DRAW_WAIT = 60.0
# Fewer cores than this, and the processes' start costs more than drawing them side by side saves
# (on 2 cores the self-check's nine took 3.6 s at once against 2.9 s one after another).
LEAST_CORES = 4


def _draw(orders: CampaignOrders, count: int, results, gpu_skips=None) -> None:
    """A drawing process: puts ``(index, cases)``, or ``(index, None)`` where it could not draw them.
    ``gpu_skips``: the run's (``encodings.told_gpu_skips``), so that it never initialises CUDA."""
    try:
        from nanfuzz.harness.campaign.runner import CampaignRunner, Hooks
        from nanfuzz.harness.judge.encodings import told_gpu_skips

        told_gpu_skips(gpu_skips)

        runner = CampaignRunner(orders.resolve(), orders.settings, Hooks(), seed=orders.search_seed)
        results.put((orders.index, runner.first_cases(count)))
    except BaseException:  # the run draws these itself, and meets whatever stopped this
        results.put((orders.index, None))


def draw_at_once(orders: list[tuple[CampaignOrders, int]], draw_here,
                 wait: float = DRAW_WAIT) -> dict[int, tuple[Case, ...]]:
    """The first ``count`` cases of each campaign (``(orders, count)``) by its index, drawn in
    processes of their own at once (where the host has ``LEAST_CORES`` or more); ``draw_here(index)``
    draws those of a campaign whose process did not give them."""
    from nanfuzz.harness.launch.backend import usable_cores

    drawn = _drawn_in_processes(orders, wait) if usable_cores() >= LEAST_CORES else {}
    return {order.index: drawn[order.index] if drawn.get(order.index) is not None else draw_here(order.index)
            for order, _ in orders}


def _drawn_in_processes(orders: list[tuple[CampaignOrders, int]], wait: float) -> dict[int, tuple[Case, ...] | None]:
    """What the campaigns' processes drew, by index, within ``wait`` seconds (None: one that could not)."""
    from nanfuzz.harness.judge.encodings import gpu_skips_for
    from nanfuzz.harness.launch.processes import fork_server_context, start

    drawn: dict[int, tuple[Case, ...] | None] = {}
    processes = []
    try:
        context = fork_server_context()
        results = context.Queue()
        skips = gpu_skips_for(orders[0][0].settings.device) if orders else None
        for order, count in orders:
            process = context.Process(target=_draw, args=(order, count, results, skips), name="nanfuzz-draw",
                                      daemon=True)
            start(process)
            processes.append(process)
        deadline = time.monotonic() + wait
        while len(drawn) < len(processes) and time.monotonic() < deadline:
            try:
                index, cases = results.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                if not any(p.is_alive() for p in processes):
                    break  # every process ended, some without a word
                continue
            drawn[index] = cases
    except (OSError, EOFError, ValueError):  # no process to draw in (or no more): the rest are drawn here
        pass
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join(timeout=5)
    return drawn
