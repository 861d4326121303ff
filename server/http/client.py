"""The upstream side: keep-alive HTTP/1.1 connections to one worker, framing by a response parser.

One :class:`UpstreamPool` per worker URL. :meth:`UpstreamPool.request` writes
the request head and the body's pieces in one vectored write (no join of a
spliced body) on an idle keep-alive connection or a new one, and returns the
:class:`UpstreamResponse` once its status line and headers are in. The body
then either accumulates (:meth:`UpstreamResponse.read`) or goes, piece by
piece as the socket delivers it, to a sink (:meth:`UpstreamResponse.stream`)
with no Python object per SSE event.

Deadlines are checked by a :class:`Deadlines` sweeper (50 ms ticks while
requests are in flight; one per pool, or one shared by an owner's pools): ``timeout`` bounds the whole exchange,
``headers_timeout`` (without ``timeout``) the wait for the response's headers,
``read_timeout`` a silence (a stream may run long; it must not stall that
long). A response read to the end on a keep-alive connection returns the
connection to the pool; anything else (a cancel, an early stop, an error)
closes it, so the worker sees the client leave.

Responses are framed by :data:`server.http.parse.ResponseParser` (llhttp's callbacks in C, or its
pure twin on httptools; ``UpstreamPool.response_parser``), which reads the four headers used here
(Content-Type, Content-Length, Retry-After, Transfer-Encoding) and calls the connection once for
the head, per body piece and at the end.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Protocol
from urllib.parse import urlsplit

from . import parse
from .parse import ResponseParser
from .request import PAST_THE_RESPONSE, BadResponse
from .upstream_wire import REQUEST_HEAD, WRITE_JOINED_BELOW, BodyPiece, UpstreamError, UpstreamTimeout

#: UpstreamPool's defaults (the orchestrator's connect_timeout_s config key reads the first): seconds
#: to open a connection to a worker, and an idle connection's life in the pool (a worker's keep-alive
#: timeout, server/http/limits.py WORKER_KEEPALIVE_TIMEOUT_S, stays above it)
CONNECT_TIMEOUT_S = 5.0
IDLE_TIMEOUT_S = 30.0


def _size(pieces: Sequence[BodyPiece]) -> int:
    size = 0
    for piece in pieces:
        size += len(piece)
    return size


class Listener(Protocol):
    """Who a response started by :meth:`UpstreamPool.start` tells its events, with no future or task."""

    def leg_head(self, resp: UpstreamResponse) -> None:
        """The final status line and headers are in (never for a whole-body request)."""

    def leg_done(self, resp: UpstreamResponse) -> None:
        """The whole response is in."""

    def leg_error(self, resp: UpstreamResponse, exc: BaseException) -> None:
        """The exchange failed (:class:`UpstreamError`, :class:`UpstreamTimeout`, or what an event raised)."""


class HeldWriter(Protocol):
    """Where a started response's listener writes: set as ``UpstreamResponse.writer``, it is held
    (:meth:`hold`) while each read of the worker's socket is parsed and flushed after it, so what
    the listener's events write for one read (a stream's head, its pieces, its end) goes out in
    one write (server.http.Responder is one)."""

    def hold(self) -> None: ...

    def flush(self) -> None: ...


class UpstreamResponse:
    """One response: status and the headers the orchestrator uses, then the body.

    Awaited (:meth:`UpstreamPool.request`), or told to a :class:`Listener` (:meth:`UpstreamPool.start`):
    setting ``listener`` to None hands a started response over to coroutines (its futures wake them)."""

    __slots__ = (
        "_conn",
        "_done",
        "_headers",
        "_whole",
        "abandoned",
        "chunks",
        "complete",
        "content_length",
        "content_type",
        "error",
        "headers_done",
        "keep_alive",
        "limit",
        "listener",
        "retry_after",
        "reused",
        "sending",
        "sink",
        "size",
        "status",
        "truncated",
        "writer",
    )

    def __init__(self, conn: _Connection | None, max_body: int = 0, listener: Listener | None = None) -> None:
        self._conn = conn
        self.status = 0
        self.content_type = b""
        self.retry_after: bytes | None = None
        #: None: no Content-Length (close-delimited unless chunked, which is -1)
        self.content_length: int | None = None
        self.chunks: list[bytes] = []
        self.size = 0
        self.limit = max_body  # 0: unbounded
        self.truncated = False
        self.sink: Callable[[bytes], None] | None = None
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.error: BaseException | None = None
        self.listener = listener
        self._headers: asyncio.Future[None] | None = None if conn is None else conn.loop.create_future()
        self._done: asyncio.Future[None] | None = None
        #: request() returns only once the whole body is in (one wake-up, not two)
        self._whole = bool(max_body)
        #: start(): the request (head, pieces, timeouts) while it may be sent again on a fresh connection
        self.sending: tuple[Any, ...] = ()
        #: start(): sent on a pooled connection (one the worker may have closed meanwhile)
        self.reused = False
        #: released before a connection was open for it
        self.abandoned = False
        #: a listener's writer held across each read of the worker's socket (see :class:`HeldWriter`)
        self.writer: HeldWriter | None = None

    @property
    def media_type(self) -> bytes:
        """``content_type`` without parameters, lower case."""
        return self.content_type.split(b";", 1)[0].strip().lower()

    def body(self) -> bytes:
        """The body read so far (all of it once ``complete``)."""
        chunks = self.chunks
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def read(self, limit: int = 0) -> bytes:
        """The whole body; with ``limit``, at most that many bytes (the rest is dropped with the connection)."""
        if self.complete and not limit:
            chunks = self.chunks
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)
        if limit:
            self.limit = limit
            if self.size > limit:
                self._truncate()
        if not self.complete and not self.truncated:
            await self._wait_done()
        chunks = self.chunks
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        return body[:limit] if limit else body

    async def stream(self, sink: Callable[[bytes], None]) -> None:
        """Hand every body piece to ``sink`` as it arrives; return at the end of the body."""
        for chunk in self.chunks:
            sink(chunk)
        self.chunks = []
        self.sink = sink
        if not self.complete:
            if self.writer is not None:
                self.writer.flush()  # what was held goes out before the wait (the next read's is held anew)
            await self._wait_done()

    def pause_reading(self) -> None:
        if self._conn is not None:  # None: not sent yet (its connection is being opened)
            self._conn.pause()

    def resume_reading(self) -> None:
        if self._conn is not None:
            self._conn.resume()

    def release(self) -> None:
        """Done with the response: its connection goes back to the pool if it can be reused, else closes."""
        if self._conn is None:
            self.abandoned = True  # its connection, once open, goes to the pool unused
            self.listener = None
            return
        self._conn.finish(self)

    # -- waiting, and a failure (the parser's events are its connection's: _Connection.on_head...) --

    def headers_arrived(self) -> asyncio.Future[None]:
        """Done once the status line and headers are in (with ``max_body``: the whole body)."""
        if self._headers is None:
            self._headers = self._conn.loop.create_future()  # type: ignore[union-attr]  # sent
        return self._headers

    def on_error(self, exc: BaseException) -> bool:
        """The exchange failed: raise ``exc`` to its waiters. False when it had already ended."""
        if self.complete or self.error is not None:
            return False
        self.error = exc
        if self.listener is not None:
            self.listener.leg_error(self, exc)
            return True
        self._wake(self._headers, exc)
        self._wake(self._done, exc)
        return True

    # -- internals -----------------------------------------------------------------

    def _truncate(self) -> None:
        self.truncated = True
        kept = b"".join(self.chunks)[: self.limit]
        self.chunks = [kept]
        self._wake(self._done, None)

    async def _wait_done(self) -> None:
        if self.error is not None:
            raise self.error
        self._done = self._conn.loop.create_future()  # type: ignore[union-attr]  # sent
        await self._done

    @staticmethod
    def _wake(fut: asyncio.Future[None] | None, exc: BaseException | None) -> None:
        if fut is not None and not fut.done():
            if exc is None:
                fut.set_result(None)
            else:
                fut.set_exception(exc)


class _Connection(asyncio.Protocol):
    """One keep-alive connection to a worker; carries one request at a time."""

    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.parser = pool.response_parser(self)
        self.response: UpstreamResponse | None = None
        self.closed = False
        self.requests = 0
        self.idle_since = 0.0
        self.timed = False  # in the sweeper's active set
        self.sweeper = pool.deadlines
        self.deadline = 0.0
        #: the deadline ends with the response's headers (a first-byte deadline)
        self.deadline_to_headers = False
        self.read_timeout = 0.0
        self.last_io = 0.0
        self.got_bytes = False
        self.paused = False
        #: the message being parsed is an interim 1xx response
        self.interim = False
        #: streamed body pieces of the current read, not yet given to the sink
        self.pending: list[bytes] = []
        #: inside the parser's feed: a response finished there goes back to the pool after it
        self.feeding = False
        self.release_after_feed = False

    # -- transport events -----------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._forget(self)
        resp = self.response
        if resp is None or resp.complete:
            return
        if resp.headers_done and resp.content_length is None and exc is None:
            self.on_message_complete(False)  # a close-delimited body ends with a clean close
            return
        why = f": {exc}" if exc else ""
        stage = "mid-response" if resp.headers_done else "before answering"
        self._fail(UpstreamError(f"connection closed {stage}{why}", clean_close=exc is None))

    def data_received(self, data: bytes) -> None:
        resp = self.response
        if resp is None:  # bytes nobody asked for: the connection cannot be trusted
            self.close()
            return
        self.got_bytes = True
        if self.read_timeout:
            self.last_io = self.loop.time()
        writer = resp.writer
        if writer is not None:
            writer.hold()
        self.feeding = True
        failed = True
        try:
            self.parser.feed(data)
            failed = False
        except BadResponse as exc:
            self._flush(resp)
            self._fail(UpstreamError(f"malformed HTTP response: {exc}"))
        except Exception as exc:  # what an event raised
            self._flush(resp)
            self._fail(exc)
        else:
            if self.pending:
                self._flush(resp)
        self.feeding = False
        writer = resp.writer  # (a listener's leg_head may have set it in this read)
        if writer is not None:
            writer.flush()
        if self.release_after_feed:
            self.release_after_feed = False
            if failed:  # bytes past the end of the response it finished: not to be trusted again
                self.close()
            elif self.response is None and not self.closed:
                self.pool._release(self)

    def _flush(self, resp: UpstreamResponse) -> None:
        """What one read brought of a streamed body, to the sink in one piece (one write to the client)."""
        pending = self.pending
        if pending and resp.sink is not None:
            self.pending = []
            resp.sink(pending[0] if len(pending) == 1 else b"".join(pending))

    # -- the parser's events (server.http.parse: both twins) ---------------------

    def on_head(
        self, status: int, content_type: bytes, content_length: int | None, retry_after: bytes | None
    ) -> None:
        resp = self.response
        if resp is None:  # given up by a listener's event earlier in this read: nobody reads on
            raise BadResponse(PAST_THE_RESPONSE)
        if 100 <= status < 200 and status != 101:
            self.interim = True  # 100 Continue and friends: skipped, the real answer follows
            return
        if resp._whole and content_length is not None and content_length > resp.limit:
            # refused before any of it is read (a worker's answer is held whole: bounded)
            raise UpstreamError(f"response body exceeds {resp.limit} bytes")
        resp.content_type = content_type
        resp.content_length = content_length
        resp.retry_after = retry_after
        if self.deadline_to_headers:
            self.deadline = 0.0  # the first byte is in: only read_timeout (if any) from here
        resp.status = status
        resp.headers_done = True
        if not resp._whole:  # (a whole-body request hears the end only)
            if resp.listener is not None:
                resp.listener.leg_head(resp)
            else:
                resp._wake(resp._headers, None)

    def on_body(self, body: bytes) -> None:
        resp = self.response
        if resp is None:
            raise BadResponse(PAST_THE_RESPONSE)
        if self.interim:
            return
        if resp.sink is not None:
            resp.size += len(body)
            self.pending.append(body)  # flushed once the read is parsed
            return
        if resp.truncated:
            return
        resp.size += len(body)
        resp.chunks.append(body)
        if resp.limit and resp.size > resp.limit:
            if resp._whole:
                # raised, not failed here: the parser stops (the rest of the read is not parsed)
                raise UpstreamError(f"response body exceeds {resp.limit} bytes")
            resp._truncate()

    def on_message_complete(self, keep_alive: bool) -> None:
        resp = self.response
        if resp is None:
            raise BadResponse(PAST_THE_RESPONSE)
        if self.interim:  # a 1xx ended (on_head kept none of its headers): the real answer follows
            self.interim = False
            return
        self._cancel_timer()
        if self.pending:  # a listener hears the end now: the stream's last pieces go first
            self._flush(resp)
        resp.complete = True
        resp.keep_alive = keep_alive
        if resp.listener is not None:
            resp.listener.leg_done(resp)
            return
        resp._wake(resp._headers, None)
        resp._wake(resp._done, None)

    # -- requests -------------------------------------------------------------------

    def send(
        self,
        resp: UpstreamResponse,
        head: bytes,
        pieces: Sequence[BodyPiece],
        size: int,
        timeout: float | None,
        read_timeout: float | None,
        headers_timeout: float | None = None,
    ) -> UpstreamResponse:
        """Write ``head`` and the body's ``pieces`` (``size`` bytes in all, the head's Content-Length)."""
        transport = self.transport
        if transport is None or transport.is_closing():
            # The worker closed (or died) and connection_lost has not run yet: writing would
            # raise (uvloop: RuntimeError). Nothing was sent, so the request may go elsewhere.
            self.closed = True
            raise UpstreamError("connection closed before the request was sent", sent=False)
        resp._conn = self
        self.response = resp
        self.parser.ended = False  # its answer may begin
        self.requests += 1
        self.got_bytes = False
        self.interim = False
        now = self.loop.time()
        self.read_timeout = read_timeout or 0.0
        self.last_io = now
        self.deadline_to_headers = not timeout and bool(headers_timeout)
        if timeout:
            self.deadline = now + timeout
        else:
            self.deadline = now + headers_timeout if headers_timeout else 0.0
        if self.deadline or self.read_timeout:
            self.timed = True
            self.sweeper.add(self)
        if size < WRITE_JOINED_BELOW:
            transport.write(b"".join((head, *pieces)))
        else:
            transport.writelines((head, *pieces))
        return resp

    def unseen(self, exc: UpstreamError) -> bool:
        """Whether the request ``exc`` failed cannot have been acted on by the worker: not sent, or the
        connection closed cleanly with no byte back (a pooled connection the worker had closed as it
        was reused: it never read the request). A reset is not: the worker may have read the request
        and failed after acting on it (vLLM's decode after pulling its prefill's blocks), and a POST is
        sent again only where it cannot have been processed (RFC 9110, 9.2.2)."""
        return not exc.sent or (exc.clean_close and not self.got_bytes)

    def _check_deadline(self, now: float) -> None:
        """Called by the sweeper: fail the request whose time is up."""
        resp = self.response
        if resp is None or resp.complete:
            self._cancel_timer()
            return
        if self.paused:
            self.last_io = now  # we stopped reading (backpressure): not the worker's silence
        if (self.deadline and now >= self.deadline) or (
            self.read_timeout and now >= self.last_io + self.read_timeout
        ):
            self._fail(UpstreamTimeout("timed out"))

    def _cancel_timer(self) -> None:
        if self.timed:
            self.timed = False
            self.sweeper.remove(self)

    def _fail(self, exc: BaseException) -> None:
        resp = self.response
        self._cancel_timer()
        if resp is None:
            return
        if resp.reused and isinstance(exc, UpstreamError) and self.unseen(exc) and resp.listener is not None:
            # Once, on a fresh connection (as request() does).
            resp.reused = False
            self.response = None
            self.close()
            self.pool._open_for(resp)
            return
        if not resp.on_error(exc):
            # It had ended (or failed already): what failed came after its end, bytes past the
            # response (a worker that wrote more than it framed). The connection is not used again.
            self.close()
            return
        self.close(reset=isinstance(exc, UpstreamTimeout))  # a silent worker may still be running it

    def finish(self, resp: UpstreamResponse) -> None:
        if resp is not self.response:
            return
        self.response = None
        self._cancel_timer()
        if self.paused:
            self.resume()
        if resp.complete and resp.keep_alive and not self.closed and not resp.truncated:
            if self.feeding:  # a listener's event: back to the pool once this read is parsed
                self.release_after_feed = True
            else:
                self.pool._release(self)
        else:
            # A response given up before its end (the client left, a leg failed): a reset, not
            # a FIN, so the worker's server knows at once that nobody reads it and aborts the
            # sequence (a FIN alone may be a half-close it has to probe first).
            self.close(reset=not resp.complete)

    def pause(self) -> None:
        if not self.paused and not self.closed and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and not self.closed and self.transport is not None:
            self.paused = False
            self.last_io = self.loop.time()
            self.transport.resume_reading()

    def close(self, *, reset: bool = False) -> None:
        if not self.closed:
            self.closed = True
            self.pool._forget(self)
            transport = self.transport
            if transport is None:
                return
            if reset:
                sock = transport.get_extra_info("socket")
                try:
                    # SO_LINGER on, 0 s: close() sends RST (Linux, BSD)
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                except (AttributeError, OSError):
                    pass
                transport.abort()
            else:
                transport.close()


#: the connection and response classes every UpstreamPool uses unless its class says otherwise: the
#: compiled twins (server/http/_upstream.pyx: the connection is its own llhttp parser, the parser's
#: events C calls) where the compiled parsers are (server.http.parse), else the two classes above
if parse.backend == "cython":
    from ._upstream import Connection as _connection_class
    from ._upstream import Response as _response_class
    from ._upstream import pool_start as _pool_start
else:
    _connection_class, _response_class = _Connection, UpstreamResponse
    _pool_start = None


def _abandon(opening: asyncio.Task[Any]) -> None:
    """A connect given up (timed out, or its caller cancelled): cancelled, and a connection it made
    all the same (it ended in that loop pass) closed, not left open to the worker."""
    opening.cancel()
    opening.add_done_callback(_close_made)


def _close_made(opening: asyncio.Task[Any]) -> None:
    if not opening.cancelled() and opening.exception() is None:
        opening.result()[0].close()


class Deadlines:
    """Enforces the deadlines of the upstream requests in flight on one event loop.

    A timer handle per request (created, then cancelled) costs more than the
    rest of a request's client side; a tick that looks at the requests in
    flight costs nothing per request and runs only while there are some. A
    pool makes its own; an owner of many pools (the orchestrator: one per
    worker) may give them one to share, so one tick serves them all.
    """

    TICK_S = 0.05

    def __init__(self) -> None:
        self.active: set[_Connection] = set()
        self.handle: asyncio.TimerHandle | None = None

    def add(self, conn: _Connection) -> None:
        # the compiled connection does this (and remove) in C: _upstream.pyx _sweeper_add
        self.active.add(conn)
        if self.handle is None:
            self.handle = conn.loop.call_later(self.TICK_S, self.tick, conn.loop)

    def remove(self, conn: _Connection) -> None:
        self.active.discard(conn)

    def tick(self, loop: asyncio.AbstractEventLoop) -> None:
        self.handle = None
        now = loop.time()
        for conn in list(self.active):
            conn._check_deadline(now)
        if self.active:
            self.handle = loop.call_later(self.TICK_S, self.tick, loop)


class UpstreamPool:
    """Keep-alive connections to the worker at ``url`` (``http://host:port[/prefix]``)."""

    #: each connection's response parser: the twin :mod:`server.http.parse` chose (the tests
    #: choose one in a subclass)
    response_parser: Callable[[_Connection], Any] = ResponseParser
    #: its connections' and responses' classes (the twins server.http.parse chose with the parsers; a
    #: pure-Python connection frames with ``response_parser``, the compiled one is its own parser)
    connection_class: Callable[[UpstreamPool], Any] = _connection_class
    response_class: Callable[..., Any] = _response_class

    def __init__(
        self,
        url: str,
        *,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        max_idle: int = 512,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        extra_headers: bytes = b"",
        deadlines: Deadlines | None = None,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"worker URL must be http://host:port, not {url!r}")
        self.url = url
        self.host = parts.hostname
        self.port = parts.port or 80
        self.prefix = parts.path.rstrip("/").encode()
        host = f"[{self.host}]" if ":" in self.host else self.host
        self._fixed = b"Host: %s:%d\r\n%s" % (host.encode(), self.port, extra_headers)
        self.connect_timeout_s = connect_timeout_s
        self.max_idle = max_idle
        self.idle_timeout_s = idle_timeout_s
        #: the loop of its connections, from the first connect (a pool may be built before a loop runs)
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]
        self.deadlines = deadlines or Deadlines()
        self.idle: list[_Connection] = []
        self.open: set[_Connection] = set()
        #: close() ran: a connect still in flight closes what it made (its request fails, not sent)
        self.closed = False

    async def _connect(self) -> _Connection:
        self.loop = loop = asyncio.get_running_loop()
        # Not asyncio.wait_for: before Python 3.12, a connect that ends in the loop pass where its
        # caller is cancelled returns the connection and the cancel is lost (a cache-events follower
        # polled on, and its owner's stop waited for it forever).
        opening = loop.create_task(
            loop.create_connection(lambda: self.connection_class(self), self.host, self.port)
        )
        try:
            await asyncio.wait((opening,), timeout=self.connect_timeout_s)
        except BaseException:  # cancelled
            _abandon(opening)
            raise
        if not opening.done():
            _abandon(opening)
            raise UpstreamError(f"connect timed out after {self.connect_timeout_s} s", sent=False)
        try:
            _, conn = opening.result()
        except OSError as exc:
            raise UpstreamError(f"cannot connect: {exc.strerror or exc}", sent=False) from None
        if self.closed:  # closed while connecting: the connection would outlive its pool
            conn.close()
            raise UpstreamError("the worker's connection pool was closed", sent=False)
        self.open.add(conn)
        return conn

    def _idle_connection(self) -> _Connection | None:
        idle = self.idle
        if not idle:
            return None
        now = self.loop.time()
        while idle:
            conn = idle.pop()
            if conn.closed or conn.transport is None or conn.transport.is_closing():
                continue
            if now - conn.idle_since > self.idle_timeout_s:
                conn.close()
                continue
            return conn
        return None

    async def request(
        self,
        method: bytes,
        path: bytes,
        pieces: Sequence[BodyPiece] = (),
        *,
        headers: bytes = b"",
        timeout: float | None = None,
        read_timeout: float | None = None,
        max_body: int = 0,
        headers_timeout: float | None = None,
    ) -> UpstreamResponse:
        """Send a request; return once the response's headers are in.

        With ``max_body``, return only once the whole body is in (at most that
        many bytes, else :class:`UpstreamError`): one wake-up per request
        instead of two, then :meth:`~UpstreamResponse.read` returns at once.
        ``headers``: extra header lines, each ending in CRLF. ``headers_timeout``
        (when there is no ``timeout``): the first byte's deadline. Raises
        :class:`UpstreamError` (``sent`` says whether the worker may have seen
        the request) or :class:`UpstreamTimeout`. The caller must
        :meth:`~UpstreamResponse.release` the response. Everything after the
        body is by keyword.
        """
        size = _size(pieces)
        head = self._head(method, path, size, headers)
        for _attempt in range(2):
            conn = self._idle_connection()
            reused = conn is not None
            if conn is None:
                conn = await self._connect()
            try:
                resp = conn.send(
                    self.response_class(conn, max_body),
                    head,
                    pieces,
                    size,
                    timeout,
                    read_timeout,
                    headers_timeout,
                )
                if not resp.complete and not (resp.headers_done and not max_body):
                    await resp.headers_arrived()
                return resp
            except UpstreamError as exc:
                # An idle connection the worker closed as we reused it (a clean close, no byte
                # back): it never saw the request. Once, on a fresh connection.
                if reused and _attempt == 0 and conn.unseen(exc):
                    conn.close()
                    continue
                raise
            except BaseException:
                conn.close(reset=True)  # cancelled (the client left) before the answer: abort it there
                raise
        raise AssertionError("unreachable")

    def _head(self, method: bytes, path: bytes, size: int, headers: bytes) -> bytes:
        return REQUEST_HEAD % (
            method,
            self.prefix,
            path,
            self._fixed,
            size,
            headers,
        )

    def start(
        self,
        listener: Listener,
        method: bytes,
        path: bytes,
        pieces: Sequence[BodyPiece] = (),
        *,
        headers: bytes = b"",
        timeout: float | None = None,
        read_timeout: float | None = None,
        max_body: int = 0,
        headers_timeout: float | None = None,
    ) -> UpstreamResponse:
        """:meth:`request` with no coroutine: the response's events go to ``listener`` (never before this
        returns). Same arguments, deadlines, bounds and retry of a stale pooled connection; a connection
        that cannot be opened is ``leg_error`` with an :class:`UpstreamError` whose ``sent`` is False."""
        resp = self.response_class(None, max_body, listener)
        size = _size(pieces)
        resp.sending = (
            self._head(method, path, size, headers),
            pieces,
            size,
            timeout,
            read_timeout,
            headers_timeout,
        )
        conn = self._idle_connection()
        if conn is None or not self._send_on(conn, resp, reused=True):
            self._open_for(resp)
        return resp

    def _send_on(self, conn: _Connection, resp: UpstreamResponse, *, reused: bool) -> bool:
        """Send a started response's request on ``conn``; False when that connection is closing."""
        try:
            conn.send(resp, *resp.sending)
        except UpstreamError:
            conn.close()
            return False
        resp.reused = reused
        return True

    def _open_for(self, resp: UpstreamResponse) -> None:
        """Open a connection for a started response, then send on it (a task, once per connection)."""
        self.loop = loop = asyncio.get_running_loop()
        opening = loop.create_task(self._connect())
        opening.add_done_callback(partial(self._opened, resp))

    def _opened(self, resp: UpstreamResponse, opening: asyncio.Task[_Connection]) -> None:
        if opening.cancelled():
            exc: BaseException | None = UpstreamError("connect cancelled", sent=False)
        else:
            exc = opening.exception()
        if exc is not None:
            if not resp.abandoned:
                resp.on_error(exc)
            return
        conn = opening.result()
        if resp.abandoned:  # the leg was given up meanwhile: the connection is the pool's
            self._release(conn)
        elif not self._send_on(conn, resp, reused=False):
            resp.on_error(UpstreamError("connection closed before the request was sent", sent=False))

    def _release(self, conn: _Connection) -> None:
        # the compiled connection does this in C: _upstream.pyx _pool_release
        if len(self.idle) >= self.max_idle:
            conn.close()
            return
        conn.idle_since = self.loop.time()
        self.idle.append(conn)

    def _forget(self, conn: _Connection) -> None:
        self.open.discard(conn)

    def close(self) -> None:
        """Close every connection; one being opened closes once open, its request failing (not sent)."""
        self.closed = True
        for conn in list(self.open):
            conn.close()
        self.idle.clear()


#: :meth:`UpstreamPool.start` as written above: the pure twin's. Where the compiled twins are, the
#: pool's ``start`` is ``server.http._upstream.pool_start``: the same steps in one C call instead of
#: five Python frames per leg (the tests set it per twin, with the classes)
pure_start = UpstreamPool.start
if _pool_start is not None:
    UpstreamPool.start = _pool_start  # type: ignore[method-assign]
