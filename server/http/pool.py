"""The upstream side's pool: keep-alive HTTP/1.1 connections to one worker.

One :class:`UpstreamPool` per worker URL. :meth:`UpstreamPool.request` writes the request head and
the body's pieces in one vectored write (no join of a spliced body) on an idle keep-alive
connection or a new one, and returns the :class:`~server.http.upstream.UpstreamResponse` once its
status line and headers are in; :meth:`UpstreamPool.start` tells the same to a listener with no
coroutine. Its connections and responses are :mod:`server.http.upstream`'s twins; their deadlines
a :class:`~server.http.upstream.DeadlineSweeper`'s (50 ms ticks while requests are in flight).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any
from urllib.parse import urlsplit

from . import upstream
from .parse import ResponseParser
from .upstream import UpstreamResponse, _Connection
from .upstream_wire import BodyPiece, UpstreamError

#: UpstreamPool's defaults (the orchestrator's connect_timeout_s config key reads the first): seconds
#: to open a connection to a worker, and an idle connection's life in the pool (a worker's keep-alive
#: timeout, server/http/limits.py WORKER_KEEPALIVE_TIMEOUT_S, stays above it)
CONNECT_TIMEOUT_S = 5.0
IDLE_TIMEOUT_S = 30.0


def _abandon(opening: asyncio.Task[Any]) -> None:
    """A connect given up (timed out, or its caller cancelled): cancelled, and a connection it made
    all the same (it ended in that loop pass) closed, not left open to the worker."""
    opening.cancel()
    opening.add_done_callback(_close_made)


def _close_made(opening: asyncio.Task[Any]) -> None:
    if not opening.cancelled() and opening.exception() is None:
        opening.result()[0].close()


class UpstreamPool:
    """Keep-alive connections to the worker at ``url`` (``http://host:port[/prefix]``)."""

    #: each connection's response parser: the twin :mod:`server.http.parse` chose (the tests
    #: choose one in a subclass)
    response_parser: Callable[[_Connection], Any] = ResponseParser
    #: its connections' and responses' classes (the twins server.http.parse chose with the parsers; a
    #: pure-Python connection frames with ``response_parser``, the compiled one is its own parser)
    connection_class: Callable[[UpstreamPool], Any] = upstream.Connection
    response_class: Callable[..., Any] = upstream.Response
    #: :func:`server.http.upstream.pool_start`, pure or compiled as :mod:`server.http.upstream` chose: the response's events go to
    #: ``listener`` (never before this returns); :meth:`request`'s arguments, deadlines, bounds and
    #: retry of a stale pooled connection; a connection that cannot be opened is the listener's
    #: ``response_error`` with an :class:`UpstreamError` whose ``sent`` is False
    start: Callable[..., UpstreamResponse] = upstream.start

    def __init__(
        self,
        url: str,
        *,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        max_idle: int = 512,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        extra_headers: bytes = b"",
        deadlines: upstream.Deadlines | None = None,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"worker URL must be http://host:port, not {url!r}")
        self.url = url
        self.host = parts.hostname
        self.port = parts.port or 80
        self.prefix = parts.path.rstrip("/").encode()
        host = f"[{self.host}]" if ":" in self.host else self.host
        #: the lines every request's head carries after its request line (upstream.outgoing writes it)
        self.fixed_headers = b"Host: %s:%d\r\n%s" % (host.encode(), self.port, extra_headers)
        self.connect_timeout_s = connect_timeout_s
        self.max_idle = max_idle
        self.idle_timeout_s = idle_timeout_s
        #: the loop of its connections, from the first connect (a pool may be built before a loop runs)
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]
        #: the sweeper of its connections' deadlines (``upstream.Deadlines``: a twin) unless given one
        self.deadlines = deadlines or upstream.Deadlines()
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

    #: the newest idle connection still usable, or None (the one function the pool's ``start`` uses too)
    idle_connection = upstream.idle_connection

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
        sending = upstream.outgoing(
            self, method, path, pieces, headers, timeout, read_timeout, headers_timeout
        )
        for _attempt in range(2):
            conn = self.idle_connection()
            reused = conn is not None
            if conn is None:
                conn = await self._connect()
            try:
                resp = self.response_class(conn, max_body)
                resp.sending = sending
                conn.send(resp)
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

    def open_for(self, resp: UpstreamResponse) -> None:
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
            self.keep(conn)
        elif not upstream.send_on(conn, resp, False):
            resp.on_error(UpstreamError("connection closed before the request was sent", sent=False))

    def keep(self, conn: _Connection) -> None:
        if len(self.idle) >= self.max_idle:
            conn.close()
            return
        conn.idle_since = self.loop.time()
        self.idle.append(conn)

    def forget(self, conn: _Connection) -> None:
        self.open.discard(conn)

    def close(self) -> None:
        """Close every connection; one being opened closes once open, its request failing (not sent)."""
        self.closed = True
        for conn in list(self.open):
            conn.close()
        self.idle.clear()
