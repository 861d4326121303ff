"""/metrics families of routing quality: predicted versus achieved prefix hits, bytes per token.

The counts live on the routers (plain integer adds on the request path) and reach the registry
in a hook run before each scrape, as the prefix chunk counters do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .routing import can_predict_hits

if TYPE_CHECKING:
    from server.metrics import Registry

    from .pools import Pool

__all__ = ["bytes_per_token", "routing_quality"]

_QUALITY = (
    ("predicted_tokens", "fastcore_orchestrator_prefix_predicted_hit_tokens_total",
     "kv_cache_aware routing: prompt tokens the router expected the chosen context worker to serve "
     "from its cache (expected hit chunks at the learned bytes per token), per pool."),
    ("achieved_tokens", "fastcore_orchestrator_prefix_achieved_hit_tokens_total",
     "kv_cache_aware routing: prompt tokens the chosen context worker served from its cache "
     "(its answer's usage.prompt_tokens_details.cached_tokens), per pool."),
    ("error_tokens", "fastcore_orchestrator_prefix_hit_error_tokens_total",
     "kv_cache_aware routing: the sum over context answers of |predicted - achieved| hit tokens, per pool."),
)  # fmt: skip


def routing_quality(registry: Registry, pools: Sequence[Pool]) -> None:
    """Counters of predicted, achieved and mispredicted hit tokens of each kv_cache_aware pool."""
    counters = [(attr, registry.counter(name, text, ("pool",))) for attr, name, text in _QUALITY]
    seen = {(pool.name, attr): 0 for pool in pools for attr, _ in counters}
    for pool in pools:
        for _, counter in counters:
            counter.inc(0, pool=pool.name)

    def update() -> None:
        for pool in pools:
            router = pool.router
            assert can_predict_hits(router)
            for attr, counter in counters:
                now = getattr(router, attr)
                counter.inc(now - seen[pool.name, attr], pool=pool.name)
                seen[pool.name, attr] = now

    registry.before_collect(update)
    _tiers(registry, pools)


_TIERS = (
    ("predicted_tier_tokens", "fastcore_orchestrator_prefix_predicted_tier_hit_tokens_total",
     "kv_cache_aware routing: prompt tokens the router expected the chosen context worker to serve from "
     "each tier of its cache (1: device, 2: its second tier, from its cache events), per pool."),
    ("achieved_tier_tokens", "fastcore_orchestrator_prefix_achieved_tier_hit_tokens_total",
     "kv_cache_aware routing: prompt tokens the chosen context worker served from each tier of its cache "
     "(2: its answer's usage.prompt_tokens_details.tier2_cached_tokens; 1: the rest of cached_tokens), "
     "per pool."),
)  # fmt: skip


def _tiers(registry: Registry, pools: Sequence[Pool]) -> None:
    """Counters of predicted and achieved hit tokens by tier of each kv_cache_aware pool."""
    counters = [(attr, registry.counter(name, text, ("pool", "tier"))) for attr, name, text in _TIERS]
    seen = {(pool.name, attr, tier): 0 for pool in pools for attr, _ in counters for tier in (0, 1)}
    for pool in pools:
        for _, counter in counters:
            for tier in ("1", "2"):
                counter.inc(0, pool=pool.name, tier=tier)

    def update() -> None:
        for pool in pools:
            router = pool.router
            assert can_predict_hits(router)
            for attr, counter in counters:
                for tier, now in enumerate(getattr(router, attr)):
                    counter.inc(now - seen[pool.name, attr, tier], pool=pool.name, tier=str(tier + 1))
                    seen[pool.name, attr, tier] = now

    registry.before_collect(update)


def bytes_per_token(registry: Registry, pools: Sequence[Pool]) -> None:
    """A gauge of each pool's learned prompt bytes per token."""
    gauge = registry.gauge(
        "fastcore_orchestrator_bytes_per_token",
        "The prompt bytes per token the orchestrator uses for every token figure, learned from the "
        "context answers' usage.prompt_tokens (seeded by the workers' /server_info), per pool.",
        ("pool",),
        multiprocess_mode="livemax",
    )

    def update() -> None:
        for pool in pools:
            gauge.set(pool.router.estimate.value, pool=pool.name)

    registry.before_collect(update)
