"""The orchestrator: runs each request's context and generation legs on the lean HTTP layer.

Request path (docs/protocol.md): read and check the client body; send the context
request to a context worker (retried on another one on connection errors and
refusals; with ``context_fallback``, prefilled on a generation worker when none
takes it); if the context response is already the answer, return it; otherwise
send the generation request to a generation worker and relay its response:
SSE bytes as they arrive, or the JSON body without internal fields. What each
leg sends is its protocol's (protocols/); the completion's steps are
completion.py's (``CompletionDriver``, which the ``Orchestrator`` is); both legs
run in one loop (legs.py: choose, lease, send, classify, retry), and the metrics
are metrics.py's. This module keeps the lifecycle, the routes and the small
endpoints.

Both sides of the hot path are :mod:`server.http`: client connections are
asyncio protocols framed by llhttp (bounded headers, bodies, time and
connections), and each worker has a pool of keep-alive upstream connections
that write request bodies as their pieces and hand streamed response bytes
straight to the client's socket. A completion is served from those
connections' callbacks (exchange.py: one object per request, no task) and goes
on in coroutines only where it leaves the common case (a worker's refusal or
failure, a deadline, the admission queue, tracing, conditional
disaggregation; completion.py): the same steps, written once. aiohttp stays off the
request path: it runs the workers' health checks.

The app keeps no per-request state beyond the request itself, so any number
of processes (``--workers N``) and hosts can share the load.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

import aiohttp

from server.errors import HTTPError
from server.http import (
    Deadlines,
    HTTPServer,
    Limits,
    Request,
    Responder,
    UpstreamError,
    UpstreamPool,
    UpstreamTimeout,
)
from server.metrics import CONTENT_TYPE, Registry
from server.routes import BY_PATH, CHAT
from server.tracing import start_tracing
from server.trtllm_endpoints import ORCHESTRATOR_ROUTES, TrtllmEndpoints

from .completion import CompletionDriver
from .config import OrchestratorConfig

if TYPE_CHECKING:
    from .discovery import Discovery
    from .fleet import Fleet
    from .fleet_cluster import FleetCluster
from .admission import Admission
from .apis import ApiResponder, ClientApi, answer_other, bound_apis
from .cache_view import CacheView
from .estimates import UsageLearner
from .exchange import Exchange
from .legs import (
    MAX_ERROR_BODY,
    LegRunner,
)
from .metrics import OrchestratorMetrics
from .pair import PairExchange, PairRunner
from .pools import HealthChecker, Pool, Worker
from .protocols import AUTO, make_protocol
from .protocols.detect import guard_probe, probe_of, resolve_auto
from .tenants import (
    ANONYMOUS,
    UNAUTHORIZED_BODY,
    UNAUTHORIZED_HEADERS,
    Tenant,
    keys_from_config,
    metrics_access_for,
)

log = logging.getLogger("fastcore.orchestrator")

LISTEN_BACKLOG = 4096
# Per-connection read buffer of the aiohttp pass-through floor (bench/passthrough.py).
READ_BUFSIZE = 1 << 22

_JSON = b"application/json"
_POST = b"POST"
_CHAT = CHAT.path
#: a completion route's POST path -> its Route (server/routes.py)
_ROUTES = BY_PATH
_GET_ROUTES = (b"/health", b"/metrics", b"/v1/models")


#: seconds a shutdown waits for its last KV releases to reach the context workers
STOP_RELEASES_S = 1.0


class Orchestrator(CompletionDriver):
    #: completions from callbacks where they can be (exchange.py); False: each in its task, as before
    #: (the tests run both request paths)
    serve_from_callbacks = True

    def __init__(self, config: OrchestratorConfig) -> None:
        config.check_runnable()
        self.config = config
        self._init_pools(config)
        #: fire-and-forget tasks (KV releases, first health checks), kept referenced until done
        self._background: set[asyncio.Task[None]] = set()
        self.discovery: Discovery | None = None
        #: several hosts' share through etcd (config fleet_cluster; set by start_server)
        self.fleet_cluster: FleetCluster | None = None
        self._init_discovery(config)
        self.secret = config.shared_secret_bytes
        self.in_flight = 0
        #: what serves completions now (tasks, exchanges): a drain that runs out of time cancels them
        self._serving: set[asyncio.Task[Any] | Exchange] = set()
        #: set by :meth:`drain`: new completions are refused (503), those in flight go on
        self.draining = False
        self.server: HTTPServer | None = None
        self.registry = Registry()
        self.metrics = OrchestratorMetrics(self.registry, self)
        self._init_client_side(config)
        self._init_upstreams(config)
        self.session: aiohttp.ClientSession | None = None
        self.health: HealthChecker | None = None
        self.cache_view: CacheView | None = None
        self._requests = 0
        #: OpenTelemetry (server/tracing.py): None unless an OTLP endpoint is configured
        self.tracing = start_tracing("fastcore-orchestrator", config.otlp_traces_endpoint)
        self.client_trace = config.otlp_config is None or config.otlp_config.client_trace_context
        #: completions served from callbacks (exchange.py; a concurrent protocol's pairs: pair.py), but
        #: those that wait for admission, are traced, or may be prefilled on their generation worker:
        #: their coroutines hold that state
        self.callbacks = (
            self.serve_from_callbacks
            and self.admission is None
            and self.tracing is None
            and self.max_local_prefill is None
        )
        #: a protocol whose legs run at once (SGLang's, vLLM Mooncake's): its pairs (pair.py)
        self.pairs = PairRunner(self) if self.protocol.concurrent else None
        #: what serves a completion from callbacks: one leg after the other, or a pair's at once
        self.exchange: type[Exchange] = PairExchange if self.protocol.concurrent else Exchange

    def _init_pools(self, config: OrchestratorConfig) -> None:
        """The protocol the legs speak, both pools and their routers' needs, conditional disaggregation."""
        #: what the legs speak to the workers (protocols/: trtllm-serve's, vLLM's): their bodies (its relay),
        #: headers, KV releases and capability probe
        self.protocol = make_protocol(config)
        #: ``worker_protocol: auto`` chose it (start_server): a worker that turns up as another is kept out
        self.protocol_detected = False
        self.relay = self.protocol.relay
        ctx_router, gen_router = config.context_servers.router, config.generation_servers.router
        breakers: dict[str, Any] = {
            "breaker_failures": config.circuit_breaker_failures,
            "breaker_open_s": config.circuit_breaker_open_s,
            "panic_threshold": config.circuit_breaker_panic_threshold,
        }
        self.context_pool = Pool(
            "context", config.context_servers.urls, ctx_router.kind, ctx_router.args, **breakers
        )
        self.generation_pool = Pool(
            "generation", config.generation_servers.urls, gen_router.kind, gen_router.args, **breakers
        )
        #: no context worker takes a request: a local_prefill generation worker serves it whole
        self.fallback = config.context_fallback == "local_prefill"
        self.pools = [self.context_pool, self.generation_pool]
        # Routing keys are computed per request only when a pool's router reads them.
        self.needs_key = any(p.needs_key for p in self.pools)
        self.count_tokens = any(p.router.weighs_tokens for p in self.pools)
        #: each context answer's usage teaches bytes per token and scores the predicted hit
        self.usage = UsageLearner(self.context_pool.router, self.generation_pool.router)
        self.needs_conversation = any("conversation" in p.router.key_kinds for p in self.pools)
        #: conditional disaggregation: remainders up to this many tokens are prefilled on the
        #: generation worker (config.check_runnable made sure its router is kv_cache_aware)
        self.max_local_prefill: int | None = None
        self.require_prefix_hit = False
        if config.conditional_disagg_config is not None:
            self.max_local_prefill = config.conditional_disagg_config.max_local_prefill_length
            self.require_prefix_hit = config.conditional_disagg_config.require_prefix_hit

    def _init_discovery(self, config: OrchestratorConfig) -> None:
        """etcd discovery (``disagg_cluster``): workers join and leave the pools as they register."""
        if config.disagg_cluster is not None:
            from .discovery import Discovery, schedule_check  # server.cluster: only with discovery

            self.discovery = Discovery(
                config.disagg_cluster,
                {"context": self.context_pool, "generation": self.generation_pool},
                model=config.model,
                protocol=self.protocol.name,
                hostname=config.hostname,
                port=config.port,
                check_now=schedule_check(lambda: self.health, self._background),
                on_removed=self._worker_left,
                secret=config.shared_secret_bytes,
            )

    def _init_client_side(self, config: OrchestratorConfig) -> None:
        """What a client meets first: API keys and tenants, admission, the client APIs, trtllm-serve's
        other endpoints and the HTTP server's limits."""
        #: client API keys and the admission queue (tenants.py, admission.py): None when not configured
        self.keys = keys_from_config(config, self.registry)
        #: each tenant's prompts cached apart: its own cache_salt on every leg (tenant_salt.py)
        self.tenant_salts = self.keys is not None and not config.share_prefix_cache_across_tenants
        self.admission = (
            Admission(
                config.admission,
                self.registry,
                config.retry_after_s,
                lambda: self.context_pool.router.estimate.value,
            )
            if config.admission is not None
            else None
        )
        if self.admission is not None:  # a request's first usage corrects its prompt-token charge
            self.usage.settle = self.admission.settle
        self.metrics_access = metrics_access_for(config, self.keys)
        #: client APIs translated to chat completions (apis/): their POST routes, their other routes' prefixes
        self.api_routes, self.api_prefixes = bound_apis(config)
        #: trtllm-serve's other endpoints: /cluster_info, /version, ... (server/trtllm_endpoints.py)
        self.trtllm = TrtllmEndpoints(
            ORCHESTRATOR_ROUTES, self.registry.render, self.metrics_access, cluster_info=self.cluster_info
        )
        self.limits = Limits(
            max_header_bytes=config.max_header_bytes,
            max_body_bytes=config.max_body_bytes,
            header_timeout_s=config.client_header_timeout_s,
            body_timeout_s=config.client_body_timeout_s,
            keepalive_timeout_s=config.client_keepalive_timeout_s,
            max_connections=config.max_client_connections,
            max_inflight_body_bytes=config.max_inflight_body_bytes,
            peer_share=config.client_ip_share,
            retry_after_s=config.retry_after_s,
        )

    def _init_upstreams(self, config: OrchestratorConfig) -> None:
        """The workers' side: keep-alive connections per worker, one deadline sweeper, the leg runner."""
        # Worker URL -> its keep-alive connections, made on first use (a
        # worker's URL may change while it is in a pool); one deadline sweeper for them all.
        self.upstreams: dict[str, UpstreamPool] = {}
        self.deadlines = Deadlines()
        #: both legs' one loop (legs.py): choose, send, classify, retry, breakers
        self.legs = LegRunner(
            max_retries=config.max_retries,
            metrics=self.metrics,
            upstream=self._upstream,
            secret=self.secret,
            mark_failed=self._mark_failed,
            release_lost_kv=self.release_lost_kv_soon,
            unavailable=self._unavailable,
            max_worker_body=config.max_worker_body_bytes,
        )

    # -- lifecycle ---------------------------------------------------------

    async def start(self, *, reuse_port: bool = False) -> HTTPServer:
        self.session = aiohttp.ClientSession(auto_decompress=False)
        self.health = HealthChecker(
            self.pools,
            self.session,
            interval=self.config.health_check_interval_s,
            timeout=self.config.health_check_timeout_s,
            on_change=self._record_health,
            capabilities_path=self.protocol.capabilities_path,
            capabilities_of=self.protocol.capabilities,
            probe=guard_probe(self.protocol.name, probe_of(self.protocol))
            if self.protocol_detected
            else getattr(self.protocol, "probe", None),
        )
        self.health.start()
        # kv_cache_aware pools follow their workers' cache events (cache_view.py)
        self.cache_view = CacheView(self.pools, self.config.metrics_token_bytes, deadlines=self.deadlines)
        self.cache_view.start()
        if self.discovery is not None:
            await self.discovery.start(self.session)
        if reuse_port:
            # A process joining a port its siblings may already serve (--workers N) takes
            # connections once it has checked its workers: before, it would refuse (503) what
            # the others serve. A check is bounded by its timeout, and so is the wait. The
            # workers discovery's first read added may have come after that round: theirs too.
            await self.health.first_round.wait()
            await self.health.check_unchecked()
        server = self.server = HTTPServer(self.handle, self.limits)
        server.on_close.append(self.stop)
        try:
            await server.start(
                self.config.hostname, self.config.port, reuse_port=reuse_port, backlog=LISTEN_BACKLOG
            )
        except BaseException:
            await self.stop()
            raise
        return server

    async def drain(self, timeout: float) -> int:
        """SIGTERM: stop listening and refuse new completions (503), let those in flight finish for
        ``timeout`` seconds, then cancel the rest (each cancel closes its legs' connections and
        releases its parked KV, as a client hang-up does). Returns how many were cancelled."""
        self.draining = True
        server = self.server
        if server is not None and server.server is not None:
            server.server.close()  # no new connections; keep-alive ones get 503s
        deadline = time.monotonic() + timeout
        while self._serving and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        left = list(self._serving)
        for serving in left:
            serving.cancel()
        if left:
            log.warning("drain: %d request(s) still running after %g s: cancelled", len(left), timeout)
            # an exchange's coroutines (exchange.py) end in its task; from callbacks, it ended at cancel
            tasks = [s.task if isinstance(s, Exchange) else s for s in left]
            await asyncio.gather(*[t for t in tasks if t is not None], return_exceptions=True)
        return len(left)

    async def stop(self) -> None:
        releases = list(self._background)
        if releases:
            # The KV releases of requests cancelled by the shutdown: sent before the connections close.
            await asyncio.wait(releases, timeout=STOP_RELEASES_S)
        if self.discovery is not None:
            await self.discovery.stop()
        if self.health is not None:
            await self.health.stop()
        if self.cache_view is not None:
            await self.cache_view.stop()
        if self.tracing is not None:
            self.tracing.shutdown()  # flush the batched spans
        if self.session is not None:
            await self.session.close()
        for upstream in self.upstreams.values():
            upstream.close()

    def _record_health(self, pool: Pool, worker: Worker) -> None:
        if worker in pool.workers:  # a first check may end after its worker left
            self.metrics.worker_healthy.set(1.0 if worker.healthy else 0.0, pool=pool.name, url=worker.url)

    def _worker_left(self, pool: Pool, worker: Worker) -> None:
        """A discovered worker is gone from the cluster: no series of it stays; its connections
        close once no other pool still has it."""
        worker.healthy = False
        self.metrics.forget_worker(pool.name, worker.url)
        if not any(w.url == worker.url for p in self.pools for w in p.workers):
            upstream = self.upstreams.pop(worker.url, None)
            if upstream is not None:
                upstream.close()

    def _upstream(self, worker: Worker) -> UpstreamPool:
        return self.upstreams.get(worker.url) or self._new_upstream(worker)

    def _new_upstream(self, worker: Worker) -> UpstreamPool:
        upstream = self.upstreams[worker.url] = UpstreamPool(
            worker.url,
            connect_timeout_s=self.config.connect_timeout_s,
            extra_headers=b"Content-Type: application/json\r\n",
            deadlines=self.deadlines,
        )
        return upstream

    # -- routing -------------------------------------------------------------

    def handle(self, request: Request, out: Responder) -> Awaitable[None] | Exchange | None:
        """The HTTP server's handler (server.http.server.Handler): a completion served from callbacks
        (an :class:`Exchange`, no task), or the awaitable that serves ``request`` (a task runs
        :meth:`_serve`'s coroutine itself: no layer that only forwards); None: answered at once."""
        path = request.path
        route = _ROUTES.get(path)
        if route is None:
            if (api := self.api_routes.get(path)) is not None:  # translated to chat (apis/)
                return self.serve_api(api, request, out)
            for prefix, other in self.api_prefixes:  # an API's other routes: its own key header, its shape
                if path.startswith(prefix):
                    return self.serve_api_other(other, request, out)
        tenant = ANONYMOUS
        if self.keys is not None and path.startswith(b"/v1/"):
            found = self.keys.tenant(request.header(b"authorization"))
            if found is None:  # one answer for a missing, malformed and wrong key
                out.send(401, UNAUTHORIZED_BODY, headers=UNAUTHORIZED_HEADERS)
                return None
            tenant = found
        if route is not None:
            if request.method != _POST:
                out.send_error(405, f"{path.decode()} takes POST", headers=b"Allow: POST\r\n")
                return None
            if self.draining:
                out.keep_alive = False
                out.send_error(
                    503,
                    "the orchestrator is shutting down",
                    code="shutting_down",
                    headers=b"Retry-After: %d\r\n" % self.config.retry_after_s,
                )
                self.metrics.count_request(route.name, 503)
                return None
            if self.callbacks:
                return self.exchange(self, request, out, route, tenant).start()
            return self._serve(request, out, route, tenant)
        if path in _GET_ROUTES:
            if request.method != b"GET":
                out.send_error(405, f"{path.decode()} takes GET", headers=b"Allow: GET\r\n")
            elif path == b"/health":
                self.health_endpoint(out)
            elif path == b"/metrics":
                self.metrics_endpoint(request, out)
            else:
                return self.models(out)
            return None
        if self.discovery is not None and self.discovery.handles(path):
            return self.discovery.handle(request, out)
        if self.trtllm.handles(path):
            self.trtllm.handle(request, out)
            return None
        shown = path.decode("utf-8", "replace")[:200]
        out.send_error(404, f"no route {shown}: the orchestrator serves {self.routes()}")
        return None

    def serve_api(
        self, api: ClientApi, request: Request, out: Responder
    ) -> Awaitable[None] | Exchange | None:
        """A client API's request (apis/): its key, its body translated to chat completions, then the chat
        path as :meth:`handle` runs it, writing to an :class:`ApiResponder` that translates the answer
        (and every error, ours or a worker's) into the API's."""
        tenant = self.api_tenant(api, request, out)
        if tenant is None:
            return None
        if request.method != _POST:
            out.send(
                405,
                api.error_body(405, f"{request.path.decode()} takes POST", None, None),
                headers=b"Allow: POST\r\n",
            )
            return None
        if self.draining:
            out.keep_alive = False
            out.send(
                503,
                api.error_body(503, "the orchestrator is shutting down", None, "shutting_down"),
                headers=b"Retry-After: %d\r\n" % self.config.retry_after_s,
            )
            self.metrics.count_request("chat", 503)
            return None
        try:
            call = api.to_chat(request.body, request, tenant.name)
        except HTTPError as exc:
            out.send(
                exc.status,
                api.error_body(exc.status, exc.message, exc.param, exc.code),
                headers=exc.header_lines(),
            )
            self.metrics.count_request("chat", exc.status)
            return None
        request.body, request.path = call.body, _CHAT  # the legs go to the workers' chat route
        translated: Any = ApiResponder(out, api, call)  # a Responder to the chat path
        if self.callbacks:
            return self.exchange(self, request, translated, CHAT, tenant).start()
        return self._serve(request, translated, CHAT, tenant)

    def api_tenant(self, api: ClientApi, request: Request, out: Responder) -> Tenant | None:
        """The tenant of an API's request by the API's key header; None: answered 401 in its shape."""
        if self.keys is None:
            return ANONYMOUS
        found = self.keys.tenant(api.credentials(request))
        if found is None:  # one answer for a missing, malformed and wrong key, in the API's shape
            message = "missing or invalid API key: send x-api-key: <key> or Authorization: Bearer <key>"
            out.send(401, api.error_body(401, message, None, "invalid_api_key"), headers=UNAUTHORIZED_HEADERS)
        return found

    def serve_api_other(self, api: ClientApi, request: Request, out: Responder) -> Awaitable[None] | None:
        """A route of an API under one of its ``prefixes`` (apis/): answered by the API (at once, or
        once a worker it asked answered)."""
        tenant = self.api_tenant(api, request, out)
        return None if tenant is None else answer_other(api, request, tenant, self, out)

    def routes(self) -> str:
        """Every route :meth:`handle` serves, from the route tables it serves them by (a 404 lists them)."""
        served = [f"POST {p.decode()}" for p in (*_ROUTES, *self.api_routes)]
        served += [f"{p.decode()}..." for p, _api in self.api_prefixes]
        served += [f"GET {p.decode()}" for p in _GET_ROUTES]
        served += [f"{'|'.join(m.decode() for m in ms)} {p.decode()}" for p, ms in self.trtllm.routes.items()]
        if self.discovery is not None and self.discovery.embedded is not None:
            served += self.discovery.embedded.routes()
        return ", ".join(served)

    # -- small endpoints ---------------------------------------------------

    def cluster_info(self) -> dict[str, Any]:
        """trtllm-serve's ``/cluster_info``: ``is_ready`` (what ``/health`` says), and with discovery
        the registered workers and ``minimal_instances``."""
        ready = not self.draining and all(p.ready for p in self.pools)
        info: dict[str, Any] = {"is_ready": ready}
        if self.discovery is not None:
            info["is_ready"] = ready and not self.discovery.missing()
            info.update(self.discovery.cluster_info())
        return info

    def health_endpoint(self, out: Responder) -> None:
        if self.draining:
            out.send_error(503, "the orchestrator is shutting down", code="shutting_down")
            return
        if self.discovery is not None:
            short = self.discovery.missing()
            if short:
                out.send_error(
                    503,
                    "waiting for disagg_cluster.minimal_instances: " + ", ".join(short),
                    code="not_enough_workers",
                )
                return
        not_ready = [p.name for p in self.pools if not p.ready]
        if (
            not_ready == ["context"]
            and self._can_fall_back()
            and all(w.checked for w in self.context_pool.workers)
        ):
            # Every request is served (prefilled on a generation worker): up, and saying so. Not before
            # every context worker's first check has ended: at start "unhealthy" means "not known yet",
            # and a balancer (or a test, or `up`) would send the first requests down the fallback path.
            out.send(
                200,
                b'{"status": "degraded", "degraded": "no healthy context worker: requests are '
                b'prefilled on generation workers (context_fallback)"}',
            )
            return
        if not_ready:
            out.send_error(503, "no healthy worker in pool(s): " + ", ".join(not_ready))
            return
        out.send(200, b'{"status": "ok"}')

    def _can_fall_back(self) -> bool:
        """``context_fallback: local_prefill`` and a healthy generation worker that says ``local_prefill``."""
        return self.fallback and any(w.healthy and w.local_prefill for w in self.generation_pool.workers)

    def metrics_endpoint(self, request: Request, out: Responder) -> None:
        """The page, to whom ``metrics_token`` allows (server/metrics_access.py): it names every
        worker URL and counts prefix-cache hits, an oracle of other clients' prompts."""
        refused = self.metrics_access.refusal(request.header(b"authorization"), out.peer)
        if refused is not None:
            out.send_error(refused.status, refused.message, code=refused.code, headers=refused.header_lines())
            return
        out.send(200, self.registry.render(), CONTENT_TYPE.encode())

    async def models(self, out: Responder) -> None:
        worker = self.context_pool.choose()
        if worker is None:
            # The same answer as a completion's with no healthy worker: one code for one condition.
            exc = self._unavailable("no healthy context worker")
            out.send_error(exc.status, exc.message, code=exc.code, headers=exc.header_lines())
            return
        try:
            resp = await self._upstream(worker).request(
                b"GET", b"/v1/models", timeout=self.config.request_timeout_s
            )
            try:
                body = await resp.read(MAX_ERROR_BODY * 16)
                out.send(resp.status, body, resp.content_type or _JSON)
            finally:
                resp.release()
        except (UpstreamError, UpstreamTimeout) as exc:
            log.warning("GET /v1/models from context worker %s failed: %s", worker.url, exc)
            out.send_error(502, "the models request to a context worker failed", code="context_leg_failed")


async def start_server(
    config: OrchestratorConfig, *, reuse_port: bool = False, fleet: Fleet | None = None
) -> tuple[HTTPServer, Orchestrator]:
    """Start serving on ``config.hostname:config.port``; the caller ``await server.cleanup()``.
    ``fleet``: one of ``--workers N``, sharing slots, rate limits and breakers (fleet.py)."""
    detected = config.worker_protocol == AUTO
    if detected:
        config = await resolve_auto(config)
    orchestrator = Orchestrator(config)
    orchestrator.protocol_detected = detected
    if fleet is not None:
        fleet.join(orchestrator)
    if config.fleet_cluster is None:
        return await orchestrator.start(reuse_port=reuse_port), orchestrator
    from .fleet_cluster import FleetCluster  # several hosts through etcd: only when configured

    # one host's --workers N processes are one group: their mapping holds the group's share
    group = f"{socket.gethostname()}:{fleet.mapping.path}" if fleet is not None else None
    cluster = FleetCluster(
        config.fleet_cluster, admission=orchestrator.admission, pools=orchestrator.pools, group=group
    )
    await cluster.start()  # the share known before the first request (or a whole one: etcd away)
    try:
        server = await orchestrator.start(reuse_port=reuse_port)
    except BaseException:
        await cluster.stop()
        raise
    orchestrator.fleet_cluster = cluster
    server.on_close.append(cluster.stop)
    return server, orchestrator
