"""Raw-byte worker stand-ins for :mod:`server.http.client`'s tests (test_http_client,
test_http_client_start): an asyncio server on 127.0.0.1 whose every byte is the test's, the pool on
the response parser a test chose, and the answers the tests write.

``_both_twins`` is an autouse fixture: a test module that imports it runs every test on both
twins of the upstream side (conftest's ``upstream_twin``, set on :class:`Pool`): the compiled
connection and response (server/http/upstream.py compiled as _upstream, its own llhttp parser) and its pure
ones on the httptools parser. A module that also imports ``event_loop_policy`` (raw_http's) runs each of its
async tests on asyncio's loop and on uvloop, where the compiled connection reads into its buffers
(``get_buffer``/``buffer_updated``) instead of being handed bytes objects.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import pytest
from helpers import StandInServer
from raw_http import event_loop_policy  # noqa: F401  (re-exported: both loops, for the modules that import it)

from server.http import UpstreamPool, UpstreamResponse, upstream

#: scheduling slack for time bounds on a busy 2-core machine (the client's sweeper ticks every 50 ms)
SLACK_S = 1.0


class Pool(UpstreamPool):
    """The pool under test: :class:`UpstreamPool` on the twin a test chose (class attributes)."""

    response_parser = UpstreamPool.response_parser
    connection_class = UpstreamPool.connection_class
    response_class = UpstreamPool.response_class


def set_twin(pool: type[UpstreamPool], twin: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """``pool``'s connections, responses, parser and ``start``, and the sweeper a pool makes: those of
    ``twin`` (conftest's ``upstream_twin``: the compiled ones, or upstream.py's on the pure parser)."""
    monkeypatch.setattr(pool, "response_parser", twin.ResponseParser)
    monkeypatch.setattr(pool, "connection_class", twin.Connection)
    monkeypatch.setattr(pool, "response_class", twin.Response)
    monkeypatch.setattr(pool, "start", twin.start)
    monkeypatch.setattr(upstream, "Deadlines", twin.Deadlines)


@pytest.fixture(autouse=True)
def _both_twins(upstream_twin: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test here runs on both twins (conftest's ``upstream_twin``)."""
    set_twin(Pool, upstream_twin, monkeypatch)


RequestLine = tuple[bytes, dict[bytes, bytes], bytes]
Reader = asyncio.StreamReader
Writer = asyncio.StreamWriter


async def read_request(reader: asyncio.StreamReader) -> RequestLine | None:
    """One request as the pool writes it (always Content-Length framed); None at EOF."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    lines = head[:-4].split(b"\r\n")
    headers: dict[bytes, bytes] = {}
    for line in lines[1:]:
        key, _, value = line.partition(b":")
        headers[key.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get(b"content-length", b"0")))
    return lines[0], headers, body


Serve = Callable[["Upstream", Reader, Writer, int], Awaitable[None]]


class Upstream(StandInServer):
    """A worker stand-in: ``answer(upstream, reader, writer, index)`` runs per accepted connection."""

    def __init__(self, answer: Serve) -> None:
        super().__init__()
        self.answer = answer
        self.accepted = 0
        self.requests: list[RequestLine] = []
        #: connections that ended with the client closing (EOF while waiting for a request)
        self.client_closed = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        index = self.accepted
        self.accepted += 1
        await self.answer(self, reader, writer, index)

    async def next_request(self, reader: asyncio.StreamReader) -> RequestLine | None:
        req = await read_request(reader)
        if req is None:
            self.client_closed += 1
        else:
            self.requests.append(req)
        return req


def answering(respond: Callable[[RequestLine], bytes]) -> Serve:
    """A keep-alive server: every request gets ``respond(request)``, until the client closes."""

    async def serve(up: Upstream, reader: Reader, writer: Writer, index: int) -> None:
        while (req := await up.next_request(reader)) is not None:
            writer.write(respond(req))
            await writer.drain()

    return serve


def ok(body: bytes = b"ok", content_type: bytes = b"application/json", extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nContent-Length: %d\r\n%s\r\n%s" % (
        content_type,
        len(body),
        extra,
        body,
    )


def chunked_response(pieces: list[bytes], extra: bytes = b"") -> bytes:
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    return b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n%s\r\n%s" % (
        extra,
        body,
    )


def echo_response(req: RequestLine) -> bytes:
    line, _, body = req
    return ok(body, extra=b"X-Line: %s\r\n" % line)


def reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset (SO_LINGER 0), not a FIN."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@contextlib.asynccontextmanager
async def pool_for(up: Upstream, path: str = "", **kw: Any) -> AsyncIterator[UpstreamPool]:
    pool = Pool(up.url + path, **kw)
    try:
        yield pool
    finally:
        pool.close()


async def fetch(
    pool: UpstreamPool, path: bytes = b"/", body: bytes = b"", **kw: Any
) -> tuple[UpstreamResponse, bytes]:
    resp = await pool.request(b"POST", path, [body] if body else [], **kw)
    try:
        return resp, await resp.read()
    finally:
        resp.release()
