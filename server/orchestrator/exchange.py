"""One completion served from callbacks: no task, no coroutine, no future, one object per request.

The orchestrator's request path in the shape of the callback-only floor (``bench/rawfloor.py``):
the client parser's complete-message event reads and checks the body and starts leg (1) on a
context worker's keep-alive connection (:meth:`server.http.client.UpstreamPool.start`); that
connection's complete-message event reads the context answer and starts leg (3) on a generation
worker; that one's events relay the answer to the client, whole or as SSE pieces as the socket
delivers them. Each step is the same code the coroutine path runs (completion.py's
``CompletionDriver``: ``prepare``, ``context_answered``, ``stream_ended``, ``serving_started``/``ended``;
``LegRunner.hold``/``lines``/``served``/``let_go``): only the waiting differs. A concurrent protocol's
pair (both legs at once) is pair.py's ``PairExchange``, a subclass.

What is not the common case goes on in coroutines, from where it is: a worker's non-200 answer, a
connection that fails, a deadline, no worker to choose. The attempt already sent is handed to
``LegRunner.run`` (``resume``), which classifies it as if it had sent it (the retries, breakers,
fallback to local prefill, KV releases and error answers are its), in a task that this exchange
holds. Requests that wait in the admission queue, are traced, or may be prefilled on their
generation worker (conditional disaggregation) take the coroutine path from the start
(``Orchestrator.callbacks``).

The client leaving (or a drain running out) cancels the exchange: the leg in flight is reset, its
worker's counts go back, and KV a context worker may have parked for it is released, as a
cancelled task's legs do.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine, Sequence
from typing import TYPE_CHECKING, Any

from server.errors import HTTPError
from server.http import BodyPiece, Handling, Request, Responder, UpstreamResponse, handler_failed
from server.routes import Route

from .completion import Completion
from .legs import Sent, WorkerAnswer
from .routing import conversation_header
from .tenants import ANONYMOUS, Tenant

if TYPE_CHECKING:
    from .completion import CompletionDriver
    from .pools import Worker

_POST = b"POST"
_SSE = b"text/event-stream"
#: the legs (docs/protocol.md numbers them: (1) context, (3) generation)
CONTEXT, GENERATION = 1, 3


class Exchange(Completion, Handling):
    """One completion from the client's request to the end of its answer (see the module): the
    completion's state (completion.py's :class:`.Completion`) and the leg in flight from callbacks."""

    __slots__ = (
        "ended",
        "handed_over",
        "leg",
        "orch",
        "request",
        "resp",
        "returned",
        "streaming",
        "task",
        "work",
        "worker",
    )

    def __init__(
        self,
        orch: CompletionDriver,
        request: Request,
        out: Responder,
        route: Route,
        tenant: Tenant = ANONYMOUS,
    ) -> None:
        #: the Orchestrator, as the completion driver it is (completion.py: the steps both drivers run)
        Completion.__init__(self, out, route, tenant)
        self.orch = orch
        self.request = request
        #: the leg in flight from callbacks (CONTEXT, GENERATION; 0: none), its response and worker
        self.leg = 0
        self.resp: UpstreamResponse | None = None
        self.worker: Worker | None = None
        self.handed_over = 0.0
        self.streaming = False
        #: the coroutines it went on in (None while it runs from callbacks), and their work until the
        #: task first runs (a task cancelled before that never runs a line of it)
        self.task: asyncio.Task[None] | None = None
        self.work: Coroutine[Any, Any, int] | None = None
        #: finished (counted, the connection told); returned by start() (before that, done() waits)
        self.ended = False
        self.returned = False

    # -- the request's steps ---------------------------------------------------------------

    def start(self) -> Exchange | None:
        """Begin (the HTTP server's handler returns this): itself, or None when answered already."""
        orch = self.orch
        orch.serving_started(self)
        try:
            self._begin()
        except BaseException as exc:
            self._failed(exc)
        self.returned = True
        return None if self.ended else self

    def _prepare(self) -> None:
        """The body read and checked (or its 400), its routing key, token weight and clock."""
        orch = self.orch
        request = self.request
        conversation = conversation_header(request) if orch.needs_conversation else None
        orch.prepared(self, request.body, conversation)

    def _begin(self) -> None:
        self._prepare()
        orch = self.orch
        orch.context_begins(self)
        self.clock.lap("build_context")
        self.started = time.perf_counter()
        worker = orch.context_pool.choose(exclude=self.tried, key=self.key)
        if worker is None:  # the leg runner says why (or falls back to local prefill)
            self._go_on(self._context_leg(None))
            return
        self.tried.append(worker)
        self._send(
            CONTEXT,
            worker,
            self.context_body,
            orch.relay.leg_headers,
            orch.protocol.context_headers(self.req),
            False,
            None,
            timeout=orch.context_timeout(len(self.body)),
            read_timeout=None,
            max_body=orch.config.max_worker_body_bytes,
            first_byte=None,
        )

    def _send(
        self,
        leg: int,
        worker: Worker,
        pieces: Sequence[BodyPiece],
        headers: bytes,
        extra: bytes,
        timed: bool,
        handoff_from: float | None,
        *,
        timeout: float | None,
        read_timeout: float | None,
        max_body: int,
        first_byte: float | None,
    ) -> None:
        """A leg's first attempt, from here: held as LegRunner.run holds one, its events to this."""
        orch = self.orch
        legs = orch.legs
        if isinstance(pieces, bytes):  # a relay mode that builds the leg whole (relay_parsed.py)
            pieces = (pieces,)
        self.handed_over = legs.hold(worker, self.tokens, timed, handoff_from)
        try:
            self.resp = orch.legs.upstream(worker).start(
                self, _POST, self.path, pieces, headers=legs.lines(headers, pieces, worker, extra), timeout=timeout,
                read_timeout=read_timeout, max_body=max_body, headers_timeout=first_byte,
            )  # fmt: skip
        except BaseException:
            legs.let_go(worker, self.tokens)
            raise
        self.leg, self.worker = leg, worker

    def _context_answered(self, resp: UpstreamResponse) -> None:
        """Leg (1)'s worker answered 200: read it, and answer, or start leg (3)."""
        orch = self.orch
        worker = self.worker
        assert worker is not None
        context_response = resp.body()
        orch.legs.served(worker, None, 0.0)
        self._leg_over(resp)
        if not orch.context_answered(self, context_response):
            self.finish(200)
            return
        # from here a failure releases the KV the context worker parked for leg (3)
        self.context_worker, self.context_response = worker, context_response
        gen = orch.generation_pool.choose(key=self.key)
        if gen is None:
            self._go_on(self._generation_leg(None))
            return
        timeout, read_timeout, max_body, first_byte = orch.generation_bounds(
            self.req.stream, self.generation_body
        )
        self._send(
            GENERATION,
            gen,
            self.generation_body,
            orch.relay.leg_headers,
            self.auth,
            True,
            self.context_done,
            timeout=timeout,
            read_timeout=read_timeout,
            max_body=max_body,
            first_byte=first_byte,
        )

    def _answered(self, resp: UpstreamResponse) -> None:
        """Leg (3)'s worker answered 200 with the whole (not streamed) answer: relay it, done."""
        orch = self.orch
        worker = self.worker
        assert worker is not None
        orch.legs.served(worker, orch.metrics.generation_ttfb, self.handed_over)
        clock = self.clock
        clock.start()
        try:
            answer = orch.relay.client_answer(self.req, resp.body())
        finally:
            self._leg_over(resp)
        clock.lap("relay")
        clock.finish()
        self.out.send(200, answer)
        self._decoded(200)

    # -- the upstream response's events (server.http.client.Listener) ---------------------

    def response_head(self, resp: UpstreamResponse) -> None:
        """A streamed leg (3)'s head: a 200 SSE is relayed as it comes; anything else goes on in coroutines."""
        if resp is not self.resp:
            return
        try:
            if resp.status != 200 or resp.media_type != _SSE:
                self._hand_over(resp, None)
                return
            worker = self.worker
            assert worker is not None
            orch = self.orch
            orch.legs.served(worker, orch.metrics.generation_ttfb, self.handed_over)
            self.streaming = True
            # its writes held: the worker's connection flushes them after each read, done() at the end
            orch.start_stream(self.out, resp)
            resp.sink = self.out.write
        except BaseException as exc:
            self._failed(exc)

    def response_done(self, resp: UpstreamResponse) -> None:
        if resp is not self.resp:
            return
        try:
            if self.streaming:
                self._stream_over(resp, None)
            elif resp.status != 200:
                self._hand_over(resp, None)
            elif self.leg == CONTEXT:
                self._context_answered(resp)
            else:
                self._answered(resp)
        except BaseException as exc:
            self._failed(exc)

    def response_error(self, resp: UpstreamResponse, exc: BaseException) -> None:
        if resp is not self.resp:
            return
        try:
            if self.streaming:
                self._stream_over(resp, exc)
            else:
                self._hand_over(resp, exc)
        except BaseException as error:
            self._failed(error)

    def _stream_over(self, resp: UpstreamResponse, failure: BaseException | None) -> None:
        worker = self.worker
        assert worker is not None
        self.streaming = False
        try:
            status = self.orch.stream_ended(self, worker, resp, failure)
        finally:
            self._leg_over(resp)
        self._decoded(status)

    def _decoded(self, status: int) -> None:
        """Leg (3) is over, the client answered (``status``): the completion is (pair.py's waits for its
        prefill's answer)."""
        self.finish(status)

    def _leg_over(self, resp: UpstreamResponse) -> None:
        """The leg from callbacks is over: its connection back (or reset), its worker's counts down."""
        self.resp = None
        self.leg = 0
        resp.release()
        worker = self.worker
        if worker is not None:
            self.worker = None
            self.orch.legs.let_go(worker, self.tokens)

    # -- going on in coroutines ------------------------------------------------------------

    def _hand_over(self, resp: UpstreamResponse, error: BaseException | None) -> None:
        """Not the common case: the leg runner classifies this attempt and goes on from it (the
        attempt stays this exchange's until the task runs: see :meth:`_run`)."""
        worker = self.worker
        assert worker is not None
        resp.listener = None  # its futures wake the coroutines from here
        sent = Sent(worker, self.handed_over, resp, error)
        self._go_on(self._context_leg(sent) if self.leg == CONTEXT else self._generation_leg(sent))

    def _context_leg(self, sent: Sent | None) -> Coroutine[Any, Any, int]:
        return self.orch.context_leg(self, None, resume=sent)

    def _generation_leg(self, sent: Sent | None) -> Coroutine[Any, Any, int]:
        return self.orch.generation_after_context(self, None, resume=sent)

    def _go_on(self, work: Coroutine[Any, Any, int]) -> None:
        self.work = work
        self.task = asyncio.get_running_loop().create_task(self._run(work))

    async def _run(self, work: Coroutine[Any, Any, int]) -> None:
        # From here the leg runner holds the attempt handed over (lets its worker go, releases its
        # response), and the coroutines the KV: a cancel goes through them.
        self.work = None
        self._taken_over()
        status = 499  # cancelled: the client went away (both legs are closed with this task)
        try:
            status = await self.orch.settle(self.out, work)
        except asyncio.CancelledError:
            if not self.out.closed:  # a drain, not the client: the response cannot be finished
                self.out.abort()
            raise
        except Exception:
            handler_failed(self.request, self.out)
            status = 500
        finally:
            self.task = None
            self.finish(status)

    def _taken_over(self) -> None:
        """The coroutines hold the attempt handed over from here (its worker, its response)."""
        self.resp, self.worker, self.leg = None, None, 0

    # -- the end ------------------------------------------------------------------------------

    def _failed(self, exc: BaseException) -> None:
        """What a step raised: an error answer (the client's 400, a worker's own), else a 500. A failure
        after leg (1) answered releases the KV its worker may hold for leg (3)."""
        resp = self.resp
        if resp is not None:
            self._leg_over(resp)
        if self.context_worker is not None and self.task is None and not self.ended:
            self.orch.release_kv_soon(self.context_worker, self.context_response)
        if isinstance(exc, (HTTPError, WorkerAnswer)):
            status = self.orch.answer_error(self.out, exc)
        elif isinstance(exc, Exception):
            handler_failed(self.request, self.out)
            status = 500
        else:
            raise exc
        self.finish(status)

    def cancel(self) -> None:
        """The client left, or a drain ran out: the leg in flight is reset, what it parked released."""
        if self.ended:
            return
        task = self.task
        if task is not None:
            task.cancel()
            if self.work is None:
                return  # its coroutines end the leg and the exchange (_run)
            self.work.close()  # never started: what they would have done is done here
            self.work = self.task = None
        resp = self.resp
        if resp is not None:
            worker = self.worker
            leg = self.leg
            self._leg_over(resp)  # not read to the end: its connection is reset
            if leg == CONTEXT and worker is not None:
                self.orch.release_lost_kv_soon(worker, self.disagg_id)
        if self.context_worker is not None:
            self.orch.release_kv_soon(self.context_worker, self.context_response)
        if not self.out.closed:
            self.out.abort()
        self.finish(499)

    def finish(self, status: int) -> None:
        if self.ended:
            return
        self.ended = True
        orch = self.orch
        orch.serving_ended(self, self.route, status)
        if self.returned:
            self.out.done()
