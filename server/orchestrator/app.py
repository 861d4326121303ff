"""The orchestrator: an aiohttp app that runs each request's context and generation legs.

Request path (PROTOCOL.md): read and check the client body; send the context
request to a context worker (retried on another one on connection errors and
5xx); if the context response is already the answer, return it; otherwise
send the generation request to a generation worker and relay its response:
SSE bytes as they arrive, or the JSON body without internal fields.

The app keeps no per-request state beyond the request itself, so any number
of processes (``--workers N``) and hosts can share the load.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web

from server.auth import SIGNATURE_HEADER, sign_body
from server.errors import HTTPError, error_body, error_response
from server.metrics import CONTENT_TYPE, Registry

from .config import OrchestratorConfig
from .pools import HealthChecker, Pool, Worker
from .relay_modes import ClientRequest, answer_as_sse, make_relay

log = logging.getLogger("fastcore.orchestrator")

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
# Enough connections for 1024 concurrent streams plus their context legs;
# per host unlimited because a pool may be a single worker.
CONNECTION_LIMIT = 4096
LISTEN_BACKLOG = 4096
# Per-connection read buffer: a context response or client body up to this size
# is read without aiohttp's flow control pausing and resuming the socket.
READ_BUFSIZE = 1 << 22
# A worker's error body is relayed, but not an unbounded one.
MAX_ERROR_BODY = 64 * 1024
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}

ORCHESTRATOR: web.AppKey[Orchestrator] = web.AppKey("orchestrator")


class WorkerAnswer(Exception):
    """A worker's own error response, to be relayed to the client as it is."""

    def __init__(self, status: int, body: bytes, content_type: str, headers: dict[str, str]) -> None:
        super().__init__(status)
        self.status = status
        self.body = body
        self.content_type = content_type
        self.headers = headers

    def response(self) -> web.Response:
        return web.Response(
            status=self.status, body=self.body, content_type=self.content_type, headers=self.headers
        )


class ClientGone(Exception):
    """The client disconnected mid-stream; ``response`` is the stream already started."""

    def __init__(self, response: web.StreamResponse) -> None:
        super().__init__("client disconnected")
        self.response = response


class RelayedStream(web.StreamResponse):
    """A relayed SSE stream; ``upstream_failed`` is the status it would have had, had
    its worker failed before the headers went out."""

    upstream_failed: int | None = None


class _Metrics:
    def __init__(self, registry: Registry, in_flight: Any) -> None:
        self.requests = registry.counter(
            "fastcore_orchestrator_requests_total",
            "Client requests by route and HTTP status.",
            ("route", "status"),
        )
        self.in_flight = registry.gauge(
            "fastcore_orchestrator_requests_in_flight", "Client requests being served.", callback=in_flight
        )
        self.retries = registry.counter(
            "fastcore_orchestrator_retries_total", "Legs retried on another worker.", ("leg",)
        )
        self.worker_healthy = registry.gauge(
            "fastcore_orchestrator_worker_healthy", "1 while a worker passes /health.", ("pool", "url")
        )
        self.worker_in_flight = registry.gauge(
            "fastcore_orchestrator_worker_in_flight", "Requests in flight per worker.", ("pool", "url")
        )
        self.cpu = registry.histogram(
            "fastcore_orchestrator_cpu_seconds",
            "The orchestrator's own CPU time per request on the event loop, by phase.",
            ("phase",),
        )
        self.context_leg = registry.histogram(
            "fastcore_orchestrator_context_leg_seconds", "Context request sent -> context response read."
        )
        self.handoff = registry.histogram(
            "fastcore_orchestrator_handoff_seconds",
            "Context response read -> generation request handed to its connection.",
        )
        self.generation_ttfb = registry.histogram(
            "fastcore_orchestrator_generation_ttfb_seconds",
            "Generation request handed over -> first byte of the generation response (its headers).",
        )
        self.finished_by_context = registry.counter(
            "fastcore_orchestrator_finished_by_context_total", "Requests answered by the context leg alone."
        )


class _CpuClock:
    """Thread CPU time of the orchestrator's synchronous work, by phase.

    Only code between awaits is measured, so other requests' work on the same
    loop is never counted against this one.
    """

    __slots__ = ("histogram", "last", "total")

    def __init__(self, histogram: Any) -> None:
        self.histogram = histogram
        self.total = 0.0
        self.last = time.thread_time()

    def start(self) -> None:
        self.last = time.thread_time()

    def lap(self, phase: str) -> None:
        now = time.thread_time()
        spent = now - self.last
        self.total += spent
        self.histogram.observe(spent, phase=phase)
        self.last = now

    def finish(self) -> None:
        self.histogram.observe(self.total, phase="total")


class Orchestrator:
    def __init__(self, config: OrchestratorConfig) -> None:
        config.check_runnable()
        self.config = config
        self.relay = make_relay(
            config.relay,
            tokids_b64=config.gen_tokids_ctxbytes,
            strip_history=config.gen_strip_message_history,
        )
        self.context_pool = Pool("context", config.context_servers.urls, config.context_servers.router.type)
        self.generation_pool = Pool(
            "generation", config.generation_servers.urls, config.generation_servers.router.type
        )
        self.pools = [self.context_pool, self.generation_pool]
        self.secret = config.shared_secret_bytes
        self.in_flight = 0
        self.registry = Registry()
        self.metrics = _Metrics(self.registry, lambda: self.in_flight)
        connect = config.connect_timeout_s
        self.context_timeout = aiohttp.ClientTimeout(total=config.request_timeout_s, sock_connect=connect)
        # A stream may run long; what must not happen is a silence that long.
        self.stream_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=connect, sock_read=config.request_timeout_s
        )
        self.unary_timeout = aiohttp.ClientTimeout(total=config.request_timeout_s, sock_connect=connect)
        self.session: aiohttp.ClientSession | None = None
        self.health: HealthChecker | None = None

    # -- lifecycle ---------------------------------------------------------

    async def _lifecycle(self, app: web.Application) -> AsyncIterator[None]:
        connector = aiohttp.TCPConnector(limit=CONNECTION_LIMIT, limit_per_host=0, keepalive_timeout=30)
        self.session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, read_bufsize=READ_BUFSIZE
        )
        self.health = HealthChecker(
            self.pools,
            self.session,
            interval=self.config.health_check_interval_s,
            timeout=self.config.health_check_timeout_s,
            on_change=self._record_health,
        )
        self.health.start()
        try:
            yield
        finally:
            await self.health.stop()
            await self.session.close()

    def _record_health(self, pool: Pool, worker: Worker) -> None:
        self.metrics.worker_healthy.set(1.0 if worker.healthy else 0.0, pool=pool.name, url=worker.url)

    def build_app(self) -> web.Application:
        # aiohttp enforces the limit while reading (chunked bodies too); the
        # 413 it raises is turned into an OpenAI error in _read_body.
        app = web.Application(client_max_size=self.config.max_body_bytes)
        app[ORCHESTRATOR] = self
        app.cleanup_ctx.append(self._lifecycle)
        app.router.add_post(CHAT_PATH, self.chat_completions)
        app.router.add_post(COMPLETIONS_PATH, self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health_endpoint)
        app.router.add_get("/metrics", self.metrics_endpoint)
        return app

    # -- small endpoints ---------------------------------------------------

    async def health_endpoint(self, request: web.Request) -> web.Response:
        not_ready = [p.name for p in self.pools if not p.ready]
        if not_ready:
            return error_response(503, "no healthy worker in pool(s): " + ", ".join(not_ready))
        return web.json_response({"status": "ok"})

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        for pool in self.pools:
            for worker in pool.workers:
                self.metrics.worker_in_flight.set(worker.in_flight, pool=pool.name, url=worker.url)
        return web.Response(body=self.registry.render(), headers={"Content-Type": CONTENT_TYPE})

    async def models(self, request: web.Request) -> web.Response:
        worker = self.context_pool.choose()
        if worker is None:
            return error_response(503, "no healthy context worker")
        assert self.session is not None
        try:
            async with self.session.get(worker.url + "/v1/models", timeout=self.unary_timeout) as resp:
                body = await resp.read()
                return web.Response(status=resp.status, body=body, content_type=resp.content_type)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            return error_response(502, f"context worker {worker.url} failed: {exc!r}")

    # -- completions ---------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _serve(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        route = "chat" if chat else "completions"
        status = 500
        self.in_flight += 1
        try:
            response = await self._run_legs(request, chat)
            # A stream cut by its worker went out as a 200; count it as what it was.
            status = getattr(response, "upstream_failed", None) or response.status
            return response
        except HTTPError as exc:
            status = exc.status
            return exc.response()
        except WorkerAnswer as exc:
            status = exc.status
            return exc.response()
        except ClientGone as exc:
            status = 499
            return exc.response
        except asyncio.CancelledError:
            status = 499  # the client went away; both legs are cancelled with this task
            raise
        finally:
            self.in_flight -= 1
            self.metrics.requests.inc(route=route, status=str(status))

    async def _read_body(self, request: web.Request) -> bytes:
        limit = self.config.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise HTTPError(
                413, f"request body of {request.content_length} bytes exceeds the limit of {limit} bytes"
            )
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise HTTPError(413, f"request body exceeds the limit of {limit} bytes") from None

    async def _run_legs(self, request: web.Request, chat: bool) -> web.StreamResponse:
        body = await self._read_body(request)
        clock = _CpuClock(self.metrics.cpu)
        req = self.relay.read_client(body, chat)
        clock.lap("validate")
        if not (self.context_pool.ready and self.generation_pool.ready):
            raise HTTPError(503, "no healthy worker: " + ", ".join(p.name for p in self.pools if not p.ready))
        path = CHAT_PATH if chat else COMPLETIONS_PATH
        # Random, not a counter: unique across orchestrator processes and hosts
        # without shared state.
        context_body = self.relay.context_request(req, random.getrandbits(63))
        clock.lap("build_context")

        started = time.perf_counter()
        context_response = await self._context_leg(path, context_body)
        context_done = time.perf_counter()
        self.metrics.context_leg.observe(context_done - started)

        clock.start()
        ctx = self.relay.read_context(req, context_response)
        clock.lap("read_context")
        if ctx.finished:
            answer = self.relay.finished_answer(req, ctx)
            if req.stream:
                answer = answer_as_sse(answer, chat=chat, include_usage=req.include_usage)
            clock.lap("relay")
            clock.finish()
            self.metrics.finished_by_context.inc()
            headers = SSE_HEADERS if req.stream else {"Content-Type": "application/json"}
            return web.Response(body=answer, headers=headers)

        generation_body = self.relay.generation_request(req, ctx)
        clock.lap("build_generation")
        return await self._generation_leg(request, req, path, generation_body, context_done, clock)

    def _headers(self, body: bytes) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.secret is not None:
            headers[SIGNATURE_HEADER] = sign_body(self.secret, body)
        return headers

    def _mark_failed(self, pool: Pool, worker: Worker) -> None:
        assert self.health is not None
        self.health.mark_unhealthy(pool, worker)

    async def _worker_failure(
        self, leg: str, worker: Worker, resp: aiohttp.ClientResponse
    ) -> HTTPError | WorkerAnswer:
        """The error to give the client for a worker's non-200 answer (read, bounded)."""
        body = await resp.content.read(MAX_ERROR_BODY)
        if resp.status < 500 or resp.status == 503:
            # 4xx is the client's problem and a full worker's 503 carries its
            # Retry-After: both reach the client as the worker sent them.
            headers = {k: v for k, v in resp.headers.items() if k.lower() == "retry-after"}
            return WorkerAnswer(resp.status, body, resp.content_type or "application/json", headers)
        text = body.decode("utf-8", "replace")
        return HTTPError(502, f"{leg} worker {worker.url} answered {resp.status}: {text}")

    async def _context_leg(self, path: str, body: bytes) -> bytes:
        assert self.session is not None
        tried: list[Worker] = []
        failure: HTTPError | WorkerAnswer | None = None
        headers = self._headers(body)
        for attempt in range(self.config.max_retries + 1):
            worker = self.context_pool.choose(exclude=tried)
            if worker is None:
                break
            if attempt:
                self.metrics.retries.inc(leg="context")
            tried.append(worker)
            worker.in_flight += 1
            try:
                async with self.session.post(
                    worker.url + path, data=body, headers=headers, timeout=self.context_timeout
                ) as resp:
                    if resp.status == 200:
                        body = await resp.read()
                        worker.served += 1
                        return body
                    failure = await self._worker_failure("context", worker, resp)
                    if resp.status < 500:
                        raise failure
            except aiohttp.ClientConnectionError as exc:
                self._mark_failed(self.context_pool, worker)
                failure = HTTPError(502, f"context worker {worker.url} failed: {exc!r}")
            except asyncio.TimeoutError:
                # The POST may still be running there: not retried.
                raise HTTPError(504, f"context worker {worker.url} timed out") from None
            finally:
                worker.in_flight -= 1
        if failure is None:
            raise HTTPError(503, "no healthy context worker")
        raise failure

    async def _generation_leg(
        self,
        request: web.Request,
        req: ClientRequest,
        path: str,
        body: bytes,
        context_done: float,
        clock: _CpuClock,
    ) -> web.StreamResponse:
        assert self.session is not None
        tried: list[Worker] = []
        failure: HTTPError | WorkerAnswer | None = None
        headers = self._headers(body)
        timeout = self.stream_timeout if req.stream else self.unary_timeout
        # Retries stop at the first byte sent to the client: nothing has been
        # sent until a worker answers 200, and the loop below returns then.
        for attempt in range(self.config.max_retries + 1):
            worker = self.generation_pool.choose(exclude=tried)
            if worker is None:
                break
            if attempt:
                self.metrics.retries.inc(leg="generation")
            tried.append(worker)
            worker.in_flight += 1
            handed_over = time.perf_counter()
            if attempt == 0:
                self.metrics.handoff.observe(handed_over - context_done)
            try:
                resp = await self.session.post(worker.url + path, data=body, headers=headers, timeout=timeout)
            except aiohttp.ClientConnectionError as exc:
                worker.in_flight -= 1
                self._mark_failed(self.generation_pool, worker)
                failure = HTTPError(502, f"generation worker {worker.url} failed: {exc!r}")
                continue
            except asyncio.TimeoutError:
                worker.in_flight -= 1
                raise HTTPError(504, f"generation worker {worker.url} timed out") from None
            except BaseException:
                worker.in_flight -= 1
                raise
            self.metrics.generation_ttfb.observe(time.perf_counter() - handed_over)
            try:
                if resp.status == 200:
                    worker.served += 1
                else:
                    failure = await self._worker_failure("generation", worker, resp)
                    if resp.status < 500:
                        raise failure
                    continue
                if resp.content_type == "text/event-stream":
                    return await self._relay_stream(request, worker, resp, clock)
                return await self._relay_unary(req, worker, resp, clock)
            finally:
                # close(), not release(): a response not read to the end must
                # drop its connection so the worker sees the cancel.
                resp.close()
                worker.in_flight -= 1
        if failure is None:
            raise HTTPError(503, "no healthy generation worker")
        raise failure

    async def _relay_unary(
        self, req: ClientRequest, worker: Worker, resp: aiohttp.ClientResponse, clock: _CpuClock
    ) -> web.Response:
        try:
            body = await resp.read()
        except aiohttp.ClientError as exc:
            raise HTTPError(502, f"generation worker {worker.url} failed mid-response: {exc!r}") from None
        except asyncio.TimeoutError:
            raise HTTPError(504, f"generation worker {worker.url} timed out") from None
        clock.start()
        answer = self.relay.client_answer(req, body)
        clock.lap("relay")
        clock.finish()
        return web.Response(body=answer, headers={"Content-Type": "application/json"})

    async def _relay_stream(
        self, request: web.Request, worker: Worker, resp: aiohttp.ClientResponse, clock: _CpuClock
    ) -> web.StreamResponse:
        out = RelayedStream(headers=SSE_HEADERS)
        await out.prepare(request)
        sent = 0
        upstream_error: str | None = None
        try:
            async for chunk in resp.content.iter_any():
                await out.write(chunk)
                sent += len(chunk)
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
            # aiohttp's write error on a closed client socket is a
            # ClientConnectionError too: tell the two apart.
            if request.transport is None or request.transport.is_closing():
                raise ClientGone(out) from None
            upstream_error = f"generation worker {worker.url} failed mid-stream: {exc!r}"
        except asyncio.TimeoutError:
            upstream_error = (
                f"generation worker {worker.url} went silent for {self.config.request_timeout_s} s"
            )
        except ConnectionResetError:
            raise ClientGone(out) from None
        if upstream_error is None and sent == 0:
            upstream_error = f"generation worker {worker.url} sent an empty stream"
        if upstream_error is not None:
            log.warning("%s", upstream_error)
            self._mark_failed(self.generation_pool, worker)
            # Headers are gone: the error travels in-band, as OpenAI streams do.
            out.upstream_failed = 502
            with contextlib.suppress(ConnectionResetError):
                await out.write(b"data: " + error_body(502, upstream_error) + b"\n\n")
        clock.finish()
        with contextlib.suppress(ConnectionResetError):
            await out.write_eof()
        return out


async def start_server(
    config: OrchestratorConfig, *, reuse_port: bool = False
) -> tuple[web.AppRunner, Orchestrator]:
    """Start serving on ``config.hostname:config.port``; the caller cleans up the runner."""
    orchestrator = Orchestrator(config)
    # handler_cancellation: a client that disconnects cancels its handler and
    # with it both upstream legs (aiohttp >= 3.9 leaves it off by default).
    runner = web.AppRunner(
        orchestrator.build_app(), handler_cancellation=True, access_log=None, read_bufsize=READ_BUFSIZE
    )
    await runner.setup()
    # A deep accept queue: 1024 clients connecting at once must not overflow
    # the default of 128 into SYN retries (a 1 s stall each).
    site = web.TCPSite(
        runner, config.hostname, config.port, reuse_port=reuse_port or None, backlog=LISTEN_BACKLOG
    )
    await site.start()
    return runner, orchestrator
