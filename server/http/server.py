"""The listening side: one asyncio protocol per client connection, framing by a request parser.

Per request the parser builds one :class:`Request` (method, path, raw
headers, body), the connection one :class:`Responder`, and runs the server's
handler in one task. Nothing else is allocated per request: no header multidict, no
timer handle (one sweeper per server enforces every connection's deadline),
no response object.

What a hostile client can hold is bounded (:class:`Limits`, in
:mod:`server.http.limits`; responses are written by :mod:`server.http.responder`):

- bytes and count of the request line plus headers (431), and of a chunked
  body's trailer section, whose fields are then dropped (never merged into
  the headers); body bytes (413, checked against Content-Length before the
  body is read, against each chunk's declared size, and while reading);
- time: to send the headers (408), the body (408), and idle between requests
  on a keep-alive connection (closed);
- connections and body bytes held at once per server (503 and close beyond
  the caps), and per client IP: past ``peer_share`` of either, a client may
  not take its last share (429: its own doing, not the server's state); at
  the connection cap an idle or slow connection of the client holding the
  most makes room for a newcomer;
- requests pipelined ahead on one connection (reading pauses);
- memory of a slow reader: the client transport's write buffer has a high
  water mark; while it is above it, :attr:`Responder.flow` (the upstream
  socket a relayed stream comes from) stops being read.

The framing and the checks of each request's bytes (smuggling, the bounds
on headers, trailers and body sizes) are the parser's
(:mod:`server.http.parse`: llhttp's callbacks in C, or its pure twin on
httptools); the connection here keeps one implementation of the rest. A
framing error answers 400 in OpenAI's error shape, never echoes the
request's bytes, and closes the connection after the responses already due
on it. A client that half-closes after complete requests is answered, then
closed; the FIN is answered by a probe (an interim 100, or an SSE comment in
an event stream already started) whose reset, from a client that closed
altogether, cancels its request (:meth:`_Connection.eof_received`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from .limits import PEER_SHARE, Limits
from .memory import malloc_trim
from .parse import RequestParser
from .request import Refused, Request
from .responder import JSON, DateHeader, Flow, Responder, simple_response, status_line

__all__ = [
    "JSON",
    "PEER_SHARE",
    "DateHeader",
    "Flow",
    "HTTPServer",
    "Handling",
    "Limits",
    "Request",
    "Responder",
    "handler_failed",
    "status_line",
]

log = logging.getLogger("fastcore.http")


class Handling:
    """What a handler returns for a request it serves from callbacks, with no task: it calls
    :meth:`Responder.done` once the response is finished, and :meth:`cancel` (the client left, a
    shutdown) must end it, :meth:`Responder.done` included. A handler returns that, an awaitable
    (run in a task, as before), or None: answered already."""

    __slots__ = ()

    def cancel(self) -> None:
        raise NotImplementedError


Handler = Callable[[Request, Responder], "Awaitable[None] | Handling | None"]


def handler_failed(req: Request, responder: Responder) -> None:
    """A bug in what serves ``req``, not the client's error (call it where the exception is caught):
    logged with its traceback, then a 500 that closes the connection, or a cut response when it
    had started."""
    log.exception("handler failed on %s %s", req.method.decode(), req.path.decode("latin-1"))
    if not responder.started:
        responder.keep_alive = False
        responder.send_error(500, "internal error")
    else:
        responder.abort()


class _Stop(Exception):
    """Raised in a parser event to stop parsing (the reason is in ``_Connection.failed``)."""


#: how long a connection that failed keeps reading (and dropping) what its client still sends
LINGER_S = 2.0
#: what a connection refused for its headers' or trailers' size (414, 431) reads while it lingers:
#: an honest client has sent little past them, a flood of them would cost a core to read and drop
LINGER_HEAD_BYTES = 256 * 1024

#: how often a half-closed client is checked for a reset (the peer had closed, not only half-closed)
HALF_CLOSE_PROBE_S = 0.05
#: the first check, soon after the probe's 100 Continue: a gone client's reset is back within a
#: round trip, and an abandoned request's KV is freed on both workers that much sooner (bench.faults)
HALF_CLOSE_FIRST_PROBE_S = 0.005
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
#: the probe in an event stream that started: a comment line (HTML living standard, server-sent
#: events 9.2.6: a line that starts with a colon is ignored), then the blank line that ends an
#: event, which dispatches nothing where no field came since the last one
SSE_PROBE = b":\n\n"


class _Peer:
    """What one client IP holds: its open connections and body bytes (bounded by ``Limits.peer_share``)."""

    __slots__ = ("body_bytes", "connections", "ip")

    def __init__(self, ip: str) -> None:
        self.ip = ip
        self.connections: set[_Connection] = set()
        self.body_bytes = 0


#: the peer of a connection not yet made
_NO_PEER = _Peer("")


class _Connection:
    """One client connection (an asyncio protocol). With the compiled request parser it is also a
    buffered one under uvloop, which reads into buffers of a protocol that has ``get_buffer`` and is
    no ``asyncio.Protocol``: ``get_buffer`` is then the parser's own (a body of a known length read
    straight into one bytes object), ``buffer_updated`` its feed; asyncio's own loop, and the pure
    twin's parser, hand ``data_received`` bytes objects."""

    __slots__ = (
        "body_timeout_s",
        "client_eof",
        "closed",
        "current",
        "deadline",
        "deadline_status",
        "drained",
        "failed",
        "get_buffer",
        "header_timeout_s",
        "limits",
        "linger_left",
        "lingering",
        "loop",
        "no_more",
        "parser",
        "peer",
        "queue",
        "reading_paused",
        "responder",
        "server",
        "serving",
        "task",
        "transport",
        "write_paused",
    )

    def __init__(self, server: HTTPServer) -> None:
        self.server = server
        self.limits = server.limits
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.parser = server.request_parser(self, self.limits)
        get_buffer = getattr(self.parser, "get_buffer", None)
        if get_buffer is not None:  # (the compiled parser's: no Python frame per read for it)
            self.get_buffer = get_buffer
        self.current: Request | None = None
        self.queue: collections.deque[Request] = collections.deque()
        #: what serves the request being answered: its task, or the handler's Handling
        self.task: asyncio.Task[None] | Handling | None = None
        #: the request being answered (while ``task`` is set)
        self.serving: Request | None = None
        self.responder: Responder | None = None
        self.closed = False
        self.failed: tuple[int, str] | None = None
        self.reading_paused = False
        self.write_paused = False
        #: set while a handler waits in Responder.drain; resolved on resume_writing or close
        self.drained: asyncio.Future[None] | None = None
        self.lingering = False
        #: bytes a lingering connection still reads before it stops reading (-1: no bound)
        self.linger_left = -1
        #: the client's IP and what it holds (set on connection_made)
        self.peer: _Peer = _NO_PEER
        #: the client half-closed (shut its sending side) after complete requests: answer them, then close
        self.client_eof = False
        #: the last request was framed so that nothing after it can be trusted
        self.no_more = False
        self.header_timeout_s = self.limits.header_timeout_s
        self.body_timeout_s = self.limits.body_timeout_s
        self.deadline = 0.0
        #: what a missed deadline answers: 408, or 0 to close silently (idle)
        self.deadline_status = 0

    # -- transport events ------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        server = self.server
        peername = transport.get_extra_info("peername")
        refusal = server.admit(self, peername[0] if isinstance(peername, tuple) and peername else "")
        if refusal is not None:
            server.refused += 1
            self.transport.write(simple_response(*refusal, server.date(), self.limits.retry_after_s))  # type: ignore[union-attr]
            self.transport.close()  # type: ignore[union-attr]
            self.closed = True
            return
        if server.closing:
            # Accepted in the loop pass where close() ran, attached after it swept the connections:
            # no sweeper times it any more, and from Python 3.12.1 wait_closed() waits for it.
            self.abort()
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
        # The running request's bytes are released by its task, cancelled here.
        if self.current is not None:
            self._release(self.current)
            self.current = None
        for req in self.queue:
            self._release(req)
        self.queue.clear()
        self.server.forget(self)
        if self.task is not None:
            self.task.cancel()

    def eof_received(self) -> bool | None:
        """The client shut its sending side (FIN).

        RFC 9112 9.6 lets a client half-close after its request and still
        read the answer: complete requests are answered, then the connection
        closes. But a FIN is also what a client that closed altogether sends;
        such a client resets the connection when it receives bytes, so a probe
        is sent and the socket is checked for that reset
        (:meth:`_check_half_closed`): a gone client's request is still
        cancelled (its task, or :meth:`Handling.cancel`), within milliseconds
        on a LAN, even while its handler writes nothing (a long prefill, a
        stalled worker). The probe is what can be written without changing
        the response:

        - before the response starts: an interim ``100 Continue`` (RFC 9110
          15.2: a 1.1 client parses 1xx it did not ask for; never to 1.0);
        - in an event stream that started, where the last write ended an
          event: an SSE comment (:data:`SSE_PROBE`, one chunk, or raw bytes
          in a close-delimited 1.0 body), which every SSE client ignores;
          never while the responder holds writes (the probe would pass them);
        - in any other started response, nothing: any byte would be part of
          the body (another stream's format, a response of a known length, an
          event half written). Its handler's next write is the probe: the
          request is cancelled then, or at its timeout.
        """
        if self.lingering or self.failed is not None or (self.task is None and not self.queue):
            return None  # nothing is due (a partial request can never end): close, end a linger
        self.client_eof = self.no_more = True
        if self.current is not None:
            self._release(self.current)
            self.current = None
        responder = self.responder
        if responder is not None:
            if not responder.started:
                if responder.chunked:  # never a 1xx to HTTP/1.0
                    self.transport.write(_CONTINUE)  # type: ignore[union-attr]
            elif responder.between_events:
                responder.write(SSE_PROBE)  # framed as the response is (a chunk, or raw to 1.0)
        self.loop.call_later(HALF_CLOSE_FIRST_PROBE_S, self._check_half_closed)
        return True

    def _check_half_closed(self) -> None:
        """A half-closed client's socket: closed once a reset says the client is gone, else checked again."""
        if self.closed or self.transport is None:
            return
        sock = self.transport.get_extra_info("socket")
        if sock is None:
            return  # not a socket: nothing to probe, the response's writes will tell
        try:
            gone = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) != 0
        except OSError:
            gone = True
        if gone:
            self.abort()
        else:
            self.loop.call_later(HALF_CLOSE_PROBE_S, self._check_half_closed)

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
        self._received(data, len(data))

    def buffer_updated(self, nbytes: int) -> None:
        self._received(None, nbytes)

    def _received(self, data: bytes | None, n: int) -> None:
        """One read: ``data``, or (``None``) ``n`` bytes where the parser's get_buffer said."""
        if self.failed is not None or self.closed or self.no_more:
            if self.lingering and self.linger_left >= 0:
                self.linger_left -= n
                if self.linger_left < 0 and not self.reading_paused:
                    self.reading_paused = True  # until the close at LINGER_S
                    self.transport.pause_reading()  # type: ignore[union-attr]
            return
        try:
            if data is None:
                self.parser.feed_buffered(n)
            else:
                self.parser.feed(data)
        except Refused as exc:
            self._fail(exc.status, exc.message)
            return
        except _Stop:
            if self.no_more and self.failed is None:
                return  # parsing stopped on purpose (after a request that ends the connection)
            self._flush_failure()
            return
        except Exception:  # a bug in an event, not a client error
            log.exception("HTTP parser event failed")
            self._fail(500, "internal error while reading the request")
            self._flush_failure()
            return
        if len(self.queue) >= self.limits.max_pipelined and not self.reading_paused:
            self.reading_paused = True
            self.transport.pause_reading()  # type: ignore[union-attr]

    # -- the parser's events (server.http.parse: both twins) ---------------------

    def on_message_begin(self, req: Request) -> None:
        self.current = req
        self.deadline = self.loop.time() + self.header_timeout_s
        self.deadline_status = 408

    def on_head(self, req: Request) -> None:
        """Its request line and headers passed the parser's checks: count its body, invite it, time it."""
        if req.content_length:
            # Counted whole now: a server that admitted every body and refused
            # them part-way when the budget ran out would answer none.
            self._hold(req, req.content_length)
        if req.expect_continue and self.task is None and not self.queue:
            req.expect_continue = False
            self.transport.write(_CONTINUE)  # type: ignore[union-attr]
        self.deadline = self.loop.time() + self.body_timeout_s

    def on_body_piece(self, req: Request, n: int) -> None:
        """``n`` more bytes of a chunked body (a Content-Length one was counted at :meth:`on_head`)."""
        self._hold(req, n)

    def _hold(self, req: Request, n: int) -> None:
        """Count ``n`` body bytes of ``req`` against the budgets, or stop: 503 for the server's, 429 for the client's share."""
        server, peer = self.server, self.peer
        budget = self.limits.max_inflight_body_bytes
        total = server.body_bytes + n
        if total > budget:
            server.over_budget += 1
            self._stop(503, "the server holds too many request bytes at once; retry later")
        kept = budget * self.limits.peer_share  # the last part, for clients under their share
        if peer.body_bytes + n > kept and total > budget - kept:
            server.over_budget += 1
            self._stop(429, "this client's requests hold too many of the server's request bytes; retry later")
        req.held += n
        peer.body_bytes += n
        server.body_bytes = total

    def _release(self, req: Request) -> None:
        """The body bytes of a request answered (or dropped) no longer count against the budgets."""
        n = req.held
        if not n:
            return
        req.held = 0
        peer = self.peer
        peer.body_bytes -= n
        server = self.server
        server.body_bytes -= n
        if self.closed:
            server.forget(self)  # the last bytes of a client gone may be these
        if n >= LARGE_BODY_BYTES:
            server.trim_when_quiet()

    def on_message_complete(self, req: Request) -> None:
        self.current = None
        if req.chunked and req.version == "1.0":
            # RFC 9112 6.1: chunked framing in HTTP/1.0 is faulty; answer this
            # one, then close without reading what follows it.
            req.keep_alive = False
            self.no_more = True
            self.queue.append(req)
            if self.task is None:
                self._next()
            raise _Stop("HTTP/1.0 with Transfer-Encoding")
        self.queue.append(req)
        self.deadline = 0.0
        if self.task is None:
            self._next()

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
            if self.reading_paused and len(self.queue) < self.limits.max_pipelined:
                self.reading_paused = False
                self.transport.resume_reading()  # type: ignore[union-attr]
            self.serving = req
            try:
                work = self.server.handler(req, responder)
            except Exception:
                work = None
                handler_failed(req, responder)
            if work is None:  # answered already
                self._after(req, responder)
            elif isinstance(work, Handling):  # served from callbacks: Responder.done() ends it
                self.task = work
            else:
                self.task = self.loop.create_task(self._handle(req, responder, work))
            return
        self.responder = None
        if self.client_eof:
            self.abort()  # half-closed: every complete request answered (close flushes them first)
            return
        if self.failed is not None:
            self._flush_failure()
            return
        current = self.current
        if current is None:
            self._set_deadline(self.limits.keepalive_timeout_s, 0)
        elif current.expect_continue and current.method:
            # Pipelined behind the responses just sent: its turn to send the body.
            current.expect_continue = False
            self.transport.write(_CONTINUE)  # type: ignore[union-attr]

    async def _handle(self, req: Request, responder: Responder, work: Awaitable[None]) -> None:
        try:
            await work
        except asyncio.CancelledError:
            self.task = self.serving = None
            self._release(req)
            if not self.closed:  # not our client leaving: the response can't be trusted to finish
                responder.abort()
            raise
        except Exception:
            handler_failed(req, responder)
        self._after(req, responder)

    def handled(self, responder: Responder) -> None:
        """A :class:`Handling` finished (:meth:`Responder.done`): the connection moves on."""
        req = self.serving
        if responder is not self.responder or req is None or not isinstance(self.task, Handling):
            return  # not the one being served (a late call): nothing to do
        self._after(req, responder)

    def _after(self, req: Request, responder: Responder) -> None:
        """``req`` is served: its bytes go back, then the next request, or the close."""
        self.task = self.serving = None
        self._release(req)
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
            if status in (413, 431):
                # It read up to a limit's worth of bytes (a trailer or a body piece
                # by piece): the heap they took goes back too, once such
                # requests stop coming.
                self.server.trim_when_quiet()
        current = self.current
        if current is not None:  # never handled: its bytes go back now, not when the linger ends
            self._release(current)
            current.chunks = []
            self.current = None
        if self.task is None:
            self._flush_failure()

    def _flush_failure(self) -> None:
        if self.closed or self.failed is None or self.task is not None or self.lingering:
            return
        status, message = self.failed
        transport = self.transport
        assert transport is not None
        retry_after = self.limits.retry_after_s if status in (429, 503) else 0
        transport.write(simple_response(status, message, self.server.date(), retry_after))
        # Lingering close: a client still sending its body (a 413 mid-upload)
        # must read the answer, not a reset. Its further bytes are dropped;
        # the connection closes when it does, or after LINGER_S.
        self.lingering = True
        if status in (414, 431):
            self.linger_left = LINGER_HEAD_BYTES
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

    @property
    def evictable(self) -> bool:
        """Nothing is being answered or due, and no body is arriving: idle, or sending its headers."""
        current = self.current
        return (
            not self.closed
            and self.task is None
            and not self.queue
            and self.failed is None
            and (current is None or not current.method)
        )


#: answering a body of at least this size leads to a trim of the C heap (with the heap kept for
#: bodies, server/http/memory.py keep_heap_for_bodies, the trim is what gives it back)
LARGE_BODY_BYTES = 64 * 1024
#: seconds without a large body answered before that trim
TRIM_QUIET_S = 0.5
#: missed deadlines handled in one callback (the rest after the I/O ready meanwhile)
SWEEP_BATCH = 128


class HTTPServer:
    """Serves ``handler`` on a port. ``connections`` is every open client connection."""

    #: each connection's request parser: the twin :mod:`server.http.parse` chose (the tests
    #: choose one in a subclass)
    request_parser: Callable[[_Connection, Limits], Any] = RequestParser

    def __init__(self, handler: Handler, limits: Limits | None = None) -> None:
        self.handler = handler
        self.limits = limits or Limits()
        #: the loop it serves on, from :meth:`start` (a server is built before its loop may run)
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]
        #: the Date line of every response, formatted once a second
        self.date = DateHeader()
        self.connections: set[_Connection] = set()
        #: client IP -> its connections and body bytes (while it holds either)
        self.peers: dict[str, _Peer] = {}
        self.server: asyncio.base_events.Server | None = None
        #: close() began: a connection that attaches from here is closed at once
        self.closing = False
        self._sweeper: asyncio.TimerHandle | None = None
        self._tick = 1.0
        #: coroutines run by :meth:`cleanup` after the server is closed
        self.on_close: list[Callable[[], Awaitable[None]]] = []
        # Counters for /metrics.
        self.refused = 0
        #: idle or slow connections closed to make room for a newcomer at the connection cap
        self.evicted = 0
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
            # a protocol by its methods, not an asyncio.Protocol (uvloop would not read into its buffers)
            lambda: _Connection(self),  # type: ignore[arg-type, return-value]
            host,
            port,
            reuse_port=reuse_port or None,
            backlog=backlog,
        )
        limits = self.limits
        self._tick = max(0.02, min(1.0, limits.header_timeout_s / 4, limits.body_timeout_s / 4))
        self._sweeper = self.loop.call_later(self._tick, self._sweep)

    def admit(self, conn: _Connection, ip: str) -> tuple[int, str] | None:
        """Count a new connection; None, or the status and reason it is refused with.

        At the cap, an idle or slow connection of the client holding the
        most is closed to make room: a slowloris's own connections, not an
        honest newcomer, pay for it. A client holding more than
        ``peer_share`` of the cap may not take the last ``peer_share`` (429):
        some room stays for the others whatever one client does, and a server
        with a single client (a proxy in front, the orchestrator for a
        worker) still uses all but that last part of its cap.
        """
        peer = self.peers.get(ip)
        if peer is None:
            peer = self.peers[ip] = _Peer(ip)
        conn.peer = peer
        cap = self.limits.max_connections
        kept = cap * self.limits.peer_share  # the last part, for clients under their share
        total = len(self.connections)
        refusal: tuple[int, str] | None = None
        if kept < cap and len(peer.connections) >= kept and total >= cap - kept:
            refusal = (429, "this client holds too many of the server's connections; retry later")
        elif total >= cap and not self._evict():
            refusal = (503, "the server has too many open connections; retry later")
        self.connections.add(conn)
        peer.connections.add(conn)
        return refusal

    def _evict(self) -> bool:
        """Close an idle or slow connection of the client holding the most (False when it has none)."""
        heaviest = max(self.peers.values(), key=lambda p: len(p.connections))
        for conn in heaviest.connections:
            if conn.evictable:
                self.evicted += 1
                conn.abort()
                return True
        return False

    def forget(self, conn: _Connection) -> None:
        """A connection is closed: it no longer counts (nor does its client, once it holds nothing)."""
        self.connections.discard(conn)
        peer = conn.peer
        peer.connections.discard(conn)
        if not peer.connections and not peer.body_bytes and self.peers.get(peer.ip) is peer:
            del self.peers[peer.ip]

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
        self._expire([c for c in self.connections if c.deadline and c.deadline <= now])
        self._sweeper = self.loop.call_later(self._tick, self._sweep)

    def _expire(self, due: list[_Connection]) -> None:
        """Missed deadlines, SWEEP_BATCH at a time: thousands of slowloris connections opened
        together expire together, and answering them all in one callback stalled every other
        client (the rest go after the I/O that is ready)."""
        now = self.loop.time()
        for conn in due[:SWEEP_BATCH]:
            if not conn.deadline or conn.deadline > now:
                continue  # it moved on since the sweep found it
            try:
                conn.on_deadline()
            except Exception:  # one bad connection must not stop the sweeps
                log.exception("deadline handling failed")
                conn.abort()
        if len(due) > SWEEP_BATCH:
            self.loop.call_soon(self._expire, due[SWEEP_BATCH:])

    async def close(self, grace_s: float = 5.0) -> None:
        """Stop listening, let requests in flight finish for ``grace_s``, then drop every connection."""
        self.closing = True
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
        loop = asyncio.get_running_loop()  # started or not
        deadline = loop.time() + grace_s
        while any(c.task is not None for c in self.connections) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        tasks = [c.task for c in self.connections if isinstance(c.task, asyncio.Task)]
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
