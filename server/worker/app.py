"""The worker's HTTP app: OpenAI routes, the disaggregated roles, the KV hand-off endpoint, metrics.

The listening side is the project's own lean HTTP server (:mod:`server.http`,
the orchestrator's too): strict framing, bounded headers, bodies, time and
connections, every error in OpenAI's JSON shape, no ``Server`` banner. A
client that disconnects cancels its handler, which frees what the request
holds in the engine at once.

The HTTP layer only talks to an engine through the :class:`Engine` protocol
(submit a request, receive :class:`~server.worker.output.Delta` objects on the
event loop, abort, parked KV), so a synthetic engine without a model can sit
behind the same routes.

Roles (docs/protocol.md):

- ``both``: plain requests, and either disaggregated leg;
- ``context``: plain requests and ``context_only`` legs: prefill, first token,
  the prompt's KV parked behind ``GET /kv/{ctx_request_id}`` until fetched or
  ``kv_ttl_s`` passes;
- ``generation``: plain requests and ``generation_only`` legs: the prompt from
  the ids (never re-tokenized), the KV fetched from ``ctx_info_endpoint``, or
  the prefill recomputed when it cannot be had (counted in ``/metrics``).

Parked KV is what a hostile or broken client can pin without a connection, so
it is bounded three ways: a context leg whose client is gone frees it at once
(nobody else knows its id); parked entries together hold at most
``max_parked_fraction`` of the cache, the oldest going first; and a request
that does not fit evicts parked entries, oldest first, before it is refused
with 503. An evicted entry's generation leg finds 404 and recomputes the
prefill.

Internal requests (the two legs) are authenticated by one of two means
(:meth:`WorkerApp._authorize`):

- fastcore's own :mod:`server.auth` signature (``X-Fastcore-Signature``) over
  the body's bytes as sent, checked before anything is parsed: what fastcore's
  orchestrator sends. A valid one authenticates any leg.
- trtllm-serve's ``x-trtllm-disagg-auth`` (HMAC over ``ctx_info_endpoint`` and
  ``encoded_opaque_state``), the only header trtllm-serve's orchestrator
  sends, and only on generation legs that carry one of those two fields. The
  key is ``trtllm_auth_key``, the shared secret unless given apart.

With a trtllm key, a leg carrying ``ctx_info_endpoint`` or
``encoded_opaque_state`` without a valid fastcore signature needs a valid
``x-trtllm-disagg-auth``, or is refused (403). With a shared secret, every other
leg without a valid fastcore signature (a context leg, a generation leg with
neither field: trtllm's orchestrator signs neither) is refused (403) unless
``accept_trtllm_orchestrator`` is set. That flag makes the worker a drop-in for
trtllm-serve behind trtllm's orchestrator: such legs are accepted unsigned (a
caller can then park KV and run prefills, as it could with plain requests;
fetching the KV still needs the fastcore signature), and a completions context
leg answers ``prompt_token_ids`` as a list even when asked for base64, since
trtllm's completion response model has no ``prompt_token_ids_b64`` (it refuses
unknown fields). ``/server_info`` says which.

KV fetches always need the fastcore signature when a secret is set; a
generation worker fetches KV only from the hosts its settings allow (loopback
by default without a secret).

Bodies flagged ``X-TRTLLM-Msgpack: 1`` (trtllm-serve's orchestrator with
``TRTLLM_SERVE_ENABLE_MSGSPEC=1``) are msgpack; they become JSON
(:func:`~server.worker.protocol.msgpack_to_json`) and are validated as JSON
bodies are. A fastcore signature signs the bytes as sent, msgpack or not.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ipaddress
import json
import logging
import re
import secrets
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import aiohttp
import numpy as np

import fastcore
from fastcore import protocol as wire
from server import tracing
from server.auth import (
    SIGNATURE_HEADER,
    TRTLLM_AUTH_HEADER,
    WRONG_DESTINATION,
    Verifier,
    check_trtllm_disagg_auth,
    sign_body,
)
from server.errors import HTTPError, error_body
from server.http import HTTPServer, Limits, Request, Responder
from server.http import limits as http_limits
from server.metrics import CONTENT_TYPE, Registry
from server.metrics_access import MetricsAccess, is_loopback_peer
from server.trtllm_endpoints import WORKER_ROUTES, TrtllmEndpoints

from .engine_api import NOT_FINISHED, Engine, EngineRequest, KVCacheFull, cache_salt_root, prompt_checksum
from .output import Delta, OutputProcessor
from .protocol import (
    CONTEXT_ONLY,
    GENERATION_ONLY,
    ParsedRequest,
    Route,
    StreamWriterState,
    completion_body,
    dump_with_members,
    msgpack_to_json,
    new_response_id,
    parse_request,
    prompt_ids_members,
    request_usage,
)

if TYPE_CHECKING:
    from .kv_transfer import KVPayload

log = logging.getLogger(__name__)

ROLES = ("both", "context", "generation")
KV_PATH = wire.KV_PATH
#: the only paths a generation worker fetches KV from (a ctx_request_id is 62 random bits)
KV_PATH_RE = re.compile(re.escape(wire.KV_PATH_PREFIX) + wire.KV_ID_PATTERN)
#: parked entries younger than this are evicted only by a request about to be refused
PARKED_GRACE_S = 1.0
#: how often requests waiting for KV room look again (frees happen on the engine thread too)
ADMISSION_POLL_S = 0.01
LISTEN_BACKLOG = 4096  # an orchestrator may open 1000s of connections at once

_POST = b"POST"
_GET = (b"GET", b"HEAD")
_KV_PREFIX = wire.KV_PATH_PREFIX.encode()
_METRICS = b"/metrics"
#: the prefix cache's keys as a stream orchestrators follow (server/worker/kv_events.py)
_CACHE_EVENTS = b"/cache_events"
#: ``DELETE /kv/by-request/<disagg_request_id>``: an orchestrator whose context answer was lost
#: (cut mid-body, timed out) releases the KV it never learnt the id of (docs/protocol.md#faults)
_KV_BY_REQUEST = wire.KV_BY_REQUEST_PREFIX.encode()
#: how long a drain waits for parked KV to be fetched once no request is running
DRAIN_PARKED_GRACE_S = 2.0
#: parked entries remembered by their disagg_request_id (oldest forgotten first)
MAX_PARKED_BY_REQUEST = 16384
_SIGNATURE = SIGNATURE_HEADER.lower().encode()
_TRTLLM_AUTH = TRTLLM_AUTH_HEADER.lower().encode()
#: trtllm-serve's flag for a msgpack body (openai_server._MsgspecRequest); only "1" means msgpack
_MSGPACK = wire.X_TRTLLM_MSGPACK.lower().encode()
_JSON = b"application/json"
_SSE = b"text/event-stream"
_SSE_HEADERS = b"Cache-Control: no-cache\r\nX-Accel-Buffering: no\r\n"
_GENERATION_ROUTES: dict[bytes, Route] = {
    wire.CHAT_COMPLETIONS_PATH.encode(): "chat",
    wire.COMPLETIONS_PATH.encode(): "completions",
}


def _host_port(entry: str) -> tuple[str, int | None]:
    """``HOST[:PORT]`` (an IPv6 address in brackets) as a lower-case host and a port or None."""
    parts = urlsplit("//" + entry.strip())
    try:
        port = parts.port
    except ValueError:
        port = -1
    host = parts.hostname
    if not host or port == -1 or parts.path or parts.query or parts.fragment or parts.username is not None:
        raise ValueError(f"KV source {entry!r} is not HOST[:PORT]")
    return host, port


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class KVSources:
    """Where a generation worker may fetch KV from: the host (and port) of ``ctx_info_endpoint``.

    With entries, only those (a host without a port allows any port; names
    are compared as written, never resolved). Without: any host when
    ``any_host`` (a shared secret is set, so only signed callers name an
    endpoint); else loopback only, and only for a caller that is itself on
    loopback: the worker never connects, for an unauthenticated caller, where
    that caller could not connect itself (a remote client naming
    ``127.0.0.1:<port>`` would otherwise probe the worker host's local ports;
    its fetch is not even tried). Whatever the host, only ``GET /kv/<digits>``
    over http(s) is ever fetched: a caller cannot point the fetch at another
    service's path.
    """

    def __init__(self, entries: Sequence[str], *, any_host: bool) -> None:
        self.entries = [_host_port(e) for e in entries]
        self.any_host = any_host

    def allows(self, endpoint: str, *, caller_local: bool = True) -> bool:
        """Whether to fetch ``endpoint`` for a leg that came from a loopback peer (``caller_local``)
        or not."""
        try:
            parts = urlsplit(endpoint)
            port = parts.port
        except ValueError:
            return False
        host = parts.hostname
        if (
            parts.scheme not in ("http", "https")
            or not host
            or parts.username is not None
            or parts.query
            or parts.fragment
            or not KV_PATH_RE.fullmatch(parts.path)
        ):
            return False
        if not self.entries:
            return self.any_host or (caller_local and _is_loopback(host))
        port = port or (443 if parts.scheme == "https" else 80)
        return any(h == host and (p is None or p == port) for h, p in self.entries)


@dataclass
class WorkerSettings:
    """Everything the app reads, filled once by the CLI (or a test)."""

    role: str = "both"
    model_name: str = "tiny"
    shared_secret: bytes | None = None
    #: the bearer token GET /metrics asks for; None: /metrics is served to loopback peers only
    metrics_token: bytes | None = None
    #: the key of trtllm-serve's ``x-trtllm-disagg-auth`` (its ``internal_request_auth_key``);
    #: None: the shared secret
    trtllm_auth_key: bytes | None = None
    #: a trtllm-serve orchestrator fronts this worker: its unsigned legs are accepted, and
    #: completions answer the prompt ids as a list (see the module docstring)
    accept_trtllm_orchestrator: bool = False
    kv_ttl_s: float = 30.0
    kv_fetch_timeout_s: float = 10.0
    #: the most of the KV cache parked entries may hold together; beyond it the oldest go
    max_parked_fraction: float = 0.5
    #: hosts (``HOST[:PORT]``) a generation worker fetches KV from; see :class:`KVSources`
    kv_allow: tuple[str, ...] = ()
    # Base URL put in ctx_info_endpoint; default: the Host the request came in on.
    public_url: str | None = None
    retry_after_s: int = http_limits.RETRY_AFTER_S
    #: how long a request that does not fit in the KV cache waits for room before its 503
    admission_wait_s: float = 10.0
    #: requests waiting for KV at once; one more is refused at once (503)
    max_waiting: int = 256
    #: a stream whose client reads nothing for this long (its write buffer stays above the high-water
    #: mark) is dropped and its KV freed: a client that never reads cannot hold KV until max_tokens
    stream_stall_timeout_s: float = 30.0
    # The listening side's bounds (server.http.Limits).
    max_body_bytes: int = http_limits.WORKER_MAX_BODY_BYTES
    max_header_bytes: int = http_limits.MAX_HEADER_BYTES
    header_timeout_s: float = http_limits.HEADER_TIMEOUT_S
    body_timeout_s: float = http_limits.BODY_TIMEOUT_S
    keepalive_timeout_s: float = http_limits.WORKER_KEEPALIVE_TIMEOUT_S
    max_connections: int = http_limits.MAX_CONNECTIONS
    max_inflight_body_bytes: int = http_limits.WORKER_MAX_INFLIGHT_BODY_BYTES
    #: one client IP's share of max_connections and max_inflight_body_bytes (Limits.peer_share)
    client_ip_share: float = http_limits.PEER_SHARE
    device: str = "cpu"
    #: OpenTelemetry traces (OTLP/HTTP); None: OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT or off (server/tracing.py)
    otlp_traces_endpoint: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        endpoint = tracing.configured_endpoint(self.otlp_traces_endpoint)
        if endpoint is not None:  # tracing asked for: the SDK must be there, the URL OTLP/HTTP
            tracing.check_endpoint(endpoint)
        if self.admission_wait_s < 0 or self.max_waiting < 0:
            raise ValueError("admission_wait_s and max_waiting must not be negative")
        if not self.stream_stall_timeout_s > 0:
            raise ValueError(f"stream_stall_timeout_s must be > 0, got {self.stream_stall_timeout_s}")
        if not 0.0 <= self.max_parked_fraction <= 1.0:
            raise ValueError(f"max_parked_fraction must be within [0, 1], got {self.max_parked_fraction}")
        self.kv_allow = tuple(self.kv_allow)
        for entry in self.kv_allow:
            _host_port(entry)

    def limits(self) -> Limits:
        return Limits(
            max_header_bytes=self.max_header_bytes,
            max_body_bytes=self.max_body_bytes,
            header_timeout_s=self.header_timeout_s,
            body_timeout_s=self.body_timeout_s,
            keepalive_timeout_s=self.keepalive_timeout_s,
            max_connections=self.max_connections,
            max_inflight_body_bytes=self.max_inflight_body_bytes,
            peer_share=self.client_ip_share,
            retry_after_s=self.retry_after_s,
        )


class WorkerMetrics:
    def __init__(self, engine: Engine, app: WorkerApp) -> None:
        r = self.registry = Registry()
        self.requests = r.counter("fastcore_worker_requests_total", "Requests by route and HTTP status",
                                  ("route", "status"))  # fmt: skip
        r.gauge("fastcore_worker_queue_depth", "Requests admitted and waiting for their prefill",
                callback=lambda: engine.queue_depth)  # fmt: skip
        r.gauge(
            "fastcore_worker_running_sequences",
            "Sequences in the decode batch",
            callback=lambda: engine.running,
        )
        r.gauge("fastcore_worker_kv_used_tokens", "KV cache tokens reserved (running, waiting, parked)",
                callback=lambda: engine.kv_used_tokens)  # fmt: skip
        r.gauge("fastcore_worker_kv_capacity_tokens", "KV cache size in tokens",
                callback=lambda: engine.kv_capacity_tokens)  # fmt: skip
        r.gauge("fastcore_worker_kv_usage_ratio", "Fraction of the KV cache in use",
                callback=lambda: engine.kv_used_tokens / max(1, engine.kv_capacity_tokens))  # fmt: skip
        r.gauge("fastcore_worker_kv_parked", "Context legs' KV waiting for a generation worker",
                callback=lambda: engine.parked_count)  # fmt: skip
        r.gauge("fastcore_worker_kv_parked_tokens", "KV cache tokens held by parked entries",
                callback=lambda: engine.parked_tokens)  # fmt: skip
        r.gauge("fastcore_worker_decode_tokens_per_second", "Decode tokens per second over the last 5 s",
                callback=lambda: engine.tokens_per_second)  # fmt: skip
        self.prompt_tokens = r.counter("fastcore_worker_prompt_tokens_total", "Prompt tokens admitted")
        r.counter("fastcore_worker_prefix_cache_hit_tokens_total",
                  "Prompt tokens whose KV came from the prefix cache (not computed)",
                  callback=lambda: engine.prefix_hit_tokens)  # fmt: skip
        r.counter("fastcore_worker_prefill_computed_tokens_total",
                  "Prompt (and replayed) tokens prefilled: computed, not from the cache or a KV hand-off",
                  callback=lambda: engine.prefill_computed_tokens)  # fmt: skip
        r.gauge("fastcore_worker_prefix_cache_tokens", "Tokens in registered full blocks (held or evictable)",
                callback=lambda: engine.prefix_cached_tokens)  # fmt: skip
        r.counter("fastcore_worker_prefix_cache_evicted_blocks_total",
                  "Cached blocks evicted to make room", callback=lambda: engine.prefix_evicted_blocks)  # fmt: skip
        self.generated_tokens = r.counter(
            "fastcore_worker_generated_tokens_total", "Completion tokens returned"
        )
        self.handoff = r.counter(
            "fastcore_worker_kv_handoff_total",
            "KV hand-off events. Context side: parked, served, expired, abandoned (the fetcher hung up "
            "mid-download), cancelled (a context leg's client left before its answer: its KV freed at "
            "once, parked or not), released (DELETE by an orchestrator that gave up on the leg), "
            "evicted (parked KV freed for the parked bound or to admit a request). "
            "Generation side: fetched, recomputed",
            ("event",),
        )
        self.fetch_failures = r.counter("fastcore_worker_kv_fetch_failures_total",
                                        "KV fetches that failed or were not tried, by reason", ("reason",))  # fmt: skip
        self.rejected = r.counter(
            "fastcore_worker_rejected_total", "Requests refused with 503, by reason", ("reason",)
        )
        self.waited = r.counter(
            "fastcore_worker_admission_waits_total", "Requests that waited for KV room before admission"
        ).labels()
        r.gauge("fastcore_worker_waiting_for_kv", "Requests waiting for KV room now",
                callback=lambda: len(app._waiting))  # fmt: skip
        self.ttft = r.histogram(
            "fastcore_worker_time_to_first_token_seconds", "Arrival to first token", ("route",)
        )
        self.latency = r.histogram("fastcore_worker_request_seconds", "Arrival to last token", ("route",))

        def server_stat(read: Callable[[HTTPServer], float]) -> Callable[[], float]:
            return lambda: read(app.server) if app.server is not None else 0

        r.gauge("fastcore_worker_client_connections", "Open client connections",
                callback=server_stat(lambda s: len(s.connections)))  # fmt: skip
        r.counter("fastcore_worker_connections_refused_total",
                  "Client connections refused at the connection cap (503)",
                  callback=server_stat(lambda s: s.refused))  # fmt: skip
        r.counter("fastcore_worker_http_framing_errors_total",
                  "Requests refused before routing: malformed HTTP, limits on headers or body, timeouts",
                  callback=server_stat(lambda s: s.framing_errors))  # fmt: skip


class KVFetchError(LookupError):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def kv_signature(secret: bytes, path: str) -> str:
    """The signature of a KV fetch: it has no body, so it signs the path (nonce and time included)."""
    return sign_body(secret, path.encode())


def _refusal_code(reason: str) -> str:
    """The error code of a signature refused for ``reason``: an orchestrator that signed for this
    worker's previous instance (it restarted since the last /health) tells it apart and retries."""
    return "wrong_destination" if reason == WRONG_DESTINATION else "bad_signature"


def _send_error(out: Responder, exc: HTTPError) -> None:
    if out.started:  # a stream already under way cannot change its status
        out.abort()
        return
    out.send_error(exc.status, exc.message, param=exc.param, code=exc.code, headers=exc.header_lines())


def _carries_disagg(raw: bytes) -> bool:
    """Whether the body has a non-null top-level ``disaggregated_params``, found without parsing
    or tokenizing (one lax scan of the top-level object, as parse_request's own first step)."""
    try:
        span = fastcore.find_span(raw, (wire.DISAGGREGATED_PARAMS,), validate=False)
    except fastcore.JSONSpanError:
        return False  # malformed: parse_request answers 400 before any tokenizing
    return span is not None and raw[span[0] : span[0] + 4] != b"null"


async def _next_delta(queue: asyncio.Queue[Delta]) -> Delta:
    delta = await queue.get()
    if delta.error is not None:
        raise HTTPError(500, delta.error, code="engine_error")
    return delta


class WorkerApp:
    """One worker: its engine, settings, metrics, signature verifier and HTTP server."""

    def __init__(self, engine: Engine, settings: WorkerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.server: HTTPServer | None = None
        self.metrics = WorkerMetrics(engine, self)
        #: this process's id (in /health and /server_info): a restarted worker has a new one
        self.instance = uuid.uuid4().hex
        secret = settings.shared_secret
        # One per worker: it remembers the nonces it has accepted, so a replay is refused.
        self.verifier = Verifier(secret) if secret is not None else None
        self.trtllm_key = settings.trtllm_auth_key if settings.trtllm_auth_key is not None else secret
        self.kv_sources = KVSources(settings.kv_allow, any_host=secret is not None)
        #: GET /metrics: counts prefix-cache hits and names KV fetch failures (server/metrics_access.py)
        self.metrics_access = MetricsAccess(settings.metrics_token)
        self.max_parked_tokens = int(settings.max_parked_fraction * engine.kv_capacity_tokens)
        #: streams dropped because their client stopped reading (stream_stall_timeout_s)
        self.stalled_streams = 0
        self.session: aiohttp.ClientSession | None = None
        self.expiry_task: asyncio.Task[None] | None = None
        #: base of ctx_info_endpoint for a request without a Host header
        self.bound_url = ""
        #: disagg_request_id -> ctx_request_id of parked KV, for a release by the request's id
        self._parked_by_request: collections.OrderedDict[int, int] = collections.OrderedDict()
        #: set by :meth:`drain` (SIGTERM): /health and new completions answer 503, KV is still served
        self.draining = False
        #: completions being served now
        self.active = 0
        #: fire-and-forget tasks (KV releases after a failed fetch), kept referenced until done
        self._background: set[asyncio.Task[None]] = set()
        #: requests waiting for KV room, woken in arrival order (:meth:`_reserve`)
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()
        self._wake_timer: asyncio.TimerHandle | None = None
        self._simple: dict[bytes, Callable[[Responder], None]] = {
            wire.HEALTH_PATH.encode(): self.health,
            b"/v1/models": self.models,
            wire.SERVER_INFO_PATH.encode(): self.server_info,
            b"/metrics": self.metrics_endpoint,
        }
        #: trtllm-serve's other endpoints: /kv_cache_events, /version, /perf_metrics, ... (server/trtllm_endpoints.py)
        self.trtllm = TrtllmEndpoints(WORKER_ROUTES, self.metrics.registry.render, self.metrics_access,
                                      kv_events=self._kv_events)  # fmt: skip
        #: OpenTelemetry (server/tracing.py): None unless an OTLP endpoint is configured
        self.tracing = tracing.start_tracing(f"fastcore-worker-{settings.role}", settings.otlp_traces_endpoint)

    # -- lifecycle -----------------------------------------------------------

    async def start(self, host: str, port: int) -> tuple[HTTPServer, int]:
        self.engine.start(asyncio.get_running_loop())
        self.session = aiohttp.ClientSession()
        self.expiry_task = asyncio.create_task(self._expire_parked_loop())
        server = self.server = HTTPServer(self.handle, self.settings.limits())
        server.on_close.append(self.stop)
        try:
            await server.start(host, port, backlog=LISTEN_BACKLOG)
        except BaseException:
            await self.stop()
            raise
        if not server.sockets:
            await server.cleanup()
            raise RuntimeError(f"worker on {host}:{port} has no listening socket")
        bound = server.sockets[0].getsockname()
        self.bound_url = f"http://{host}:{bound[1]}" if ":" not in host else f"http://[{host}]:{bound[1]}"
        return server, int(bound[1])

    async def drain(self, timeout: float) -> bool:
        """SIGTERM (after the cluster deregistration): refuse new completions and fail /health (503,
        so orchestrators stop choosing this worker), keep serving KV fetches, and wait up to
        ``timeout`` for the requests in flight and the parked KV to be done. True if all were."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.active and loop.time() < deadline:
            await asyncio.sleep(0.02)
        # A parked entry's fetch follows its answer within milliseconds; one still parked after
        # DRAIN_PARKED_GRACE_S has nobody coming for it (its orchestrator gave up or died).
        parked_deadline = min(deadline, loop.time() + DRAIN_PARKED_GRACE_S)
        while self.engine.parked_count and loop.time() < parked_deadline:
            await asyncio.sleep(0.02)
        if self.active or self.engine.parked_count:
            log.warning("drain: %d request(s) and %d parked KV entries left after %g s",
                        self.active, self.engine.parked_count, timeout)  # fmt: skip
            return False
        return True

    async def stop(self) -> None:
        if self._background:
            await asyncio.wait(list(self._background), timeout=1.0)
        if self.expiry_task is not None:
            self.expiry_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.expiry_task
        if self.session is not None:
            await self.session.close()
        if self.tracing is not None:
            self.tracing.shutdown()  # flush the batched spans
        await asyncio.get_running_loop().run_in_executor(None, self.engine.stop)

    async def _expire_parked_loop(self) -> None:
        period = max(0.05, min(1.0, self.settings.kv_ttl_s / 4))
        while True:
            await asyncio.sleep(period)
            expired = self.engine.expire_parked()
            if expired:
                self.metrics.handoff.inc(expired, event="expired")

    # -- routing -------------------------------------------------------------

    async def handle(self, request: Request, out: Responder) -> None:
        path = request.path
        try:
            route = _GENERATION_ROUTES.get(path)
            if route is not None:
                if request.method != _POST:
                    raise HTTPError(405, f"{path.decode()} takes POST", headers={"Allow": "POST"})
                await self.generate(request, out, route)
                return
            simple = self._simple.get(path)
            if simple is not None:
                if request.method not in _GET:
                    raise HTTPError(405, f"{path.decode()} takes GET", headers={"Allow": "GET, HEAD"})
                if path == _METRICS:
                    refused = self.metrics_access.refusal(request.header(b"authorization"), out.peer)
                    if refused is not None:
                        raise refused
                simple(out)
                return
            if self.trtllm.handles(path):
                self.trtllm.handle(request, out)
                return
            if path == _CACHE_EVENTS:
                await self.cache_events(request, out)
                return
            if path.startswith(_KV_PREFIX):
                # GET or DELETE only: a HEAD would hand the KV over to nobody.
                if request.method == b"GET":
                    await self.kv(request, out)
                elif request.method == b"DELETE":
                    self.release_kv(request, out)
                else:
                    raise HTTPError(
                        405, "the KV endpoint takes GET or DELETE", headers={"Allow": "GET, DELETE"}
                    )
                return
            raise HTTPError(
                404,
                f"no route {path.decode('utf-8', 'replace')[:200]}: this worker serves POST "
                "/v1/chat/completions, POST /v1/completions, GET /v1/models, /health, /server_info, "
                f"/metrics, {KV_PATH}",
            )
        except HTTPError as exc:
            _send_error(out, exc)
        except Exception:
            log.exception("unhandled error on %s", path.decode("utf-8", "replace"))
            _send_error(out, HTTPError(500, "internal error in the worker"))

    # -- simple routes ---------------------------------------------------------

    def health(self, out: Responder) -> None:
        if self.draining:
            out.send_error(503, "the worker is draining (shutting down)", code="draining")
            return
        if not self.engine.alive:
            out.send_error(503, "the engine is not running")
            return
        out.send(
            200, json.dumps({"status": "ok", wire.INFO_ROLE: self.settings.role, wire.INFO_INSTANCE: self.instance}).encode()
        )

    def models(self, out: Responder) -> None:
        model = {
            "id": self.settings.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "fastcore",
            "max_model_len": self.engine.max_context,
        }
        out.send(200, json.dumps({"object": "list", "data": [model]}).encode())

    def server_info(self, out: Responder) -> None:
        out.send(200, json.dumps(self.info()).encode())

    def info(self) -> dict[str, Any]:
        """What ``/server_info`` answers (and a cluster registration carries as capabilities)."""
        engine, settings = self.engine, self.settings
        info = {
            wire.INFO_ROLE: settings.role,
            wire.INFO_INSTANCE: self.instance,
            wire.INFO_MODEL: settings.model_name,
            wire.INFO_MAX_CONTEXT_LENGTH: engine.max_context,
            wire.INFO_VOCAB_SIZE: engine.vocab_size,
            wire.INFO_KV_ENDPOINT: KV_PATH,
            wire.INFO_KV_CAPACITY_TOKENS: engine.kv_capacity_tokens,
            wire.INFO_KV_TTL_S: settings.kv_ttl_s,
            wire.INFO_MAX_PARKED_TOKENS: self.max_parked_tokens,
            wire.INFO_DEVICE: settings.device,
            # What an orchestrator may ask of a context leg: return_prompt_token_ids_b64 is
            # honoured on these routes (else the list is answered).
            wire.INFO_B64_CHAT: True,
            wire.INFO_B64_COMPLETIONS: not settings.accept_trtllm_orchestrator,
            # Bodies flagged X-TRTLLM-Msgpack: 1 are decoded as msgpack.
            wire.INFO_MSGPACK_REQUESTS: True,
            # A plain request (no disaggregated_params) is served whole, prefill included, whatever
            # the role: an orchestrator may skip the context leg (conditional disaggregation).
            wire.INFO_LOCAL_PREFILL: True,
            # Full KV blocks are reused across requests that share a prefix (server/worker/kv_cache.py).
            wire.INFO_PREFIX_CACHING: bool(getattr(engine, "prefix_caching", False)),
            # The synthetic text mode's text bytes per prompt id (--bytes-per-token); absent otherwise.
            **({wire.INFO_BYTES_PER_TOKEN: bpt} if (bpt := getattr(engine, "bytes_per_token", None)) else {}),
            # Legs this worker accepts: a fastcore signature needed (else unsigned); an
            # x-trtllm-disagg-auth accepted (and needed) on legs naming where the KV is.
            wire.INFO_INTERNAL_AUTH: {
                wire.INFO_AUTH_FASTCORE_SIGNATURE: self.verifier is not None,
                wire.INFO_AUTH_TRTLLM_DISAGG_AUTH: self.trtllm_key is not None,
                wire.INFO_AUTH_ACCEPT_TRTLLM_ORCHESTRATOR: settings.accept_trtllm_orchestrator,
            },
        }
        return info

    def metrics_endpoint(self, out: Responder) -> None:
        out.send(200, self.metrics.registry.render(), CONTENT_TYPE.encode())

    async def cache_events(self, request: Request, out: Responder) -> None:
        """The prefix cache in the orchestrators' key space (server/worker/kv_events.py
        ``follow_cache_events``), under /metrics' access rule: the keys are an oracle of prompts."""
        from .kv_events import follow_cache_events

        if request.method not in _GET:
            raise HTTPError(405, "/cache_events takes GET", headers={"Allow": "GET, HEAD"})
        refused = self.metrics_access.refusal(request.header(b"authorization"), out.peer)
        if refused is not None:
            raise refused
        answer = await follow_cache_events(getattr(self.engine, "cache", None), self.instance, request.query)
        out.send(200, json.dumps(answer).encode())

    def _kv_events(self) -> list[dict[str, Any]]:
        """trtllm-serve's KV cache events of the engine's prefix cache (recorded from the first poll)."""
        from .kv_events import events_of

        cache = getattr(self.engine, "cache", None)
        if cache is None:
            return []
        return events_of(cache, cache.block_size, cache.num_blocks).drain()

    # -- KV hand-off, context side -----------------------------------------------

    def _kv_id(self, request: Request, signed: bytes, what: str, prefix: bytes = _KV_PREFIX) -> int:
        """The id at the end of a KV request's path (after ``prefix``) whose signature (over ``signed``)
        holds: a ctx_request_id, or after ``/kv/by-request/`` a disagg_request_id."""
        if self.verifier is not None:
            # Bound to this instance when the sender knows it (an orchestrator's release); a generation
            # worker's fetch cannot be: the path names a random id parked here only.
            reason = self.verifier.check(signed, request.header(_SIGNATURE), destination=self.instance)
            if reason is not None:
                raise HTTPError(
                    403, f"KV {what} refused: {SIGNATURE_HEADER} {reason}", code=_refusal_code(reason)
                )
        raw_id = request.path[len(prefix) :]
        if not (raw_id.isdigit() and len(raw_id) <= 20):
            field = wire.CTX_REQUEST_ID if prefix == _KV_PREFIX else wire.DISAGG_REQUEST_ID
            raise HTTPError(400, f"{field} must be an integer", param=field)
        return int(raw_id)

    def release_kv(self, request: Request, out: Responder) -> None:
        """``DELETE /kv/{id}``: the orchestrator gave up on the generation leg; free the parked KV now.

        Signed over ``DELETE <path>`` (a fetch's signature cannot release). ``/kv/by-request/<id>``
        names the entry by the leg's ``disagg_request_id`` instead.
        """
        if request.path.startswith(_KV_BY_REQUEST):
            disagg_id = self._kv_id(request, b"DELETE " + request.path, "release", _KV_BY_REQUEST)
            ctx_request_id = self._parked_by_request.pop(disagg_id, None)
            if ctx_request_id is None or not self.engine.discard_parked(ctx_request_id):
                raise HTTPError(404, f"no KV held for disagg_request_id {disagg_id}")
            self.metrics.handoff.inc(event="released")
            out.send(200, b'{"released": true}')
            return
        ctx_request_id = self._kv_id(request, b"DELETE " + request.path, "release")
        if not self.engine.discard_parked(ctx_request_id):
            raise HTTPError(
                404, f"no KV held for ctx_request_id {ctx_request_id} (already fetched or expired)"
            )
        self.metrics.handoff.inc(event="released")
        out.send(200, b'{"released": true}')

    async def kv(self, request: Request, out: Responder) -> None:
        from .kv_transfer import encode_kv  # torch: only engines that park KV get here

        ctx_request_id = self._kv_id(request, request.path, "fetch")
        parked = self.engine.take_parked(ctx_request_id)
        if parked is None:
            raise HTTPError(
                404, f"no KV held for ctx_request_id {ctx_request_id} (already fetched or expired)"
            )
        # The generation worker may hang up midway (timeout, cancel, crash) and
        # recompute the prefill; this handler is then cancelled. The KV is gone
        # either way (read_parked frees it): count it, without a traceback.
        served = False
        trace = tracing.start_kv_export(self.tracing, request, parked.num_tokens) if self.tracing else None
        try:
            # The gather (and a device-to-host copy on CUDA) must not run on the event loop.
            # Shielded: the read owns the blocks from here, and a cancelled executor
            # future whose job had not started yet (executor busy) would never free them.
            read = asyncio.get_running_loop().run_in_executor(None, self.engine.read_parked, parked)
            k, v = await asyncio.shield(read)
            pieces = encode_kv(
                k,
                v,
                prompt_crc32=parked.prompt_crc32,
                first_token=parked.first_token,
                first_logprob=parked.first_logprob,
            )
            out.send_pieces(200, pieces, b"application/octet-stream")
            if trace is not None:
                trace.set("fastcore.kv.bytes", sum(len(piece) for piece in pieces))
            await out.drain()
            served = not out.closed
        finally:
            self.metrics.handoff.inc(event="served" if served else "abandoned")
            if trace is not None:
                trace.end(200 if served else 499)

    # -- KV hand-off, generation side ------------------------------------------

    async def fetch_kv(
        self, endpoint: str, prompt_ids: np.ndarray, trace_headers: dict[str, str] | None = None
    ) -> KVPayload:
        """The prompt's KV from a context worker, or a :class:`KVFetchError` saying why not."""
        from .kv_transfer import (  # torch: real engines only
            KVTransferError,
            check_header,
            decode_kv,
            parse_prefix,
        )

        assert self.session is not None
        headers = trace_headers or {}
        if self.settings.shared_secret is not None:
            headers[SIGNATURE_HEADER] = kv_signature(self.settings.shared_secret, urlsplit(endpoint).path)
        layout = self.engine.kv_layout
        num_tokens = int(prompt_ids.size)
        crc = prompt_checksum(prompt_ids)
        timeout = aiohttp.ClientTimeout(total=self.settings.kv_fetch_timeout_s)
        try:
            async with self.session.get(
                endpoint, headers=headers, timeout=timeout, allow_redirects=False
            ) as resp:
                if resp.status != 200:
                    raise KVFetchError(f"http_{resp.status}", f"context worker answered {resp.status}")
                body = bytearray(await resp.content.readexactly(12))
                header_len = parse_prefix(body)
                body += await resp.content.readexactly(header_len)
                try:
                    check_header(body[12:], layout, num_tokens=num_tokens, prompt_crc32=crc)
                except KVTransferError as exc:
                    raise KVFetchError("mismatch", str(exc)) from None
                # Sized by this worker's own model and prompt, never by the sender's header.
                body += await resp.content.readexactly(layout.payload_bytes(num_tokens))
        except KVTransferError as exc:
            raise KVFetchError("malformed", str(exc)) from None
        except asyncio.IncompleteReadError as exc:
            raise KVFetchError(
                "malformed", f"KV body ended early ({len(exc.partial)} bytes short read)"
            ) from None
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise KVFetchError("unreachable", f"{type(exc).__name__}: {exc}") from None
        try:
            return decode_kv(body, layout, num_tokens=num_tokens, prompt_crc32=crc)
        except KVTransferError as exc:
            raise KVFetchError("malformed", str(exc)) from None

    def _release_kv_soon(self, endpoint: str) -> None:
        """``DELETE`` a KV entry this worker gave up fetching, in the background (best effort)."""
        task = asyncio.get_running_loop().create_task(self._release_kv(endpoint))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release_kv(self, endpoint: str) -> None:
        assert self.session is not None
        headers = {}
        if self.settings.shared_secret is not None:
            signed = b"DELETE " + urlsplit(endpoint).path.encode()
            headers[SIGNATURE_HEADER] = sign_body(self.settings.shared_secret, signed)
        try:
            timeout = aiohttp.ClientTimeout(total=min(2.0, self.settings.kv_fetch_timeout_s))
            async with self.session.delete(endpoint, headers=headers, timeout=timeout, allow_redirects=False):
                pass
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            log.info("releasing the KV at %s failed: %s", endpoint, exc)

    async def _attach_context_kv(
        self, req: ParsedRequest, engine_req: EngineRequest, caller_local: bool = True
    ) -> None:
        assert req.disagg is not None
        metrics = self.metrics
        endpoint = req.disagg.ctx_info_endpoint
        first = req.disagg.first_gen_tokens
        reason = None
        if not endpoint:
            reason = "no_endpoint"
        elif len(first) != 1:
            reason = "several_first_tokens"
        elif not self.kv_sources.allows(endpoint, caller_local=caller_local):
            log.info(
                "ctx_info_endpoint %.200r is not an allowed KV source; recomputing the prefill", endpoint
            )
            reason = "not_allowed"
        if reason is not None:
            metrics.fetch_failures.inc(reason=reason)
            metrics.handoff.inc(event="recomputed")
            return
        assert endpoint is not None
        trace, span, trace_headers = tracing.current_trace(), None, None
        if trace is not None:  # the hand-off's span; the context worker's export span is its child
            span, trace_headers = tracing.start_kv_fetch(trace, endpoint, int(req.prompt_ids.size))
        try:
            payload = await self.fetch_kv(endpoint, req.prompt_ids, trace_headers)
        except KVFetchError as exc:
            if trace is not None:
                tracing.end_span(trace, span, error=exc.reason)
            log.info("KV fetch from %s failed (%s): %s; recomputing the prefill", endpoint, exc.reason, exc)
            metrics.fetch_failures.inc(reason=exc.reason)
            metrics.handoff.inc(event="recomputed")
            if exc.reason == "unreachable" or exc.reason.startswith("http_5"):
                # The KV may still be parked there (the fetch never reached it, or timed out
                # before it was read): nobody else will fetch it, so say so now, not at its TTL.
                self._release_kv_soon(endpoint)
            return
        if trace is not None:
            nbytes = self.engine.kv_layout.payload_bytes(int(req.prompt_ids.size))
            mismatch = "first token mismatch" if payload.first_token != first[0] else None
            tracing.end_span(trace, span, {"fastcore.kv.bytes": nbytes}, error=mismatch)
        if payload.first_token != first[0]:
            metrics.fetch_failures.inc(reason="mismatch")
            metrics.handoff.inc(event="recomputed")
            return
        engine_req.kv_import = (payload.k, payload.v)
        engine_req.kv_imported = True
        engine_req.forced_logprobs = [payload.first_logprob if req.params.logprobs is not None else None]
        metrics.handoff.inc(event="fetched")

    # -- completions -------------------------------------------------------------

    async def generate(self, request: Request, out: Responder, route: Route) -> None:
        status = 500
        trace = None
        self.active += 1
        try:
            if self.tracing is not None:
                trace = tracing.start_worker_request(self.tracing, request, route, self.settings.role)
            if self.draining:
                raise HTTPError(503, "the worker is draining (shutting down): send it elsewhere",
                                code="draining", headers={"Retry-After": str(self.settings.retry_after_s)})  # fmt: skip
            status = await self._generate(request, out, route)
        except HTTPError as exc:
            status = exc.status
            _send_error(out, exc)
        except asyncio.CancelledError:
            status = 499  # the client went away (nginx's code for it)
            raise
        finally:
            self.active -= 1
            self.metrics.requests.inc(route=route, status=str(status))
            if trace is not None:
                trace.end(status)

    def _authenticate(self, request: Request) -> bool:
        """Check a fastcore signature on the body's bytes as sent, before anything is parsed;
        True if signed. A signature present is checked (a 403 names why it fails, whatever the
        header holds)."""
        verifier = self.verifier
        header = request.header(_SIGNATURE)
        if verifier is None or header is None:
            return False
        # Bound to this process's instance: nonces are per process, so only the binding stops a
        # leg signed for another worker (or for this one before a restart) from being replayed here.
        reason = verifier.check(request.body, header, destination=self.instance, bound=True)
        if reason is not None:
            raise HTTPError(403, f"{SIGNATURE_HEADER} refused: {reason}", code=_refusal_code(reason))
        return True

    def _refuse_unsigned_early(self, body: bytes, request: Request) -> None:
        """With a shared secret, an unsigned body carrying ``disaggregated_params`` that nothing
        else can admit (no ``x-trtllm-disagg-auth``, no ``accept_trtllm_orchestrator``) is refused
        before any tokenizing or engine work; :meth:`_authorize` decides the rest after parsing."""
        if self.settings.accept_trtllm_orchestrator or request.header(_TRTLLM_AUTH) is not None:
            return
        if _carries_disagg(body):
            raise HTTPError(403, f"disaggregated_params without a {SIGNATURE_HEADER}: internal requests "
                            "must be signed", param=wire.DISAGGREGATED_PARAMS, code="missing_signature")  # fmt: skip

    def _authorize(self, req: ParsedRequest, signed: bool, trtllm_header: bytes | None) -> None:
        """Whether the leg may run (the rules of the module docstring); a 403 if not."""
        disagg = req.disagg
        if disagg is None or signed:
            return
        endpoint = disagg.raw.get(wire.CTX_INFO_ENDPOINT)
        opaque = disagg.raw.get(wire.ENCODED_OPAQUE_STATE)
        key = self.trtllm_key
        if key is not None and (endpoint is not None or opaque is not None):
            if trtllm_header is None:
                raise HTTPError(403, f"a {disagg.request_type} request naming ctx_info_endpoint or "
                                f"encoded_opaque_state must carry {TRTLLM_AUTH_HEADER} or {SIGNATURE_HEADER}",
                                param=wire.DISAGGREGATED_PARAMS, code="missing_signature")  # fmt: skip
            if not check_trtllm_disagg_auth(key, endpoint, opaque, trtllm_header):
                raise HTTPError(403, f"{TRTLLM_AUTH_HEADER} refused: it does not sign this request's "
                                "ctx_info_endpoint and encoded_opaque_state",
                                param=wire.DISAGGREGATED_PARAMS, code="bad_signature")  # fmt: skip
            return
        if self.verifier is not None and not self.settings.accept_trtllm_orchestrator:
            raise HTTPError(403, f"{disagg.request_type} request without a {SIGNATURE_HEADER}",
                            param=wire.DISAGGREGATED_PARAMS, code="missing_signature")  # fmt: skip

    def _check_role(self, req: ParsedRequest) -> None:
        if req.disagg is None:
            return
        role = self.settings.role
        kind = req.disagg.request_type
        if kind == CONTEXT_ONLY and role == "generation":
            raise HTTPError(400, "this worker's role is generation: it does not take context_only requests",
                            param=wire.DISAGGREGATED_PARAMS)  # fmt: skip
        if kind == GENERATION_ONLY and role == "context":
            raise HTTPError(400, "this worker's role is context: it does not take generation_only requests",
                            param=wire.DISAGGREGATED_PARAMS)  # fmt: skip

    async def _reserve(self, engine_req: EngineRequest) -> None:
        """Take the request's KV. When it does not fit: parked entries, oldest first, give way;
        then the request waits for room (bounded in time and in waiters) before its 503.

        Requests whose clients left hold their KV until the engine drops them
        (before its next step), and a burst of admissions holds it until its
        prefills run: a short wait turns those moments into latency instead of
        errors. A waiting request holds no KV; its client leaving ends the
        wait (the task is cancelled). Arrivals queue behind those already
        waiting.
        """
        engine = self.engine
        settings = self.settings
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        why = "requests are already waiting for KV"
        while True:
            if deadline is not None or not self._waiting:
                try:
                    engine.reserve(engine_req)
                    return
                except KVCacheFull as exc:
                    if not exc.ever_fits:
                        raise HTTPError(
                            400, f"the request is too large for this worker: {exc}", param=wire.MAX_TOKENS
                        ) from None
                    # A parked entry is the cheapest KV to lose: its generation leg
                    # recomputes the prefill. One parked just now is likely about to
                    # be fetched: while the request may still wait, only older ones go.
                    waiting_left = settings.admission_wait_s > 0 and (
                        deadline is None or loop.time() < deadline
                    )
                    before = time.monotonic() - PARKED_GRACE_S if waiting_left else None
                    evicted = engine.evict_parked(1, before) if engine.parked_tokens > 0 else 0
                    if evicted:
                        self.metrics.handoff.inc(evicted, event="evicted")
                        continue
                    why = str(exc)
            now = loop.time()
            if deadline is None:
                full = len(self._waiting) >= settings.max_waiting
                deadline = now if full else now + settings.admission_wait_s
                if not full:
                    self.metrics.waited.inc()
            if now >= deadline:
                self.metrics.rejected.inc(reason="kv_full")
                raise HTTPError(
                    503,
                    f"the worker is full: {why}",
                    code="worker_full",
                    headers={"Retry-After": str(settings.retry_after_s)},
                )
            await self._wait_for_kv(deadline - now)

    async def _wait_for_kv(self, timeout: float) -> None:
        """Until KV may have been freed (looked at every ADMISSION_POLL_S), or ``timeout``."""
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self._waiting.append(waiter)
        if self._wake_timer is None:
            self._wake_timer = loop.call_later(ADMISSION_POLL_S, self._wake_waiters)
        try:
            await asyncio.wait_for(waiter, timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            with contextlib.suppress(ValueError):
                self._waiting.remove(waiter)

    def _wake_waiters(self) -> None:
        # Frees happen on the engine thread too (finished sequences): a short
        # poll while anyone waits is simpler than a cross-thread signal per free.
        self._wake_timer = None
        # Each woken request leaves the queue itself when it runs, so one
        # arriving meanwhile still queues behind it.
        for waiter in self._waiting:
            if not waiter.done():
                waiter.set_result(None)

    async def _generate(self, request: Request, out: Responder, route: Route) -> int:
        arrived = time.monotonic()
        signed = self._authenticate(request)
        # A msgpack body becomes the JSON of the same object: one validation for both.
        body = msgpack_to_json(request.body) if request.header(_MSGPACK) == b"1" else request.body
        if self.verifier is not None and not signed:
            self._refuse_unsigned_early(body, request)
        engine = self.engine
        req = parse_request(
            body,
            route,
            tokenizer=engine.tokenizer,
            model_name=self.settings.model_name,
            max_context=engine.max_context,
        )
        self._authorize(req, signed, request.header(_TRTLLM_AUTH))
        self._check_role(req)
        if not engine.alive:
            raise HTTPError(503, "the engine is not running", code="engine_down",
                            headers={"Retry-After": str(self.settings.retry_after_s)})  # fmt: skip

        queue: asyncio.Queue[Delta] = asyncio.Queue()
        on_delta: Callable[[Delta], None] = queue.put_nowait
        trace = tracing.current_trace()
        if trace is not None:
            tracing.request_parsed(trace, req)
        prompt_tail = req.prompt_ids[-4:].tolist()
        engine_req = EngineRequest(
            request_id=uuid.uuid4().hex,
            prompt_ids=req.prompt_ids,
            params=req.params,
            processor=OutputProcessor(engine.tokenizer, req.params, prompt_tail),
            on_delta=on_delta,
            cache_root=cache_salt_root(req.cache_salt),
        )
        if trace is not None:  # the prefill and decode spans, from the engine's output
            engine_req.on_delta = tracing.watch_deltas(trace, on_delta, engine_req)
        # a follower of GET /cache_events learns this prompt's keys once its blocks are stored
        chunks = getattr(getattr(engine, "cache", None), "chunks", None)
        if chunks is not None:
            chunks.track(engine_req.request_id, body, route == "chat")
        if req.is_context_only:
            engine_req.park_as = secrets.randbits(62)
            engine_req.park_ttl_s = self.settings.kv_ttl_s
        elif req.is_generation_only:
            assert req.disagg is not None
            engine_req.forced_tokens = list(req.disagg.first_gen_tokens)
        reserving = trace.now() if trace is not None else 0
        await self._reserve(engine_req)
        if trace is not None:
            trace.record("fastcore.queue", reserving)

        queued = answered = False
        try:
            if req.is_generation_only:
                await self._attach_context_kv(req, engine_req, is_loopback_peer(out.peer))
            if trace is not None:
                trace.mark = trace.now()
            engine.enqueue(engine_req)
            queued = True
            self.metrics.prompt_tokens.inc(int(req.prompt_ids.size))
            if req.stream and not req.is_context_only:
                answered = await self._stream(out, req, engine_req, queue, arrived)
            else:
                answered = await self._respond(request, out, req, engine_req, queue, arrived)
            return 200
        finally:
            if chunks is not None:
                chunks.pending.pop(engine_req.request_id, None)
            if not queued:
                engine.unreserve(engine_req)
            elif not answered:
                # Client gone or handler failed: free the slot now, not when
                # max_tokens runs out, and a context leg's KV, parked already
                # or about to be: its id never left this worker, so nobody
                # could ever fetch it.
                engine.abort(engine_req.request_id)
                if engine_req.park_as is not None:
                    engine.discard_parked(engine_req.park_as)
                    self.metrics.handoff.inc(event="cancelled")

    def _context_fields(
        self,
        request: Request,
        req: ParsedRequest,
        engine_req: EngineRequest,
        token_ids: list[int],
        body: dict[str, Any],
    ) -> list[bytes]:
        """The context response's extras (docs/protocol.md (2)): ``disaggregated_params`` set in ``body``,
        and the prompt ids returned as JSON members for :func:`dump_with_members`."""
        assert req.disagg is not None and engine_req.park_as is not None
        host = request.header(b"host")
        base = self.settings.public_url or (f"http://{host.decode('latin-1')}" if host else self.bound_url)
        ctx_id = engine_req.park_as
        body[wire.CHOICES][0][wire.DISAGGREGATED_PARAMS] = {
            wire.REQUEST_TYPE: CONTEXT_ONLY,
            wire.FIRST_GEN_TOKENS: token_ids,
            wire.CTX_REQUEST_ID: ctx_id,
            wire.DISAGG_REQUEST_ID: req.disagg.disagg_request_id,
            wire.ENCODED_OPAQUE_STATE: None,
            wire.CTX_INFO_ENDPOINT: base.rstrip("/") + wire.kv_path(ctx_id),
            wire.DRAFT_TOKENS: None,
        }
        if body[wire.CHOICES][0][wire.FINISH_REASON] == NOT_FINISHED:
            self.metrics.handoff.inc(event="parked")
            disagg_id = req.disagg.disagg_request_id
            if type(disagg_id) is int:
                by_request = self._parked_by_request
                by_request[disagg_id] = ctx_id
                if len(by_request) > MAX_PARKED_BY_REQUEST:
                    by_request.popitem(last=False)
            over = self.engine.parked_tokens - self.max_parked_tokens
            if over > 0:
                self.metrics.handoff.inc(self.engine.evict_parked(over), event="evicted")
        # Base64 only when asked, and on completions only when not fronted by trtllm-serve's
        # orchestrator, whose completion response model refuses the field. Straight from the
        # int32 array: no Python list on the way to base64.
        b64 = req.disagg.return_prompt_token_ids_b64 and (
            req.route == "chat" or not self.settings.accept_trtllm_orchestrator
        )
        return prompt_ids_members(req.prompt_ids, b64=b64)

    async def _respond(
        self,
        request: Request,
        out: Responder,
        req: ParsedRequest,
        engine_req: EngineRequest,
        queue: asyncio.Queue[Delta],
        arrived: float,
    ) -> bool:
        """The whole answer as one JSON body; whether it reached a connected client."""
        metrics = self.metrics
        deltas: list[Delta] = []
        while True:
            delta = await _next_delta(queue)
            if not deltas:
                metrics.ttft.observe(time.monotonic() - arrived, route=req.route)
            deltas.append(delta)
            if delta.finish_reason is not None:
                break
        metrics.latency.observe(time.monotonic() - arrived, route=req.route)
        token_ids = [t for d in deltas for t in d.token_ids]
        metrics.generated_tokens.inc(len(token_ids))
        logprobs = [lp for d in deltas for lp in d.logprobs] if req.want_logprobs else None
        body = completion_body(
            route=req.route,
            response_id=new_response_id(req.route),
            created=int(time.time()),
            model=req.model,
            text="".join(d.text for d in deltas),
            finish_reason=deltas[-1].finish_reason,
            usage=request_usage(req, len(token_ids), engine_req),
            logprobs=logprobs,
            tokenizer=self.engine.tokenizer,
        )
        members = (
            self._context_fields(request, req, engine_req, token_ids, body) if req.is_context_only else []
        )
        out.send(200, dump_with_members(body, members), _JSON)
        if engine_req.park_as is not None:
            # A reset read in the same loop pass as the engine's output closes
            # the connection in the next one: yield once, so that this handler
            # is cancelled (and the KV freed) rather than the KV kept for a
            # client that never got its id.
            await asyncio.sleep(0)
        return not out.closed

    async def _stream(
        self,
        out: Responder,
        req: ParsedRequest,
        engine_req: EngineRequest,
        queue: asyncio.Queue[Delta],
        arrived: float,
    ) -> bool:
        """The answer as SSE events; whether the stream reached its end on a connected client."""
        # Wait for the first output before committing to a 200, so an engine error is still a JSON error.
        first = await _next_delta(queue)
        self.metrics.ttft.observe(time.monotonic() - arrived, route=req.route)
        out.start(200, _SSE, _SSE_HEADERS)
        writer = StreamWriterState(req, self.engine.tokenizer)
        num_tokens = 0
        out.write(writer.start())
        delta = first
        while True:
            if delta.error is not None:
                out.write(b"data: " + error_body(500, delta.error) + b"\n\n")
                break
            num_tokens += len(delta.token_ids)
            out.write(writer.delta(delta))
            if delta.finish_reason is not None:
                out.write(writer.end(request_usage(req, num_tokens, engine_req)))
                break
            if out.paused and not await self._drained(out):
                return False  # dropped: the caller frees its KV now, not at max_tokens
            delta = await queue.get()
        self.metrics.generated_tokens.inc(num_tokens)
        self.metrics.latency.observe(time.monotonic() - arrived, route=req.route)
        out.end()
        return not out.closed


    async def _drained(self, out: Responder) -> bool:
        """Wait while the client's write buffer is above the high-water mark (a client that does not
        read holds no more than that); False, the connection dropped, when it has not come back down
        within ``stream_stall_timeout_s``: 40 never-read streams without max_tokens held a small
        worker's whole KV until they finished."""
        try:  # wait_for, not asyncio.timeout: Python 3.10 (only while paused: no cost per token)
            await asyncio.wait_for(out.drain(), self.settings.stream_stall_timeout_s)
        except asyncio.TimeoutError:
            self.stalled_streams += 1
            out.abort()
            return False
        return True


async def start_worker(
    engine: Engine, settings: WorkerSettings, host: str = "127.0.0.1", port: int = 0
) -> tuple[HTTPServer, int]:
    """Serve on ``host:port`` (0: a free port); returns the server and the bound port.

    ``await server.cleanup()`` stops it: the listening socket, the connections,
    the KV session, the expiry task and the engine.
    """
    return await WorkerApp(engine, settings).start(host, port)


__all__ = [
    "KV_PATH",
    "ROLES",
    "Engine",
    "KVSources",
    "WorkerApp",
    "WorkerSettings",
    "kv_signature",
    "start_worker",
]
