# cython: annotation_typing=False, auto_pickle=False, nonecheck=True
"""The upstream side's connection, response, deadline sweeper and the pool's ``start``, written once:
this module is the pure twin, and Cython compiles the same source, in its pure-Python mode, into
``server.http._upstream`` (setup.py), the compiled twin, typed by ``_upstream.pxd`` (cdef classes,
the connection a subclass of :mod:`server.http._parse`'s ``ResponseParser``; the few lines only one
twin runs stand under ``cython.compiled``). Chosen once at this module's end (aiohttp's rule: the
pure ``upstream.py`` is the public module); the annotations are for mypy alone
(``annotation_typing=False``). ``nonecheck``: a typed object that is None (a response its listener
released while the read that ended it is still parsed) raises AttributeError, caught as a failed
read, in the compiled twin too.

:meth:`UpstreamPool.request <server.http.pool.UpstreamPool.request>` returns an
:class:`UpstreamResponse` once its status line and headers are in; its body then either accumulates
(:meth:`UpstreamResponse.read`) or goes, piece by piece as the socket delivers it, to a sink
(:meth:`UpstreamResponse.stream`) with no Python object per SSE event; :func:`pool_start` (the pool's
``start``) tells the same events to a :class:`Listener` instead. A response read to the end on a
keep-alive connection returns the connection to the pool; anything else (a cancel, an early stop, an
error) closes it, so the worker sees the client leave.

The pure :class:`_Connection` frames responses with its pool's ``response_parser``
(:data:`server.http.parse.ResponseParser`: llhttp's callbacks in C, or its pure twin on
httptools), which reads the four headers used here (Content-Type, Content-Length, Retry-After,
Transfer-Encoding) and calls the connection once for the head, per body piece and at the end; the
compiled connection *is* its parser (those events C calls). Either talks to its pool only through
:class:`ConnectionPool`'s methods and fields, and to its :class:`DeadlineSweeper` through ``add`` and
``remove``.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from fastcore import compiled_twin

from .request import PAST_THE_RESPONSE, BadResponse
from .upstream_wire import REQUEST_HEAD, WRITE_JOINED_BELOW, BodyPiece, UpstreamError, UpstreamTimeout

try:
    import cython
except ImportError:  # no Cython where this runs (it is a build requirement only): the pure twin
    from types import SimpleNamespace

    cython = SimpleNamespace(compiled=False)

if not cython.compiled:
    #: what _upstream.pxd cimports from _parse for the compiled twin alone: the connection's base
    #: (``body_at`` calls it) and the reader of uvloop's reads (``get_buffer`` makes one)
    ResponseParser: Any = None
    BodyReader: Any = None

#: a request under this many bytes goes out in one joined write (a C constant in the compiled twin)
_JOINED_BELOW = WRITE_JOINED_BELOW


def body_size(pieces: Sequence[BodyPiece]) -> int:
    size = 0
    for piece in pieces:
        size += len(piece)
    return size


def outgoing(
    pool: ConnectionPool,
    method: bytes,
    path: bytes,
    pieces: Sequence[BodyPiece],
    headers: bytes,
    timeout: float | None,
    read_timeout: float | None,
    headers_timeout: float | None,
) -> tuple[Any, ...]:
    """A request as a connection's :meth:`~_Connection.send` takes it (``UpstreamResponse.sending``): its
    head (the pool's prefix and fixed lines, Content-Length, ``headers``), the body's pieces, their
    size and the three deadlines; both :meth:`UpstreamPool.request` and :func:`pool_start` make it."""
    size = body_size(pieces)
    head = REQUEST_HEAD % (method, pool.prefix, path, pool.fixed_headers, size, headers)
    return (head, pieces, size, timeout, read_timeout, headers_timeout)


class ConnectionPool(Protocol):
    """What a connection (either twin), :func:`outgoing` and :func:`pool_start` ask of their pool
    (:class:`~server.http.pool.UpstreamPool` is the one)."""

    loop: asyncio.AbstractEventLoop
    #: the deadline sweeper of its connections (``add``/``remove``: :class:`DeadlineSweeper`)
    deadlines: Any
    response_parser: Callable[[Any], Any]
    response_class: Callable[..., Any]
    #: its idle connections, the newest last, and how long one may stay idle
    idle: list[Any]
    idle_timeout_s: float
    #: what each request's head carries: the path prefix, and the fixed lines (Host, extra headers)
    prefix: bytes
    fixed_headers: bytes

    def keep(self, conn: Any) -> None:
        """A connection whose response was read to its end: idle in the pool, or closed if it is full."""

    def forget(self, conn: Any) -> None:
        """A connection that closed."""

    def open_for(self, resp: Any) -> None:
        """Open a connection for a started response, then send it there."""


class Listener(Protocol):
    """Who a response started by :meth:`UpstreamPool.start` tells its events, with no future or task."""

    def response_head(self, resp: UpstreamResponse) -> None:
        """The final status line and headers are in (never for a whole-body request)."""

    def response_done(self, resp: UpstreamResponse) -> None:
        """The whole response is in."""

    def response_error(self, resp: UpstreamResponse, exc: BaseException) -> None:
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
            self.listener.response_error(self, exc)
            return True
        _wake(self._headers, exc)
        _wake(self._done, exc)
        return True

    # -- internals -----------------------------------------------------------------

    def _truncate(self) -> None:
        self.truncated = True
        kept = b"".join(self.chunks)[: self.limit]
        self.chunks = [kept]
        _wake(self._done, None)

    async def _wait_done(self) -> None:
        if self.error is not None:
            raise self.error
        self._done = self._conn.loop.create_future()  # type: ignore[union-attr]  # sent
        await self._done


def _wake(fut: asyncio.Future[None] | None, exc: BaseException | None) -> None:
    """Wake a response's waiter (its headers' or its end's future) with ``exc``, or with nothing."""
    if fut is not None and not fut.done():
        if exc is None:
            fut.set_result(None)
        else:
            fut.set_exception(exc)


class DeadlineSweeper:
    """Enforces the deadlines of the upstream requests in flight on one event loop.

    ``timeout`` bounds a whole exchange, ``headers_timeout`` (without ``timeout``) the wait for the
    response's headers, ``read_timeout`` a silence (a stream may run long; it must not stall that
    long); a connection (either twin) is added when it sends a timed request and removed when it ends.
    A timer handle per request (created, then cancelled) costs more than the rest of a request's
    client side; a tick that looks at the requests in flight costs nothing per request and runs only
    while there are some. A pool makes its own; an owner of many pools (the orchestrator: one per
    worker) may give them one to share, so one tick serves them all. Compiled with the connection,
    whose ``add``/``remove`` are then C calls (as Python methods: +1.8% instructions a request).
    """

    TICK_S = 0.05

    def __init__(self) -> None:
        self.active: set[_Connection] = set()
        self.handle: asyncio.TimerHandle | None = None

    def add(self, conn: _Connection) -> None:
        self.active.add(conn)
        if self.handle is None:
            loop = conn.loop
            self.handle = loop.call_later(self.TICK_S, self.tick, loop)

    def remove(self, conn: _Connection) -> None:
        self.active.discard(conn)

    def tick(self, loop: asyncio.AbstractEventLoop) -> None:
        self.handle = None
        now = loop.time()
        for conn in list(self.active):
            conn._check_deadline(now)
        if self.active:
            self.handle = loop.call_later(self.TICK_S, self.tick, loop)


def _sweeper_add(sweeper: Any, conn: _Connection) -> None:
    """``sweeper.add(conn)``: a C call in the compiled twin where the sweeper is its :class:`DeadlineSweeper`."""
    if cython.compiled and type(sweeper) is DeadlineSweeper:
        cython.cast(DeadlineSweeper, sweeper).add(conn)
    else:
        sweeper.add(conn)


def _sweeper_remove(sweeper: Any, conn: _Connection) -> None:
    if cython.compiled and type(sweeper) is DeadlineSweeper:
        cython.cast(DeadlineSweeper, sweeper).remove(conn)
    else:
        sweeper.remove(conn)


class _Connection:
    """One keep-alive connection to a worker; carries one request at a time.

    The pure twin frames with its pool's ``response_parser``, which calls :meth:`on_head`,
    :meth:`on_body` and :meth:`on_message_complete`; the compiled one (``_upstream.pxd``: a subclass
    of :mod:`server.http._parse`'s ``ResponseParser``) is its own parser, whose events ``head``,
    ``body``, ``body_at`` and ``complete`` are C calls into the same three, and reads into its own
    buffers where uvloop lets it (``get_buffer``/``buffer_updated``). Both are asyncio protocols
    (neither subclasses ``asyncio.Protocol``, which uvloop takes as a refusal of ``get_buffer``).
    """

    def __init__(self, pool: ConnectionPool) -> None:
        if cython.compiled:
            self.conn = None  # (the parser's events are this class's C methods)
        else:
            self.parser = pool.response_parser(self)
        self.pool = pool
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
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
        #: (compiled) where uvloop's reads go once it asks (``get_buffer``): a whole body of a known
        #: length into its own bytes; None until then, and always in the pure twin
        self.reader: Any = None

    # -- transport events (asyncio.Protocol's) --------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        resp = self.response
        if resp is None or resp.complete:
            return
        if resp.headers_done and resp.content_length is None and exc is None:
            self.on_message_complete(False)  # a close-delimited body ends with a clean close
            return
        why = f": {exc}" if exc else ""
        stage = "mid-response" if resp.headers_done else "before answering"
        self._fail(UpstreamError(f"connection closed {stage}{why}", clean_close=exc is None))

    def eof_received(self) -> None:
        return None

    def pause_writing(self) -> None:
        pass

    def resume_writing(self) -> None:
        pass

    def data_received(self, data: bytes) -> None:
        self._received(data, 0)

    @property
    def buffered(self) -> bool:
        """Whether the loop reads into this connection's buffers (uvloop asked the compiled one)."""
        return self.reader is not None

    def get_buffer(self, sizehint: int) -> Any:
        if self.reader is None:
            self.reader = BodyReader()
        return self.reader.buffer(cython.address(self.parser))

    def buffer_updated(self, nbytes: int) -> None:
        self._received(None, nbytes)

    def _received(self, data: bytes | None, nbytes: int) -> None:
        """One read: ``data`` (data_received), else ``nbytes`` bytes uvloop read into the reader's buffer."""
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
            if not cython.compiled:
                self.parser.feed(data)
            elif data is not None:
                self.execute(data)  # type: ignore[attr-defined]  # (ResponseParser's, compiled)
            else:
                self.execute_at(self.reader.last_read(), nbytes)  # type: ignore[attr-defined]
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
        writer = resp.writer  # (a listener's response_head may have set it in this read)
        if writer is not None:
            writer.flush()
        if self.release_after_feed:
            self.release_after_feed = False
            if failed:  # bytes past the end of the response it finished: not to be trusted again
                self.close()
            elif self.response is None and not self.closed:
                self.pool.keep(self)

    def _flush(self, resp: UpstreamResponse) -> None:
        """What one read brought of a streamed body, to the sink in one piece (one write to the client)."""
        pending = self.pending
        if pending and resp.sink is not None:
            self.pending = []
            resp.sink(pending[0] if len(pending) == 1 else b"".join(pending))

    # -- the parser's events (server.http.parse: both twins; the compiled one's own, below) -------
    # Each returns 0: the compiled parser's C events return an int (-1: raised).

    def on_head(
        self, status: int, content_type: bytes, content_length: int | None, retry_after: bytes | None
    ) -> int:
        resp = self.response
        if resp is None:  # given up by a listener's event earlier in this read: nobody reads on
            raise BadResponse(PAST_THE_RESPONSE)
        if 100 <= status < 200 and status != 101:
            self.interim = True  # 100 Continue and friends: skipped, the real answer follows
            return 0
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
        if self.reader is not None:  # (compiled, under uvloop) a whole body of a known length: one bytes
            if resp._whole and content_length is not None and content_length <= resp.limit:
                self.reader.begin(content_length)
            else:
                self.reader.drop()
        if not resp._whole:  # (a whole-body request hears the end only)
            if resp.listener is not None:
                resp.listener.response_head(resp)
            else:
                _wake(resp._headers, None)
        return 0

    def on_body(self, body: bytes) -> int:
        resp = self.response
        if resp is None:
            raise BadResponse(PAST_THE_RESPONSE)
        if self.interim:
            return 0
        if resp.sink is not None:
            resp.size += len(body)
            self.pending.append(body)  # flushed once the read is parsed
            return 0
        if resp.truncated:
            return 0
        resp.size += len(body)
        resp.chunks.append(body)
        if resp.limit and resp.size > resp.limit:
            if resp._whole:
                # raised, not failed here: the parser stops (the rest of the read is not parsed)
                raise UpstreamError(f"response body exceeds {resp.limit} bytes")
            resp._truncate()
        return 0

    def on_message_complete(self, keep_alive: bool) -> int:
        resp = self.response
        if resp is None:
            raise BadResponse(PAST_THE_RESPONSE)
        if self.interim:  # a 1xx ended (on_head kept none of its headers): the real answer follows
            self.interim = False
            return 0
        if self.reader is not None and self.reader.data is not None:
            whole = self.reader.finish()  # (compiled) the body read into its own bytes
            if whole is not None:
                resp.chunks = [whole]
        self._cancel_timer()
        if self.pending:  # a listener hears the end now: the stream's last pieces go first
            self._flush(resp)
        resp.complete = True
        resp.keep_alive = keep_alive
        if resp.listener is not None:
            resp.listener.response_done(resp)
            return 0
        _wake(resp._headers, None)
        _wake(resp._done, None)
        return 0

    # The compiled parser's C events (ResponseParser's, overridden): the three above, and a body
    # piece where llhttp saw it, taken into the reader's bytes where it reads a whole body.

    def head(
        self, status: int, content_type: bytes, content_length: int | None, retry_after: bytes | None
    ) -> int:
        return self.on_head(status, content_type, content_length, retry_after)

    def body(self, piece: bytes) -> int:
        return self.on_body(piece)

    def complete(self, keep_alive: bool) -> int:
        return self.on_message_complete(keep_alive)

    def body_at(self, at: Any, n: int) -> int:
        resp = self.response
        if resp is None:
            raise BadResponse(PAST_THE_RESPONSE)
        if self.reader is None or self.reader.data is None or self.interim:
            return ResponseParser.body_at(self, at, n)
        self.reader.take(at, n)
        resp.size += n
        return 0

    # -- requests -------------------------------------------------------------------

    def send(self, resp: UpstreamResponse) -> UpstreamResponse:
        """Write the request ``resp.sending`` holds (:func:`outgoing`): its head and its body's pieces
        (``size`` bytes in all, the head's Content-Length), and time it."""
        head, pieces, size, timeout, read_timeout, headers_timeout = resp.sending
        transport = self.transport
        if transport is None or transport.is_closing():
            # The worker closed (or died) and connection_lost has not run yet: writing would
            # raise (uvloop: RuntimeError). Nothing was sent, so the request may go elsewhere.
            self.closed = True
            raise UpstreamError("connection closed before the request was sent", sent=False)
        resp._conn = self
        self.response = resp
        if cython.compiled:
            self.ended = False  # its answer may begin
        else:
            self.parser.ended = False
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
            _sweeper_add(self.sweeper, self)
        if size < _JOINED_BELOW:
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
            _sweeper_remove(self.sweeper, self)

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
            self.pool.open_for(resp)
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
                self.pool.keep(self)
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
        if self.reader is not None:
            self.reader.drop()  # a body read into when it failed goes now, not with this object
        if not self.closed:
            self.closed = True
            self.pool.forget(self)
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


if not cython.compiled:
    # The compiled twin's own parser events and buffered reads (uvloop reads through get_buffer into
    # any protocol that has it): the pure connection takes its parser's events as Python calls.
    del _Connection.head, _Connection.body, _Connection.complete, _Connection.body_at
    del _Connection.get_buffer, _Connection.buffer_updated


def idle_connection(pool: ConnectionPool) -> _Connection | None:
    """The newest idle connection of ``pool`` still open and not idle too long (the stale ones closed
    on the way), or None: :meth:`UpstreamPool.idle_connection <server.http.pool.UpstreamPool.idle_connection>`."""
    idle = pool.idle
    if not idle:
        return None
    now = pool.loop.time()
    limit = pool.idle_timeout_s
    while idle:
        conn = idle.pop()
        if conn.closed or conn.transport is None or conn.transport.is_closing():
            continue
        if now - conn.idle_since > limit:
            conn.close()
            continue
        return conn
    return None


def send_on(conn: _Connection, resp: UpstreamResponse, reused: bool) -> bool:
    """Send a started response's request on ``conn``; False (``conn`` closed) when it is closing."""
    try:
        conn.send(resp)
    except UpstreamError:
        conn.close()
        return False
    resp.reused = reused
    return True


def pool_start(
    pool: ConnectionPool,
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
    """:meth:`UpstreamPool.start <server.http.pool.UpstreamPool.start>`: :meth:`~UpstreamPool.request`
    with no coroutine: the response's events go to ``listener`` (never before this returns). Same
    arguments, deadlines, bounds and retry of a stale pooled connection; a connection that cannot be
    opened is ``response_error`` with an :class:`UpstreamError` whose ``sent`` is False. Compiled, one
    C call a leg (no Python frame for it, :func:`outgoing`, :func:`idle_connection` or :func:`send_on`)."""
    resp = pool.response_class(None, max_body, listener)
    resp.sending = outgoing(pool, method, path, pieces, headers, timeout, read_timeout, headers_timeout)
    conn = idle_connection(pool)
    if conn is None or not send_on(conn, resp, True):
        pool.open_for(resp)
    return resp


#: the twins every :class:`~server.http.pool.UpstreamPool` uses unless its class says otherwise: this
#: source compiled (server.http._upstream, typed by _upstream.pxd: the connection is its own llhttp
#: parser, the parser's events C calls, the pool's ``start`` one C call a leg), else the pure ones
#: above (the tests choose per twin); the compiled module binds the same names to its own classes
_compiled = None if cython.compiled else compiled_twin("server.http._upstream")
Connection: Callable[[ConnectionPool], Any] = _Connection
Response: Callable[..., Any] = UpstreamResponse
start: Callable[..., Any] = pool_start
if _compiled is not None:
    Connection, Response, start = _compiled.Connection, _compiled.Response, _compiled.start
if TYPE_CHECKING:  # the pure class is the type (the compiled one is the same source)
    Deadlines = DeadlineSweeper
else:
    #: the deadline sweeper a pool makes unless given one (``server.http.Deadlines``): the compiled
    #: one with the compiled connection, whose ``add``/``remove`` are then C calls
    Deadlines = DeadlineSweeper if _compiled is None else _compiled.Deadlines
#: ``"cython"`` or ``"python"``: which twin :data:`Connection` is
backend = "cython" if cython.compiled or _compiled is not None else "python"
