"""A completion in coroutines: the orchestrator's coroutine driver (``CompletionDriver``, which
:class:`.app.Orchestrator` is).

The same steps as the callback driver (exchange.py: one object per request, no task), run where a
completion must wait or leaves the common case: the admission queue, a traced request, conditional
disaggregation (the generation worker chosen before leg (1)), a worker's refusal or failure, a
deadline, the fallback to local prefill (each handed over from callbacks with ``resume``). A request's
state is one :class:`Completion` (an exchange.py ``Exchange`` is one), which each step reads. In order:

- :meth:`CompletionDriver._serve`: a task per request (admission, tracing, the status counted);
- :meth:`~CompletionDriver.prepare` (shared with exchange.py): the client's body read and checked,
  its routing key, token weight and CPU clock;
- :meth:`~CompletionDriver._run_legs`: a concurrent protocol's pair (pair.py), local prefill, or
  leg (1) (:meth:`~CompletionDriver.context_leg`, legs.py's runner) and what follows it:
  :meth:`~CompletionDriver.context_answered` (shared), the answer itself when the context worker
  finished it, else leg (3) (:meth:`~CompletionDriver._generation_leg`), relayed whole or as SSE
  (:meth:`~CompletionDriver.relay_answer`, :meth:`~CompletionDriver.stream_ended`, shared);
- a context leg no worker took falls back to local prefill (:meth:`~CompletionDriver._fall_back`);
  KV a context worker parked for a leg (3) that never came is released (``DELETE /kv/...``).

The Orchestrator (app.py) keeps the lifecycle, the routes and the small endpoints; what a leg sends
is its protocol's (protocols/).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import re
import time
from collections.abc import Awaitable, Coroutine, Sequence
from functools import partial
from typing import Any

import fastcore
from fastcore import protocol as wire
from server.auth import SIGNATURE_HEADER, sign_body
from server.errors import HTTPError, check_not_empty, error_body
from server.http import (
    BodyPiece,
    Request,
    Responder,
    UpstreamError,
    UpstreamPool,
    UpstreamResponse,
    UpstreamTimeout,
)
from server.routes import Route
from server.tracing import current_trace, start_orchestrator_request, traced_wait

from .admission import Admission
from .config import OrchestratorConfig
from .estimates import StreamUsage, UsageLearner
from .legs import (
    LegRunner,
    LegSpent,
    LegUnavailable,
    Sent,
    WorkerAnswer,
    leg_failed,
    leg_timed_out,
)
from .metrics import CPU_SAMPLE_EVERY, NO_CLOCK, Clock, CpuClock, OrchestratorMetrics
from .pools import HealthChecker, Pool, Worker
from .protocols import VllmProtocol, WorkerProtocol
from .relay_modes import ClientRequest, answer_as_sse
from .routing import (
    BYTES_PER_TOKEN,
    RequestKey,
    can_predict_hits,
    conversation_header,
    request_key,
)
from .tenant_salt import salted_body
from .tenants import (
    ANONYMOUS,
    Tenant,
)

log = logging.getLogger("fastcore.orchestrator")

_KV_ENDPOINT_PATH = (("choices", 0, wire.DISAGGREGATED_PARAMS, wire.CTX_INFO_ENDPOINT),)
#: a fastcore context worker's KV endpoint, at the end of ctx_info_endpoint
_KV_PATH = re.compile(re.escape(wire.KV_PATH_PREFIX) + wire.KV_ID_PATTERN + r"\Z")
KV_RELEASE_TIMEOUT_S = 5.0

_SSE = b"text/event-stream"
_SSE_EXTRA = b"Cache-Control: no-cache\r\n"
_SIGNATURE = SIGNATURE_HEADER.encode()

_getrandbits = random.getrandbits
_DISAGG_ID_BITS = wire.DISAGG_REQUEST_ID_END.bit_length() - 1
assert 1 << _DISAGG_ID_BITS == wire.DISAGG_REQUEST_ID_END


class Completion:
    """One completion's state, which both drivers create once per request and every step reads (an
    exchange.py ``Exchange`` is one; the coroutine driver makes one in :meth:`CompletionDriver._run_legs`):
    the route, tenant and client ``out``; what :meth:`CompletionDriver.prepare` made of the body (``req``,
    ``body``, ``key``, ``tokens``, ``clock``); leg (1)'s ``disagg_id``, ``context_body``, the workers
    ``tried`` and when it ``started``; once a context worker answered, its ``context_worker`` and
    ``context_response`` (a failure from there releases the KV it parked) and leg (3)'s
    ``generation_body``, ``auth`` line and ``context_done`` (when the hand-off began)."""

    __slots__ = (
        "auth",
        "body",
        "clock",
        "context_body",
        "context_done",
        "context_response",
        "context_worker",
        "disagg_id",
        "generation_body",
        "key",
        "out",
        "path",
        "req",
        "route",
        "started",
        "tenant",
        "tokens",
        "tried",
    )

    req: ClientRequest
    body: bytes
    key: RequestKey | None
    tokens: int
    clock: Clock
    disagg_id: int
    context_body: Sequence[BodyPiece]
    started: float
    generation_body: Sequence[BodyPiece]
    auth: bytes
    context_done: float

    def __init__(self, out: Responder, route: Route, tenant: Tenant) -> None:
        self.out = out
        self.route = route
        self.tenant = tenant
        self.path = route.path
        self.tried: list[Worker] = []
        self.context_worker: Worker | None = None
        self.context_response = b""


class CompletionDriver:
    """The completion path in coroutines (see the module); the Orchestrator's state it reads is set by
    :class:`.app.Orchestrator`'s ``__init__`` (declared here for the type checker)."""

    config: OrchestratorConfig
    protocol: WorkerProtocol
    relay: Any
    context_pool: Pool
    generation_pool: Pool
    pools: list[Pool]
    legs: LegRunner
    metrics: OrchestratorMetrics
    usage: UsageLearner
    admission: Admission | None
    keys: Any
    tracing: Any
    client_trace: bool
    health: HealthChecker | None
    pairs: Any
    secret: bytes | None
    fallback: bool
    needs_key: bool
    needs_conversation: bool
    count_tokens: bool
    tenant_salts: bool
    max_local_prefill: int | None
    require_prefix_hit: bool
    in_flight: int
    _requests: int
    _background: set[asyncio.Task[None]]
    _serving: set[Any]

    def _upstream(self, worker: Worker) -> UpstreamPool:
        raise NotImplementedError  # the Orchestrator's (its upstream connections)

    def _can_fall_back(self) -> bool:
        raise NotImplementedError  # the Orchestrator's (its /health says it too)

    def serving_started(self, serving: Any) -> None:
        """A completion begins (a task of :meth:`_serve`, or an exchange.py ``Exchange``): counted in
        flight, and cancelled by a drain that runs out of time."""
        self.in_flight += 1
        self._serving.add(serving)

    def serving_ended(self, serving: Any, route: Route, status: int) -> None:
        """A completion is over: its route's ``status`` counted (each driver calls this once)."""
        self.in_flight -= 1
        self._serving.discard(serving)
        self.metrics.count_request(route.name, status)

    async def _serve(
        self, request: Request, out: Responder, route: Route, tenant: Tenant = ANONYMOUS
    ) -> None:
        status = 500
        task = asyncio.current_task()
        assert task is not None
        self.serving_started(task)
        trace = None
        if self.tracing is not None:
            tenant_name = tenant.name if self.keys is not None else None
            trace = start_orchestrator_request(
                self.tracing, request, route.text, tenant_name, self.client_trace
            )
        try:
            header = conversation_header(request) if self.needs_conversation else None
            if self.admission is None:
                status = await self.settle(out, self._run_legs(request.body, out, route, header, tenant))
            else:  # a slot in the workers, maybe after a wait in the queue (or a 429)
                slot = self.admission.slot(tenant, request.body)
                async with traced_wait(trace, "fastcore.admission", slot):
                    status = await self.settle(out, self._run_legs(request.body, out, route, header, tenant))
        except HTTPError as exc:  # the admission's 429
            status = self.answer_error(out, exc)
        except asyncio.CancelledError:
            status = 499  # the client went away; both legs are closed with this task
            raise
        finally:
            self.serving_ended(task, route, status)
            if trace is not None:
                trace.end(status)

    async def settle(self, out: Responder, work: Awaitable[int]) -> int:
        """Await a completion's legs; the status the client got, an error answered here included."""
        try:
            return await work
        except (HTTPError, WorkerAnswer) as exc:
            return self.answer_error(out, exc)

    def answer_error(self, out: Responder, exc: HTTPError | WorkerAnswer) -> int:
        """Answer an error a leg raised (ours, or a worker's own relayed as it is); its status."""
        # An answer, not a failure: its traceback would keep the legs' frames (and the bodies
        # they hold) alive in a reference cycle until the next full garbage collection.
        exc.__traceback__ = None
        if isinstance(exc, WorkerAnswer):
            out.send(exc.status, exc.body, exc.content_type, exc.headers)
        else:
            out.send_error(
                exc.status, exc.message, param=exc.param, code=exc.code, headers=exc.header_lines()
            )
        return exc.status

    def _clock(self) -> Clock:
        self._requests += 1
        if self._requests % CPU_SAMPLE_EVERY:
            return NO_CLOCK
        return CpuClock(self.metrics.cpu_phase)

    def prepare(
        self, body: bytes, route: Route, conversation: bytes | None, tenant: Tenant = ANONYMOUS
    ) -> tuple[ClientRequest, RequestKey | None, int, Clock]:
        """A completion's first steps, before any leg: the client's body read and checked (or its 400), a
        worker pool not ready (503), its routing key and token weight, the clock of its CPU phases. The
        body both legs carry is the request's ``body`` (a top-level ``conversation_id`` moved; with
        ``tenant_salts``, its ``cache_salt`` the tenant's, which the routing key reads too)."""
        clock = self._clock()
        check_not_empty(body)
        chat = route.chat
        req = self.relay.read_client(body, chat)
        if self.tenant_salts:
            # trtllm-serve's completions take no cache_salt: added there only where every worker does
            add = chat or (self.context_pool.salts_completions and self.generation_pool.salts_completions)
            salted = salted_body(req.body, tenant.name, add)
            if salted is not req.body:
                req = self.relay.read_client(salted, chat)  # the spans both legs splice, of this body
        body = req.body
        clock.lap("validate")
        if self.tracing is not None and (trace := current_trace()) is not None:
            trace.set("gen_ai.request.model", req.model or "")
        if not (self.generation_pool.ready and (self.context_pool.ready or self.fallback)):
            raise self._unavailable(
                "no healthy worker: " + ", ".join(p.name for p in self.pools if not p.ready)
            )
        key = request_key(body, chat, conversation) if self.needs_key else None
        # load_balancing with use_tokens: a request weighs its prompt's estimated tokens
        tokens = self.generation_pool.router.estimate.tokens(len(body)) if self.count_tokens else 0
        return req, key, tokens, clock

    def prepared(self, c: Completion, body: bytes, conversation: bytes | None) -> None:
        """:meth:`prepare` for a completion: its ``req``, ``body`` (the one both legs carry), ``key``,
        ``tokens`` and ``clock`` set."""
        req, c.key, c.tokens, c.clock = self.prepare(body, c.route, conversation, c.tenant)
        c.req, c.body = req, req.body

    def context_begins(self, c: Completion) -> None:
        """Leg (1)'s body, for a new disaggregated id (the completion's first, or a retried hand-off's)."""
        disagg_id = c.disagg_id = self.disagg_id()
        c.context_body = self.relay.context_pieces(c.req, disagg_id, self.context_pool.b64_completions)

    async def _run_legs(
        self,
        body: bytes,
        out: Responder,
        route: Route,
        conversation: bytes | None = None,
        tenant: Tenant = ANONYMOUS,
    ) -> int:
        """Serve one completion; the status the client got (a stream cut by its worker counts as 502).

        ``conversation``: the ``X-Conversation-Id`` header (read only for a conversation router)."""
        c = Completion(out, route, tenant)
        self.prepared(c, body, conversation)
        if self.pairs is not None:
            return await self.pairs.run(c)
        generation_worker: Worker | None = None
        if self.max_local_prefill is not None:
            # Conditional disaggregation: the generation worker first, by its prefix index; a short
            # enough uncached remainder on it (and a worker that says local_prefill) skips leg (1).
            generation_worker = self.generation_pool.choose(key=c.key)
            if generation_worker is not None and self._prefill_locally(generation_worker, c.key):
                c.clock.lap("build_context")
                self.metrics.path_local.inc()
                return await self._generation_leg(c, c.body, first=generation_worker, local=True)
        self.context_begins(c)
        c.clock.lap("build_context")
        c.started = time.perf_counter()
        return await self.context_leg(c, generation_worker)

    @staticmethod
    def disagg_id() -> int:
        """A request's disaggregated id. Random, not a counter: unique across orchestrator processes and
        hosts without shared state; from [2^40, 2^63), as trtllm-serve keeps the ids below 2^40 for the
        ones it makes itself."""
        while True:  # a draw below the floor: one in 2^23
            drawn = _getrandbits(_DISAGG_ID_BITS)
            if drawn >= wire.DISAGG_REQUEST_ID_MIN:
                return drawn

    async def context_leg(
        self,
        c: Completion,
        generation_worker: Worker | None,
        *,
        resume: Sent | None = None,
        spent: Worker | None = None,
    ) -> int:
        """Leg (1) and what follows it: the answer of the last worker tried (``c.tried``, legs.py;
        ``resume``: its first attempt, sent from callbacks); a lost answer's parked KV is released by
        ``c.disagg_id``. Completions ask for prompt_token_ids_b64 only when every context worker says it
        answers them so (/server_info): trtllm-serve answers them with the list only, and its completion
        models refuse the field. ``spent``: the generation worker of the attempt this one retries (not
        chosen)."""
        unavailable: LegUnavailable | None = None
        req = c.req
        try:
            context_response = await self.legs.run(
                "context",
                self.context_pool,
                c.path,
                c.context_body,
                _body,
                headers=self.relay.leg_headers,
                extra=self.protocol.context_headers(req),
                timeout=self.context_timeout(len(c.body)),
                key=c.key,
                tokens=c.tokens,
                tried=c.tried,
                disagg_id=c.disagg_id,
                resume=resume,
                panic=not self._can_fall_back(),
            )
        except LegUnavailable as exc:
            unavailable = exc  # served outside this handler: the client's error carries no context
        if unavailable is not None:
            return await self._fall_back(unavailable, c)
        if not self.context_answered(c, context_response):
            return 200
        # from here a failure releases the KV the context worker (the one that answered) parked
        c.context_worker, c.context_response = c.tried[-1], context_response
        return await self.generation_after_context(c, generation_worker, spent=spent)

    def context_answered(self, c: Completion, context_response: bytes) -> bool:
        """A context worker answered 200 (leg (1) began at ``c.started``): False when that was the answer
        (sent here), else True with leg (3)'s body, its trtllm-serve auth line and when the hand-off
        began set on ``c``."""
        context_done = time.perf_counter()
        metrics = self.metrics
        metrics.context_leg.observe(context_done - c.started)
        metrics.path_disaggregated.inc()
        clock = c.clock
        clock.start()
        relay = self.relay
        req = c.req
        key = c.key
        ctx = relay.read_context(req, context_response)
        # learned from the prompt's span, not the whole body, which a client may pad
        self.usage.context_answer(
            context_response,
            key.prompt_bytes if key else relay.prompt_bytes(req),
            key.hit_chunks if key else None,
            relay.usage_tokens(ctx),
        )
        clock.lap("read_context")
        if ctx.finished:
            answer = relay.finished_answer(req, ctx)
            if req.stream:
                answer = answer_as_sse(answer, chat=req.chat, include_usage=req.include_usage)
            clock.lap("relay")
            clock.finish()
            metrics.finished_by_context.inc()
            if req.stream:
                c.out.send(200, answer, _SSE, _SSE_EXTRA)
            else:
                c.out.send(200, answer)
            return False
        c.generation_body = relay.generation_pieces(req, ctx)
        clock.lap("build_generation")
        c.auth = self.protocol.generation_headers(req, ctx)
        c.context_done = context_done
        return True

    async def generation_after_context(
        self, c: Completion, first: Worker | None, resume: Sent | None = None, spent: Worker | None = None
    ) -> int:
        """Leg (3) after a context worker's answer (``c.context_worker``); a spent hand-off retried once
        from a new leg (1)."""
        context_worker = c.context_worker
        assert context_worker is not None
        tried: list[Worker] = [] if spent is None else [spent]  # the generation workers the leg tried
        try:
            return await self._generation_leg(
                c,
                c.generation_body,
                first=first,
                extra_headers=c.auth,
                context_done=c.context_done,
                resume=resume,
                tried=tried,
            )
        except LegSpent as exc:
            # A decode that may have read the hand-off (vLLM's lease, read once) failed: once, the
            # completion goes on from a new context leg, to another generation worker.
            self.release_kv_soon(context_worker, c.context_response)
            if spent is not None:
                raise exc.error from None
            self.metrics.retries_leg["generation"].inc()
            c.context_worker, c.context_response, c.tried = None, b"", []
            self.context_begins(c)
            c.started = time.perf_counter()
            return await self.context_leg(c, None, spent=exc.worker)
        except HTTPError as exc:
            # The leg failed: the context worker may still hold the prompt's KV for a fetch that will
            # never come (a fastcore /kv endpoint; vLLM's blocks, freed by one more decode request).
            self.release_kv_soon(context_worker, c.context_response)
            if exc.status != 504:  # a decode timed out may have pulled: its reset frees what it holds
                self.release_by_decode_soon(c, [*tried, *([resume.worker] if resume else [])])
            raise
        except BaseException:
            # The client left: the context worker may still hold the prompt's KV for a fetch that will
            # never come (vLLM's decode, cut, tells its prefill itself).
            self.release_kv_soon(context_worker, c.context_response)
            raise

    def context_timeout(self, body_bytes: int) -> float:
        """Leg (1)'s deadline: ``context_timeout_s`` plus its allowance per 1,000 estimated prompt tokens
        (body bytes / BYTES_PER_TOKEN), never above ``request_timeout_s``."""
        config = self.config
        allowance = config.context_timeout_per_1k_tokens_s * body_bytes / (BYTES_PER_TOKEN * 1000)
        return min(config.request_timeout_s, config.context_timeout_s + allowance)

    def _first_byte_timeout(self, body: bytes | Sequence[BodyPiece]) -> float:
        """A stream's generation leg: ``generation_first_byte_timeout_s`` plus the per-1k-tokens
        allowance on the leg's body (its prompt may be prefilled there), never above
        ``request_timeout_s``."""
        config = self.config
        if isinstance(body, bytes):
            size = len(body)
        else:
            size = 0
            for piece in body:
                size += len(piece)
        allowance = config.context_timeout_per_1k_tokens_s * size / (BYTES_PER_TOKEN * 1000)
        return min(config.request_timeout_s, config.generation_first_byte_timeout_s + allowance)

    def generation_bounds(
        self, stream: bool, body: bytes | Sequence[BodyPiece]
    ) -> tuple[float | None, float | None, int, float | None]:
        """Leg (3)'s upstream bounds: ``timeout``, ``read_timeout``, ``max_body``, ``first_byte``. A stream
        may run long; what must not happen is a silence that long, and its first byte has its own
        deadline (a frozen worker costs it that, then another worker is tried: nothing has reached the
        client yet). Unary: the whole answer within ``request_timeout_s``, read before anyone wakes."""
        limit = self.config.request_timeout_s
        if stream:
            return None, limit, 0, self._first_byte_timeout(body)
        return limit, None, self.config.max_worker_body_bytes, None

    async def _fall_back(self, exc: LegUnavailable, c: Completion) -> int:
        """No context worker took the request: with ``context_fallback: local_prefill`` and a healthy
        generation worker that says ``local_prefill``, it serves the client's body whole (conditional
        disaggregation's local path: the same answers, streams and usage); else the leg's error."""
        if not self._can_fall_back():
            raise exc.error
        log.debug("context leg unavailable (%s): prefilling on a generation worker", exc.reason)
        self.metrics.fallbacks[exc.reason].inc()
        self.metrics.path_fallback.inc()
        c.clock.start()
        return await self._generation_leg(c, c.body, local=True)

    def _prefill_locally(self, worker: Worker, key: RequestKey | None) -> bool:
        """Whether ``worker`` (chosen by the generation pool's kv_cache_aware router, which set
        ``key.hit_chunks``) should serve the request alone: it says ``local_prefill`` and the
        request's expected uncached remainder there (prompt bytes minus the expected hit, at the
        pool's learned bytes per token) is at most ``max_local_prefill_length`` tokens."""
        if not worker.local_prefill or key is None or self.max_local_prefill is None:
            return False
        if (
            key.hit_chunks == 0 and self.require_prefix_hit
        ):  # trtllm-serve's rule: a cold prompt disaggregates
            return False
        router = self.generation_pool.router
        assert can_predict_hits(router)
        remainder = router.estimate.tokens(key.prompt_bytes - key.hit_chunks * router.chunk_bytes)
        return remainder <= self.max_local_prefill

    def release_kv_soon(self, worker: Worker, context_response: bytes) -> None:
        """``DELETE`` the context leg's parked KV on ``worker``, in the background (best effort).

        Only a fastcore endpoint (``.../kv/<id>``) is released, and only on the
        worker that answered (never a host the response names). A 404 (the
        generation worker fetched it first) is the common answer and fine. A protocol without
        releases (vLLM's: its blocks' lease ends) sends none.
        """
        if not self.protocol.releases_kv:
            return
        try:
            (span,) = fastcore.find_spans(context_response, _KV_ENDPOINT_PATH, validate=False)
            endpoint = json.loads(context_response[span[0] : span[1]]) if span is not None else None
        except (fastcore.JSONSpanError, ValueError):
            return
        match = _KV_PATH.search(endpoint) if isinstance(endpoint, str) else None
        if match is None:
            return
        self._in_background(self._release_kv(worker, match.group(0).encode()))

    def release_by_decode_soon(self, c: Completion, failed: Sequence[Worker]) -> None:
        """vLLM's NIXL (``releases_by_decode``): a decode leg that failed without reading the prefill's
        blocks (a 5xx, a refused connection) leaves them held until the prefill's lease ends (vLLM has
        no release endpoint); one more decode request carrying the prefill answer's
        ``kv_transfer_params`` frees them (:meth:`VllmProtocol.release`), sent in the background to a
        decode worker other than the ones that failed where there is one (the one that failed may fail
        this too)."""
        protocol = self.protocol
        if not (isinstance(protocol, VllmProtocol) and protocol.releases_by_decode) or not c.context_response:
            return
        workers = self.generation_pool.workers
        others = [w for w in workers if w not in failed]
        decodes = [w for w in others if w.healthy] or others or workers
        if not decodes:
            return
        ctx = self.relay.read_context(c.req, c.context_response)
        decode = self._upstream(random.choice(decodes))
        self._in_background(self._release_by_decode(protocol, decode, c, ctx))

    @staticmethod
    async def _release_by_decode(
        protocol: VllmProtocol, decode: UpstreamPool, c: Completion, ctx: Any
    ) -> None:
        await protocol.release(decode, c.path, c.req, ctx)

    def release_lost_kv_soon(self, worker: Worker, disagg_id: int) -> None:
        """``DELETE /kv/by-request/<disagg_id>`` on the context worker whose answer was lost (best
        effort: a fastcore worker frees what it parked for the leg; 404 when it parked nothing)."""
        if not self.protocol.releases_kv:
            return
        self._in_background(
            self._release_kv(worker, b"%s%d" % (wire.KV_BY_REQUEST_PREFIX.encode(), disagg_id))
        )

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release_kv(self, worker: Worker, path: bytes) -> None:
        headers = b""
        if self.secret is not None:
            signature = sign_body(self.secret, b"DELETE " + path, destination=worker.instance)
            headers = b"%s: %s\r\n" % (_SIGNATURE, signature.encode())
        try:
            resp = await self._upstream(worker).request(
                b"DELETE", path, headers=headers, timeout=KV_RELEASE_TIMEOUT_S, max_body=1 << 16
            )
            resp.release()
            self.metrics.kv_released.labels(status=str(resp.status)).inc()
        except (UpstreamError, UpstreamTimeout) as exc:
            log.info("releasing %s on context worker %s failed: %s", path.decode(), worker.url, exc)

    def _unavailable(self, message: str) -> HTTPError:
        return HTTPError(
            503, message, code="no_healthy_worker", headers={"Retry-After": str(self.config.retry_after_s)}
        )

    def _mark_failed(self, pool: Pool, worker: Worker) -> None:
        assert self.health is not None
        self.health.mark_unhealthy(pool, worker)

    async def _generation_leg(
        self,
        c: Completion,
        body: bytes | Sequence[BodyPiece],
        *,
        first: Worker | None = None,
        local: bool = False,
        extra_headers: bytes = b"",
        context_done: float | None = None,
        resume: Sent | None = None,
        tried: list[Worker] | None = None,
    ) -> int:
        """Leg (3), relayed to ``c.out``; or with ``local`` the client's own body as a plain JSON request
        (no relay-mode flags; conditional disaggregation: retried only on other workers that say
        ``local_prefill``). ``first``: the worker already chosen for it (conditional disaggregation
        chose it before leg (1)); ``tried``: workers not to choose. Retries stop at the first byte sent
        to the client: nothing is sent until a worker answers 200. A leg its worker may have read, on a
        protocol that does not send it again (``resends_generation``), is :class:`LegSpent`."""
        pool = self.generation_pool
        req = c.req
        timeout, read_timeout, max_body, first_byte = self.generation_bounds(req.stream, body)
        answered = partial(self._relay_local if local else self.relay_answer, c)
        try:
            return await self.legs.run(
                "generation", pool, c.path, body, answered,
                headers=b"" if local else self.relay.leg_headers, extra=extra_headers,
                timeout=timeout, read_timeout=read_timeout, max_body=max_body, first_byte=first_byte,
                key=c.key, tokens=c.tokens, first=first,
                tried=[w for w in pool.workers if not w.local_prefill] if local else tried,
                handoff_from=None if local else context_done, ttfb=self.metrics.generation_ttfb, resume=resume,
                resend=local or self.protocol.resends_generation,
            )  # fmt: skip
        except LegSpent:
            raise  # the caller goes on from a new context leg (generation_after_context)
        except LegUnavailable as exc:
            error = exc.error
        raise error  # outside the handler: the client's error carries no context

    def relay_answer(self, c: Completion, worker: Worker, resp: UpstreamResponse) -> Coroutine[Any, Any, int]:
        """A generation worker's 200, relayed to the client: SSE as it arrives, or the whole answer
        (the relay's coroutine itself: no frame of its own between the leg and the relay)."""
        if resp.media_type == _SSE:
            return self._relay_stream(c, worker, resp)
        return self._relay_unary(c, worker, resp)

    def _relay_local(self, c: Completion, worker: Worker, resp: UpstreamResponse) -> Coroutine[Any, Any, int]:
        """Local prefill's answer, relayed as :meth:`relay_answer` does and its ``usage`` learned from: no
        context answer taught anything for this request, and a figure learned only from context
        answers would keep a wrong guess that sends every prompt here (the body's usage; a stream's
        last chunk's, which it has when the client asked for it)."""
        if resp.media_type == _SSE:
            req = c.req
            usage = StreamUsage(self.relay.prompt_bytes(req)) if req.include_usage else None
            return self._relay_stream(c, worker, resp, usage)
        return self._relay_unary(c, worker, resp, learn=True)

    async def _relay_unary(
        self, c: Completion, worker: Worker, resp: UpstreamResponse, learn: bool = False
    ) -> int:
        try:
            body = await resp.read()
        except UpstreamError as exc:
            log.warning("generation worker %s failed mid-response: %s", worker.url, exc)
            raise leg_failed("generation", "its worker failed mid-response") from None
        except UpstreamTimeout:
            raise leg_timed_out("generation", self.config.request_timeout_s) from None
        clock = c.clock
        req = c.req
        clock.start()
        answer = self.relay.client_answer(req, body)
        clock.lap("relay")
        clock.finish()
        c.out.send(200, answer)
        if learn:
            self.usage.answer(body, self.relay.prompt_bytes(req))
        return 200

    async def _relay_stream(
        self, c: Completion, worker: Worker, resp: UpstreamResponse, usage: StreamUsage | None = None
    ) -> int:
        out = c.out
        self.start_stream(out, resp)
        failure: BaseException | None = None
        trace = current_trace()
        sink = out.write if trace is None else trace.watch_stream(out.write)
        if usage is not None:
            usage.write, sink = sink, usage
        try:
            await resp.stream(sink)
        except (UpstreamError, UpstreamTimeout) as exc:
            failure = exc
        except BaseException:
            out.flow = None
            raise
        status = self.stream_ended(c, worker, resp, failure, trace)
        out.flush()
        if usage is not None and status == 200:
            self.usage.learn(usage.prompt_bytes, usage.prompt_tokens())
        return status

    @staticmethod
    def start_stream(out: Responder, resp: UpstreamResponse) -> None:
        """A generation worker's 200 SSE: the client's stream starts; its socket's backpressure pauses
        the worker's (while the client's buffer is full, the worker's socket is not read). Its writes
        are held (Responder.hold): what each read of the worker's socket brings (the first: the head
        too; the last: the end too) goes out in one write. The worker's connection flushes them after
        each read (``resp.writer``); the caller flushes what is left at the end."""
        out.hold()
        resp.writer = out
        out.start(200, _SSE, _SSE_EXTRA)
        out.flow = resp
        if out.paused:
            resp.pause_reading()

    def stream_ended(
        self,
        c: Completion,
        worker: Worker,
        resp: UpstreamResponse,
        failure: BaseException | None,
        trace: Any = None,
    ) -> int:
        """A relayed stream is over: ended, or, when its worker failed (``failure``) or sent nothing,
        the error in-band (headers are gone), as OpenAI streams do. The status: 200 or 502."""
        out = c.out
        out.flow = None
        upstream_error: str | None = None
        detail = ""
        if isinstance(failure, UpstreamTimeout):
            upstream_error = f"its worker went silent for {self.config.request_timeout_s:g} s"
        elif failure is not None:
            upstream_error, detail = "its worker failed mid-stream", str(failure)
        elif resp.size == 0:
            upstream_error = "its worker sent an empty stream"
        status = 200
        if upstream_error is not None:
            log.warning("generation worker %s: %s %s", worker.url, upstream_error, detail)
            if trace is not None:
                trace.leg_failed(upstream_error)
            self._mark_failed(self.generation_pool, worker)
            self.legs.breaker_failed(self.generation_pool, worker)
            status = 502
            error = leg_failed("generation", upstream_error)
            out.write(b"data: " + error_body(502, error.message, code=error.code) + b"\n\n")
        c.clock.finish()
        out.end()
        return status


def _body(worker: Worker, resp: UpstreamResponse) -> Coroutine[Any, Any, bytes]:
    """A context worker's 200: its whole answer (in already: the leg waited for it)."""
    return resp.read()
