"""The worker's aiohttp app: OpenAI routes, the disaggregated roles, the KV hand-off endpoint, metrics.

The HTTP layer only talks to an engine through the :class:`Engine` protocol
(submit a request, receive :class:`~server.worker.output.Delta` objects on the
event loop, abort, parked KV), so a synthetic engine without a model can sit
behind the same routes.

Roles (PROTOCOL.md):

- ``both``: plain requests, and either disaggregated leg;
- ``context``: plain requests and ``context_only`` legs: prefill, first token,
  the prompt's KV parked behind ``GET /kv/{ctx_request_id}`` until fetched or
  ``kv_ttl_s`` passes;
- ``generation``: plain requests and ``generation_only`` legs: the prompt from
  the ids (never re-tokenized), the KV fetched from ``ctx_info_endpoint``, or
  the prefill recomputed when it cannot be had (counted in ``/metrics``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
import numpy as np
from aiohttp import web
from yarl import URL

from server.auth import SIGNATURE_HEADER, sign_body, verify_body
from server.errors import HTTPError, error_body, error_response
from server.metrics import CONTENT_TYPE, Registry

from .engine_api import NOT_FINISHED, Engine, EngineRequest, KVCacheFull, prompt_checksum
from .output import Delta, OutputProcessor
from .protocol import (
    CONTEXT_ONLY,
    GENERATION_ONLY,
    ParsedRequest,
    Route,
    StreamWriterState,
    completion_body,
    dump_with_members,
    new_response_id,
    parse_request,
    prompt_ids_members,
    usage_body,
)

if TYPE_CHECKING:
    from .kv_transfer import KVPayload

log = logging.getLogger(__name__)

ROLES = ("both", "context", "generation")
KV_PATH = "/kv/{ctx_request_id}"


@dataclass
class WorkerSettings:
    """Everything the app reads, filled once by the CLI (or a test)."""

    role: str = "both"
    model_name: str = "tiny"
    shared_secret: bytes | None = None
    kv_ttl_s: float = 30.0
    kv_fetch_timeout_s: float = 10.0
    # Base URL put in ctx_info_endpoint; default: the Host the request came in on.
    public_url: str | None = None
    retry_after_s: int = 1
    max_body_bytes: int = 64 << 20
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")


class WorkerMetrics:
    def __init__(self, engine: Engine) -> None:
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
        r.gauge("fastcore_worker_decode_tokens_per_second", "Decode tokens per second over the last 5 s",
                callback=lambda: engine.tokens_per_second)  # fmt: skip
        self.prompt_tokens = r.counter("fastcore_worker_prompt_tokens_total", "Prompt tokens admitted")
        self.generated_tokens = r.counter(
            "fastcore_worker_generated_tokens_total", "Completion tokens returned"
        )
        self.handoff = r.counter(
            "fastcore_worker_kv_handoff_total",
            "KV hand-off events: parked/served/expired (context side), fetched/recomputed (generation side)",
            ("event",),
        )
        self.fetch_failures = r.counter("fastcore_worker_kv_fetch_failures_total",
                                        "KV fetches that failed, by reason", ("reason",))  # fmt: skip
        self.rejected = r.counter(
            "fastcore_worker_rejected_total", "Requests refused with 503, by reason", ("reason",)
        )
        self.ttft = r.histogram(
            "fastcore_worker_time_to_first_token_seconds", "Arrival to first token", ("route",)
        )
        self.latency = r.histogram("fastcore_worker_request_seconds", "Arrival to last token", ("route",))


class WorkerState:
    def __init__(self, engine: Engine, settings: WorkerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = WorkerMetrics(engine)
        self.session: aiohttp.ClientSession | None = None
        self.expiry_task: asyncio.Task[None] | None = None


STATE_KEY = web.AppKey("worker_state", WorkerState)


# ---------------------------------------------------------------- middleware


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except HTTPError as exc:
        return exc.response()
    except web.HTTPException as exc:
        # aiohttp's own 404/405/413 would otherwise be HTML: keep every error OpenAI-shaped.
        if exc.status < 400:
            raise
        return error_response(exc.status, exc.reason if exc.status != 413 else "request body too large")
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unhandled error on %s", request.path)
        return error_response(500, "internal error in the worker")


# ---------------------------------------------------------------- simple routes


async def handle_health(request: web.Request) -> web.Response:
    state: WorkerState = request.app[STATE_KEY]
    if not state.engine.alive:
        return error_response(503, "the engine is not running")
    return web.json_response({"status": "ok", "role": state.settings.role})


async def handle_models(request: web.Request) -> web.Response:
    state: WorkerState = request.app[STATE_KEY]
    model = {
        "id": state.settings.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "fastcore",
        "max_model_len": state.engine.max_context,
    }
    return web.json_response({"object": "list", "data": [model]})


async def handle_server_info(request: web.Request) -> web.Response:
    state: WorkerState = request.app[STATE_KEY]
    engine = state.engine
    return web.json_response(
        {
            "role": state.settings.role,
            "model": state.settings.model_name,
            "max_context_length": engine.max_context,
            "vocab_size": engine.vocab_size,
            "kv_endpoint": KV_PATH,
            "kv_capacity_tokens": engine.kv_capacity_tokens,
            "kv_ttl_s": state.settings.kv_ttl_s,
            "device": state.settings.device,
        }
    )


async def handle_metrics(request: web.Request) -> web.Response:
    state: WorkerState = request.app[STATE_KEY]
    return web.Response(body=state.metrics.registry.render(), headers={"Content-Type": CONTENT_TYPE})


# ---------------------------------------------------------------- KV hand-off, context side


def kv_signature(secret: bytes, path: str) -> str:
    """A KV fetch has no body, so the signature covers the path."""
    return sign_body(secret, path.encode())


async def handle_kv(request: web.Request) -> web.StreamResponse:
    state: WorkerState = request.app[STATE_KEY]
    secret = state.settings.shared_secret
    if secret is not None and not verify_body(
        secret, request.path.encode(), request.headers.get(SIGNATURE_HEADER)
    ):
        raise HTTPError(403, "KV fetch without a valid signature")
    try:
        ctx_request_id = int(request.match_info["ctx_request_id"])
    except ValueError:
        raise HTTPError(400, "ctx_request_id must be an integer", param="ctx_request_id") from None
    parked = state.engine.take_parked(ctx_request_id)
    if parked is None:
        raise HTTPError(404, f"no KV held for ctx_request_id {ctx_request_id} (already fetched or expired)")
    from .kv_transfer import encode_kv  # torch: only engines that park KV get here

    loop = asyncio.get_running_loop()
    # The gather (and a device-to-host copy on CUDA) must not run on the event loop.
    k, v = await loop.run_in_executor(None, state.engine.read_parked, parked)
    pieces = encode_kv(
        k,
        v,
        prompt_crc32=parked.prompt_crc32,
        first_token=parked.first_token,
        first_logprob=parked.first_logprob,
    )
    response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
    response.content_length = sum(len(p) for p in pieces)
    # The generation worker may hang up midway (timeout, cancel, crash) and
    # recompute the prefill; this handler is then cancelled or its write fails.
    # The KV is gone either way: count it, without a traceback.
    served = False
    try:
        await response.prepare(request)
        for piece in pieces:
            await response.write(piece)
        await response.write_eof()
        served = True
    except ConnectionResetError:
        pass
    finally:
        state.metrics.handoff.inc(event="served" if served else "abandoned")
    return response


async def expire_parked_loop(state: WorkerState) -> None:
    period = max(0.05, min(1.0, state.settings.kv_ttl_s / 4))
    while True:
        await asyncio.sleep(period)
        expired = state.engine.expire_parked()
        if expired:
            state.metrics.handoff.inc(expired, event="expired")


# ---------------------------------------------------------------- KV hand-off, generation side


async def fetch_kv(state: WorkerState, endpoint: str, prompt_ids: np.ndarray) -> KVPayload:
    """The prompt's KV from a context worker, or a :class:`KVFetchError` saying why not."""
    from .kv_transfer import (  # torch: real engines only
        KVTransferError,
        check_header,
        decode_kv,
        parse_prefix,
    )

    assert state.session is not None
    headers = {}
    if state.settings.shared_secret is not None:
        headers[SIGNATURE_HEADER] = kv_signature(state.settings.shared_secret, URL(endpoint).path)
    layout = state.engine.kv_layout
    num_tokens = int(prompt_ids.size)
    crc = prompt_checksum(prompt_ids)
    timeout = aiohttp.ClientTimeout(total=state.settings.kv_fetch_timeout_s)
    try:
        async with state.session.get(endpoint, headers=headers, timeout=timeout) as resp:
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


class KVFetchError(LookupError):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


# ---------------------------------------------------------------- completions


def make_generation_handler(route: Route) -> Any:
    async def handler(request: web.Request) -> web.StreamResponse:
        state: WorkerState = request.app[STATE_KEY]
        status = 500
        try:
            response = await generate(request, state, route)
            status = response.status
            return response
        except HTTPError as exc:
            status = exc.status
            raise
        except asyncio.CancelledError:
            status = 499  # the client went away (nginx's code for it)
            raise
        finally:
            state.metrics.requests.inc(route=route, status=str(status))

    return handler


def _check_role(state: WorkerState, req: ParsedRequest, raw: bytes, request: web.Request) -> None:
    if req.disagg is None:
        return
    role = state.settings.role
    kind = req.disagg.request_type
    if kind == CONTEXT_ONLY and role == "generation":
        raise HTTPError(400, "this worker's role is generation: it does not take context_only requests",
                        param="disaggregated_params")  # fmt: skip
    if kind == GENERATION_ONLY and role == "context":
        raise HTTPError(400, "this worker's role is context: it does not take generation_only requests",
                        param="disaggregated_params")  # fmt: skip
    secret = state.settings.shared_secret
    if secret is not None and not verify_body(secret, raw, request.headers.get(SIGNATURE_HEADER)):
        raise HTTPError(
            403, f"{kind} request without a valid {SIGNATURE_HEADER}", param="disaggregated_params"
        )


async def generate(request: web.Request, state: WorkerState, route: Route) -> web.StreamResponse:
    arrived = time.monotonic()
    raw = await request.read()
    engine = state.engine
    req = parse_request(
        raw,
        route,
        tokenizer=engine.tokenizer,
        model_name=state.settings.model_name,
        max_context=engine.max_context,
    )
    _check_role(state, req, raw, request)
    if not engine.alive:
        raise HTTPError(503, "the engine is not running", code="engine_down",
                        headers={"Retry-After": str(state.settings.retry_after_s)})  # fmt: skip

    queue: asyncio.Queue[Delta] = asyncio.Queue()
    prompt_tail = req.prompt_ids[-4:].tolist()
    engine_req = EngineRequest(
        request_id=uuid.uuid4().hex,
        prompt_ids=req.prompt_ids,
        params=req.params,
        processor=OutputProcessor(engine.tokenizer, req.params, prompt_tail),
        on_delta=queue.put_nowait,
    )
    if req.is_context_only:
        engine_req.park_as = secrets.randbits(62)
        engine_req.park_ttl_s = state.settings.kv_ttl_s
    elif req.is_generation_only:
        assert req.disagg is not None
        engine_req.forced_tokens = list(req.disagg.first_gen_tokens)

    try:
        engine.reserve(engine_req)
    except KVCacheFull as exc:
        if not exc.ever_fits:
            raise HTTPError(
                400, f"the request is too large for this worker: {exc}", param="max_tokens"
            ) from None
        state.metrics.rejected.inc(reason="kv_full")
        raise HTTPError(
            503,
            f"the worker is full: {exc}",
            code="worker_full",
            headers={"Retry-After": str(state.settings.retry_after_s)},
        ) from None

    queued = False
    try:
        if req.is_generation_only:
            await _attach_context_kv(state, req, engine_req)
        engine.enqueue(engine_req)
        queued = True
        state.metrics.prompt_tokens.inc(int(req.prompt_ids.size))
        if req.stream and not req.is_context_only:
            return await _stream(request, state, req, engine_req, queue, arrived)
        return await _respond(request, state, req, engine_req, queue, arrived)
    finally:
        if not queued:
            engine.unreserve(engine_req)
        elif not engine_req.processor.finished:
            # Client gone or handler failed: free the slot now, not when max_tokens runs out.
            engine.abort(engine_req.request_id)


async def _attach_context_kv(state: WorkerState, req: ParsedRequest, engine_req: EngineRequest) -> None:
    assert req.disagg is not None
    endpoint = req.disagg.ctx_info_endpoint
    first = req.disagg.first_gen_tokens
    if not endpoint or len(first) != 1:
        reason = "no_endpoint" if not endpoint else "several_first_tokens"
        state.metrics.fetch_failures.inc(reason=reason)
        state.metrics.handoff.inc(event="recomputed")
        return
    try:
        payload = await fetch_kv(state, endpoint, req.prompt_ids)
    except KVFetchError as exc:
        log.info("KV fetch from %s failed (%s): %s; recomputing the prefill", endpoint, exc.reason, exc)
        state.metrics.fetch_failures.inc(reason=exc.reason)
        state.metrics.handoff.inc(event="recomputed")
        return
    if payload.first_token != first[0]:
        state.metrics.fetch_failures.inc(reason="mismatch")
        state.metrics.handoff.inc(event="recomputed")
        return
    engine_req.kv_import = (payload.k, payload.v)
    engine_req.forced_logprobs = [payload.first_logprob if req.params.logprobs is not None else None]
    state.metrics.handoff.inc(event="fetched")


async def _next_delta(queue: asyncio.Queue[Delta]) -> Delta:
    delta = await queue.get()
    if delta.error is not None:
        raise HTTPError(500, delta.error, code="engine_error")
    return delta


def _context_fields(
    request: web.Request,
    state: WorkerState,
    req: ParsedRequest,
    engine_req: EngineRequest,
    token_ids: list[int],
    body: dict[str, Any],
) -> list[bytes]:
    """The context response's extras (PROTOCOL.md (2)): ``disaggregated_params`` set in ``body``,
    and the prompt ids returned as JSON members for :func:`dump_with_members`."""
    assert req.disagg is not None and engine_req.park_as is not None
    base = state.settings.public_url or f"{request.scheme}://{request.host}"
    ctx_id = engine_req.park_as
    body["choices"][0]["disaggregated_params"] = {
        "request_type": CONTEXT_ONLY,
        "first_gen_tokens": token_ids,
        "ctx_request_id": ctx_id,
        "disagg_request_id": req.disagg.disagg_request_id,
        "encoded_opaque_state": None,
        "ctx_info_endpoint": base.rstrip("/") + KV_PATH.format(ctx_request_id=ctx_id),
        "draft_tokens": None,
    }
    if body["choices"][0]["finish_reason"] == NOT_FINISHED:
        state.metrics.handoff.inc(event="parked")
    # Straight from the int32 array: no Python list on the way to base64.
    return prompt_ids_members(req.prompt_ids, b64=bool(req.disagg.return_prompt_token_ids_b64))


async def _respond(
    request: web.Request,
    state: WorkerState,
    req: ParsedRequest,
    engine_req: EngineRequest,
    queue: asyncio.Queue[Delta],
    arrived: float,
) -> web.Response:
    deltas: list[Delta] = []
    while True:
        delta = await _next_delta(queue)
        if not deltas:
            state.metrics.ttft.observe(time.monotonic() - arrived, route=req.route)
        deltas.append(delta)
        if delta.finish_reason is not None:
            break
    state.metrics.latency.observe(time.monotonic() - arrived, route=req.route)
    token_ids = [t for d in deltas for t in d.token_ids]
    state.metrics.generated_tokens.inc(len(token_ids))
    logprobs = [lp for d in deltas for lp in d.logprobs] if req.want_logprobs else None
    body = completion_body(
        route=req.route,
        response_id=new_response_id(req.route),
        created=int(time.time()),
        model=req.model,
        text="".join(d.text for d in deltas),
        finish_reason=deltas[-1].finish_reason,
        usage=usage_body(int(req.prompt_ids.size), len(token_ids)),
        logprobs=logprobs,
        tokenizer=state.engine.tokenizer,
    )
    members = _context_fields(request, state, req, engine_req, token_ids, body) if req.is_context_only else []
    return web.Response(body=dump_with_members(body, members), content_type="application/json")


async def _stream(
    request: web.Request,
    state: WorkerState,
    req: ParsedRequest,
    engine_req: EngineRequest,
    queue: asyncio.Queue[Delta],
    arrived: float,
) -> web.StreamResponse:
    # Wait for the first output before committing to a 200, so an engine error is still a JSON error.
    first = await _next_delta(queue)
    state.metrics.ttft.observe(time.monotonic() - arrived, route=req.route)
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
    await response.prepare(request)
    writer = StreamWriterState(req, state.engine.tokenizer)
    num_tokens = 0
    await response.write(writer.start())
    delta = first
    while True:
        if delta.error is not None:
            await response.write(b"data: " + error_body(500, delta.error) + b"\n\n")
            break
        num_tokens += len(delta.token_ids)
        await response.write(writer.delta(delta))
        if delta.finish_reason is not None:
            await response.write(writer.end(usage_body(int(req.prompt_ids.size), num_tokens)))
            break
        delta = await queue.get()
    state.metrics.generated_tokens.inc(num_tokens)
    state.metrics.latency.observe(time.monotonic() - arrived, route=req.route)
    await response.write_eof()
    return response


# ---------------------------------------------------------------- app


def create_app(engine: Engine, settings: WorkerSettings) -> web.Application:
    app = web.Application(client_max_size=settings.max_body_bytes, middlewares=[error_middleware])
    state = WorkerState(engine, settings)
    app[STATE_KEY] = state

    async def on_startup(app: web.Application) -> None:
        engine.start(asyncio.get_running_loop())
        state.session = aiohttp.ClientSession()
        state.expiry_task = asyncio.create_task(expire_parked_loop(state))

    async def on_cleanup(app: web.Application) -> None:
        if state.expiry_task is not None:
            state.expiry_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await state.expiry_task
        if state.session is not None:
            await state.session.close()
        await asyncio.get_running_loop().run_in_executor(None, engine.stop)

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    app.router.add_post("/v1/chat/completions", make_generation_handler("chat"))
    app.router.add_post("/v1/completions", make_generation_handler("completions"))
    app.router.add_get("/v1/models", handle_models)
    app.router.add_get("/health", handle_health)
    app.router.add_get("/server_info", handle_server_info)
    app.router.add_get("/metrics", handle_metrics)
    app.router.add_get(KV_PATH, handle_kv)
    return app


async def start_worker(
    engine: Engine, settings: WorkerSettings, host: str = "127.0.0.1", port: int = 0
) -> tuple[web.AppRunner, int]:
    """Serve on ``host:port`` (0: a free port); returns the runner and the bound port."""
    # handler_cancellation: a client that disconnects cancels its handler, whose
    # finally-block aborts the request in the engine, freeing its slot at once.
    runner = web.AppRunner(create_app(engine, settings), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=4096)  # an orchestrator may open 1000s at once
    await site.start()
    sockets = getattr(site._server, "sockets", None) or []
    if not sockets:
        raise RuntimeError(f"worker site on {host}:{port} has no listening socket")
    return runner, int(sockets[0].getsockname()[1])


__all__ = ["KV_PATH", "ROLES", "Engine", "WorkerSettings", "create_app", "kv_signature", "start_worker"]
