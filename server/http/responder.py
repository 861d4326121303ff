"""The writing side of one request: status lines, the Date header (:class:`DateHeader`), :class:`Responder`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from email.utils import formatdate
from http import HTTPStatus
from typing import Protocol

from server.errors import error_body

JSON = b"application/json"
EVENT_STREAM = b"text/event-stream"
#: a streamed piece below this many bytes is framed by a copy and written (or held) with its framing;
#: a larger one is written as its pieces, never held
SMALL_PIECE = 4096

_REASONS: dict[int, bytes] = {s.value: s.phrase.encode() for s in HTTPStatus}
_REASONS[499] = b"Client Closed Request"
_STATUS_LINES: dict[int, bytes] = {}


def status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        line = _STATUS_LINES[status] = b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown"))
    return line


class DateHeader:
    """``Date: ...\\r\\n`` (RFC 9110 6.6.1), formatted once a second; one per server."""

    __slots__ = ("_line", "_second")

    def __init__(self) -> None:
        self._second = 0
        self._line = b""

    def __call__(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._line = b"Date: " + formatdate(now, usegmt=True).encode() + b"\r\n"
        return self._line


class Flow(Protocol):
    def pause_reading(self) -> None: ...
    def resume_reading(self) -> None: ...


class _Dated(Protocol):
    @property
    def date(self) -> DateHeader: ...


class Connection(Protocol):
    """What a :class:`Responder` needs of its client connection (server.http.server's)."""

    @property
    def server(self) -> _Dated: ...

    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport | None
    closed: bool
    #: the client's write buffer is above its high-water mark; ``drained`` is done when it is not
    write_paused: bool
    drained: asyncio.Future[None] | None

    def abort(self) -> None: ...

    def handled(self, responder: Responder) -> None: ...


class Responder:
    """Writes one request's response: whole (:meth:`send`) or streamed (:meth:`start`, :meth:`write`, :meth:`end`)."""

    __slots__ = (
        "_conn",
        "_held",
        "_last",
        "_transport",
        "chunked",
        "event_stream",
        "finished",
        "flow",
        "head_only",
        "keep_alive",
        "started",
        "status",
    )

    def __init__(self, conn: Connection, keep_alive: bool, http10: bool, head_only: bool = False) -> None:
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
        #: a streamed response's writes held (:meth:`hold`) until :meth:`flush`
        self._held: list[bytes | memoryview] | None = None
        #: the streamed response is ``text/event-stream``; the last piece :meth:`write` was given
        self.event_stream = False
        self._last: bytes | memoryview = b""

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
            self._conn.server.date(),
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
        elif len(body) < SMALL_PIECE:
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
        self.event_stream = (
            content_type == EVENT_STREAM  # (what our workers and the orchestrator send)
            or content_type.partition(b";")[0].strip().lower() == EVENT_STREAM
        )
        if not self.chunked:
            self.keep_alive = False
        framing = b"Transfer-Encoding: chunked\r\n" if self.chunked else b""
        if not self._conn.closed:
            self._out(
                b"%sContent-Type: %s\r\n%s%s%s%s\r\n"
                % (
                    status_line(status),
                    content_type,
                    framing,
                    self._conn.server.date(),
                    self._connection(),
                    headers,
                )
            )

    def write(self, data: bytes | memoryview) -> None:
        """One piece of a streamed body (no-op once the client is gone)."""
        if not data or self._conn.closed or self.head_only:
            return
        self._last = data
        if self.chunked:
            if len(data) < SMALL_PIECE:  # one small write, not three pieces (as send: a copy costs less)
                self._out(b"%x\r\n%s\r\n" % (len(data), data))
                return
            pieces: tuple[bytes | memoryview, ...] = (b"%x\r\n" % len(data), data, b"\r\n")
        elif len(data) < SMALL_PIECE:
            self._out(data)
            return
        else:
            pieces = (data,)
        held = self._held
        if held:  # what is held goes first; a large piece is not copied to join it
            self._held = []
            self._transport.write(held[0] if len(held) == 1 else b"".join(held))
        self._transport.writelines(pieces)

    def end(self) -> None:
        if self.finished:
            return
        self.finished = True
        if self.chunked and not self._conn.closed and not self.head_only:
            self._out(b"0\r\n\r\n")

    @property
    def between_events(self) -> bool:
        """An event stream that started and did not end, whose last write ended an event (a blank line
        in LF, as our workers and OpenAI write them), with nothing held: an SSE comment written now
        changes nothing a client parses. A stream that stopped elsewhere (a relayed read that split an
        event, CRLF lines) is not: in the middle of an event its blank line would dispatch the event's
        first half."""
        return (
            self.event_stream
            and not self.finished
            and self._held is None
            and (not self._last or self._last[-2:] == b"\n\n")
        )

    def _out(self, data: bytes | memoryview) -> None:
        if self._held is None:
            self._transport.write(data)
        else:
            self._held.append(data)

    def hold(self) -> None:
        """Keep what the stream writes (head, pieces, end) until :meth:`flush`, which writes it at once:
        what one read of a worker's socket brings goes to the client in one write, not three."""
        if self._held is None:
            self._held = []

    def flush(self) -> None:
        """Write what :meth:`hold` kept, in one write, and stop holding."""
        held = self._held
        if held is None:
            return
        self._held = None
        if held and not self._conn.closed:
            self._transport.write(held[0] if len(held) == 1 else b"".join(held))

    def abort(self) -> None:
        """Drop the connection (a stream that cannot be finished properly)."""
        self.finished = True
        self.keep_alive = False
        self._conn.abort()

    def done(self) -> None:
        """The handler's :class:`~server.http.server.Handling` is over: the connection moves on (what it
        held written first: the next pipelined answer goes after it)."""
        if self._held is not None:
            self.flush()
        self._conn.handled(self)


def simple_response(status: int, message: str, date: bytes, retry_after_s: int = 0) -> bytes:
    """A whole error response that closes the connection (``date``: the server's Date line)."""
    body = error_body(status, message)
    retry = b"Retry-After: %d\r\n" % retry_after_s if retry_after_s else b""
    return b"%sContent-Type: application/json\r\nContent-Length: %d\r\n%s%sConnection: close\r\n\r\n%s" % (
        status_line(status),
        len(body),
        date,
        retry,
        body,
    )
