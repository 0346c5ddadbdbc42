"""What a campaign draws its cases under: capabilities, specialisation pool, strategy, compile plan.

The capabilities are the kernel's, narrowed by the campaign's focus and by
what the device's Triton runs; on a GPU, a kernel that compiles per shape
draws each case's compile-time part from a pool (``strategies.specialisations``),
and a compile farm (``harness.launch.farm``) builds that pool ahead of the search.
"""
from __future__ import annotations

from dataclasses import replace

from nanfuzz.harness.judge import encodings
from nanfuzz.harness.kernel import Kernel
from nanfuzz.harness.kernels._common import GPU_POOL as DEFAULT_POOL
from nanfuzz.harness.campaign.settings import Settings
from nanfuzz.harness.launch.farm import Farm, Plan, default_processes
from nanfuzz.harness.launch.subjects import worker_spec
from nanfuzz.harness.launch.worker import WorkerSpec
from nanfuzz.reference.capabilities import Capabilities
from nanfuzz.reference.errors import NanfuzzError
from nanfuzz.strategies import paged_cases
from nanfuzz.strategies.aims import Aims
from nanfuzz.strategies.cases import TIERS, campaign_pool, default_tier
from nanfuzz.strategies.production import production_size
from nanfuzz.strategies.targets import Targets, production_targets


def campaign_capabilities(kernel: Kernel, settings: Settings) -> tuple[Capabilities, list[str]]:
    """What the campaign draws cases under (the kernel's capabilities, its focus, what the
    device's Triton runs), and a note for each KV-cache encoding left out."""
    interpreter = settings.device == "cpu"
    caps = settings.focus.apply(kernel.capabilities, kernel.name)
    if interpreter and not caps.runnable_dtypes(interpreter=True):
        raise NanfuzzError(f"kernel {kernel.name}: no dtype of {', '.join(caps.dtypes)} runs under Triton's interpreter; "
                           "use --device cuda")
    caps, skipped = encodings.runnable(caps, settings.device)
    if not caps.kv_cache_dtypes and not caps.token_head_dtypes and not caps.cache_formats:
        raise NanfuzzError(f"kernel {kernel.name}: no KV cache it takes runs here ({'; '.join(skipped)})")
    return caps, skipped


def campaign_tier(kernel: Kernel, settings: Settings) -> str:
    """The size tier the campaign draws: ``--size``, else the kernel's own, else the device's default."""
    tier = settings.size or kernel.size or default_tier(settings.device == "cpu")
    if tier not in TIERS:
        raise NanfuzzError(f"size {tier!r} is not one of {', '.join(TIERS)}")
    return tier


# The fewest live keys a campaign sharing its device draws up to, however many share it: room
# for a 32k-key sequence beside 127 others, the production targets' longest and widest batches.
SHARED_LEAST_LIVE_KEYS = 1 << 17
# The fewest new tokens a batch of such a campaign holds: 128 prefills of several tokens each
# (the targets' widest batch of prefills), and a chunk of 1,024 beside a long context.
SHARED_LEAST_TOKENS = 1 << 10


def campaign_production_size(settings: Settings):
    """The production size a campaign draws at: a huge cache (block ids past 2^31 elements, 8+ GiB)
    only for a campaign that has its device to itself (one job, no other campaign on the device).
    A campaign sharing its device with others (its jobs, campaigns side by side) also draws live
    keys for its share alone: a check holds up to about 45 KiB per live key (float32, 16 KV
    heads), and at the whole budget of 2^21 a drawn case's check wanted up to 90 GiB, which
    campaigns sharing an 80 GB card waited minutes for.  Its batches' new tokens shrink with the
    share too: the oracle holds float64 rows per token and query head, and a check of 8,192 tokens
    in 128 heads of 256 peaked at 37 GiB, more than the live keys of a whole share take."""
    size = production_size(settings.device == "cpu")
    sharing = max(1, settings.jobs) * max(1, settings.campaigns_per_device)
    if sharing <= 1:
        return size
    keys = max(min(size.max_live_keys, SHARED_LEAST_LIVE_KEYS), size.max_live_keys // sharing)
    tokens = max(min(size.max_tokens, SHARED_LEAST_TOKENS), size.max_tokens // sharing)
    return replace(size, huge_cache_bytes=0, max_live_keys=keys, max_tokens=tokens,
                   max_query_len=min(size.max_query_len, tokens))


def campaign_pool_of(caps: Capabilities, settings: Settings, pool_seed: int | None = None,
                     tier: str = "small", growth: int = 0) -> tuple[tuple | None, int]:
    """The campaign's specialisation pool (None: free draws) and the seed that picked it
    (``pool_seed``, else ``settings.pool_seed``, else the campaign's seed, else 0), in the
    round ``settings.pool_round``, grown ``growth`` times (``strategies.cases.campaign_pool``)."""
    interpreter = settings.device == "cpu"
    pool_size = settings.pool_size
    if pool_size is None:
        # the kernel's own pool is for compiles, and under the interpreter nothing compiles; on a GPU a
        # kernel that declares none gets the built-in kernels' pool, 0 draws freely
        declared = caps.specialisation_pool
        pool_size = 0 if interpreter else (DEFAULT_POOL if declared is None else declared)
    if pool_seed is None:
        pool_seed = settings.pool_seed if settings.pool_seed is not None else (settings.seed or 0)
    if not pool_size:
        return None, pool_seed
    pool = campaign_pool(caps, pool_size, pool_seed, interpreter=interpreter, tier=tier,
                         pool_round=settings.pool_round, growth=growth)
    return pool, pool_seed


def with_next_pool_round(kernel: Kernel, settings: Settings) -> Settings:
    """``settings`` in the next round of ``kernel``'s pool (``harness.campaign.pool_rounds``) for a
    run that pins nothing (no seed, no pool seed) and has a pool (on a GPU, or asked for); else as
    they are."""
    from nanfuzz.harness.campaign import pool_rounds

    has_pool = settings.pool_size != 0 and (settings.device != "cpu" or settings.pool_size)
    if settings.seed is not None or settings.pool_seed is not None or not has_pool:
        return settings
    return settings.replace(pool_round=pool_rounds.take(settings.state_dir, kernel.name))


def campaign_targets(caps: Capabilities, settings: Settings, pool, tier: str = "small") -> Targets:
    """The production targets the campaign declares (``strategies.targets``): none for the small tier."""
    if tier == "small":
        return Targets()
    return production_targets(caps, campaign_production_size(settings), pool)


def campaign_strategy(caps: Capabilities, settings: Settings, pool, tier: str = "small", aims: Aims | None = None):
    """What the campaign's search draws its cases from (and ``harness.campaign.upcoming`` draws ahead);
    ``aims``: what its production cases aim at (by default every target within reach)."""
    return paged_cases(caps, interpreter=settings.device == "cpu", poison_classes=settings.focus.poison_classes,
                       pool=pool, tier=tier, production=campaign_production_size(settings), aims=aims)


def compile_plan(kernel: Kernel, settings: Settings, pool_seed: int | None = None) -> Plan | None:
    """What a compile farm builds ahead of ``kernel``'s campaign: None under the interpreter,
    without a pool, or for a kernel no other process can load."""
    if settings.device == "cpu" or settings.compile_jobs == 0:
        return None
    try:
        caps, _ = campaign_capabilities(kernel, settings)
    except NanfuzzError:
        return None  # the campaign itself says why
    tier = campaign_tier(kernel, settings)
    pool, _ = campaign_pool_of(caps, settings, pool_seed, tier)
    return plan_for(worker_spec(kernel, settings) if pool else None, caps, pool, settings, tier)


def plan_for(spec: WorkerSpec | None, caps: Capabilities, pool, settings: Settings, tier: str = "small") -> Plan | None:
    """``compile_plan`` for a caller that has the worker spec, capabilities and pool already."""
    if settings.device == "cpu" or settings.compile_jobs == 0 or not pool or spec is None:
        return None
    return Plan(spec, caps, settings.focus.poison_classes, pool, tier=tier)


def start_farm(plans: list[Plan | None], settings: Settings, after=None, first_cases_later: bool = False,
               prefer_fork: bool = False) -> Farm | None:
    """A compile farm for the plans there are (None when there is none); ``after``,
    ``first_cases_later`` and ``prefer_fork``: see ``Farm``."""
    plans = [p for p in plans if p is not None]
    if not plans:
        return None
    return Farm(plans, settings.compile_jobs or default_processes(), after=after, first_cases_later=first_cases_later,
                prefer_fork=prefer_fork)
