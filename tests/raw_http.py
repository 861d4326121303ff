"""A raw HTTP/1.1 client for the server tests (test_http_server, test_http_abuse): requests written as
bytes, so the exact bytes on the wire are the test's, and responses parsed by httptools (llhttp), never by
hand; the server under test started on 127.0.0.1, port 0, in the test's event loop, on the request
parser that the test module's fixture chose (:class:`Server`: every test runs on both twins).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from types import ModuleType
from typing import Any

import httptools
import pytest

from server.errors import default_code
from server.http import HTTPServer, Limits, Request, Responder

#: a recognisable marker put in the bad part of a request; an error body must never echo it
MARKER = b"Zq7MARKERxK2"

Handler = Callable[[Request, Responder], Awaitable[None]]


class Server(HTTPServer):
    """The server under test: :class:`HTTPServer` on the request parser a test chose.

    ``request_parser`` is set per test from conftest's ``http_parser`` fixture (the pure twin or
    the compiled one), as a subclass's class attribute: production code takes no parser argument.
    """

    request_parser = HTTPServer.request_parser


# -- the fixtures a server test module imports: both loops, both request parsers ------------------


@pytest.fixture(params=["asyncio", "uvloop"])
def event_loop_policy(request: pytest.FixtureRequest) -> Iterator[asyncio.AbstractEventLoopPolicy]:
    """Every test of a module that imports this runs on asyncio's default loop and on uvloop (what the
    processes run): pytest-asyncio's replacement, a pytest_asyncio_loop_factories hook, would be a
    conftest-wide hook for every async test. (Such a module filters the override's deprecation warning.)"""
    if request.param == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        yield uvloop.EventLoopPolicy()
    else:
        yield asyncio.DefaultEventLoopPolicy()


@pytest.fixture(autouse=True)
def _both_parsers(http_twin: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test of a module that imports this runs on both request parsers (conftest's ``http_twin``)."""
    monkeypatch.setattr(Server, "request_parser", http_twin.RequestParser)


# -- handlers ----------------------------------------------------------------------------


async def echo(req: Request, out: Responder) -> None:
    """The body back, with what the server parsed in headers."""
    out.send(
        200,
        req.body,
        b"application/octet-stream",
        b"X-Method: %s\r\nX-Url: %s\r\nX-Version: %s\r\nX-Headers: %d\r\n"
        % (req.method, req.url, req.version.encode(), len(req.headers)),
    )


# -- a client that reads responses with httptools --------------------------------------------


class Response:
    __slots__ = ("complete", "headers", "headers_done", "pieces", "status", "version")

    def __init__(self) -> None:
        self.status = 0
        self.version = ""
        self.headers: list[tuple[bytes, bytes]] = []
        self.pieces: list[bytes] = []
        self.headers_done = False
        self.complete = False

    @property
    def body(self) -> bytes:
        return b"".join(self.pieces)

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

    def json(self) -> Any:
        return json.loads(self.body)

    def __repr__(self) -> str:
        return f"<Response {self.status} {self.headers!r} {self.body[:200]!r}>"


class ResponseStream:
    """Every response on one connection, in order (1xx included), parsed by llhttp."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.responses: list[Response] = []
        self.current: Response | None = None
        self.raw = bytearray()
        self.error: Exception | None = None

    def feed(self, data: bytes) -> None:
        self.raw += data
        if self.error is None:
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserError as exc:
                self.error = exc

    def feed_eof(self) -> None:
        """EOF ends a close-delimited body (no Content-Length, not chunked)."""
        cur = self.current
        if cur is not None and cur.headers_done and not cur.complete:
            if cur.header(b"content-length") is None and cur.header(b"transfer-encoding") is None:
                self.on_message_complete()

    # llhttp callbacks
    def on_message_begin(self) -> None:
        self.current = Response()

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.current is not None
        self.current.headers.append((name, value))

    def on_headers_complete(self) -> None:
        assert self.current is not None
        self.current.status = self.parser.get_status_code()
        self.current.version = self.parser.get_http_version()
        self.current.headers_done = True

    def on_body(self, body: bytes) -> None:
        assert self.current is not None
        self.current.pieces.append(body)

    def on_message_complete(self) -> None:
        assert self.current is not None
        self.current.complete = True
        self.responses.append(self.current)
        self.current = None


class Client:
    """One raw client connection."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.stream = ResponseStream()
        self.eof = False
        self.reset = False

    @classmethod
    async def connect(cls, port: int, *, rcvbuf: int = 0) -> Client:
        if not rcvbuf:
            return cls(*await asyncio.open_connection("127.0.0.1", port))
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        return cls(*await asyncio.open_connection(sock=sock))

    async def send(self, data: bytes, *, step: int = 0, delay: float = 0.0) -> None:
        """``data`` in one write, or in writes of ``step`` bytes ``delay`` seconds apart."""
        if not step:
            self.writer.write(data)
            await self.writer.drain()
            return
        for i in range(0, len(data), step):
            self.writer.write(data[i : i + step])
            await self.writer.drain()
            await asyncio.sleep(delay)

    async def _read_once(self, timeout: float) -> None:
        try:
            data = await asyncio.wait_for(self.reader.read(65536), timeout)
        except (ConnectionResetError, BrokenPipeError):
            self.reset = True
            data = b""
        if not data:
            self.eof = True
            self.stream.feed_eof()
        else:
            self.stream.feed(data)

    async def responses(self, n: int, timeout: float = 5.0) -> list[Response]:
        """The first ``n`` complete responses (fails on timeout or an early close)."""
        deadline = time.monotonic() + timeout
        while len(self.stream.responses) < n:
            assert self.stream.error is None, (
                f"unparsable response bytes: {self.stream.error}: {bytes(self.stream.raw)!r}"
            )
            assert not self.eof, (
                f"closed after {len(self.stream.responses)} of {n} responses: {bytes(self.stream.raw)!r}"
            )
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(
                    f"{len(self.stream.responses)} of {n} responses in {timeout} s: {bytes(self.stream.raw)!r}"
                )
            with contextlib.suppress(asyncio.TimeoutError):
                await self._read_once(left)
        return self.stream.responses[:n]

    async def until_closed(self, timeout: float = 5.0) -> list[Response]:
        """Every response until the server closes (fails if it does not within ``timeout``)."""
        deadline = time.monotonic() + timeout
        while not self.eof:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"connection still open after {timeout} s: {bytes(self.stream.raw)!r}")
            with contextlib.suppress(asyncio.TimeoutError):
                await self._read_once(left)
        assert self.stream.error is None, (
            f"unparsable response bytes: {self.stream.error}: {bytes(self.stream.raw)!r}"
        )
        return self.stream.responses

    async def read_until(self, condition: Callable[[], bool], timeout: float = 5.0) -> None:
        """Read until ``condition`` holds of what arrived (fails on timeout or a close first)."""
        deadline = time.monotonic() + timeout
        while not condition():
            assert not self.eof, f"closed first: {bytes(self.stream.raw)!r}"
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"not within {timeout} s: {bytes(self.stream.raw)!r}")
            with contextlib.suppress(asyncio.TimeoutError):
                await self._read_once(left)

    async def silent_for(self, seconds: float) -> bool:
        """True when nothing arrives (and the connection stays open) for ``seconds``."""
        before = len(self.stream.raw)
        with contextlib.suppress(asyncio.TimeoutError):
            await self._read_once(seconds)
        return len(self.stream.raw) == before and not self.eof

    async def collect_for(self, seconds: float) -> None:
        """Whatever arrives within ``seconds`` (unparsed bytes are in ``stream.raw``)."""
        deadline = time.monotonic() + seconds
        while not self.eof and (left := deadline - time.monotonic()) > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await self._read_once(left)

    def close(self) -> None:
        self.writer.close()

    def abort(self) -> None:
        self.writer.transport.abort()


@contextlib.asynccontextmanager
async def serving(handler: Handler = echo, **limits: Any) -> AsyncIterator[tuple[HTTPServer, int]]:
    server = Server(handler, Limits(**limits))
    await server.start("127.0.0.1", 0)
    try:
        yield server, server.sockets[0].getsockname()[1]
    finally:
        await server.close(grace_s=0.5)


@contextlib.asynccontextmanager
async def connected(port: int, **kw: Any) -> AsyncIterator[Client]:
    client = await Client.connect(port, **kw)
    try:
        yield client
    finally:
        client.close()


def assert_json_error(resp: Response, status: int, *, closes: bool = True) -> dict[str, Any]:
    """An OpenAI-shaped error: ``{"error": {"message", "type", "param", "code"}}``."""
    assert resp.status == status, resp
    assert resp.header(b"content-type") == b"application/json", resp
    assert int(resp.header(b"content-length") or b"-1") == len(resp.body)
    body = resp.json()
    assert list(body) == ["error"], body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert error["code"] == default_code(status) and isinstance(error["code"], str)
    if closes:
        assert resp.header(b"connection") == b"close", resp
    return error


def get(path: bytes = b"/", *, extra: bytes = b"", version: bytes = b"1.1") -> bytes:
    return b"GET %s HTTP/%s\r\nHost: t\r\n%s\r\n" % (path, version, extra)


def post(path: bytes, body: bytes, *, extra: bytes = b"") -> bytes:
    return b"POST %s HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n%s\r\n%s" % (path, len(body), extra, body)


def chunked(pieces: Sequence[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces if p) + b"0\r\n\r\n"
