"""Worker pools: a router per pool and the health checker that keeps them honest.

A worker is routable while ``/health`` says so. Evidence of a dead worker
takes it out at once: a refused or reset connection (during a health check
or a request: the next request does not try it too), or a ``/health`` that
answers anything but 200. A health check that merely times out is weaker
evidence: under load the orchestrator's own loop, not the worker, may be what
is slow, and taking every worker out then would turn overload into an outage
of 503s. So a worker leaves on timeouts only after ``UNHEALTHY_AFTER_TIMEOUTS``
checks in a row time out with no request served by it in between. The checker
puts a worker back when ``/health`` answers 200 again.

Beside health, each worker has a :class:`CircuitBreaker` fed by the legs
themselves, on evidence about the worker only (server/orchestrator/legs.py
says which): failures in a row (a timed-out leg at once) open it, and an open
worker gets no new legs until one probe leg, let through after a while,
succeeds. A frozen worker (its socket accepts, nothing answers) is out after
its first timed-out leg, not after three health checks.

A breaker may still be wrong, and a pool that refuses every client because
every breaker is open turns a few failed legs into an outage. So, as envoy's
panic threshold does, once fewer than ``panic_threshold`` of a pool's up
workers (healthy by ``/health``) have a breaker that lets legs through, legs
go to every up worker as if no breaker were open (a success there closes its
breaker). A worker down by ``/health`` is never included: its refused
connection or non-200 is evidence from now, and the checker puts it back
within an interval of its recovery. A leg with another way out (a context
leg that can fall back to local prefill) does not panic.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Collection
from typing import Any

import aiohttp

from fastcore import protocol as wire
from server.tasks import stop_tasks

from . import twins
from .breaker import BREAKER_FAILURES, BREAKER_OPEN_S, CircuitBreaker, watch_epoch
from .routing import ROUTERS, LeastLoadedRouter, RequestKey, RoundRobinRouter, Router, make_router

__all__ = [
    "ROUTERS",
    "Capabilities",
    "CircuitBreaker",
    "HealthChecker",
    "LeastLoadedRouter",
    "Pool",
    "RoundRobinRouter",
    "Router",
    "Worker",
]

log = logging.getLogger("fastcore.orchestrator")


UNHEALTHY_AFTER_TIMEOUTS = 3
#: bumped by every change of a worker's health, capabilities or breaker state: a Pool's cached view of
#: its workers (routable ones, readiness, base64 ids) is rebuilt only then, not on every request
#: (routing cost independent of fleet size)
_ROUTABLE_EPOCH = [0]


class Capabilities:
    """What a worker's ``/server_info`` says it can do (everything False / None on any doubt)."""

    __slots__ = (
        "b64_completions",
        "bootstrap_port",
        "bytes_per_token",
        "cache_salt_completions",
        "engine_id",
        "kv_capacity_tokens",
        "kv_tier2",
        "local_prefill",
        "refused",
    )

    def __init__(
        self,
        b64_completions: bool = False,
        local_prefill: bool = False,
        kv_capacity_tokens: int | None = None,
        bytes_per_token: float | None = None,
        cache_salt_completions: bool = False,
        bootstrap_port: int | None = None,
        engine_id: str | None = None,
        refused: str | None = None,
    ) -> None:
        self.b64_completions = b64_completions
        self.local_prefill = local_prefill
        self.kv_capacity_tokens = kv_capacity_tokens
        self.bytes_per_token = bytes_per_token
        #: it takes ``cache_salt`` on completions: a fastcore worker (it says ``prefix_caching``);
        #: trtllm-serve's completion request has no such field and refuses one
        self.cache_salt_completions = cache_salt_completions
        #: an SGLang prefill worker's ``disaggregation_bootstrap_port`` (protocols/sglang.py), a vLLM
        #: Mooncake prefill's bootstrap server port (protocols/vllm_mooncake.py)
        self.bootstrap_port = bootstrap_port
        #: a second KV tier's (tokens, load tokens/s, prefill tokens/s), each None unless said
        self.kv_tier2: tuple[int | None, float | None, float | None] = (None, None, None)
        #: a vLLM Mooncake prefill's engine id, from its bootstrap server's ``/query``
        self.engine_id = engine_id
        #: why the worker is kept out of routing (worker_protocol: auto: it speaks another protocol)
        self.refused = refused

    @classmethod
    def of(cls, info: object) -> Capabilities:
        if not isinstance(info, dict):
            return cls()
        capacity = info.get(wire.INFO_KV_CAPACITY_TOKENS)
        local = info.get(wire.INFO_LOCAL_PREFILL, True if wire.INFO_TRTLLM_MARKER in info else None)
        bpt = info.get(wire.INFO_BYTES_PER_TOKEN)
        caps = cls(
            info.get(wire.INFO_B64_COMPLETIONS) is True,
            local is True,
            capacity if type(capacity) is int and capacity > 0 else None,
            _positive(bpt),
            wire.INFO_PREFIX_CACHING in info,
        )
        tier2 = info.get(wire.INFO_KV_TIER2_CAPACITY_TOKENS)
        if type(tier2) is int and tier2 > 0:  # only with a second KV tier (docs/protocol.md)
            caps.kv_tier2 = (
                tier2,
                _positive(info.get(wire.INFO_KV_TIER2_LOAD_TOKENS_PER_S)),
                _positive(info.get(wire.INFO_PREFILL_TOKENS_PER_S)),
            )
        return caps


def _positive(value: object) -> float | None:
    """A positive number of a worker's JSON as a float; None for anything else."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    return float(value) if number and value > 0 else None  # type: ignore[arg-type,operator]


#: the most of a /health body read (it is a small JSON object)
MAX_HEALTH_BODY = 4096


def _instance(body: bytes) -> str | None:
    """The ``instance`` of a fastcore worker's /health body (None from any other server)."""
    if b'"%s"' % wire.INFO_INSTANCE.encode() not in body:
        return None
    try:
        value = json.loads(body).get(wire.INFO_INSTANCE)
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


#: the default share of a pool's up workers whose breakers must let legs through, below which legs go
#: to every up worker (the config key circuit_breaker_panic_threshold; envoy's healthy_panic_threshold)
PANIC_THRESHOLD = 0.5


#: the pure twin (breaker.py, the behavioural reference); where the compiled one is built (the same
#: source compiled: server.orchestrator._breaker, which twins.py picks) ``CircuitBreaker`` is its;
#: both bump this module's epoch
PURE: dict[str, type] = {"CircuitBreaker": CircuitBreaker}
watch_epoch(_ROUTABLE_EPOCH)
if twins.breaker is not None:
    twins.breaker.watch_epoch(_ROUTABLE_EPOCH)
    CircuitBreaker = twins.breaker.CircuitBreaker  # type: ignore[misc]


class Worker:
    __slots__ = (
        "_b64_completions",
        "_healthy",
        "answered_at",
        "bootstrap_port",
        "breaker",
        "cache_salt_completions",
        "checked",
        "engine_id",
        "in_flight",
        "in_flight_tokens",
        "instance",
        "kv_capacity_tokens",
        "kv_tier2",
        "local_prefill",
        "served",
        "timeouts",
        "url",
    )

    def __init__(self, url: str, breaker: CircuitBreaker | None = None) -> None:
        self.url = url
        self.breaker = breaker if breaker is not None else CircuitBreaker()
        # Not routable until the first health check says so: the orchestrator's
        # own /health is 503 until then.
        self._healthy = False
        #: a health check of it has ended (either way): until then "unhealthy" only means "not known yet"
        self.checked = False
        self.in_flight = 0
        # Their prompts' estimated tokens (counted only for a load_balancing router with use_tokens).
        self.in_flight_tokens = 0
        # Requests this worker answered since the last health check (passive evidence).
        self.served = 0
        #: when (perf_counter) it last answered a generation leg 200: evidence that it serves while a
        #: leg sent to it before then waits (server/orchestrator/legs.py, LegRunner.served)
        self.answered_at = 0.0
        # Health checks in a row that timed out.
        self.timeouts = 0
        # From /server_info, read each time the worker becomes healthy.
        self._b64_completions = False
        self.cache_salt_completions = False
        self.local_prefill = False
        self.kv_capacity_tokens: int | None = None
        #: a second KV tier's (tokens, load tokens/s, prefill tokens/s) from /server_info
        self.kv_tier2: tuple[int | None, float | None, float | None] = (None, None, None)
        self.bootstrap_port: int | None = None
        self.engine_id: str | None = None
        # The worker process's id, from its /health (a fastcore worker says it): a new one is
        # a restart, whose cache is empty even though /health never failed.
        self.instance: str | None = None

    @property
    def healthy(self) -> bool:
        return self._healthy

    @healthy.setter
    def healthy(self, healthy: bool) -> None:
        if healthy != self._healthy:
            self._healthy = healthy
            _ROUTABLE_EPOCH[0] += 1  # Pool.choose's cached candidates are stale

    @property
    def b64_completions(self) -> bool:
        return self._b64_completions

    @b64_completions.setter
    def b64_completions(self, b64: bool) -> None:
        if b64 != self._b64_completions:
            self._b64_completions = b64
            _ROUTABLE_EPOCH[0] += 1  # Pool.b64_completions' cached answer is stale

    def set_capabilities(self, caps: Capabilities) -> None:
        self.b64_completions = caps.b64_completions
        if caps.cache_salt_completions != self.cache_salt_completions:
            self.cache_salt_completions = caps.cache_salt_completions
            _ROUTABLE_EPOCH[0] += 1  # Pool.salts_completions' cached answer is stale
        self.local_prefill = caps.local_prefill
        self.kv_capacity_tokens = caps.kv_capacity_tokens
        self.kv_tier2 = caps.kv_tier2
        self.bootstrap_port = caps.bootstrap_port
        self.engine_id = caps.engine_id

    def __repr__(self) -> str:
        return f"Worker({self.url!r}, healthy={self.healthy}, in_flight={self.in_flight})"


class Pool:
    def __init__(
        self,
        name: str,
        urls: list[str],
        router: str,
        router_args: dict[str, Any] | None = None,
        *,
        breaker_failures: int = BREAKER_FAILURES,
        breaker_open_s: float = BREAKER_OPEN_S,
        panic_threshold: float = PANIC_THRESHOLD,
    ) -> None:
        self.name = name
        self.breaker_failures = breaker_failures
        self.breaker_open_s = breaker_open_s
        #: see the module: 0 never panics, 1 panics once any up worker's breaker is open
        self.panic_threshold = panic_threshold
        #: in panic since the last choice that was not (logged once per panic, not per leg)
        self.panicking = False
        self.workers = [self._worker(u) for u in urls]
        self.router: Router = make_router(router, router_args)
        #: the router reads a per-request key (RequestKey); round_robin and least_loaded do not
        self.needs_key = self.router.needs_key
        self.router.sync(self.workers)
        self.static = frozenset(urls)
        #: URLs of the workers that discovery added (server/orchestrator/discovery.py)
        self.discovered: set[str] = set()
        #: Pool.choose's cached routable workers (see _routable)
        self._routable_list: list[Worker] | None = None
        self._ready = self._b64 = self._salts = False
        self._routable_epoch = -1
        self._routable_of: list[Worker] | None = None

    def sync_discovered(self, urls: Collection[str]) -> tuple[list[Worker], list[Worker]]:
        """Make the discovered workers exactly ``urls`` (the configured ones stay whatever
        discovery says); returns (added, removed). A removed worker's requests in flight go on:
        only new requests stop choosing it."""
        wanted = set(urls) - self.static
        added = [self._worker(url) for url in sorted(wanted - self.discovered)]
        gone = self.discovered - wanted
        removed = [w for w in self.workers if w.url in gone]
        if added or removed:
            # A new list, never an in-place edit: a health round iterating the old one is unaffected.
            self.workers = [w for w in self.workers if w.url not in gone] + added
            self.discovered = wanted
            for worker in removed:
                self.router.forget(worker)
            self.router.sync(self.workers)
        return added, removed

    def _worker(self, url: str) -> Worker:
        return Worker(url, CircuitBreaker(self.breaker_failures, self.breaker_open_s))

    def healthy_count(self) -> int:
        return sum(1 for w in self.workers if w.healthy)

    @property
    def b64_completions(self) -> bool:
        """Every worker said it answers completions with ``prompt_token_ids_b64`` (docs/protocol.md (1)).

        Any worker of the pool may take a request, so one that cannot (a
        trtllm-serve server, or one not heard from yet) means the list.
        """
        if self._routable_epoch != _ROUTABLE_EPOCH[0] or self._routable_of is not self.workers:
            self._refresh()
        return self._b64

    @property
    def salts_completions(self) -> bool:
        """Every healthy worker takes ``cache_salt`` on completions (server/orchestrator/tenant_salt.py):
        one that does not (a trtllm-serve server) means none is added. A worker's capabilities are
        read before it is healthy, and one that is not takes no leg."""
        if self._routable_epoch != _ROUTABLE_EPOCH[0] or self._routable_of is not self.workers:
            self._refresh()
        return self._salts

    @property
    def ready(self) -> bool:
        """Some worker is healthy (read on every request: kept with the routable workers)."""
        if self._routable_epoch != _ROUTABLE_EPOCH[0] or self._routable_of is not self.workers:
            self._refresh()
        return self._ready

    def choose(
        self, exclude: Collection[Worker] = (), key: RequestKey | None = None, *, panic: bool = False
    ) -> Worker | None:
        """A healthy worker not in ``exclude`` (those already tried) whose breaker lets a leg through,
        or None. ``key``: the request's routing key, for a router that ``needs_key`` (None: it routes
        as least_loaded would). ``panic``: the leg has no other way out, so below ``panic_threshold``
        every healthy worker is a candidate, breakers ignored (see the module). The leg that goes
        there marks its breaker (:meth:`CircuitBreaker.chosen`)."""
        if not exclude:
            routable = self._routable()
            if routable is not None:
                return self.router.choose(routable, key) if routable else None
        now = time.monotonic()
        up = [w for w in self.workers if w.healthy]
        passing = [w for w in up if w.breaker.state == CircuitBreaker.CLOSED or w.breaker.allows(now)]
        if panic and len(passing) < self.panic_threshold * len(up):
            passing = up
            if not self.panicking:
                self.panicking = True
                log.warning(
                    "%s pool: too few breakers let legs through: legs go to every healthy worker "
                    "(circuit_breaker_panic_threshold %g)",
                    self.name,
                    self.panic_threshold,
                )
        elif panic:
            self.panicking = False
        candidates = [w for w in passing if not (exclude and w in exclude)] if exclude else passing
        if not candidates:
            return None
        return self.router.choose(candidates, key)

    def _routable(self) -> list[Worker] | None:
        """The healthy workers whose breakers are closed (a list routers must not change), kept until
        a health, breaker or capability change or a new member list; None while some healthy worker's
        breaker is not closed (whether it lets a probe through depends on the time: the full pass
        decides)."""
        if self._routable_epoch != _ROUTABLE_EPOCH[0] or self._routable_of is not self.workers:
            self._refresh()
        return self._routable_list

    def _refresh(self) -> None:
        """What the pool's workers say now, kept until the next change (``_ROUTABLE_EPOCH``) or member
        list: the routable ones, whether any is healthy, whether all answer with base64 ids."""
        workers = self.workers
        closed = [w for w in workers if w.healthy and w.breaker.state == CircuitBreaker.CLOSED]
        tripped = any(w.healthy and w.breaker.state != CircuitBreaker.CLOSED for w in workers)
        self._routable_list = None if tripped else closed
        if not tripped:
            self.panicking = False  # every breaker closed: the next panic is logged again
        self._ready = any(w.healthy for w in workers)
        self._b64 = all(w.b64_completions for w in workers)
        self._salts = all(w.cache_salt_completions for w in workers if w.healthy)
        self._routable_epoch, self._routable_of = _ROUTABLE_EPOCH[0], workers

    def all_open(self) -> bool:
        """Some worker is healthy, and every healthy one's breaker is open (or probing)."""
        now = time.monotonic()
        healthy = [w for w in self.workers if w.healthy]
        return bool(healthy) and not any(w.breaker.allows(now) for w in healthy)

    def forget(self, worker: Worker) -> None:
        """``worker`` turned unhealthy or came back: its router state (a prefix index) is stale."""
        self.router.forget(worker)


async def read_json(session: aiohttp.ClientSession, url: str, timeout: aiohttp.ClientTimeout) -> object:
    """``GET url``'s JSON answer; None on any doubt (not a 200, not JSON, no answer)."""
    try:
        async with session.get(url, timeout=timeout) as resp:
            if resp.status != 200:
                return None
            return await resp.json(content_type=None)
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError):
        return None


class HealthChecker:
    """Polls ``GET /health`` of every worker every ``interval`` seconds."""

    def __init__(
        self,
        pools: list[Pool],
        session: aiohttp.ClientSession,
        *,
        interval: float,
        timeout: float,
        on_change: Callable[[Pool, Worker], None] = lambda pool, worker: None,
        capabilities_path: str = wire.SERVER_INFO_PATH,
        capabilities_of: Callable[[object], Capabilities] = Capabilities.of,
        probe: Callable[[aiohttp.ClientSession, Worker, aiohttp.ClientTimeout], Awaitable[Capabilities]]
        | None = None,
    ) -> None:
        self.pools = pools
        #: the worker protocol's probe (server/orchestrator/protocols/): where a worker says what it can
        #: do, and what that answer means
        self.capabilities_path = capabilities_path
        self.capabilities_of = capabilities_of
        #: a protocol whose probe reads more than one answer (vLLM Mooncake's bootstrap /query) runs it
        #: instead
        self.probe = probe
        #: worker URL -> why its probe keeps it out (logged once per reason)
        self._refused: dict[str, str] = {}
        self.session = session
        self.interval = interval
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self.on_change = on_change
        self._task: asyncio.Task[None] | None = None
        #: set once every worker has been checked once (each check bounded by ``timeout``)
        self.first_round = asyncio.Event()

    async def check_worker(self, pool: Pool, worker: Worker) -> None:
        try:
            async with self.session.get(worker.url + wire.HEALTH_PATH, timeout=self.timeout) as resp:
                healthy = resp.status == 200
                body = await resp.content.read(MAX_HEALTH_BODY) if healthy else b""
            worker.timeouts = 0
            instance = _instance(body)
            if healthy and worker.healthy and instance != worker.instance and worker.instance is not None:
                log.info(
                    "%s worker %s restarted (instance %s): its cache is empty",
                    pool.name,
                    worker.url,
                    instance,
                )
                pool.forget(worker)
                self._set_capabilities(pool, worker, await self.read_capabilities(worker))
            worker.instance = instance
        except asyncio.TimeoutError:
            # Slow, not dead: a request it answered since the last check restarts
            # the count; only a silent streak takes it out.
            worker.timeouts = 0 if worker.served else worker.timeouts + 1
            healthy = worker.healthy and worker.timeouts < UNHEALTHY_AFTER_TIMEOUTS
        except (aiohttp.ClientError, OSError):
            healthy = False
        worker.served = 0
        if healthy and not worker.healthy:
            caps = await self.read_capabilities(worker)
            if caps.refused is not None:
                if self._refused.get(worker.url) != caps.refused:
                    log.warning(
                        "%s worker %s is kept out of routing: %s", pool.name, worker.url, caps.refused
                    )
                self._refused[worker.url] = caps.refused
                healthy = False
            else:
                self._refused.pop(worker.url, None)
            self._set_capabilities(pool, worker, caps)
        if healthy != worker.healthy:
            # Down or back: a worker that comes back may have restarted with an empty cache.
            pool.forget(worker)
            log.log(
                logging.INFO if healthy else logging.WARNING,
                "%s worker %s is %s",
                pool.name,
                worker.url,
                "healthy" if healthy else "unhealthy",
            )
            worker.healthy = healthy
        worker.checked = True
        self.on_change(pool, worker)

    @staticmethod
    def _set_capabilities(pool: Pool, worker: Worker, caps: Capabilities) -> None:
        worker.set_capabilities(caps)
        pool.router.estimate.seed(caps.bytes_per_token)  # until answers teach the pool better

    async def read_capabilities(self, worker: Worker) -> Capabilities:
        """What ``worker``'s ``/server_info`` says (trtllm: completions in base64, ``local_prefill``,
        ``kv_capacity_tokens``; another protocol's probe: ``capabilities_path``), False / None on any doubt."""
        if self.probe is not None:
            return await self.probe(self.session, worker, self.timeout)
        return self.capabilities_of(
            await read_json(self.session, worker.url + self.capabilities_path, self.timeout)
        )

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check_worker(p, w) for p in self.pools for w in p.workers))

    async def check_unchecked(self) -> None:
        """One check of each worker never checked yet (one discovery added after the first round)."""
        await asyncio.gather(
            *(self.check_worker(p, w) for p in self.pools for w in p.workers if not w.checked)
        )

    def mark_unhealthy(self, pool: Pool, worker: Worker) -> None:
        if worker.healthy:
            log.warning("%s worker %s failed a request; out until /health recovers", pool.name, worker.url)
            worker.healthy = False
            pool.forget(worker)
            self.on_change(pool, worker)

    async def _run(self) -> None:
        while True:
            try:
                await self.check_all()
            except Exception:  # a checker that dies would freeze every worker's state
                log.exception("health check round failed")
            self.first_round.set()
            await asyncio.sleep(self.interval)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="fastcore-health-checker")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await stop_tasks([task])
