"""Routers say what they can do (server/orchestrator/routing/base.py): /metrics, the cache view and
local prefill ask a policy's capability attributes, never its class (issue 41 item 4)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from server.metrics import Registry
from server.orchestrator.cache_view import CacheView
from server.orchestrator.estimates import BytesPerToken
from server.orchestrator.metrics import OrchestratorMetrics
from server.orchestrator.routing import (
    ROUTERS,
    KvCacheAwareRouter,
    RequestKey,
    Router,
    can_follow_cache_events,
    can_predict_hits,
    make_router,
)


class Wrapped(Router):
    """A policy of its own (no KvCacheAwareRouter subclass) that predicts hits and follows cache
    events through one it holds: the users must take it for what it says it does."""

    name = "wrapped"
    needs_key = True
    key_kinds = frozenset({"prefix"})
    predicts_hits = True
    follows_cache_events = True

    def __init__(self) -> None:
        self.inner = KvCacheAwareRouter({"chunk_bytes": 64})
        self.estimate = self.inner.estimate

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def choose(self, candidates: list[Any], key: RequestKey | None = None) -> Any:
        return self.inner.choose(candidates, key)


def pool(router: Router, name: str = "context") -> Any:
    return SimpleNamespace(name=name, router=router, workers=[])


def test_only_kv_cache_aware_says_it_predicts_hits_and_follows_cache_events() -> None:
    routers = {kind: make_router(kind) for kind in ROUTERS}
    says = {kind: (r.predicts_hits, r.follows_cache_events) for kind, r in routers.items()}
    assert says == {
        "round_robin": (False, False),
        "least_loaded": (False, False),
        "conversation": (False, False),
        "kv_cache_aware": (True, True),
    }
    assert can_predict_hits(routers["kv_cache_aware"]) and not can_predict_hits(routers["conversation"])
    assert can_follow_cache_events(Wrapped()) and not can_follow_cache_events(make_router("least_loaded"))


def test_metrics_count_the_hits_of_a_policy_that_says_it_predicts_them() -> None:
    router = Wrapped()
    router.inner.routed_chunks, router.inner.hit_chunks, router.inner.predicted_tokens = 10, 4, 256
    registry = Registry()
    pools = [pool(router), pool(make_router("least_loaded"), "generation")]
    OrchestratorMetrics._prefix_routing(registry, pools)
    page = registry.render().decode()
    for line in (
        'fastcore_orchestrator_prefix_chunks_total{pool="context"} 10',
        'fastcore_orchestrator_prefix_hit_chunks_total{pool="context"} 4',
        'fastcore_orchestrator_prefix_predicted_hit_tokens_total{pool="context"} 256',
    ):
        assert line in page or line + ".0" in page, line
    assert 'pool="generation"' not in page  # least_loaded predicts nothing


def test_the_cache_view_follows_the_pools_whose_policy_takes_cache_events() -> None:
    followed = pool(Wrapped())
    view = CacheView([followed, pool(make_router("conversation", {"match_threshold": 0.5}))], None)
    assert view.pools == [followed]


class Weighs(Router):
    """A policy of its own (no LeastLoadedRouter, no ``use_tokens``) that reads the workers'
    in-flight prompt tokens: the orchestrator must count them for it."""

    name = "weighs"
    weighs_tokens = True

    def __init__(self) -> None:
        self.estimate = BytesPerToken()

    def choose(self, candidates: list[Any], key: RequestKey | None = None) -> Any:
        return min(candidates, key=lambda w: w.in_flight_tokens)


def test_only_least_loaded_with_use_tokens_says_it_weighs_tokens() -> None:
    says = {kind: make_router(kind).weighs_tokens for kind in ROUTERS}
    assert says == dict.fromkeys(ROUTERS, False)
    assert make_router("least_loaded", {"use_tokens": True}).weighs_tokens


def test_the_orchestrator_counts_prompt_tokens_for_a_policy_that_weighs_them(monkeypatch: Any) -> None:
    from server.orchestrator import pools
    from server.orchestrator.app import Orchestrator
    from server.orchestrator.config import build_config

    data = {"context_servers": {"urls": ["127.0.0.1:1"]}, "generation_servers": {"urls": ["127.0.0.1:2"]}}
    assert not Orchestrator(build_config(data, environ={})).count_tokens
    monkeypatch.setattr(pools, "make_router", lambda kind, args=None: Weighs())
    assert Orchestrator(build_config(data, environ={})).count_tokens
