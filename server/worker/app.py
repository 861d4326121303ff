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

The parts, one module each: reading a request (:mod:`server.worker.request`:
one parse of the body, JSON or msgpack), who may send a leg
(:mod:`server.worker.internal_auth`), the KV hand-off and its bounds
(:mod:`server.worker.kv_handoff`), admission by KV room
(:mod:`server.worker.admission`), the answers (:mod:`server.worker.responses`),
``/metrics`` (:mod:`server.worker.metrics`), the settings (:mod:`server.worker.settings`).

Bodies flagged ``X-TRTLLM-Msgpack: 1`` (trtllm-serve's orchestrator with
``TRTLLM_SERVE_ENABLE_MSGSPEC=1``) are msgpack, decoded once into the values of
their JSON twin (:func:`~server.worker.msgpack_body.load_msgpack_body`) and
validated field by field as JSON bodies are. A fastcore signature signs the
bytes as sent, msgpack or not.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec

from fastcore import protocol as wire
from server import tracing
from server.auth import Verifier
from server.errors import HTTPError
from server.http import HTTPServer, Request, Responder
from server.metrics import CONTENT_TYPE
from server.metrics_access import MetricsAccess, is_loopback_peer
from server.trtllm_endpoints import WORKER_ROUTES, TrtllmEndpoints

from .admission import Admission
from .engine_api import NOT_FINISHED, Engine, EngineRequest, cache_salt_root
from .internal_auth import InternalAuth
from .kv_handoff import KVHandoff
from .metrics import WorkerMetrics
from .output import Delta, OutputProcessor
from .prompt_bytes import PromptBytesPerToken, prompt_span_bytes
from .request import CONTEXT_ONLY, ParsedRequest, RequestReader, Route
from .responses import (
    StreamWriterState,
    completion_body,
    dump_with_members,
    new_response_id,
    prompt_ids_members,
    request_usage,
)
from .settings import ROLES, WorkerSettings
from .stream_sink import DeltaRelay, StreamSink, collect_answer

log = logging.getLogger(__name__)

KV_PATH = wire.KV_PATH
LISTEN_BACKLOG = 4096  # an orchestrator may open 1000s of connections at once

_POST = b"POST"
_GET = (b"GET", b"HEAD")
_KV_PREFIX = wire.KV_PATH_PREFIX.encode()
_METRICS = b"/metrics"
#: the prefix cache's keys as a stream orchestrators follow (server/worker/kv_events.py)
_CACHE_EVENTS = b"/cache_events"
_TOKENIZE = wire.TOKENIZE_PATH.encode()
#: how long a drain waits for parked KV to be fetched once no request is running
DRAIN_PARKED_GRACE_S = 2.0
_JSON = b"application/json"
_SSE = b"text/event-stream"
_SSE_HEADERS = b"Cache-Control: no-cache\r\nX-Accel-Buffering: no\r\n"
_GENERATION_ROUTES: dict[bytes, Route] = {
    wire.CHAT_COMPLETIONS_PATH.encode(): "chat",
    wire.COMPLETIONS_PATH.encode(): "completions",
}


def _send_error(out: Responder, exc: HTTPError) -> None:
    if out.started:  # a stream already under way cannot change its status
        out.abort()
        return
    out.send_error(exc.status, exc.message, param=exc.param, code=exc.code, headers=exc.header_lines())


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
        #: OpenTelemetry (server/tracing.py): None unless an OTLP endpoint is configured
        self.tracing = tracing.start_tracing(
            f"fastcore-worker-{settings.role}", settings.otlp_traces_endpoint
        )
        self.metrics = WorkerMetrics(engine, lambda: len(self.admission.waiting), lambda: self.server)
        #: this process's id (in /health and /server_info): a restarted worker has a new one
        self.instance = uuid.uuid4().hex
        secret = settings.shared_secret
        # One per worker: it remembers the nonces it has accepted, so a replay is refused.
        verifier = Verifier(secret) if secret is not None else None
        trtllm_key = settings.trtllm_auth_key if settings.trtllm_auth_key is not None else secret
        self.auth = InternalAuth(
            verifier,
            trtllm_key,
            self.instance,
            accept_trtllm_orchestrator=settings.accept_trtllm_orchestrator,
        )
        self.reader = RequestReader(
            engine.tokenizer,
            settings.model_name,
            engine.max_context,
            settings.role,
            settings.tool_call_parser,
        )
        #: /server_info's bytes_per_token, measured on the prompts tokenized here; None where the
        #: engine states its own (the synthetic one's: its ids are not a tokenizer's)
        self.prompt_bytes = (
            None if hasattr(engine, "bytes_per_token") else PromptBytesPerToken(engine.tokenizer)
        )
        self.kv = KVHandoff(engine, settings, self.metrics, self.auth, self.tracing)
        self.admission = Admission(engine, settings, self.metrics)
        #: GET /metrics: counts prefix-cache hits and names KV fetch failures (server/metrics_access.py)
        self.metrics_access = MetricsAccess(settings.metrics_token)
        #: streams dropped because their client stopped reading (stream_stall_timeout_s)
        self.stalled_streams = 0
        #: base of ctx_info_endpoint for a request without a Host header
        self.bound_url = ""
        #: set by :meth:`drain` (SIGTERM): /health and new completions answer 503, KV is still served
        self.draining = False
        #: completions being served now
        self.active = 0
        self._simple: dict[bytes, Callable[[Responder], None]] = {
            wire.HEALTH_PATH.encode(): self.health,
            b"/v1/models": self.models,
            wire.SERVER_INFO_PATH.encode(): self.server_info,
            b"/metrics": self.metrics_endpoint,
        }
        #: trtllm-serve's other endpoints: /kv_cache_events, /version, /perf_metrics, ... (server/trtllm_endpoints.py)
        self.trtllm = TrtllmEndpoints(
            WORKER_ROUTES, self.metrics.registry.render, self.metrics_access, kv_events=self._kv_events
        )

    # -- lifecycle -----------------------------------------------------------

    async def start(self, host: str, port: int) -> tuple[HTTPServer, int]:
        self.engine.start(asyncio.get_running_loop())
        self.kv.start()
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
            log.warning(
                "drain: %d request(s) and %d parked KV entries left after %g s",
                self.active,
                self.engine.parked_count,
                timeout,
            )
            return False
        return True

    async def stop(self) -> None:
        await self.kv.stop()
        if self.tracing is not None:
            self.tracing.shutdown()  # flush the batched spans
        await asyncio.get_running_loop().run_in_executor(None, self.engine.stop)

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
            if path == _TOKENIZE:
                self.tokenize(request, out)
                return
            if path.startswith(_KV_PREFIX):
                await self.kv.handle(request, out)
                return
            raise HTTPError(
                404,
                f"no route {path.decode('utf-8', 'replace')[:200]}: this worker serves POST "
                "/v1/chat/completions, POST /v1/completions, POST /tokenize, GET /v1/models, /health, /server_info, "
                f"/metrics, {KV_PATH}",
            )
        except HTTPError as exc:
            _send_error(out, exc)
        except Exception:
            log.exception("unhandled error on %s", path.decode("utf-8", "replace"))
            _send_error(out, HTTPError(500, "internal error in the worker"))

    # -- simple routes ---------------------------------------------------------

    def tokenize(self, request: Request, out: Responder) -> None:
        """``POST /tokenize`` (vLLM's): the prompt of a chat or completion body, counted."""
        if request.method != _POST:
            raise HTTPError(405, f"{wire.TOKENIZE_PATH} takes POST", headers={"Allow": "POST"})
        ids = self.reader.tokenize(request)
        out.send(
            200,
            json.dumps(
                {
                    wire.TOKENIZE_COUNT: int(ids.size),
                    wire.TOKENIZE_MAX_MODEL_LEN: self.engine.max_context,
                    wire.TOKENIZE_TOKENS: ids.tolist(),
                }
            ).encode(),
            _JSON,
        )

    def health(self, out: Responder) -> None:
        if self.draining:
            out.send_error(503, "the worker is draining (shutting down)", code="draining")
            return
        if not self.engine.alive:
            out.send_error(503, "the engine is not running")
            return
        out.send(
            200,
            json.dumps(
                {"status": "ok", wire.INFO_ROLE: self.settings.role, wire.INFO_INSTANCE: self.instance}
            ).encode(),
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
            wire.INFO_MAX_PARKED_TOKENS: self.kv.max_parked_tokens,
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
            # Bytes of prompt span (messages / prompt, as sent) per prompt id: measured on what this
            # worker tokenizes (server/worker/prompt_bytes.py); the synthetic text mode's own
            # --bytes-per-token; absent where neither is known (the synthetic fixed prompts).
            **({wire.INFO_BYTES_PER_TOKEN: bpt} if (bpt := self.bytes_per_token) else {}),
            # A second KV tier's size and load rate beside the prefill rate (docs/protocol.md)
            **getattr(engine, "kv_tiers_info", {}),
            # Legs this worker accepts: a fastcore signature needed (else unsigned); an
            # x-trtllm-disagg-auth accepted (and needed) on legs naming where the KV is.
            wire.INFO_INTERNAL_AUTH: {
                wire.INFO_AUTH_FASTCORE_SIGNATURE: self.auth.verifier is not None,
                wire.INFO_AUTH_TRTLLM_DISAGG_AUTH: self.auth.trtllm_key is not None,
                wire.INFO_AUTH_ACCEPT_TRTLLM_ORCHESTRATOR: settings.accept_trtllm_orchestrator,
            },
        }
        return info

    @property
    def bytes_per_token(self) -> float | None:
        if self.prompt_bytes is not None:
            return self.prompt_bytes.value
        return getattr(self.engine, "bytes_per_token", None)

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
        cache = getattr(self.engine, "cache", None)
        chunk_bytes = self.settings.cache_events_chunk_bytes
        out.send(200, await follow_cache_events(cache, self.instance, request.query, chunk_bytes))

    def _kv_events(self) -> tuple[bytes, int]:
        """A page of trtllm-serve's KV cache events of the engine's prefix cache (recorded from the
        first poll), as JSON, and how many events wait after it."""
        from .kv_events import events_of

        cache = getattr(self.engine, "cache", None)
        if cache is None:
            return b"[]", 0
        log = events_of(cache, cache.block_size, cache.num_blocks)
        return log.page(), log.waiting

    # -- completions -------------------------------------------------------------

    async def generate(self, request: Request, out: Responder, route: Route) -> None:
        status = 500
        trace = None
        self.active += 1
        try:
            if self.tracing is not None:
                trace = tracing.start_worker_request(self.tracing, request, route, self.settings.role)
            if self.draining:
                raise HTTPError(
                    503,
                    "the worker is draining (shutting down): send it elsewhere",
                    code="draining",
                    headers={"Retry-After": str(self.settings.retry_after_s)},
                )
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

    async def _generate(self, request: Request, out: Responder, route: Route) -> int:
        arrived = time.monotonic()
        req = self.reader.read(request, route, self.auth)
        engine = self.engine
        if self.prompt_bytes is not None and not req.prompt_from_ids and not req.msgpack:
            # the orchestrator's units: the span's bytes as sent (a msgpack body has none of its own)
            self.prompt_bytes.observe(
                prompt_span_bytes(request.body, route == "chat"), int(req.prompt_ids.size)
            )
        if not engine.alive:
            raise HTTPError(
                503,
                "the engine is not running",
                code="engine_down",
                headers={"Retry-After": str(self.settings.retry_after_s)},
            )

        queue: asyncio.Queue[Delta] = asyncio.Queue()
        relay = DeltaRelay(queue.put_nowait)  # a started stream's sink writes from it (stream_sink)
        on_delta: Callable[[Delta], None] = relay
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
            # The keys are of the JSON text (an orchestrator's); a msgpack body's is its JSON twin.
            text = msgspec.json.encode(req.body) if req.msgpack else request.body
            chunks.track(engine_req.request_id, text, route == "chat")
        if req.is_context_only:
            engine_req.park_as = secrets.randbits(62)
            engine_req.park_ttl_s = self.settings.kv_ttl_s
        elif req.is_generation_only:
            assert req.disagg is not None
            engine_req.forced_tokens = list(req.disagg.first_gen_tokens)
        reserving = trace.now() if trace is not None else 0
        await self.admission.reserve(engine_req)
        if trace is not None:
            trace.record("fastcore.queue", reserving)

        queued = answered = False
        try:
            if req.is_generation_only:
                await self.kv.attach(req, engine_req, is_loopback_peer(out.peer))
            if trace is not None:
                trace.mark = trace.now()
            engine.enqueue(engine_req)
            queued = True
            self.metrics.prompt_tokens.inc(int(req.prompt_ids.size))
            if req.stream and not req.is_context_only:
                answered = await self._stream(out, req, engine_req, relay, queue, arrived)
            else:
                answered = await self._respond(request, out, req, engine_req, relay, queue, arrived)
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
            self.kv.parked(req, ctx_id)
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
        relay: DeltaRelay,
        queue: asyncio.Queue[Delta],
        arrived: float,
    ) -> bool:
        """The whole answer as one JSON body; whether it reached a connected client."""
        metrics = self.metrics
        deltas, first_at = await collect_answer(relay, queue)  # the handler wakes at the last
        if deltas[0].error is None:
            metrics.ttft.observe(first_at - arrived, route=req.route)
        if deltas[-1].error is not None:
            raise HTTPError(500, deltas[-1].error, code="engine_error")
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
            tools=None if req.is_context_only else req.tools,  # a context leg's one token is no answer
            stop_reason=deltas[-1].stop_reason,
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
        relay: DeltaRelay,
        queue: asyncio.Queue[Delta],
        arrived: float,
    ) -> bool:
        """The answer as SSE events; whether the stream reached its end on a connected client."""
        # Wait for the first output before committing to a 200, so an engine error is still a JSON error.
        first = await _next_delta(queue)
        self.metrics.ttft.observe(time.monotonic() - arrived, route=req.route)
        out.start(200, _SSE, _SSE_HEADERS)
        sink = StreamSink(out, StreamWriterState(req, self.engine.tokenizer), req, engine_req, relay, queue)
        out.write(sink.writer.start())
        sink.write(first)
        while not sink.ended:
            if out.paused and not await self._drained(out):
                return False  # dropped: the caller frees its KV now, not at max_tokens
            await sink.run()  # the engine's callback writes the events; back here at the end or a full buffer
        self.metrics.generated_tokens.inc(sink.num_tokens)
        self.metrics.latency.observe(time.monotonic() - arrived, route=req.route)
        out.end()
        return not out.closed

    async def _drained(self, out: Responder) -> bool:
        """Wait while the client's write buffer is above the high-water mark (a client that does not
        read holds no more than that); False, the connection dropped, when it has not come back down
        within ``stream_stall_timeout_s``: 40 never-read streams without max_tokens held a small
        worker's whole KV until they finished."""
        # asyncio.wait, not wait_for (before 3.12) nor asyncio.timeout (3.11+): the connection's loss
        # wakes the drain and cancels this handler in one step, and wait_for returned the drain that
        # ended meanwhile and dropped the cancel: the stream went on for nobody. (Only while paused:
        # no cost per token.)
        drain = asyncio.ensure_future(out.drain())
        try:
            done, _ = await asyncio.wait([drain], timeout=self.settings.stream_stall_timeout_s)
        finally:
            drain.cancel()
        if not done:
            self.stalled_streams += 1
            out.abort()
            return False
        return not out.closed


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
    "WorkerApp",
    "WorkerSettings",
    "start_worker",
]
