"""The listening side: one asyncio protocol per client connection, framing by httptools.

Per request the connection builds one :class:`Request` (method, path, raw
headers, body) and one :class:`Responder`, and runs the server's handler in
one task. Nothing else is allocated per request: no header multidict, no
timer handle (one sweeper per server enforces every connection's deadline),
no response object.

What a hostile client can hold is bounded (:class:`Limits`):

- bytes and count of the request line plus headers (431), body bytes (413,
  checked against Content-Length before the body is read, and while reading a
  chunked one);
- time: to send the headers (408), the body (408), and idle between requests
  on a keep-alive connection (closed);
- connections per server (503 and close beyond the cap), requests pipelined
  ahead on one connection (reading pauses);
- memory of a slow reader: the client transport's write buffer has a high
  water mark; while it is above it, :attr:`Responder.flow` (the upstream
  socket a relayed stream comes from) stops being read.

llhttp, in httptools' strict mode, refuses Content-Length with
Transfer-Encoding, two Content-Lengths, obs-fold, bare LF line ends and
chunk-size overflow; a Transfer-Encoding other than ``chunked`` is refused
here (501). A framing error answers 400 in OpenAI's error shape, never echoes
the request's bytes, and closes the connection after the responses already
due on it.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from email.utils import formatdate
from http import HTTPStatus
from typing import Any, Protocol

import httptools

from server.errors import error_body

log = logging.getLogger("fastcore.http")

JSON = b"application/json"


@dataclass(slots=True)
class Limits:
    """Bounds on what one client can hold (times in seconds, sizes in bytes)."""

    max_header_bytes: int = 16 * 1024
    max_headers: int = 100
    max_body_bytes: int = 32 * 1024 * 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    keepalive_timeout_s: float = 60.0
    max_connections: int = 8192
    #: request body bytes held by the whole server at once (received, not yet
    #: answered); a request that would go past it is a 503 with Retry-After
    max_inflight_body_bytes: int = 512 * 1024 * 1024
    #: seconds a 503 at a server-wide cap (connections, body bytes) asks the client to wait
    retry_after_s: int = 1
    #: complete requests queued behind the one being answered on a connection
    max_pipelined: int = 16
    #: the client write buffer above which a relayed stream's upstream stops being read
    write_high_water: int = 1 << 20


_REASONS: dict[int, bytes] = {s.value: s.phrase.encode() for s in HTTPStatus}
_REASONS[499] = b"Client Closed Request"
_STATUS_LINES: dict[int, bytes] = {}


def status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        line = _STATUS_LINES[status] = b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown"))
    return line


_date = [0, b""]


def date_header() -> bytes:
    """``Date: ...\\r\\n``, formatted once a second."""
    now = int(time.time())
    if now != _date[0]:
        _date[0] = now
        _date[1] = b"Date: " + formatdate(now, usegmt=True).encode() + b"\r\n"
    return _date[1]  # type: ignore[return-value]


class Request:
    """A parsed request: method and path as bytes, raw headers, the whole body."""

    __slots__ = (
        "body",
        "chunked",
        "chunks",
        "content_length",
        "expect_continue",
        "headers",
        "keep_alive",
        "method",
        "path",
        "query",
        "size",
        "url",
        "version",
    )

    def __init__(self) -> None:
        self.method = b""
        self.url = b""
        self.path = b""
        self.query = b""
        self.version = "1.1"
        self.headers: list[tuple[bytes, bytes]] = []
        self.body = b""
        self.chunks: list[bytes] = []
        self.size = 0
        self.content_length: int | None = None
        self.expect_continue = False
        self.chunked = False
        self.keep_alive = True

    def header(self, name: bytes) -> bytes | None:
        """The first header called ``name`` (lower case), or None."""
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None


class Flow(Protocol):
    def pause_reading(self) -> None: ...
    def resume_reading(self) -> None: ...


class Responder:
    """Writes one request's response: whole (:meth:`send`) or streamed (:meth:`start`, :meth:`write`, :meth:`end`)."""

    __slots__ = (
        "_conn",
        "_transport",
        "chunked",
        "finished",
        "flow",
        "head_only",
        "keep_alive",
        "started",
        "status",
    )

    def __init__(self, conn: _Connection, keep_alive: bool, http10: bool, head_only: bool = False) -> None:
        self._conn = conn
        #: a response to HEAD: headers as for GET, never a body (RFC 9110 9.3.2)
        self.head_only = head_only
        self._transport: asyncio.Transport = conn.transport  # type: ignore[assignment]
        self.keep_alive = keep_alive
        self.chunked = not http10
        self.started = False
        self.finished = False
        self.status = 0
        #: while set, paused and resumed with the client's write buffer (backpressure)
        self.flow: Flow | None = None

    @property
    def closed(self) -> bool:
        """The client is gone (or its connection is closing: nothing written now would reach it)."""
        return self._conn.closed or self._transport.is_closing()

    @property
    def paused(self) -> bool:
        return self._conn.write_paused

    @property
    def peer(self) -> object:
        """The client's address (``transport.get_extra_info("peername")``)."""
        return self._transport.get_extra_info("peername")

    def _connection(self) -> bytes:
        return b"" if self.keep_alive else b"Connection: close\r\n"

    def _whole(self, status: int, length: int, content_type: bytes, headers: bytes) -> bytes | None:
        """Start a whole response: its head, or None when the client is gone."""
        if self.started:
            raise RuntimeError("response already started")
        self.started = self.finished = True
        self.status = status
        if self._conn.closed:
            return None
        return b"%sContent-Type: %s\r\nContent-Length: %d\r\n%s%s%s\r\n" % (
            status_line(status),
            content_type,
            length,
            date_header(),
            self._connection(),
            headers,
        )

    def send(self, status: int, body: bytes, content_type: bytes = JSON, headers: bytes = b"") -> None:
        """The whole response. ``headers``: extra header lines, each ending in CRLF."""
        head = self._whole(status, len(body), content_type, headers)
        if head is None:
            return
        if self.head_only:
            self._transport.write(head)
        elif len(body) < 4096:
            self._transport.write(head + body)
        else:
            self._transport.writelines((head, body))

    def send_pieces(
        self, status: int, pieces: Sequence[bytes | memoryview], content_type: bytes, headers: bytes = b""
    ) -> None:
        """:meth:`send` of a body given as pieces (Content-Length their sum), written without joining."""
        head = self._whole(status, sum(len(p) for p in pieces), content_type, headers)
        if head is not None:
            self._transport.writelines((head,) if self.head_only else (head, *pieces))

    def send_error(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: bytes = b"",
    ) -> None:
        self.send(status, error_body(status, message, param=param, code=code), JSON, headers)

    async def drain(self) -> None:
        """Wait while the client's write buffer is above the high-water mark (returns at once if gone)."""
        conn = self._conn
        while conn.write_paused and not conn.closed:
            if conn.drained is None or conn.drained.done():
                conn.drained = conn.loop.create_future()
            await conn.drained

    def start(self, status: int, content_type: bytes, headers: bytes = b"") -> None:
        """Headers of a streamed response (chunked; close-delimited to an HTTP/1.0 client)."""
        if self.started:
            raise RuntimeError("response already started")
        self.started = True
        self.status = status
        if not self.chunked:
            self.keep_alive = False
        framing = b"Transfer-Encoding: chunked\r\n" if self.chunked else b""
        if not self._conn.closed:
            self._transport.write(
                b"%sContent-Type: %s\r\n%s%s%s%s\r\n"
                % (status_line(status), content_type, framing, date_header(), self._connection(), headers)
            )

    def write(self, data: bytes | memoryview) -> None:
        """One piece of a streamed body (no-op once the client is gone)."""
        if not data or self._conn.closed or self.head_only:
            return
        if self.chunked:
            self._transport.writelines((b"%x\r\n" % len(data), data, b"\r\n"))
        else:
            self._transport.write(data)

    def end(self) -> None:
        if self.finished:
            return
        self.finished = True
        if self.chunked and not self._conn.closed and not self.head_only:
            self._transport.write(b"0\r\n\r\n")

    def abort(self) -> None:
        """Drop the connection (a stream that cannot be finished properly)."""
        self.finished = True
        self.keep_alive = False
        self._conn.abort()


Handler = Callable[[Request, Responder], Awaitable[None]]


class _Stop(Exception):
    """Raised in a parser callback to stop parsing (the reason is in ``_Connection.failed``)."""


#: how long a connection that failed keeps reading (and dropping) what its client still sends
LINGER_S = 2.0

# len() of the header names on_header looks at: content-length, transfer-encoding, expect, content-encoding
_CHECKED_LENGTHS = frozenset((14, 17, 6, 16))


class _Connection(asyncio.Protocol):
    __slots__ = (
        "body_timeout_s",
        "closed",
        "current",
        "deadline",
        "deadline_status",
        "drained",
        "failed",
        "head_bytes",
        "header_timeout_s",
        "held",
        "last_read",
        "limits",
        "lingering",
        "loop",
        "max_headers",
        "no_more",
        "parser",
        "queue",
        "reading_paused",
        "responder",
        "server",
        "task",
        "transport",
        "write_paused",
    )

    def __init__(self, server: HTTPServer) -> None:
        self.server = server
        self.limits = server.limits
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.current: Request | None = None
        self.queue: collections.deque[Request] = collections.deque()
        self.task: asyncio.Task[None] | None = None
        self.responder: Responder | None = None
        self.closed = False
        self.failed: tuple[int, str] | None = None
        self.reading_paused = False
        self.write_paused = False
        #: set while a handler waits in Responder.drain; resolved on resume_writing or close
        self.drained: asyncio.Future[None] | None = None
        self.lingering = False
        #: body bytes of this connection's requests not yet answered (the server-wide budget)
        self.held = 0
        #: the last request was framed so that nothing after it can be trusted
        self.no_more = False
        self.head_bytes = 0
        self.last_read = 0
        self.max_headers = self.limits.max_headers
        self.header_timeout_s = self.limits.header_timeout_s
        self.body_timeout_s = self.limits.body_timeout_s
        self.deadline = 0.0
        #: what a missed deadline answers: 408, or 0 to close silently (idle)
        self.deadline_status = 0

    # -- transport events ------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        server = self.server
        server.connections.add(self)
        if len(server.connections) > self.limits.max_connections:
            server.refused += 1
            self.transport.write(  # type: ignore[union-attr]
                _simple_response(
                    503, "the server has too many open connections; retry later", self.limits.retry_after_s
                )
            )
            self.transport.close()  # type: ignore[union-attr]
            self.closed = True
            return
        self.transport.set_write_buffer_limits(high=self.limits.write_high_water)  # type: ignore[union-attr]
        self._set_deadline(self.limits.header_timeout_s, 0)

    def _wake_drain(self) -> None:
        drained = self.drained
        if drained is not None:
            self.drained = None
            if not drained.done():
                drained.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._wake_drain()
        self._release(self.held)
        self.server.connections.discard(self)
        self.queue.clear()
        if self.task is not None:
            self.task.cancel()

    def eof_received(self) -> bool | None:
        return None  # a half-closed client is a gone client: close, cancel what runs (or end a linger)

    def pause_writing(self) -> None:
        self.write_paused = True
        responder = self.responder
        if responder is not None and responder.flow is not None:
            responder.flow.pause_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake_drain()
        responder = self.responder
        if responder is not None and responder.flow is not None:
            responder.flow.resume_reading()
        if self.task is None and self.queue:
            self._next()

    def data_received(self, data: bytes) -> None:
        if self.failed is not None or self.closed or self.no_more:
            return
        self.last_read = len(data)
        current = self.current
        # Headers already in progress when this read began: the whole read is header bytes.
        mid_headers = current is not None and not current.method
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(501, "protocol upgrades (Upgrade, CONNECT) are not supported")
            return
        except httptools.HttpParserCallbackError:
            if self.no_more and self.failed is None:
                return  # parsing stopped on purpose (_Stop after a request that ends the connection)
            if self.failed is None:  # a bug in a callback, not a client error
                log.exception("HTTP parser callback failed")
                self._fail(500, "internal error while reading the request")
            self._flush_failure()
            return
        except httptools.HttpParserError as exc:
            if self.failed is None:
                self._fail(400, f"malformed HTTP request: {exc}")
            return
        current = self.current
        if current is not None and not current.method:
            # Headers still incomplete after this read: bound what they may
            # take. The read they began in is not counted (it may carry the
            # previous request's tail); the exact sum is taken when they end.
            if mid_headers:
                self.head_bytes += len(data)
            if self.head_bytes > self.limits.max_header_bytes:
                self._fail(431, f"request headers exceed {self.limits.max_header_bytes} bytes")
                return
        if len(self.queue) >= self.limits.max_pipelined and not self.reading_paused:
            self.reading_paused = True
            self.transport.pause_reading()  # type: ignore[union-attr]

    # -- parser callbacks --------------------------------------------------------

    def on_message_begin(self) -> None:
        self.current = Request()
        self.head_bytes = 0
        self.deadline = self.loop.time() + self.header_timeout_s
        self.deadline_status = 408

    def on_url(self, url: bytes) -> None:
        req = self.current
        assert req is not None
        req.url += url
        if len(req.url) > self.limits.max_header_bytes:
            self._stop(414, f"request line exceeds {self.limits.max_header_bytes} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        # The hot path: six headers a request. Only three names matter here,
        # told apart by length before any lower-casing.
        headers = self.current.headers  # type: ignore[union-attr]
        headers.append((name, value))
        if len(name) in _CHECKED_LENGTHS:
            self._check_header(name.lower(), value)
        if len(headers) > self.max_headers:
            self._stop(431, f"more than {self.max_headers} request headers")

    def _check_header(self, key: bytes, value: bytes) -> None:
        req = self.current
        assert req is not None
        if key == b"content-length":
            req.content_length = int(value)  # llhttp checked: digits, one header
        elif key == b"transfer-encoding":
            req.chunked = True
            if value.strip().lower() != b"chunked" or sum(k.lower() == key for k, _ in req.headers) > 1:
                self._stop(501, "only 'Transfer-Encoding: chunked' is supported")
        elif key == b"expect":
            if value.strip().lower() != b"100-continue":
                self._stop(417, "only 'Expect: 100-continue' is supported")
            req.expect_continue = True
        elif key == b"content-encoding":
            # A compressed body would reach JSON readers as garbage (or be a
            # decompression bomb): refused up front, never decoded.
            if value.strip().lower() not in (b"identity", b""):
                self._stop(415, "Content-Encoding is not supported: send the request body uncompressed")

    def on_headers_complete(self) -> None:
        req = self.current
        assert req is not None
        # Header bytes: counted per read while the headers were incomplete
        # (data_received); the read that completed them is summed only when
        # it could have carried more than the limit.
        limit = self.limits.max_header_bytes
        if self.head_bytes + self.last_read > limit:
            size = len(req.url) + sum(len(k) + len(v) + 4 for k, v in req.headers)
            if size > limit:
                self._stop(431, f"request headers exceed {limit} bytes")
        parser = self.parser
        req.version = parser.get_http_version()
        if req.version not in ("1.1", "1.0"):
            self._stop(505, f"HTTP/{req.version} is not supported; use HTTP/1.1")
        if parser.should_upgrade():
            self._stop(501, "protocol upgrades (Upgrade, CONNECT) are not supported")
        req.method = parser.get_method()
        url = req.url
        if url[:1] != b"/":
            self._stop(400, "the request target must be a path (origin-form)")
        query = url.find(b"?")
        if query < 0:
            req.path = url
        else:
            req.path, req.query = url[:query], url[query + 1 :]
        limit = self.limits.max_body_bytes
        if req.content_length is not None:
            if req.content_length > limit:
                self._stop(
                    413, f"request body of {req.content_length} bytes exceeds the limit of {limit} bytes"
                )
            if self.server.body_bytes + req.content_length > self.limits.max_inflight_body_bytes:
                self._over_budget()
        if req.version == "1.0":
            req.expect_continue = False  # RFC 9110 15.2: never a 1xx to HTTP/1.0
        if req.expect_continue and self.task is None and not self.queue:
            req.expect_continue = False
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # type: ignore[union-attr]
        self.deadline = self.loop.time() + self.body_timeout_s

    def on_body(self, body: bytes) -> None:
        req = self.current
        assert req is not None
        n = len(body)
        req.size += n
        if req.size > self.limits.max_body_bytes:
            self._stop(413, f"request body exceeds the limit of {self.limits.max_body_bytes} bytes")
        self.held += n
        server = self.server
        server.body_bytes += n
        if server.body_bytes > self.limits.max_inflight_body_bytes:
            self._over_budget()
        req.chunks.append(body)

    def _over_budget(self) -> None:
        self.server.over_budget += 1
        self._stop(503, "the server holds too many request bytes at once; retry later")

    def _release(self, n: int) -> None:
        """Body bytes of a request answered (or of a connection gone) no longer count against the budget."""
        n = min(n, self.held)
        self.held -= n
        server = self.server
        server.body_bytes -= n
        if n >= LARGE_BODY_BYTES:
            server.trim_when_quiet()

    def on_message_complete(self) -> None:
        req = self.current
        assert req is not None
        self.current = None
        req.keep_alive = self.parser.should_keep_alive()
        if req.chunked and req.version == "1.0":
            # RFC 9112 6.1: chunked framing in HTTP/1.0 is faulty; answer this
            # one, then close without reading what follows it.
            req.keep_alive = False
            self.no_more = True
            self.queue.append(self._finish_body(req))
            if self.task is None:
                self._next()
            raise _Stop("HTTP/1.0 with Transfer-Encoding")
        self.queue.append(self._finish_body(req))
        self.deadline = 0.0
        if self.task is None:
            self._next()

    def _finish_body(self, req: Request) -> Request:
        chunks = req.chunks
        if chunks:
            req.body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            req.chunks = []
        return req

    # -- requests ----------------------------------------------------------------

    def _next(self) -> None:
        if self.closed:
            return
        if self.queue and self.write_paused:
            return  # a client that does not read gets no more answers buffered (resume_writing)
        if self.queue:
            req = self.queue.popleft()
            responder = self.responder = Responder(
                self, req.keep_alive, req.version == "1.0", req.method == b"HEAD"
            )
            self.task = self.loop.create_task(self._handle(req, responder))
            if self.reading_paused and len(self.queue) < self.limits.max_pipelined:
                self.reading_paused = False
                self.transport.resume_reading()  # type: ignore[union-attr]
            return
        self.responder = None
        if self.failed is not None:
            self._flush_failure()
            return
        current = self.current
        if current is None:
            self._set_deadline(self.limits.keepalive_timeout_s, 0)
        elif current.expect_continue and current.method:
            # Pipelined behind the responses just sent: its turn to send the body.
            current.expect_continue = False
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # type: ignore[union-attr]

    async def _handle(self, req: Request, responder: Responder) -> None:
        try:
            await self.server.handler(req, responder)
        except asyncio.CancelledError:
            self.task = None
            self._release(req.size)
            if not self.closed:  # not our client leaving: the response can't be trusted to finish
                responder.abort()
            raise
        except Exception:
            log.exception("handler failed on %s %s", req.method.decode(), req.path.decode("latin-1"))
            if not responder.started:
                responder.keep_alive = False
                responder.send_error(500, "internal error")
            else:
                responder.abort()
        self.task = None
        self._release(req.size)
        if not responder.finished:
            if not responder.started:
                responder.send_error(500, "the handler sent no response")
            responder.end()
        if self.closed:
            return
        if not responder.keep_alive:
            self.transport.close()  # type: ignore[union-attr]
            self.closed = True
            return
        self._next()

    # -- failures and deadlines --------------------------------------------------

    def _stop(self, status: int, message: str) -> None:
        self._fail(status, message)
        raise _Stop(message)

    def _fail(self, status: int, message: str) -> None:
        """The connection cannot go on: answer ``status`` after what is due, then close."""
        if self.failed is None:
            self.failed = (status, message)
            self.server.framing_errors += 1
        if self.task is None:
            self._flush_failure()

    def _flush_failure(self) -> None:
        if self.closed or self.failed is None or self.task is not None or self.lingering:
            return
        status, message = self.failed
        transport = self.transport
        assert transport is not None
        transport.write(_simple_response(status, message, self.limits.retry_after_s if status == 503 else 0))
        # Lingering close: a client still sending its body (a 413 mid-upload)
        # must read the answer, not a reset. Its further bytes are dropped;
        # the connection closes when it does, or after LINGER_S.
        self.lingering = True
        if self.reading_paused:
            self.reading_paused = False
            transport.resume_reading()
        if transport.can_write_eof():
            transport.write_eof()
        self._set_deadline(LINGER_S, 0)

    def _set_deadline(self, seconds: float, status: int) -> None:
        self.deadline = self.loop.time() + seconds
        self.deadline_status = status

    def on_deadline(self) -> None:
        self.deadline = 0.0
        if self.closed:
            return
        status = self.deadline_status
        if status == 0 or self.lingering:
            if self.task is None:
                self.abort()
            return
        what = "headers" if self.current is not None and not self.current.method else "body"
        self.server.timeouts += 1
        self._fail(status, f"the request {what} did not arrive in time")

    def abort(self) -> None:
        if not self.closed:
            self.closed = True
            self.transport.close()  # type: ignore[union-attr]


def _simple_response(status: int, message: str, retry_after_s: int = 0) -> bytes:
    body = error_body(status, message)
    retry = b"Retry-After: %d\r\n" % retry_after_s if retry_after_s else b""
    return b"%sContent-Type: application/json\r\nContent-Length: %d\r\n%s%sConnection: close\r\n\r\n%s" % (
        status_line(status),
        len(body),
        date_header(),
        retry,
        body,
    )


def _malloc_trim() -> Callable[[], None] | None:
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    return lambda: trim(0)


#: glibc's malloc_trim(0), or None where there is none
malloc_trim = _malloc_trim()
#: answering a body of at least this size leads to a trim of the C heap
LARGE_BODY_BYTES = 1024 * 1024
#: seconds without a large body answered before that trim
TRIM_QUIET_S = 0.5


class HTTPServer:
    """Serves ``handler`` on a port. ``connections`` is every open client connection."""

    def __init__(self, handler: Handler, limits: Limits | None = None) -> None:
        self.handler = handler
        self.limits = limits or Limits()
        self.loop = asyncio.get_event_loop()
        self.connections: set[_Connection] = set()
        self.server: asyncio.base_events.Server | None = None
        self._sweeper: asyncio.TimerHandle | None = None
        self._tick = 1.0
        #: coroutines run by :meth:`cleanup` after the server is closed
        self.on_close: list[Callable[[], Awaitable[None]]] = []
        # Counters for /metrics.
        self.refused = 0
        self.framing_errors = 0
        self.timeouts = 0
        #: request body bytes held now (all connections), and requests refused for the budget
        self.body_bytes = 0
        self.over_budget = 0
        self._trim: asyncio.TimerHandle | None = None
        self.trims = 0

    @property
    def sockets(self) -> Any:
        return self.server.sockets if self.server else ()

    async def start(self, host: str, port: int, *, reuse_port: bool = False, backlog: int = 4096) -> None:
        self.loop = asyncio.get_running_loop()
        self.server = await self.loop.create_server(
            lambda: _Connection(self), host, port, reuse_port=reuse_port or None, backlog=backlog
        )
        limits = self.limits
        self._tick = max(0.02, min(1.0, limits.header_timeout_s / 4, limits.body_timeout_s / 4))
        self._sweeper = self.loop.call_later(self._tick, self._sweep)

    def trim_when_quiet(self) -> None:
        """Give the C heap back to the OS once large bodies stop coming (TRIM_QUIET_S after the last).

        Python frees a body's memory, but glibc keeps the freed heap (its mmap
        threshold rises after large frees, so later bodies come from the heap):
        without a trim the process would rest near its peak RSS. Each large
        body answered pushes the trim back, so it runs once, after the burst,
        however slowly the burst's requests are handled.
        """
        if malloc_trim is None:
            return
        if self._trim is not None:
            self._trim.cancel()
        self._trim = self.loop.call_later(TRIM_QUIET_S, self._run_trim)

    def _run_trim(self) -> None:
        self._trim = None
        if malloc_trim is not None:
            malloc_trim()
            self.trims += 1

    def _sweep(self) -> None:
        now = self.loop.time()
        for conn in [c for c in self.connections if c.deadline and c.deadline <= now]:
            try:
                conn.on_deadline()
            except Exception:  # one bad connection must not stop the sweeps
                log.exception("deadline handling failed")
                conn.abort()
        self._sweeper = self.loop.call_later(self._tick, self._sweep)

    async def close(self, grace_s: float = 5.0) -> None:
        """Stop listening, let requests in flight finish for ``grace_s``, then drop every connection."""
        if self.server is not None:
            self.server.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        if self._trim is not None:
            self._trim.cancel()
            self._trim = None
        for conn in list(self.connections):
            if conn.task is None:
                conn.abort()
        deadline = self.loop.time() + grace_s
        while any(c.task is not None for c in self.connections) and self.loop.time() < deadline:
            await asyncio.sleep(0.05)
        tasks = [c.task for c in self.connections if c.task is not None]
        for conn in list(self.connections):
            conn.abort()
            if conn.task is not None:
                conn.task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self.server is not None:
            await self.server.wait_closed()

    async def cleanup(self) -> None:
        """:meth:`close`, then the ``on_close`` hooks (the owner's own shutdown)."""
        await self.close()
        for hook in self.on_close:
            await hook()
