"""One compile farm for the campaigns of a run of several kernels, building what each meets first, in order.

A run of several campaigns (the self-check: every built-in kernel in turn)
has one farm for all of them.  Each campaign's search seed is picked before
the farm starts, so that its first cases can be drawn ahead
(``CampaignRunner.first_cases``); the farm builds, campaign by campaign in the
order they run, each campaign's first cases in the order it meets them and then
a sample case of each of its pool entries, and nothing else: the
specialisations a campaign meets later compile in its own worker when it meets
them.  Campaign by campaign, since a campaign draws from its whole pool long
before the last campaign starts; campaigns that run side by side
(``harness.campaign.side_by_side``) take turns instead, every one's first cases
before any one's samples.  Each campaign waits only for its own
plan (``FarmHandle.for_plan``): once that is built it compiles what else it
meets rather than putting it off until the farm is done with the campaigns
after it.

Drawing the first cases takes seconds on a GPU host, and so does a campaign's
start (its worker's imports, its GPU context), so campaigns that run side by
side start meanwhile: each starts its worker, then waits for ``Ahead.drawn``
before its search meets a case (``Ahead.draw_first_cases``, which the run
calls once the campaigns are started).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from nanfuzz.harness.campaign.drawn_ahead import draw_at_once
from nanfuzz.harness.campaign.runner import CampaignRunner, Hooks
from nanfuzz.harness.campaign.scope import start_farm
from nanfuzz.harness.campaign.settings import Settings
from nanfuzz.harness.campaign.side_by_side import CampaignOrders
from nanfuzz.harness.kernel import Kernel
from nanfuzz.harness.launch.farm import Farm, FarmHandle
from nanfuzz.harness.launch.processes import fork_server_context
from nanfuzz.harness.launch.subjects import worker_spec
from nanfuzz.harness.registry import import_path
from nanfuzz.reference.errors import NanfuzzError


@dataclass
class Ahead:
    """The farm (None: nothing compiles ahead) and, per campaign, its search seed and its plan's
    number; ``drawn``: an event (of the fork server's context) set once every campaign's first cases
    are drawn and sent to the farm (None: nothing to draw)."""

    farm: Farm | None
    seeds: list[int | None] = field(default_factory=list)
    plans: list[int | None] = field(default_factory=list)
    drawn: object = None
    at_once: int = 1  # the campaigns run that many at a time (``Farm.schedule``)
    _planners: list | None = None  # per plan, its campaign's runner and its first cases' count, until drawn

    def draw_first_cases(self) -> None:
        """Draw each campaign's first cases (a process each) and send the farm its tasks; once only.
        ``drawn`` is set whatever happens: a campaign waiting for it goes on to meet what it meets."""
        planners, self._planners = self._planners, None
        try:
            if planners is not None:
                orders = [(CampaignOrders(p, runner.kernel.name, import_path(runner.kernel), runner.settings,
                                          search_seed=runner.search_seed, stands_in_for=runner.kernel.stands_in_for),
                           count) for p, (runner, count) in enumerate(planners) if count]
                drawn = {p: () for p, (_, count) in enumerate(planners) if not count}  # its jobs draw their own
                drawn.update(draw_at_once(orders, lambda p: planners[p][0].first_cases(planners[p][1])))
                campaigns = [c for c, plan in enumerate(self.plans) if plan is not None]
                self.farm.schedule(drawn, self.at_once, campaigns)
        finally:
            if self.drawn is not None:
                self.drawn.set()

    def handle(self, campaign: int) -> FarmHandle | None:
        """What campaign ``campaign`` waits for: its own plan of the farm."""
        if self.farm is None or self.plans[campaign] is None:
            return None
        return self.farm.handle.for_plan(self.plans[campaign])

    def close(self) -> None:
        if self.farm is not None:
            self.farm.close()


def compile_ahead(runs: list[tuple[Kernel, Settings]], settings: Settings,
                  first_cases: Callable[[Kernel], int | None], samples: Callable[[str], int],
                  at_once: int = 1, draw_later: bool = False) -> Ahead:
    """A farm for ``runs`` (kernel, its campaign's settings), run in this order: ``first_cases(kernel)``
    of each campaign's first cases (None: every case its first search run draws while all pass),
    then ``samples(tier)`` cases of each pool entry (``tier``: the campaign's size tier).  A campaign
    of several jobs picks its seeds in its jobs: the farm builds its samples alone.  ``at_once``:
    the campaigns run that many at a time (``Farm.schedule``).  ``draw_later``: the first cases are
    drawn at ``Ahead.draw_first_cases``, which the caller calls once its campaigns are started."""
    plans, planners, ahead = [], [], Ahead(None, at_once=at_once)
    if settings.device == "cpu" or settings.compile_jobs == 0:  # nothing compiles ahead (``scope.plan_for``)
        return Ahead(None, [None] * len(runs), [None] * len(runs))
    for kernel, run in runs:
        alone = run.jobs <= 1
        try:
            runner = CampaignRunner(kernel, run, Hooks())
        except NanfuzzError:  # the campaign itself says why, when it runs
            ahead.seeds.append(None)
            ahead.plans.append(None)
            continue
        spec = worker_spec(kernel, run) if runner.pool else None
        plan = runner.farm_plan(spec, samples(runner.tier)) if spec is not None else None
        ahead.seeds.append(runner.search_seed if alone else None)
        ahead.plans.append(len(plans) if plan is not None else None)
        if plan is not None:
            plans.append(plan)
            count = first_cases(kernel) if alone else 0
            planners.append((runner, runner.max_examples if count is None else count))
    # the farm's processes start while the first cases are drawn, every campaign's at once
    ahead.farm = start_farm(plans, settings, first_cases_later=True)
    if ahead.farm is not None and ahead.farm.awaits_first_cases:
        ahead._planners = planners
        if draw_later:
            ahead.drawn = fork_server_context().Event()
        else:
            ahead.draw_first_cases()
    return ahead
