"""Concurrent legs: a protocol whose prefill and decode legs run at once (``concurrent``: SGLang's bootstrap,
protocols/sglang.py; vLLM Mooncake's push, protocols/vllm_mooncake.py), from callbacks and in coroutines.

A pair is a prefill worker and a decode worker, chosen by their pools' routers, and the legs' bodies
(the protocol's ``pair_legs``: SGLang's one body with the prefill's bootstrap address and a new room;
vLLM Mooncake's two on a new ``transfer_id``). Each leg is one attempt of :class:`.legs.LegRunner`
(its breakers, health marks, signatures, metrics; no retry of its own: a leg re-sent alone would
join a room its partner left):

- the decode leg relays its answer to the client, the prefill leg's answer is read and discarded;
- a leg that fails cuts its partner at once (its connection closes, and SGLang aborts a request
  whose connection closed), else the survivor would wait for a bootstrap that never comes (SGLang's
  own timeout: 300 s);
- a pair whose leg failed before the client got a byte is retried (``max_retries``) with a new room,
  the failed leg's worker excluded; a prefill that fails after the decode's stream began ends it with
  the error in-band;
- the client leaving cuts both.

The common case runs from callbacks (:class:`PairExchange`, exchange.py's shape: both legs started
from the client's complete-message event on pooled connections, no task); a failed leg (a non-200,
a connection that fails, a deadline) cuts its partner there and hands its attempt to
:meth:`PairRunner.run` (``failed``), which classifies it as if it had sent it and goes on in
coroutines (:meth:`PairRunner._pair`: a task per leg), as requests that wait for admission or are
traced do from the start.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from server.errors import HTTPError, error_body
from server.http import BodyPiece, Request, Responder, UpstreamResponse
from server.routes import Route

from .exchange import GENERATION, Exchange
from .legs import LegUnavailable, Sent, WorkerAnswer, leg_failed
from .tenants import ANONYMOUS, Tenant

if TYPE_CHECKING:
    from .completion import Completion, CompletionDriver
    from .pools import Worker
    from .routing import RequestKey

log = logging.getLogger("fastcore.orchestrator")

_POST = b"POST"
#: a leg's end that sends the pair to other workers (a timeout spent the request's time: not retried)
_RETRIED = ("failed", "refused", "no_worker", "circuit_open")


class _PairFailed(Exception):
    """One leg of a pair failed before the client got a byte: ``side`` ("context", "generation")."""

    def __init__(self, side: str, unavailable: LegUnavailable) -> None:
        super().__init__(side)
        self.side = side
        self.unavailable = unavailable


class FailedLeg:
    """A pair's leg that failed from callbacks (:class:`PairExchange`), its partner cut there: ``side``
    ("context", "generation"), its attempt (``sent``, held), the pair's workers, the failed leg's body
    (its deadlines are classified by it) and ``decoded``: the status the client got whole already (0:
    none; the prefill's failure then changes nothing)."""

    __slots__ = ("decode", "decoded", "pieces", "prefill", "sent", "side")

    def __init__(
        self,
        side: str,
        sent: Sent,
        prefill: Worker,
        decode: Worker,
        pieces: Sequence[BodyPiece],
        decoded: int,
    ) -> None:
        self.side = side
        self.sent = sent
        self.prefill = prefill
        self.decode = decode
        self.pieces = pieces
        self.decoded = decoded


class PairRunner:
    """Runs a concurrent protocol's pairs for an orchestrator (app.py; see the module)."""

    def __init__(self, orch: CompletionDriver) -> None:
        #: the Orchestrator, as the completion driver it is (completion.py)
        self.orch = orch
        self.attempts = orch.config.max_retries + 1
        #: the orchestrator's leg runner with one attempt a leg (a pair is retried whole)
        self.legs = orch.legs.with_retries(0)

    async def run(self, c: Completion, failed: FailedLeg | None = None) -> int:
        """Serve one completion on pairs; the status the client got (a stream cut mid-way: 502).
        ``failed``: the first pair's, sent from callbacks (:class:`PairExchange`), whose leg failed."""
        req, clock, key = c.req, c.clock, c.key
        orch = self.orch
        relay = orch.relay
        no_prefill: list[Worker] = []  # failed, or without a bootstrap port
        no_decode: list[Worker] = []
        error: HTTPError | WorkerAnswer | None = None
        prefill: Worker | None = None
        for attempt in range(self.attempts):
            if failed is not None:
                prefill, decode = failed.prefill, failed.decode
                work = self._resumed(c, failed)
                failed = None
            else:
                prefill = self._prefill_worker(no_prefill, key)
                chosen = orch.generation_pool.choose(exclude=no_decode, key=key)
                if prefill is None or chosen is None:
                    break
                decode = chosen
                if attempt:
                    orch.metrics.retries_leg["context"].inc()
                    orch.metrics.retries_leg["generation"].inc()
                legs = relay.pair_legs(req, prefill)
                clock.lap("build_context")
                work = self._pair(c, legs, prefill, decode)
            try:
                status: int = await work
                return status
            except _PairFailed as pair_failed:
                error = pair_failed.unavailable.error
                (no_prefill if pair_failed.side == "context" else no_decode).append(
                    prefill if pair_failed.side == "context" else decode
                )
                if pair_failed.unavailable.reason not in _RETRIED:
                    break
                log.info(
                    "%s leg of a pair failed (%s): the pair is retried with a new room",
                    pair_failed.side,
                    pair_failed.unavailable.reason,
                )
        if error is not None:
            raise error
        missing = "prefill worker with a bootstrap port" if prefill is None else "decode worker"
        raise self.legs.unavailable(f"no healthy {missing}")

    def _prefill_worker(self, excluded: list[Worker], key: RequestKey | None) -> Worker | None:
        """The pool's choice among the prefill workers whose ``/server_info`` gave a bootstrap port (those
        without one are excluded for this request: their legs could not meet)."""
        pool = self.orch.context_pool
        while (
            worker := pool.choose(exclude=excluded, key=key)
        ) is not None and worker.bootstrap_port is None:
            log.warning(
                "prefill worker %s has no %s: not chosen",
                worker.url,
                getattr(self.orch.protocol, "bootstrap_source", "bootstrap address"),
            )
            excluded.append(worker)
        return worker

    async def _pair(
        self, c: Completion, legs: tuple[list[BodyPiece], list[BodyPiece]], prefill: Worker, decode: Worker
    ) -> int:
        """Both legs at once; the first to fail cuts the other (see the module)."""
        req, path, key, tokens = c.req, c.path, c.key, c.tokens
        orch = self.orch
        protocol = orch.protocol
        loop = asyncio.get_running_loop()
        prefill_pieces, pieces = legs
        timeout, read_timeout, max_body, first_byte = orch.generation_bounds(req.stream, pieces)
        prefill_leg = loop.create_task(
            self.legs.run(
                "context",
                orch.context_pool,
                path,
                prefill_pieces,
                _discard,
                headers=orch.relay.leg_headers,
                extra=protocol.context_headers(req),
                timeout=orch.context_timeout(len(req.body)),
                key=key,
                tokens=tokens,
                first=prefill,
            )
        )
        decode_leg = loop.create_task(
            self.legs.run(
                "generation",
                orch.generation_pool,
                path,
                pieces,
                partial(orch.relay_answer, c),
                headers=orch.relay.leg_headers,
                extra=protocol.generation_headers(req, None),
                timeout=timeout,
                read_timeout=read_timeout,
                max_body=max_body,
                first_byte=first_byte,
                key=key,
                tokens=tokens,
                first=decode,
                ttfb=orch.metrics.generation_ttfb,
            )
        )
        try:
            await asyncio.wait((prefill_leg, decode_leg), return_when=asyncio.FIRST_COMPLETED)
            if prefill_leg.done() and (failure := _failure(prefill_leg)) is not None:
                return await self._prefill_failed(c.out, decode_leg, failure)
            try:
                status: int = await decode_leg
            except LegUnavailable as exc:
                raise _PairFailed("generation", exc) from None
            orch.metrics.path_disaggregated.inc()
            if status == 200 and not prefill_leg.done():
                # The client has its answer, so the KV was pushed: the prefill's own answer follows.
                await asyncio.wait((prefill_leg,))
            return status
        finally:
            await _cut(prefill_leg, decode_leg)

    async def _prefill_failed(
        self, out: Responder, decode_leg: asyncio.Task[int], failure: BaseException
    ) -> int:
        """The prefill leg failed: the decode leg is cut now; before the client got a byte, the pair
        failed (retried), after (a stream began), the stream ends with the error in-band."""
        if not decode_leg.done():
            decode_leg.cancel()
            await asyncio.wait((decode_leg,))
        elif not decode_leg.cancelled() and decode_leg.exception() is None:
            return decode_leg.result()  # the client's answer went out whole: the KV had been pushed
        return _after_failure(out, "context", failure)

    async def _resumed(self, c: Completion, failed: FailedLeg) -> int:
        """A pair's leg that failed from callbacks, its partner cut there: its attempt classified by the
        leg runner as if it had sent it (breakers, health marks, the client's error), then as
        :meth:`_pair`'s failures go on (a retry, the client's error, the error in-band)."""
        orch = self.orch
        req = c.req
        context = failed.side == "context"
        answered: Callable[[Worker, UpstreamResponse], Awaitable[int | None]]
        timeout: float | None
        read_timeout: float | None = None
        max_body: int | None = None
        first_byte: float | None = None
        if context:
            pool, answered, ttfb = orch.context_pool, _discard, None
            timeout = orch.context_timeout(len(req.body))
        else:
            pool, ttfb = orch.generation_pool, orch.metrics.generation_ttfb
            answered = partial(orch.relay_answer, c)
            timeout, read_timeout, max_body, first_byte = orch.generation_bounds(req.stream, failed.pieces)
        try:
            status = await self.legs.run(
                failed.side, pool, c.path, failed.pieces, answered, headers=b"", timeout=timeout,
                read_timeout=read_timeout, max_body=max_body, first_byte=first_byte, tokens=c.tokens,
                ttfb=ttfb, resume=failed.sent,
            )  # fmt: skip
        except (LegUnavailable, HTTPError, WorkerAnswer) as exc:
            if failed.decoded:
                return failed.decoded  # the client's answer went out whole: the KV had been pushed
            return _after_failure(c.out, failed.side, exc)
        if status is None:  # a prefill's 200 (dropped): not handed over, but its answer is no failure
            return failed.decoded or 200
        orch.metrics.path_disaggregated.inc()  # a decode's 200 that is not the stream asked for: relayed
        return status


def _after_failure(out: Responder, side: str, failure: BaseException) -> int:
    """A pair's leg failed, its partner cut: before the client got a byte, the pair failed (retried when
    the leg runner says another worker may take it: ``_PairFailed``) or its error is the client's; after
    (a stream began: only a prefill can fail then), the stream ends with the error in-band (502)."""
    if not out.started:
        if isinstance(failure, LegUnavailable):
            raise _PairFailed(side, failure)
        raise failure  # a worker's 4xx (the client's answer), or ours
    error = failure.error if isinstance(failure, LegUnavailable) else failure
    if not isinstance(error, HTTPError):
        error = leg_failed(side, "its worker refused it")
    out.flow = None
    out.write(b"data: " + error_body(502, error.message, code=error.code) + b"\n\n")
    out.end()
    out.flush()
    return 502


def _failure(task: asyncio.Task[Any]) -> BaseException | None:
    return None if task.cancelled() else task.exception()


async def _cut(*legs: asyncio.Task[Any]) -> None:
    """Cancel the legs still running (their connections close: the workers abort them) and wait for them;
    what they raised is retrieved (it was answered, or does not matter once the partner ended)."""
    running = [leg for leg in legs if not leg.done()]
    for leg in running:
        leg.cancel()
    if running:
        await asyncio.wait(running)
    for leg in legs:
        if not leg.cancelled():
            leg.exception()


async def _discard(worker: Worker, resp: UpstreamResponse) -> None:
    """A prefill worker's 200: its answer read to the end (its one token is not the client's) and dropped."""
    await resp.read()


class PairExchange(Exchange):
    """A concurrent protocol's completion from callbacks (the module; exchange.py's shape): both legs
    started from the client's complete-message event on pooled connections, no task. The decode leg
    is exchange.py's leg (3) (``resp``, ``worker``: relayed whole or as SSE as it comes); the prefill
    leg (``prefill_resp``) is read to its end and dropped. A leg that fails cuts its partner here, at
    once, and its attempt goes on in coroutines (:meth:`PairRunner.run`'s ``failed``)."""

    __slots__ = ("decode", "decode_pieces", "decoded", "prefill", "prefill_resp")

    def __init__(
        self,
        orch: CompletionDriver,
        request: Request,
        out: Responder,
        route: Route,
        tenant: Tenant = ANONYMOUS,
    ) -> None:
        super().__init__(orch, request, out, route, tenant)
        self.prefill: Worker | None = None
        self.decode: Worker | None = None
        #: the prefill leg in flight (None: not started, over, or handed over)
        self.prefill_resp: UpstreamResponse | None = None
        self.decode_pieces: Sequence[BodyPiece] = ()
        #: the status the client got whole while the prefill's answer is awaited (0: none yet)
        self.decoded = 0

    def _begin(self) -> None:
        self._prepare()
        orch = self.orch
        pairs: PairRunner = orch.pairs
        key = self.key
        prefill = pairs._prefill_worker([], key)
        decode = orch.generation_pool.choose(key=key) if prefill is not None else None
        if prefill is None or decode is None:  # the pair runner says which is missing (a 503)
            self._go_on(pairs.run(self))
            return
        req = self.req
        relay = orch.relay
        protocol = orch.protocol
        prefill_pieces, pieces = relay.pair_legs(req, prefill)
        self.clock.lap("build_context")
        self.prefill, self.decode, self.decode_pieces = prefill, decode, pieces
        timeout, read_timeout, max_body, first_byte = orch.generation_bounds(req.stream, pieces)
        self._send(
            GENERATION,
            decode,
            pieces,
            relay.leg_headers,
            protocol.generation_headers(req, None),
            True,
            None,
            timeout=timeout,
            read_timeout=read_timeout,
            max_body=max_body,
            first_byte=first_byte,
        )
        legs = orch.legs
        legs.hold(prefill, self.tokens, False, None)
        try:
            self.prefill_resp = orch.legs.upstream(prefill).start(
                self, _POST, self.path, prefill_pieces,
                headers=legs.lines(relay.leg_headers, prefill_pieces, prefill, protocol.context_headers(req)),
                timeout=orch.context_timeout(len(req.body)), max_body=orch.config.max_worker_body_bytes,
            )  # fmt: skip
        except BaseException:
            legs.let_go(prefill, self.tokens)
            raise

    # -- the prefill leg's events (whole-body: never a head) ---------------------------------------

    def response_done(self, resp: UpstreamResponse) -> None:
        if resp is not self.prefill_resp:
            super().response_done(resp)
            return
        try:
            if resp.status != 200:
                self._prefill_failed(resp, None)
                return
            prefill = self.prefill
            assert prefill is not None
            self.orch.legs.served(prefill, None, 0.0)
            self._prefill_over()  # its one token is not the client's: dropped
            if self.decoded:
                self.finish(self.decoded)
        except BaseException as exc:
            self._failed(exc)

    def response_error(self, resp: UpstreamResponse, exc: BaseException) -> None:
        if resp is not self.prefill_resp:
            super().response_error(resp, exc)
            return
        try:
            self._prefill_failed(resp, exc)
        except BaseException as error:
            self._failed(error)

    def _prefill_over(self) -> None:
        """The prefill leg is over: its connection back (read to the end) or reset (cut), its counts down."""
        resp = self.prefill_resp
        assert resp is not None and self.prefill is not None
        self.prefill_resp = None
        resp.release()
        self.orch.legs.let_go(self.prefill, self.tokens)

    def _prefill_failed(self, resp: UpstreamResponse, error: BaseException | None) -> None:
        """The prefill leg failed: the decode (unless its answer went out whole) is cut now, the
        prefill's attempt goes on in coroutines."""
        decode = self.resp
        if decode is not None:
            if self.streaming:
                self.streaming = False
                self.out.flow = None
            self._leg_over(decode)
        self._go_on_failed("context", resp, error, 0.0)

    def _hand_over(self, resp: UpstreamResponse, error: BaseException | None) -> None:
        """The decode leg failed before its stream (or answered a status not 200): the prefill is cut
        now, the decode's attempt goes on in coroutines."""
        if self.prefill_resp is not None:
            self._prefill_over()
        self._go_on_failed("generation", resp, error, self.handed_over)

    def _go_on_failed(
        self, side: str, resp: UpstreamResponse, error: BaseException | None, handed_over: float
    ) -> None:
        prefill, decode = self.prefill, self.decode
        assert prefill is not None and decode is not None
        resp.listener = None  # its futures wake the coroutines from here
        context = side == "context"
        sent = Sent(prefill if context else decode, handed_over, resp, error)
        failed = FailedLeg(side, sent, prefill, decode, () if context else self.decode_pieces, self.decoded)
        self._go_on(self.orch.pairs.run(self, failed))

    def _decoded(self, status: int) -> None:
        """The decode leg is over: done, unless the prefill has not answered yet after a whole answer
        (the client has it, so the KV was pushed: the prefill's own answer follows); a stream's
        failure cuts the prefill."""
        self.orch.metrics.path_disaggregated.inc()
        if self.prefill_resp is not None:
            if status == 200:
                self.decoded = status
                return
            self._prefill_over()
        self.finish(status)

    def _taken_over(self) -> None:
        super()._taken_over()
        self.prefill_resp = None

    def _failed(self, exc: BaseException) -> None:
        if self.prefill_resp is not None:
            self._prefill_over()
        super()._failed(exc)

    def cancel(self) -> None:
        if not self.ended and self.prefill_resp is not None:
            self._prefill_over()
        super().cancel()
