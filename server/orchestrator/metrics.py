"""The orchestrator's ``/metrics``: its families, each bound child made once, and the per-phase CPU clock.

Everything a request touches on the hot path is a bound child (``.labels()``
called here, once), counted in plain numbers (:class:`TallyOne`,
:class:`TallyHistogram`: no lock, no call into prometheus_client) that reach
the page whenever the registry syncs: at each scrape, each read of a value, and
with ``--workers N`` each second. Gauges that
mirror state (workers' health, in-flight legs, breakers, the cluster's view)
are read from the pools when the page is scraped, not kept up to date per
request.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

from server.metrics import Registry, Scraped, http_server_families, scraped_families

from . import twins
from .routing import can_predict_hits
from .routing_metrics import bytes_per_token, routing_quality
from .tally import NoClock, TallyHistogram, TallyOne

if TYPE_CHECKING:
    from server.http import HTTPServer

    from .discovery import Discovery
    from .fleet_cluster import FleetCluster
    from .pools import Pool

#: why a request fell back to local prefill (``fastcore_orchestrator_context_fallbacks_total``)
FALLBACK_REASONS = ("no_worker", "circuit_open", "refused", "failed", "timeout")
#: the per-phase CPU clock (a thread_time() syscall per phase) runs on one request in this many;
#: every request is still counted everywhere else
CPU_SAMPLE_EVERY = 32
PHASES = ("validate", "build_context", "read_context", "build_generation", "relay", "total")
LEGS = ("context", "generation")


class Observed(Protocol):
    """What the metrics read of the orchestrator when the page is scraped."""

    in_flight: int
    pools: list[Pool]
    discovery: Discovery | None
    server: HTTPServer | None
    #: several hosts' membership (fleet_cluster.py): set by start_server once joined
    fleet_cluster: FleetCluster | None


class OrchestratorMetrics:
    """The orchestrator's families in ``registry``; ``orchestrator`` is read at each scrape."""

    def __init__(self, registry: Registry, orchestrator: Observed) -> None:
        self.requests = registry.counter(
            "fastcore_orchestrator_requests_total",
            "Client requests by route and HTTP status.",
            ("route", "status"),
        )
        registry.gauge(
            "fastcore_orchestrator_requests_in_flight",
            "Client requests being served.",
            callback=lambda: orchestrator.in_flight,
        )
        self.retries = registry.counter(
            "fastcore_orchestrator_retries_total", "Legs retried on another worker.", ("leg",)
        )
        self.kv_released = registry.counter(
            "fastcore_orchestrator_kv_released_total",
            "Context legs' parked KV released (DELETE) after their generation leg was given up, by answer "
            "(404: the generation worker had fetched it already).",
            ("status",),
        )
        self._workers(registry, orchestrator.pools)
        if orchestrator.discovery is not None:
            self._cluster(registry, orchestrator.discovery)
        if getattr(getattr(orchestrator, "config", None), "fleet_cluster", None) is not None:
            _fleet_cluster(registry, orchestrator)
        self._paths(registry)
        self._breakers(registry, orchestrator.pools)
        self._prefix_routing(registry, orchestrator.pools)
        bytes_per_token(registry, orchestrator.pools)
        self._latencies(registry)
        self._protocol(registry, getattr(orchestrator, "protocol", None))
        _server_stats(registry, orchestrator)
        self.cpu_phase = {phase: bind_histogram(self.cpu.labels(phase=phase), registry) for phase in PHASES}
        self.retries_leg = {leg: bind_counter(self.retries.labels(leg=leg), registry) for leg in LEGS}
        self._registry = registry
        #: (route, status): its child's count-one call, bound at the first such request
        self._requests: dict[tuple[str, int], Callable[[], None]] = {}

    def count_request(self, route: str, status: int) -> None:
        count = self._requests.get((route, status))
        if count is None:
            child = self.requests.labels(route=route, status=str(status))
            count = self._requests[(route, status)] = bind_counter(child, self._registry).inc
        count()

    def forget_worker(self, pool: str, url: str) -> None:
        """A worker left its pool: none of its series stays on the page."""
        self.worker_healthy.remove(pool=pool, url=url)
        self.worker_in_flight.remove(pool=pool, url=url)
        self.breaker_state.remove(pool=pool, url=url)

    def _workers(self, registry: Registry, pools: Sequence[Pool]) -> None:
        # With --workers N, each process checks health on its own: 1 while every process sees it pass.
        self.worker_healthy = registry.gauge(
            "fastcore_orchestrator_worker_healthy",
            "1 while a worker passes /health.",
            ("pool", "url"),
            multiprocess_mode="livemin",
        )
        self.worker_in_flight = registry.gauge(
            "fastcore_orchestrator_worker_in_flight", "Requests in flight per worker.", ("pool", "url")
        )

        def worker_in_flight() -> None:
            for pool in pools:
                for worker in pool.workers:
                    self.worker_in_flight.set(worker.in_flight, pool=pool.name, url=worker.url)

        registry.before_collect(worker_in_flight)

    def _cluster(self, registry: Registry, discovery: Discovery) -> None:
        registry.gauge(
            "fastcore_orchestrator_cluster_connected",
            "1 while the cluster registry (disagg_cluster) is reachable; 0: serving the last known workers.",
            callback=lambda: 1.0 if discovery.connected else 0.0,
            multiprocess_mode="livemin",  # 0 when any process of --workers N has lost it
        )
        registry.counter(
            "fastcore_orchestrator_cluster_resyncs_total",
            "Full reads of the cluster registry after the first (one per reconnection).",
            callback=lambda: discovery.resyncs,
        )
        # Every process of --workers N discovers the same set: the scrape says it once.
        self.cluster_workers = registry.gauge(
            "fastcore_orchestrator_cluster_workers", "Workers discovered through the cluster, per pool.",
            ("pool",), multiprocess_mode="livemax",
        )  # fmt: skip
        registry.gauge(
            "fastcore_orchestrator_cluster_refused_workers",
            "Registered workers refused now (another model, an unknown role).",
            callback=lambda: len(discovery.refused),
            multiprocess_mode="livemax",
        )

        def cluster_workers() -> None:
            for name in discovery.pools:
                self.cluster_workers.set(discovery.count(name), pool=name)

        registry.before_collect(cluster_workers)

    def _paths(self, registry: Registry) -> None:
        self.by_path = registry.counter(
            "fastcore_orchestrator_requests_by_path_total",
            "Completions by path: disaggregated (context leg, then generation leg) or local_prefill "
            "(conditional_disagg_config: the generation worker prefilled the request itself).",
            ("path",),
        )
        self.path_disaggregated = bind_counter(self.by_path.labels(path="disaggregated"), registry)
        self.path_local = bind_counter(self.by_path.labels(path="local_prefill"), registry)
        self.path_fallback = bind_counter(self.by_path.labels(path="context_fallback"), registry)
        fallbacks = registry.counter(
            "fastcore_orchestrator_context_fallbacks_total",
            "Requests served whole by a local_prefill generation worker because no context worker took "
            "them (context_fallback), by reason: no_worker (none healthy), circuit_open (every healthy "
            "one's breaker open), refused (429/503 from each tried), failed (connection or 5xx), timeout "
            "(context_timeout_s).",
            ("reason",),
        )
        self.fallbacks = {reason: fallbacks.labels(reason=reason) for reason in FALLBACK_REASONS}
        for child in self.fallbacks.values():
            child.inc(0)
        self.fallbacks = {reason: bind_counter(child, registry) for reason, child in self.fallbacks.items()}

    def _breakers(self, registry: Registry, pools: Sequence[Pool]) -> None:
        self.breaker_opened = registry.counter(
            "fastcore_orchestrator_circuit_opened_total",
            "Worker circuit breakers opened (failed legs in a row, a timed-out leg, a failed probe).",
            ("pool",),
        )
        self.deadlines_not_counted = registry.counter(
            "fastcore_orchestrator_deadlines_not_counted_total",
            "Unary generation legs past request_timeout_s while their worker answered other legs: the "
            "request's own length, not counted against the worker's breaker.",
            ("pool",),
        )
        for pool in pools:
            self.breaker_opened.inc(0, pool=pool.name)
        self.breaker_state = registry.gauge(
            "fastcore_orchestrator_worker_circuit_state",
            "A worker's circuit breaker: 0 closed, 1 half-open (one probe leg), 2 open (no legs).",
            ("pool", "url"),
            multiprocess_mode="livemax",
        )

        def breaker_states() -> None:
            for pool in pools:
                for worker in pool.workers:
                    breaker = worker.breaker
                    breaker.allows(time.monotonic())  # an open one past its time reads half-open
                    self.breaker_state.set(breaker.state, pool=pool.name, url=worker.url)

        registry.before_collect(breaker_states)

    @staticmethod
    def _prefix_routing(registry: Registry, pools: Sequence[Pool]) -> None:
        kv_pools = [p for p in pools if p.router.predicts_hits]
        if not kv_pools:
            return
        hits = registry.counter(
            "fastcore_orchestrator_prefix_hit_chunks_total",
            "kv_cache_aware routing: prompt chunks expected to be cached on the chosen worker, per pool.",
            ("pool",),
        )
        routed = registry.counter(
            "fastcore_orchestrator_prefix_chunks_total",
            "kv_cache_aware routing: prompt chunks routed (hit or not), per pool.",
            ("pool",),
        )
        seen: dict[str, tuple[int, int]] = {p.name: (0, 0) for p in kv_pools}
        for pool in kv_pools:
            hits.inc(0, pool=pool.name)
            routed.inc(0, pool=pool.name)

        def prefix_counts() -> None:
            for pool in kv_pools:
                router = pool.router
                assert can_predict_hits(router)
                hit0, all0 = seen[pool.name]
                hits.inc(router.hit_chunks - hit0, pool=pool.name)
                routed.inc(router.routed_chunks - all0, pool=pool.name)
                seen[pool.name] = (router.hit_chunks, router.routed_chunks)

        registry.before_collect(prefix_counts)
        routing_quality(registry, kv_pools)

    def _protocol(self, registry: Registry, protocol: Any) -> None:
        """One gauge naming what the legs speak, set once: one protocol per deployment, so a label on
        every leg counter would only repeat it (and cost a lookup per request); a query joins on it."""
        if protocol is None:
            return
        registry.gauge(
            "fastcore_orchestrator_worker_protocol",
            "1 for the protocol the legs speak to the workers (worker_protocol; auto: the one the workers "
            "speak) and how the KV moves (transfer: vLLM's connector, SGLang's bootstrap, trtllm-serve's "
            "disaggregated_params).",
            ("protocol", "transfer"),
            multiprocess_mode="livemax",
        ).set(1.0, protocol=protocol.name, transfer=getattr(protocol, "transfer", ""))

    def _latencies(self, registry: Registry) -> None:
        self.cpu = registry.histogram(
            "fastcore_orchestrator_cpu_seconds",
            "The orchestrator's own CPU time per request on the event loop, by phase "
            f"(thread CPU clock, sampled: one request in {CPU_SAMPLE_EVERY}).",
            ("phase",),
        )
        self.context_leg = bind_histogram(
            registry.histogram(
                "fastcore_orchestrator_context_leg_seconds", "Context request sent -> context response read."
            ).labels(),
            registry,
        )
        self.handoff = bind_histogram(
            registry.histogram(
                "fastcore_orchestrator_handoff_seconds",
                "Context response read -> generation request handed to its connection.",
            ).labels(),
            registry,
        )
        self.generation_ttfb = bind_histogram(
            registry.histogram(
                "fastcore_orchestrator_generation_ttfb_seconds",
                "Generation request handed over -> first byte of the generation response (its headers).",
            ).labels(),
            registry,
        )
        self.finished_by_context = bind_counter(
            registry.counter(
                "fastcore_orchestrator_finished_by_context_total",
                "Requests answered by the context leg alone.",
            ).labels(),
            registry,
        )


def _fleet_cluster(registry: Registry, orchestrator: Observed) -> None:
    """Several hosts (config fleet_cluster, fleet_cluster.py): the members this orchestrator counts
    and the share it takes, read from its membership at each scrape. Before start_server joined it
    the page says one member with a whole share, as admission holds until then.
    Every process of a host's --workers N sees the same members and holds its group's share: the
    scrape says it once (livemax); connected is 0 when any process has lost etcd (livemin)."""

    admission = getattr(orchestrator, "admission", None)
    whole = float(admission.max_inflight) if admission is not None else 0.0

    def read(value: Callable[[FleetCluster], float], alone: float) -> Callable[[], float]:
        def scraped() -> float:
            cluster = orchestrator.fleet_cluster
            return alone if cluster is None else value(cluster)

        return scraped

    registry.gauge(
        "fastcore_orchestrator_fleet_members",
        "Orchestrator processes live in the fleet (fleet_cluster) as this one's watch sees them, itself "
        "included.",
        callback=read(lambda cluster: cluster.member_count, 1.0),
        multiprocess_mode="livemax",
    )
    registry.gauge(
        "fastcore_orchestrator_fleet_share",
        "This orchestrator's (its host's processes') fraction of each tenant's rate limits in the fleet.",
        callback=read(lambda cluster: cluster.share[0], 1.0),
        multiprocess_mode="livemax",
    )
    registry.gauge(
        "fastcore_orchestrator_fleet_max_inflight",
        "This orchestrator's (its host's processes') part of admission.max_inflight in the fleet.",
        callback=read(lambda cluster: cluster.share[1], whole),
        multiprocess_mode="livemax",
    )
    registry.gauge(
        "fastcore_orchestrator_fleet_connected",
        "1 while the fleet's etcd (fleet_cluster) is reachable; 0: the last share kept.",
        callback=read(lambda cluster: 1.0 if cluster.connected else 0.0, 0.0),
        multiprocess_mode="livemin",
    )


#: the client side's body budget, beside the HTTP server's families (server.metrics.http_server_families)
_BODY_BUDGET: list[Scraped] = [
    ("gauge", "fastcore_orchestrator_client_body_bytes",
     "Client request body bytes held now (received, not yet answered).", "body_bytes"),
    ("counter", "fastcore_orchestrator_body_budget_refused_total",
     "Client requests refused (503) because the process held too many body bytes.", "over_budget"),
]  # fmt: skip


def _server_stats(registry: Registry, orchestrator: Observed) -> None:
    """The client side's counts, read from the orchestrator's HTTP server at each scrape."""
    families = [*http_server_families("fastcore_orchestrator"), *_BODY_BUDGET]
    scraped_families(registry, lambda: orchestrator.server, families)


class BoundHistogram:
    """A histogram child's ``observe`` in one frame: the values prometheus_client's child observes
    into (its sum, its bucket counters; a lock each, or mmap slots in multiprocess mode), bound
    once, and the bucket found by bisection.

    prometheus_client's own ``observe`` checks the child is bound, then walks the bucket bounds
    in Python (~80 bytecodes for a few-ms observation); the same ``inc`` calls on the same values
    land here, so the page and the multiprocess files read the same. The bounds end at +Inf, so
    the bucket found holds any number; NaN, which no bound holds, goes to the sum alone as there.
    """

    __slots__ = ("_bounds", "_buckets", "_sum", "native")

    def __init__(self, child: Any) -> None:
        self.native = child
        self._bounds = tuple(child._upper_bounds)
        self._buckets = tuple(child._buckets)
        self._sum = child._sum

    def observe(self, amount: float) -> None:
        self._sum.inc(amount)
        i = bisect_left(self._bounds, amount)
        if amount <= self._bounds[i]:
            self._buckets[i].inc(1)


class CountOne:
    """A counter child whose ``inc()`` adds one straight to prometheus_client's value (its lock, or
    its mmap slot in multiprocess mode): the child's own ``inc`` first checks it is bound and the
    amount not negative, two Python frames per count on the request path. ``native``: the child."""

    __slots__ = ("inc", "native")

    def __init__(self, child: Any) -> None:
        self.native = child
        self.inc: Callable[[], None] = partial(child._value.inc, 1.0)


def bind_counter(child: Any, registry: Registry | None = None) -> Any:
    """``child`` counted through a :class:`TallyOne` flushed by ``registry``'s syncs, or without one
    through a :class:`CountOne`, where it is prometheus_client's (another registry's child is kept
    as it is)."""
    return _bind(child, "_value", CountOne, TallyOne, registry)


def bind_histogram(child: Any, registry: Registry | None = None) -> Any:
    """``child`` observed through a :class:`TallyHistogram` flushed by ``registry``'s syncs, or without
    one through a :class:`BoundHistogram`, where it is prometheus_client's (another registry's child,
    as bench.metrics_cost's hand-written one, is kept as it is)."""
    return _bind(child, "_upper_bounds", BoundHistogram, TallyHistogram, registry)


def _bind(
    child: Any, native: str, immediate: Callable[[Any], Any], tally: Any, registry: Registry | None
) -> Any:
    """A prometheus_client child (one with attribute ``native``) bound for the hot path: ``tally(child)``,
    flushed at each of ``registry``'s syncs, or without a registry ``immediate(child)``."""
    if not hasattr(child, native):
        return child
    if registry is None:
        return immediate(child)
    bound = tally(child)
    registry.before_collect(bound.flush)
    return bound


class CpuClock:
    """Thread CPU time of the orchestrator's synchronous work, by phase.

    Only code between awaits is measured, so other requests' work on the same
    loop is never counted against this one.
    """

    __slots__ = ("last", "phases", "total")

    def __init__(self, phases: dict[str, Any]) -> None:
        self.phases = phases
        self.total = 0.0
        self.last = time.thread_time()

    def start(self) -> None:
        self.last = time.thread_time()

    def lap(self, phase: str) -> None:
        now = time.thread_time()
        spent = now - self.last
        self.total += spent
        self.phases[phase].observe(spent)
        self.last = now

    def finish(self) -> None:
        self.phases["total"].observe(self.total)


#: the pure twins of the per-request numbers (tally.py, the behavioural reference); where the compiled
#: ones are built (the same source compiled: server.orchestrator._tally, which twins.py picks) the
#: names are theirs
PURE: dict[str, type] = {"TallyOne": TallyOne, "TallyHistogram": TallyHistogram, "NoClock": NoClock}
if twins.tally is not None:
    TallyOne = twins.tally.TallyOne  # type: ignore[misc]
    TallyHistogram = twins.tally.TallyHistogram  # type: ignore[misc]
    NoClock = twins.tally.NoClock  # type: ignore[misc]

NO_CLOCK = NoClock()
Clock = CpuClock | NoClock
