"""One leg runner for both legs: choose a worker, send, classify what came back, retry or give up.

Leg (1) (the context request) and leg (3) (the generation request, or a client's
body prefilled on a generation worker) differ in what they send and what they do
with a 200; the rest is one loop (:meth:`LegRunner.run`):

- choose a worker of the leg's pool not tried yet (its breaker lets a leg through);
  hold it for the whole attempt (its in-flight counts, the breaker's probe: one
  ``try``/``finally``, the only place they go up and down), so no path forgets to
  give it back;
- send on the worker's keep-alive connections, signed for that worker's instance;
- a 200 is handed to the leg's ``answered`` (the worker served it, its breaker closes);
- a refusal (429, 503), a worker that restarted since its last ``/health`` (a 403
  ``wrong_destination``), a dead connection: the next worker; any other 4xx is the
  client's answer (:class:`WorkerAnswer`), raised as it is; a 5xx, a spent deadline
  and no worker left end the leg with :class:`LegUnavailable` (why, and the client's
  error). A 5xx and a timed-out POST are not sent to another worker (the body may be
  the cause; the POST may still run there), but a stream that sent no first byte is.

A leg whose answer was lost (cut, timed out, the client left) may have parked KV
whose id never arrived: with ``disagg_id`` it is released by that id.

What counts against a worker's breaker (:meth:`LegRunner.breaker_failed`): evidence about the
worker, never what a client's own request explains.

- Counted: a connection that cannot be opened or breaks (reset, closed mid-answer), a response
  that breaks the protocol (every :class:`UpstreamError` is one call site, ``_no_answer``), a 5xx
  other than 503, a stream's head that does not come within its first-byte deadline (at once), a
  stream that stalls (no byte for ``request_timeout_s`` once its head came: app.py's
  ``stream_ended``), a context leg's deadline (it grows with the prompt: the client's size is in
  it already; at once), and a probe that fails.
- A unary generation leg's deadline (``request_timeout_s`` for the whole answer, which a worker
  sends whole once its decode ends, so no head or byte shows progress before it): the worker's
  (at once) only when the worker answered no other generation leg after this one was handed to
  it. A worker that answered others meanwhile is decoding; what kept this leg past the deadline
  is the request itself (its ``max_tokens`` at the worker's decode rate, a prompt that cannot be
  served), and opening the breaker would refuse every other client for it. The client still gets
  its 504, and the worker's connection is reset (it stops decoding). Workers publish no decode
  rate (``/server_info``; a worker's tokens per second is its whole batch's, not a request's),
  so the worker's own answers, not an estimate, are the evidence. A lone long request on an idle
  worker does count: nobody else's answer is lost to that breaker (a pool with every breaker open
  keeps routing to them: pools.py's panic), and the next success closes it.
- Never counted: a refusal (429, 503), a misdirected leg (403 ``wrong_destination``), the
  client's own 4xx, a client that left.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from server.auth import SIGNATURE_HEADER, sign_pieces
from server.errors import HTTPError, normalise_error_body
from server.http import BodyPiece, UpstreamError, UpstreamPool, UpstreamResponse, UpstreamTimeout
from server.http.limits import MAX_WORKER_ANSWER_BYTES
from server.tracing import current_trace

if TYPE_CHECKING:
    from .metrics import OrchestratorMetrics
    from .pools import Pool, Worker
    from .routing import RequestKey

log = logging.getLogger("fastcore.orchestrator")

_POST = b"POST"
_JSON = b"application/json"
_SIGNATURE = SIGNATURE_HEADER.encode()
# A worker's error body is relayed, but not an unbounded one.
MAX_ERROR_BODY = 64 * 1024
#: a worker's statuses that say "not me, not now" (full, draining, rate-limited): the leg is retried
#: on another worker (a context leg then falls back); any other 4xx is the client's answer
REFUSED_STATUSES = frozenset((429, 503))
#: the code of a worker's 403 for a leg signed for another instance of it (server/worker/app.py)
_MISDIRECTED = b'"wrong_destination"'
#: the code of a draining worker's 503 (server/worker/app.py)
_DRAINING = b'"draining"'

T = TypeVar("T")


class WorkerAnswer(Exception):
    """A worker's own error response, to be relayed to the client as it is."""

    def __init__(self, status: int, body: bytes, content_type: bytes, headers: bytes) -> None:
        super().__init__(status)
        self.status = status
        self.body = body
        self.content_type = content_type
        self.headers = headers


@dataclass(slots=True)
class Sent:
    """A first attempt sent from callbacks (exchange.py), handed to :meth:`LegRunner.run` to go on
    with: its worker (held, and last in ``tried``), when it was handed over, and what came back
    (the response, or the error)."""

    worker: Worker
    handed_over: float
    resp: UpstreamResponse
    error: BaseException | None

    def outcome(self) -> UpstreamResponse:
        """What came back: the response, or the error raised (as the send would have raised it)."""
        if self.error is not None:
            raise self.error
        return self.resp


class LegUnavailable(Exception):
    """No worker took the leg: ``reason`` (one of metrics.FALLBACK_REASONS) and ``error``, the answer
    the client gets (unless a context leg falls back to local prefill)."""

    def __init__(self, reason: str, error: HTTPError | WorkerAnswer) -> None:
        super().__init__(reason)
        self.reason = reason
        self.error = error


class LegSpent(LegUnavailable):
    """A leg that ``worker`` may have read, then failed (a reset, no first byte), on a protocol whose
    leg may not be sent again as it is (``resends_generation``: vLLM's decode had pulled its prefill's
    blocks, a lease read once): the caller goes on from a new context leg, without ``worker``."""

    def __init__(self, reason: str, error: HTTPError | WorkerAnswer, worker: Worker) -> None:
        super().__init__(reason, error)
        self.worker = worker


def leg_failed(leg: str, why: str) -> HTTPError:
    """A 502 that names the leg, never the worker's address or an exception's text (those are logged)."""
    return HTTPError(502, f"the {leg} leg failed: {why}", code=f"{leg}_leg_failed")


def leg_timed_out(leg: str, seconds: float) -> HTTPError:
    return HTTPError(504, f"the {leg} leg timed out after {seconds:g} s", code=f"{leg}_leg_timeout")


class LegRunner:
    """Runs legs for an orchestrator: its retries, upstream connections, signatures, breakers, metrics.

    :meth:`run` takes a leg as arguments, not as an object (it runs twice per request).
    ``body``: bytes or pieces (views into the bodies it was spliced from go out in one vectored
    write, never joined). ``headers``: the relay mode's lines (empty for a plain JSON body), then
    the signature, then ``extra`` (trtllm-serve's auth). ``timeout``, ``read_timeout``,
    ``max_body``: the upstream request's (None: ``max_worker_body``, a whole answer's bound, the
    orchestrator's ``max_worker_body_bytes``); ``first_byte``: a stream's deadline for its first byte
    (past it, the next worker). ``tried``: workers not to choose (a local prefill excludes those
    that cannot), each one tried appended: the last is the one that answered. ``first``: the first
    attempt's worker, already chosen (while healthy). ``disagg_id``: the id whose parked KV is
    released when the answer is lost. ``handoff_from``: when the context answer was read (the
    hand-off is observed); ``ttfb``: the histogram of the time to first byte. ``resume``: the first
    attempt, already sent (from callbacks, server/orchestrator/exchange.py) and held: what came back
    is classified as if :meth:`run` had sent it. ``panic``: when too few breakers let legs through,
    every healthy worker is chosen from (pools.py); False for a leg with another way out (a context
    leg that falls back to local prefill). ``resend`` False: a leg its worker may have read is not
    sent to another (:class:`LegSpent`). :meth:`run`'s steps are methods, not coroutines: a coroutine
    an attempt would cost each leg ~1k instructions (a request's two legs run in ~215k).
    """

    def __init__(
        self,
        *,
        max_retries: int,
        metrics: OrchestratorMetrics,
        upstream: Callable[[Worker], UpstreamPool],
        secret: bytes | None,
        mark_failed: Callable[[Pool, Worker], None],
        release_lost_kv: Callable[[Worker, int], None],
        unavailable: Callable[[str], HTTPError],
        max_worker_body: int = MAX_WORKER_ANSWER_BYTES,
    ) -> None:
        self.attempts = max_retries + 1
        self.max_worker_body = max_worker_body
        self.metrics = metrics
        self.upstream = upstream
        self.secret = secret
        self.mark_failed = mark_failed
        self.release_lost_kv = release_lost_kv
        self.unavailable = unavailable

    async def run(
        self,
        name: str,
        pool: Pool,
        path: bytes,
        body: bytes | Sequence[BodyPiece],
        answered: Callable[[Worker, UpstreamResponse], Awaitable[T]],
        *,
        headers: bytes,
        timeout: float | None,
        read_timeout: float | None = None,
        max_body: int | None = None,
        first_byte: float | None = None,
        extra: bytes = b"",
        key: RequestKey | None = None,
        tokens: int = 0,
        first: Worker | None = None,
        tried: list[Worker] | None = None,
        disagg_id: int | None = None,
        handoff_from: float | None = None,
        ttfb: Any = None,
        resume: Sent | None = None,
        panic: bool = True,
        resend: bool = True,
    ) -> T:
        """Leg ``name`` to ``pool``: ``answered(worker, resp)`` of the first worker that answers 200 (held
        until it returns), else :class:`WorkerAnswer` or :class:`LegUnavailable` (see the class)."""
        pieces: Sequence[BodyPiece] = (body,) if isinstance(body, bytes) else body
        max_body = self.max_worker_body if max_body is None else max_body
        tried = tried if tried is not None else []
        last: tuple[HTTPError | WorkerAnswer, str] | None = None  # the last attempt's error, and why
        trace = current_trace()
        timed = ttfb is not None or handoff_from is not None
        for attempt in range(self.attempts):
            routed = trace.now() if trace is not None else 0
            if attempt or resume is None:
                resume = None  # (a resumed attempt is the first only)
                worker = self._choose(name, pool, attempt, first, tried, key, panic)
                if worker is None:
                    break
                handed_over = self.hold(worker, tokens, timed, handoff_from if attempt == 0 else None)
            else:
                worker, handed_over = resume.worker, resume.handed_over
            span: Any = None
            try:
                try:
                    if resume is not None:
                        resp = resume.outcome()
                    else:
                        if trace is not None:  # the leg's span; its traceparent goes with the leg
                            span = trace.start_leg(name, pool, worker, key, routed, attempt)
                        resp = await self.upstream(worker).request(
                            _POST, path, pieces, headers=self.lines(headers, pieces, worker, extra, span),
                            timeout=timeout, read_timeout=read_timeout, max_body=max_body, headers_timeout=first_byte,
                        )  # fmt: skip
                except (UpstreamError, UpstreamTimeout) as e:  # no answer: the next worker, or raises
                    last = self._unanswered(
                        e, name, pool, worker, span, timeout, first_byte, disagg_id, handed_over, ttfb, resend
                    )
                    continue
                except BaseException as exc:
                    self._abandoned(exc, worker, span, disagg_id)
                    raise
                try:
                    if span is not None:
                        span.answered(resp.status, resp)
                    if resp.status == 200:
                        self.served(worker, ttfb, handed_over)
                        return await answered(worker, resp)
                    if ttfb is not None:
                        ttfb.observe(time.perf_counter() - handed_over)
                    last = await self._refused(name, pool, worker, resp)  # or raises
                finally:
                    # A response not read to the end closes its connection, so the worker sees the cancel.
                    resp.release()
                    if span is not None:
                        span.end()
            finally:
                self.let_go(worker, tokens)
        raise self._gave_up(name, pool, last)

    def _choose(
        self,
        name: str,
        pool: Pool,
        attempt: int,
        first: Worker | None,
        tried: list[Worker],
        key: RequestKey | None,
        panic: bool,
    ) -> Worker | None:
        """An attempt's worker: ``first`` on the first attempt while it is healthy, else the pool's
        choice among those not in ``tried`` (None: no worker left); appended to ``tried``."""
        worker = first if attempt == 0 and first is not None and first.healthy else None
        if worker is None:
            worker = pool.choose(exclude=tried, key=key, panic=panic)
            if worker is None:
                return None
        if attempt:
            self.metrics.retries_leg[name].inc()
        tried.append(worker)
        return worker

    def _unanswered(
        self,
        exc: UpstreamError | UpstreamTimeout,
        name: str,
        pool: Pool,
        worker: Worker,
        span: Any,
        timeout: float | None,
        first_byte: float | None,
        disagg_id: int | None,
        handed_over: float,
        ttfb: Any,
        resend: bool,
    ) -> tuple[HTTPError, str]:
        """No answer came from ``worker`` (its connection failed, or a deadline ran out): the error and
        why, for the next worker to do better. Raises :class:`LegSpent` where the worker may have read
        the leg and it may not be sent again (``resend`` False), and :class:`LegUnavailable` for a
        deadline that ends the leg (:meth:`_timed_out`)."""
        if isinstance(exc, UpstreamError):
            failure, reason, spent = (
                self._no_answer(name, pool, worker, span, exc, disagg_id),
                "failed",
                exc.sent,
            )
        else:  # raises unless a stream's first byte: that one goes to the next worker
            generation = handed_over if ttfb is not None else None
            failure = self._timed_out(name, pool, worker, span, timeout, first_byte, disagg_id, generation)
            reason, spent = "timeout", True
        if spent and not resend:
            raise LegSpent(reason, failure, worker) from None
        return failure, reason

    def _abandoned(self, exc: BaseException, worker: Worker, span: Any, disagg_id: int | None) -> None:
        """The attempt ended by ``exc``, not by an answer. Cancelled (the client left, a drain ran out):
        the leg's connection is reset, but its answer may be in flight already, the KV parked behind an
        id never read: released by that id."""
        cancelled = isinstance(exc, asyncio.CancelledError)
        if cancelled and disagg_id is not None:
            self.release_lost_kv(worker, disagg_id)
        _end(span, "cancelled" if cancelled else exc)

    def _gave_up(
        self, name: str, pool: Pool, last: tuple[HTTPError | WorkerAnswer, str] | None
    ) -> LegUnavailable:
        """What ends a leg no worker served: the ``last`` attempt's error and why, else no worker to try."""
        if last is None:
            reason = "circuit_open" if pool.all_open() else "no_worker"
            return LegUnavailable(reason, self.unavailable(f"no healthy {name} worker"))
        error, reason = last
        return LegUnavailable(reason, error)

    def with_retries(self, max_retries: int) -> LegRunner:
        """This runner (its connections, signatures, breakers, metrics) with ``max_retries`` retries a leg
        (pair.py's: none, a pair is retried whole)."""
        runner = copy.copy(self)
        runner.attempts = max_retries + 1
        return runner

    # -- one attempt's bookkeeping: here and in server/orchestrator/exchange.py -------------------

    def hold(self, worker: Worker, tokens: int, timed: bool, handoff_from: float | None) -> float:
        """An attempt on ``worker`` begins: its counts go up (routers read them; in half-open this leg
        is the breaker's probe) until :meth:`let_go`. Returns when (perf_counter) it was handed over
        (0.0 unless ``timed``); ``handoff_from``: a first attempt's hand-off is observed from then."""
        worker.in_flight += 1
        if tokens:  # counted only for a least_loaded router with use_tokens
            worker.in_flight_tokens += tokens
        worker.breaker.chosen()
        if not timed:
            return 0.0
        handed_over = time.perf_counter()
        if handoff_from is not None:
            self.metrics.handoff.observe(handed_over - handoff_from)
        return handed_over

    def let_go(self, worker: Worker, tokens: int) -> None:
        """An attempt on ``worker`` is over (whatever came of it): its counts go back down."""
        worker.in_flight -= 1
        if tokens:
            worker.in_flight_tokens -= tokens
        worker.breaker.ended()

    def served(self, worker: Worker, ttfb: Any, handed_over: float) -> None:
        """``worker`` answered 200: counted, its breaker closes; a generation leg's (``ttfb``): the time
        to its first byte observed, and when it answered kept (evidence for its other legs' deadlines)."""
        if ttfb is not None:
            now = time.perf_counter()
            ttfb.observe(now - handed_over)
            worker.answered_at = now
        worker.served += 1
        worker.breaker.succeeded()

    def lines(
        self, headers: bytes, pieces: Sequence[BodyPiece], worker: Worker, extra: bytes, span: Any = None
    ) -> bytes:
        """An attempt's header lines: the relay mode's, the signature for ``worker``, then ``extra``, then
        a traced leg's ``span``'s traceparent."""
        lines = headers if self.secret is None else headers + self._signature(pieces, worker)
        if extra:
            lines += extra
        return lines if span is None else lines + span.header

    def _no_answer(
        self, name: str, pool: Pool, worker: Worker, span: Any, exc: UpstreamError, disagg_id: int | None
    ) -> HTTPError:
        """The worker could not be reached or its connection broke: it is out until its /health
        passes, its breaker counts a failure, a lost answer's KV is released; the next worker."""
        self.mark_failed(pool, worker)
        self.breaker_failed(pool, worker)
        if exc.sent and disagg_id is not None:
            self.release_lost_kv(worker, disagg_id)
        log.warning("%s worker %s failed: %s", name, worker.url, exc)
        _end(span, exc)
        return leg_failed(name, "its worker did not answer")

    async def _refused(
        self, name: str, pool: Pool, worker: Worker, resp: UpstreamResponse
    ) -> tuple[HTTPError | WorkerAnswer, str]:
        """A worker's non-200 that sends the leg to the next worker: the error and why (``refused``);
        raises the client's 4xx as it is, and a 5xx as :class:`LegUnavailable` (not sent to another
        worker: the body may be the cause)."""
        failure = await self._worker_failure(name, worker, resp)
        if self._misdirected(pool, worker, failure):
            return self.unavailable(f"no healthy {name} worker"), "refused"
        if resp.status in REFUSED_STATUSES:
            if isinstance(failure, WorkerAnswer) and _DRAINING in failure.body:
                # Its words are for an orchestrator ("send it elsewhere"): should no other worker take
                # the leg, the client is told what it can do about it.
                return self.unavailable(f"no healthy {name} worker"), "refused"
            return failure, "refused"
        if resp.status < 500:
            raise failure  # the client's answer: another worker would give the same
        self.breaker_failed(pool, worker)
        raise LegUnavailable("failed", failure)

    def _timed_out(
        self,
        name: str,
        pool: Pool,
        worker: Worker,
        span: Any,
        timeout: float | None,
        first_byte: float | None,
        disagg_id: int | None,
        handed_over: float | None,
    ) -> HTTPError:
        """A leg's deadline ran out (the connection is reset: the worker sees the cancel when it can).
        A stream with no first byte goes to another worker (nothing reached the client yet): its
        error is returned; any other deadline is spent, the leg ends (:class:`LegUnavailable`).
        ``handed_over``: a generation leg's, when it was handed to ``worker``: its whole-answer
        deadline counts against the worker only if the worker answered no leg since (the module)."""
        clients = first_byte is None and handed_over is not None and worker.answered_at > handed_over
        if clients:
            log.info(
                "%s worker %s: a leg outlasted its deadline while the worker answered others: the "
                "request's own length, not counted against the worker",
                name,
                worker.url,
            )
            self.metrics.deadlines_not_counted.inc(pool=pool.name)
        else:
            self.breaker_failed(pool, worker, at_once=True)
        if disagg_id is not None:
            self.release_lost_kv(worker, disagg_id)
        if first_byte is not None:
            log.warning("%s worker %s: no first byte in %g s", name, worker.url, first_byte)
            _end(span, "no first byte")
            return leg_timed_out(name, first_byte)
        seconds = timeout if timeout is not None else 0.0
        log.warning("%s worker %s: no answer in %g s", name, worker.url, seconds)
        _end(span, f"no answer in {seconds:g} s")
        raise LegUnavailable("timeout", leg_timed_out(name, seconds))

    def _signature(self, pieces: Sequence[BodyPiece], worker: Worker) -> bytes:
        """The leg's signature line for ``worker`` (bound to its instance id, from its last /health:
        a leg replayed to another worker is refused there)."""
        assert self.secret is not None
        signature = sign_pieces(self.secret, pieces, destination=worker.instance)
        return b"%s: %s\r\n" % (_SIGNATURE, signature.encode())

    def breaker_failed(self, pool: Pool, worker: Worker, *, at_once: bool = False) -> None:
        """Evidence against ``worker`` (see the module for what is): its breaker counts a failure."""
        if worker.breaker.failed(at_once=at_once):
            log.warning(
                "%s worker %s: circuit breaker open (no new legs for %g s)",
                pool.name,
                worker.url,
                worker.breaker.open_for,
            )
            self.metrics.breaker_opened.inc(pool=pool.name)

    async def _worker_failure(
        self, leg: str, worker: Worker, resp: UpstreamResponse
    ) -> HTTPError | WorkerAnswer:
        """The error to give the client for a worker's non-200 answer (read, bounded).

        4xx is the client's problem and a full worker's 503 carries its
        Retry-After: both reach the client with the worker's status and message. Any other
        5xx is a 502 that names the leg and the status; the worker's address
        and its body stay in this process's log.
        """
        try:
            body = await resp.read(MAX_ERROR_BODY)
        except UpstreamError as exc:
            log.warning("%s worker %s answered %d, then failed: %s", leg, worker.url, resp.status, exc)
            return leg_failed(leg, f"its worker answered {resp.status}, then failed")
        if resp.status < 500 or resp.status == 503:
            extra = b"Retry-After: %s\r\n" % resp.retry_after if resp.retry_after else b""
            # In our OpenAI shape whatever the worker's (trtllm-serve has three of its own).
            return WorkerAnswer(resp.status, normalise_error_body(resp.status, body), _JSON, extra)
        log.warning(
            "%s worker %s answered %d: %s",
            leg,
            worker.url,
            resp.status,
            body[:500].decode("utf-8", "replace"),
        )
        return leg_failed(leg, f"its worker answered {resp.status}")

    def _misdirected(self, pool: Pool, worker: Worker, failure: HTTPError | WorkerAnswer) -> bool:
        """Whether ``worker`` refused a leg as signed for another instance: it restarted since its
        last /health (its new id is not known yet). It leaves the pool until the health check reads
        the new id, and the leg goes to another worker: the client never sees that 403."""
        if not (isinstance(failure, WorkerAnswer) and failure.status == 403 and _MISDIRECTED in failure.body):
            return False
        log.info(
            "%s worker %s refused a leg signed for its instance %s: restarted",
            pool.name,
            worker.url,
            worker.instance,
        )
        self.mark_failed(pool, worker)
        return True


def _end(span: Any, error: BaseException | str) -> None:
    """End a leg's span that got no answer, saying why."""
    if span is not None:
        span.end(error)
