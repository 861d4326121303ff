"""server.http.server on real sockets: framing, limits, time bounds, pipelining, streaming, backpressure.

Every test starts an :class:`HTTPServer` on 127.0.0.1 (port 0) in its own
event loop with a small handler written here, and talks to it through raw
client sockets, so the exact bytes on the wire are the test's. Responses are
parsed with httptools (llhttp), never by hand; one streaming test reads with
``http.client`` as a second, independent parser.

Limits are small (a fraction of a second, a few KiB) so that the time bounds
are checked quickly; the margins are generous because the machine is shared.
"""

from __future__ import annotations

import asyncio
import http.client
import itertools
import socket
import time
from collections.abc import Callable, Sequence
from email.utils import parsedate_to_datetime

import pytest
from helpers import eventually, made_in_a_thread
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from raw_http import (  # noqa: F401  (fixtures: both request parsers, both loops)
    MARKER,
    Client,
    Handler,
    Server,
    _both_parsers,
    assert_json_error,
    chunked,
    connected,
    echo,
    event_loop_policy,
    get,
    post,
    serving,
)

from server.http import HTTPServer, Limits, Request, Responder
from server.http import server as server_module

# Both loops through raw_http's event_loop_policy fixture (uvloop: the compiled parser's buffered reads).
pytestmark = pytest.mark.filterwarnings('ignore:Overriding the "event_loop_policy" fixture is deprecated')

#: scheduling slack for time bounds on a busy 2-core machine
SLACK_S = 1.5
#: every time bound small, for tests that wait on one
QUICK: dict[str, float] = {"header_timeout_s": 0.2, "body_timeout_s": 0.2, "keepalive_timeout_s": 0.2}


# -- framing: request smuggling and malformed requests ---------------------------------------

H = b"Host: t\r\n"
SMUGGLED = b"GET /" + MARKER + b" HTTP/1.1\r\nHost: t\r\n\r\n"
POST = b"POST / HTTP/1.1\r\n" + H

BAD_REQUESTS = [
    # Content-Length and Transfer-Encoding together, both orders (the classic CL.TE / TE.CL smuggle).
    pytest.param(
        POST + b"Content-Length: 6\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + SMUGGLED,
        (400,),
        id="content-length-then-transfer-encoding",
    ),
    pytest.param(
        POST + b"Transfer-Encoding: chunked\r\nContent-Length: 6\r\n\r\n0\r\n\r\n" + SMUGGLED,
        (400,),
        id="transfer-encoding-then-content-length",
    ),
    pytest.param(
        POST + b"Content-Length: 5\r\nContent-Length: 5\r\n\r\n" + MARKER[:5] + SMUGGLED,
        (400,),
        id="two-content-lengths-same",
    ),
    pytest.param(
        POST + b"Content-Length: 0\r\nContent-Length: 44\r\n\r\n" + SMUGGLED,
        (400,),
        id="two-content-lengths-different",
    ),
    pytest.param(
        b"GET / HTTP/1.1\r\n" + H + b"X-Folded: first\r\n " + MARKER + b"\r\n\r\n",
        (400,),
        id="obs-fold-space",
    ),
    pytest.param(
        b"GET / HTTP/1.1\r\n" + H + b"X-Folded: first\r\n\t" + MARKER + b"\r\n\r\n",
        (400,),
        id="obs-fold-tab",
    ),
    pytest.param(b"GET /" + MARKER + b" HTTP/1.1\nHost: t\n\n", (400,), id="bare-lf-request-line"),
    pytest.param(b"GET / HTTP/1.1\r\nHost: t\nX-M: " + MARKER + b"\r\n\r\n", (400,), id="bare-lf-header"),
    pytest.param(b"GET / HTTP/1.1\r\nX-M: " + MARKER + b"\r\n\n", (400,), id="bare-lf-end-of-headers"),
    pytest.param(
        POST + b"Transfer-Encoding: chunked\r\n\r\n1" + b"0" * 20 + b"\r\n" + MARKER + b"\r\n0\r\n\r\n",
        (400,),
        id="chunk-size-overflow",
    ),
    pytest.param(
        POST + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n" + MARKER + b"\r\n0\r\n\r\n",
        (400,),
        id="chunk-size-not-hex",
    ),
    pytest.param(
        POST + b"Transfer-Encoding: chunked\r\n\r\n-1\r\n" + MARKER + b"\r\n0\r\n\r\n",
        (400,),
        id="chunk-size-negative",
    ),
    pytest.param(
        POST + b"Transfer-Encoding: chunked\r\n\r\n3\r\nabc" + MARKER + b"\r\n0\r\n\r\n",
        (400,),
        id="chunk-data-longer-than-size",
    ),
    pytest.param(
        POST + b"Transfer-Encoding: chunked\r\n\r\n3\nabc\r\n0\r\n\r\n" + SMUGGLED,
        (400,),
        id="chunk-size-bare-lf",
    ),
    pytest.param(
        POST + b"Transfer-Encoding: gzip\r\n\r\n" + MARKER,
        (501,),
        id="transfer-encoding-gzip",
    ),
    pytest.param(
        POST + b"Transfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n" + SMUGGLED,
        (501,),
        id="transfer-encoding-gzip-chunked",
    ),
    pytest.param(
        POST + b"Transfer-Encoding: identity\r\n\r\n" + MARKER,
        (400, 501),
        id="transfer-encoding-identity",
    ),
    pytest.param(
        POST + b"Transfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\n" + SMUGGLED,
        (400, 501),
        id="transfer-encoding-chunked-not-last",
    ),
    pytest.param(
        POST + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + SMUGGLED,
        (400, 501),
        id="two-transfer-encodings",
    ),
    pytest.param(
        POST + b"Transfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n" + SMUGGLED,
        (400, 501),
        id="two-transfer-encodings-different",
    ),
    pytest.param(POST + b"Content-Length: +5\r\n\r\n" + MARKER, (400,), id="content-length-plus"),
    pytest.param(POST + b"Content-Length: -5\r\n\r\n" + MARKER, (400,), id="content-length-minus"),
    pytest.param(
        POST + b"Content-Length: 1 2\r\n\r\n" + MARKER,
        (400,),
        id="content-length-space",
    ),
    pytest.param(
        POST + b"Content-Length: 5, 5\r\n\r\n" + MARKER,
        (400,),
        id="content-length-list",
    ),
    pytest.param(POST + b"Content-Length: 0x5\r\n\r\n" + MARKER, (400,), id="content-length-hex"),
    pytest.param(POST + b"Content-Length: \r\n\r\n" + MARKER, (400,), id="content-length-empty"),
    pytest.param(
        POST + b"Content-Length: 1" + b"0" * 30 + b"\r\n\r\n" + MARKER,
        (400,),
        id="content-length-overflow",
    ),
    pytest.param(
        b"GET / HTTP/1.1\r\n" + H + b"X-M: a\x00" + MARKER + b"\r\n\r\n", (400,), id="nul-in-header-value"
    ),
    pytest.param(
        b"GET / HTTP/1.1\r\n" + H + b"X-M\x00" + MARKER + b": a\r\n\r\n", (400,), id="nul-in-header-name"
    ),
    pytest.param(b"GET /a\x00" + MARKER + b" HTTP/1.1\r\n" + H + b"\r\n", (400,), id="nul-in-target"),
    pytest.param(
        b"GET / HTTP/1.1\r\n" + H + b"X-M: a\x01" + MARKER + b"\r\n\r\n", (400,), id="control-char-in-value"
    ),
    pytest.param(
        b"GET / HTTP/1.1\r\n" + H + b"X-M: a\r" + MARKER + b"\r\n\r\n", (400,), id="bare-cr-in-value"
    ),
    pytest.param(
        b"GET / HTTP/1.1\r\n" + H + b"X-M" + MARKER + b" : a\r\n\r\n", (400,), id="space-before-colon"
    ),
    pytest.param(b"GET /" + MARKER + b"\r\n\r\n", (400, 505), id="http-0.9-request-line"),
    pytest.param(b"GET /" + MARKER + b" HTTP/0.9\r\n" + H + b"\r\n", (400, 505), id="http-0.9-version"),
    pytest.param(b"GET /" + MARKER + b" HTTP/2.0\r\n" + H + b"\r\n", (400, 505), id="http-2.0-version"),
    pytest.param(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + MARKER, (400, 505), id="http2-preface"),
    pytest.param(b"GET /" + MARKER + b" HTTP/3.0\r\n" + H + b"\r\n", (400, 505), id="http-3.0-version"),
    pytest.param(b"GET / http/1.1\r\n" + H + b"X: " + MARKER + b"\r\n\r\n", (400,), id="lower-case-protocol"),
    pytest.param(
        b"GET http://evil.example/" + MARKER + b" HTTP/1.1\r\n" + H + b"\r\n", (400,), id="absolute-form"
    ),
    pytest.param(
        b"GET evil.example/" + MARKER + b" HTTP/1.1\r\n" + H + b"\r\n", (400,), id="no-leading-slash"
    ),
    pytest.param(b"OPTIONS * HTTP/1.1\r\n" + H + b"X: " + MARKER + b"\r\n\r\n", (400,), id="asterisk-form"),
    pytest.param(
        b"CONNECT evil.example:443 HTTP/1.1\r\n" + H + b"X: " + MARKER + b"\r\n\r\n", (400, 501), id="connect"
    ),
    pytest.param(b"G\x7fT /" + MARKER + b" HTTP/1.1\r\n" + H + b"\r\n", (400,), id="invalid-method"),
    pytest.param(b"\x16\x03\x01\x02\x00\x01\x00" + MARKER + b"\r\n\r\n", (400,), id="tls-client-hello"),
    pytest.param(
        POST + b"Expect: " + MARKER + b"\r\nContent-Length: 0\r\n\r\n",
        (417,),
        id="expect-unsupported",
    ),
]


@pytest.mark.parametrize(("data", "statuses"), BAD_REQUESTS)
async def test_bad_request_refused_with_json_error_and_closed(data: bytes, statuses: tuple[int, ...]) -> None:
    async with serving() as (server, port), connected(port) as client:
        await client.send(data)
        responses = await client.until_closed(timeout=3.0)
        assert len(responses) == 1, responses  # nothing smuggled behind the bad request is answered
        (resp,) = responses
        assert resp.status in statuses, resp
        assert_json_error(resp, resp.status)
        assert MARKER not in bytes(client.stream.raw), bytes(client.stream.raw)
        assert not client.reset
        assert server.framing_errors == 1


@pytest.mark.parametrize("step", [1, 7])
async def test_bad_request_in_small_writes_refused_the_same(step: int) -> None:
    """Framing errors do not depend on where the reads split the bytes."""
    data = (
        b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 6\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
        + SMUGGLED
    )
    async with serving() as (_server, port), connected(port) as client:
        await client.send(data, step=step, delay=0.001)
        (resp,) = await client.until_closed()
        assert_json_error(resp, 400)
        assert MARKER not in bytes(client.stream.raw)


async def test_bad_request_after_good_ones_answers_those_first() -> None:
    """A framing error closes the connection after the responses already due on it."""
    async with serving() as (_server, port), connected(port) as client:
        await client.send(
            get(b"/one") + post(b"/two", b"body") + b"GET / HTTP/1.1\r\nX: a\x00" + MARKER + b"\r\n\r\n"
        )
        responses = await client.until_closed()
        assert [r.status for r in responses] == [200, 200, 400]
        assert responses[0].header(b"x-url") == b"/one"
        assert responses[1].body == b"body"
        assert_json_error(responses[2], 400)
        assert MARKER not in bytes(client.stream.raw)


async def test_content_length_with_surrounding_whitespace_is_a_length() -> None:
    """Optional whitespace around a field value is not part of it (RFC 9110 5.5)."""
    async with serving() as (_server, port), connected(port) as client:
        await client.send(
            b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length:   5  \r\n\r\nhello" + get(b"/after")
        )
        first, second = await client.responses(2)
        assert first.status == 200 and first.body == b"hello"
        assert second.header(b"x-url") == b"/after"


async def test_chunked_with_extensions_and_trailers_accepted() -> None:
    async with serving() as (_server, port), connected(port) as client:
        await client.send(
            b"POST /c HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5;name=value\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n" + get(b"/after")
        )
        first, second = await client.responses(2)
        assert first.status == 200 and first.body == b"hello world"
        assert second.status == 200 and second.header(b"x-url") == b"/after"


async def test_http10_with_transfer_encoding_closes_after_it() -> None:
    """A 1.0 hop may not know chunked: what follows such a request must not be read as a request."""
    async with serving() as (_server, port), connected(port) as client:
        await client.send(
            b"POST / HTTP/1.0\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
            + SMUGGLED
        )
        responses = await client.until_closed(timeout=1.0)
        assert len(responses) == 1, responses
        assert MARKER not in bytes(client.stream.raw)
        if responses[0].status != 200:
            assert_json_error(responses[0], 400)


async def test_upgrade_request_gets_exactly_one_response() -> None:
    """Upgrade is not supported: the request may be refused (501) or served ignoring it, not both."""
    async with serving() as (_server, port), connected(port) as client:
        await client.send(b"GET /up HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n")
        (first,) = await client.responses(1)
        if first.status == 200:
            # Served as a plain request: the connection goes on like any other.
            assert await client.silent_for(0.3)
            await client.send(get(b"/next"))
            _, second = await client.responses(2)
            assert second.header(b"x-url") == b"/next"
        else:
            assert_json_error(first, 501)
            assert await client.until_closed() == [first]


async def test_head_response_has_no_body() -> None:
    """RFC 9110 9.3.2: the server must not send content in the response to HEAD."""

    async def hello(req: Request, out: Responder) -> None:
        out.send(200, b"hello", b"text/plain")

    async with serving(hello) as (_server, port), connected(port) as client:
        await client.send(b"HEAD /h HTTP/1.1\r\nHost: t\r\n\r\n" + get(b"/next"))
        await client.collect_for(0.3)
        head, _, rest = bytes(client.stream.raw).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"Content-Length: 5" in head
        assert rest.startswith(b"HTTP/1.1 200"), rest  # the next status line, not a body


# -- limits -----------------------------------------------------------------------------------


@pytest.mark.parametrize("step", [0, 100])
async def test_header_bytes_over_limit_431(step: int) -> None:
    async with serving(max_header_bytes=1024) as (server, port), connected(port) as client:
        await client.send(
            b"GET / HTTP/1.1\r\nHost: t\r\nX-Big: " + b"v" * 1100 + MARKER + b"\r\n\r\n",
            step=step,
            delay=0.002,
        )
        (resp,) = await client.until_closed()
        assert_json_error(resp, 431)
        assert MARKER not in bytes(client.stream.raw)
        assert server.framing_errors == 1


async def test_header_bytes_over_limit_431_when_a_small_read_ends_them() -> None:
    """Headers past the limit in the read they began in, ended by a small second read: the sum at
    their end counts the first read too (it once counted only the reads after it and the last)."""
    async with serving(max_header_bytes=1024) as (server, port), connected(port) as client:
        await client.send(b"GET / HTTP/1.1\r\nHost: t\r\nX-Big: " + b"v" * 2000 + MARKER + b"\r\n")
        await asyncio.sleep(0.05)  # separate reads
        await client.send(b"\r\n")
        (resp,) = await client.until_closed()
        error = assert_json_error(resp, 431)
        assert error["message"] == "request headers exceed 1024 bytes", error
        assert MARKER not in bytes(client.stream.raw)
        assert server.framing_errors == 1


async def test_header_bytes_over_limit_431_without_end_of_headers() -> None:
    """Headers that never end are refused once they pass the limit, not when they end."""
    async with serving(max_header_bytes=1024) as (_server, port), connected(port) as client:
        await client.send(b"GET / HTTP/1.1\r\nHost: t\r\n")
        for i in range(40):
            await client.send(b"X-H%d: %s\r\n" % (i, b"v" * 40))
            await asyncio.sleep(0.002)
        (resp,) = await client.until_closed()
        assert_json_error(resp, 431)


@pytest.mark.parametrize("step", [0, 1])
async def test_header_bytes_under_limit_accepted(step: int) -> None:
    head = b"GET /u HTTP/1.1\r\nHost: t\r\nX-Big: " + b"v" * 850 + b"\r\n\r\n"
    async with serving(max_header_bytes=1024) as (_server, port), connected(port) as client:
        await client.send(head, step=step)
        (resp,) = await client.responses(1)
        assert resp.status == 200 and resp.header(b"x-url") == b"/u"


async def test_too_many_headers_431() -> None:
    async with serving(max_headers=10) as (_server, port):
        async with connected(port) as client:
            await client.send(
                b"GET / HTTP/1.1\r\nHost: t\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(9)) + b"\r\n"
            )
            (resp,) = await client.responses(1)
            assert resp.status == 200 and resp.header(b"x-headers") == b"10"
        async with connected(port) as client:
            await client.send(
                b"GET / HTTP/1.1\r\n"
                + b"".join(b"X-%d: 1\r\n" % i for i in range(11))
                + b"X: "
                + MARKER
                + b"\r\n\r\n"
            )
            (resp,) = await client.until_closed()
            assert_json_error(resp, 431)
            assert MARKER not in bytes(client.stream.raw)


@pytest.mark.parametrize("step", [0, 256])
async def test_url_over_limit_414(step: int) -> None:
    async with serving(max_header_bytes=1024) as (_server, port), connected(port) as client:
        await client.send(
            b"GET /" + MARKER + b"u" * 2000 + b" HTTP/1.1\r\nHost: t\r\n\r\n", step=step, delay=0.002
        )
        (resp,) = await client.until_closed()
        assert_json_error(resp, 414)
        assert MARKER not in bytes(client.stream.raw)


async def test_long_url_under_limit_accepted_over_two_reads() -> None:
    """A 620-byte request head under a 1024-byte limit, its end in a second read."""
    async with serving(max_header_bytes=1024) as (_server, port), connected(port) as client:
        await client.send(b"GET /" + b"u" * 600 + b" HTTP/1.1\r\nHost: t\r\n")
        await asyncio.sleep(0.05)
        await client.send(b"\r\n")
        (resp,) = await client.responses(1)
        assert resp.status == 200


async def test_pipelined_request_after_large_body_accepted() -> None:
    async with serving(max_header_bytes=1024) as (_server, port), connected(port) as client:
        await client.send(post(b"/1", b"b" * 2000) + b"GET /2 HTTP/1.1\r\n")
        await asyncio.sleep(0.05)
        await client.send(b"Host: t\r\n\r\n")
        first, second = await client.responses(2)
        assert first.body == b"b" * 2000
        assert second.status == 200 and second.header(b"x-url") == b"/2"


async def test_body_at_limit_accepted() -> None:
    body = bytes(range(256)) * 16  # 4096
    async with serving(max_body_bytes=4096) as (_server, port), connected(port) as client:
        await client.send(
            post(b"/cl", body)
            + b"POST /te HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
            + chunked([body[:1000], body[1000:]])
        )
        first, second = await client.responses(2)
        assert first.body == body and second.body == body


async def _send_until_answered(client: Client, piece: bytes, total: int) -> int:
    """Keep sending ``piece`` (up to ``total`` bytes) until a response arrives; the bytes sent."""
    sent = 0
    reader = asyncio.ensure_future(client.responses(1, timeout=5.0))
    try:
        while sent < total and not reader.done():
            client.writer.write(piece)
            await client.writer.drain()  # a reset would raise here
            sent += len(piece)
            await asyncio.sleep(0)
        await reader
    finally:
        reader.cancel()
    return sent


async def test_body_over_limit_content_length_413_before_the_body() -> None:
    async with serving(max_body_bytes=64 * 1024) as (server, port), connected(port) as client:
        await client.send(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 10000000\r\n\r\n")
        (resp,) = await client.responses(1, timeout=2.0)  # not a byte of the body sent
        assert_json_error(resp, 413)
        assert server.framing_errors == 1


async def test_body_over_limit_content_length_lingering_close() -> None:
    """The client keeps uploading: it reads the 413, never a reset, and the server then closes."""
    async with serving(max_body_bytes=64 * 1024) as (_server, port), connected(port) as client:
        await client.send(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 10000000\r\n\r\n" + MARKER)
        sent = await _send_until_answered(client, MARKER * 5000, 4_000_000)
        for _ in range(40):  # still sending after the answer: dropped, not reset
            await client.send(MARKER * 5000)
        (resp,) = await client.until_closed()
        assert_json_error(resp, 413)
        assert not client.reset
        assert MARKER not in bytes(client.stream.raw)
        assert sent > 0


async def test_body_over_limit_chunked_413_while_reading() -> None:
    async with serving(max_body_bytes=64 * 1024) as (server, port), connected(port) as client:
        await client.send(b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n")
        piece = chunked([MARKER * 1000])[:-5]  # one chunk, not the last
        sent = await _send_until_answered(client, piece, 4_000_000)
        assert 64 * 1024 < sent < 4_000_000
        for _ in range(40):
            await client.send(piece)
        (resp,) = await client.until_closed()
        assert_json_error(resp, 413)
        assert not client.reset
        assert MARKER not in bytes(client.stream.raw)
        assert server.framing_errors == 1


async def test_expect_continue_over_limit_413_without_continue() -> None:
    async with serving(max_body_bytes=1000) as (_server, port), connected(port) as client:
        await client.send(
            b"POST / HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 1001\r\n\r\n"
        )
        (resp,) = await client.until_closed()
        assert_json_error(resp, 413)


# -- time bounds -------------------------------------------------------------------------------


async def test_slow_headers_408_and_closed() -> None:
    """A byte at a time, each in time for a per-read timer but not for the whole head."""
    async with serving(header_timeout_s=0.3) as (server, port), connected(port) as client:
        start = time.monotonic()
        trickle = asyncio.ensure_future(
            client.send(b"GET / HTTP/1.1\r\nHost: t\r\nX-Slow: " + b"s" * 200, step=1, delay=0.02)
        )
        try:
            (resp,) = await client.until_closed(timeout=0.3 + SLACK_S)
        finally:
            trickle.cancel()
        elapsed = time.monotonic() - start
        assert_json_error(resp, 408)
        assert 0.25 <= elapsed < 0.3 + SLACK_S
        assert server.timeouts == 1


@pytest.mark.parametrize(
    "head",
    [
        b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\nabc",
        b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n",
    ],
    ids=["content-length", "chunked"],
)
async def test_slow_body_408_and_closed(head: bytes) -> None:
    async with serving(header_timeout_s=5.0, body_timeout_s=0.3) as (server, port), connected(port) as client:
        start = time.monotonic()
        await client.send(head)
        (resp,) = await client.until_closed(timeout=0.3 + SLACK_S)
        elapsed = time.monotonic() - start
        assert_json_error(resp, 408)
        assert 0.25 <= elapsed < 0.3 + SLACK_S
        assert server.timeouts == 1


async def test_idle_keepalive_connection_closed() -> None:
    async with (
        serving(keepalive_timeout_s=0.3, header_timeout_s=0.3) as (server, port),
        connected(port) as client,
    ):
        await client.send(get())
        await client.responses(1)
        start = time.monotonic()
        responses = await client.until_closed(timeout=0.3 + SLACK_S)
        elapsed = time.monotonic() - start
        assert len(responses) == 1  # closed silently: nothing was asked
        assert 0.25 <= elapsed < 0.3 + SLACK_S
        assert await eventually(lambda: not server.connections)


async def test_keepalive_timer_restarts_per_request() -> None:
    """Requests every 0.15 s keep a connection with a 0.3 s idle timeout open."""
    async with (
        serving(keepalive_timeout_s=0.3, header_timeout_s=0.3) as (_server, port),
        connected(port) as client,
    ):
        for i in range(6):
            await client.send(get(b"/%d" % i))
            await client.responses(i + 1)
            await asyncio.sleep(0.15)
        assert not client.eof


async def test_silent_connection_closed_after_header_timeout() -> None:
    async with serving(header_timeout_s=0.3) as (server, port), connected(port) as client:
        start = time.monotonic()
        responses = await client.until_closed(timeout=0.3 + SLACK_S)
        elapsed = time.monotonic() - start
        assert responses == [] and client.stream.raw == b""
        assert 0.25 <= elapsed < 0.3 + SLACK_S
        assert await eventually(lambda: not server.connections)


async def test_slow_handler_is_not_a_timeout() -> None:
    """The time bounds are on the client's bytes, not on the handler's work."""

    async def slow(req: Request, out: Responder) -> None:
        await asyncio.sleep(0.6)
        out.send(200, b"late")

    async with serving(slow, **QUICK) as (_s, port):
        async with connected(port) as client:
            await client.send(post(b"/", b"x"))
            (resp,) = await client.responses(1, timeout=3.0)
            assert resp.status == 200 and resp.body == b"late"


@pytest.mark.parametrize(
    "partial",
    [
        b"GET /next HTTP/1.1\r\nX-Partial: ",
        b"POST /next HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\nabc",
    ],
    ids=["headers", "body"],
)
async def test_partial_pipelined_request_times_out_behind_slow_handler(partial: bytes) -> None:
    async def slow(req: Request, out: Responder) -> None:
        if req.path == b"/slow":
            await asyncio.sleep(0.6)
        out.send(200, b"")

    async with serving(slow, **QUICK) as (_s, port):
        async with connected(port) as client:
            await client.send(get(b"/slow") + partial)
            responses = await client.until_closed(timeout=0.6 + 0.2 + SLACK_S)
            assert responses[0].status == 200
            assert_json_error(responses[1], 408)


# -- connection cap ------------------------------------------------------------------------------


async def test_connection_cap_503_then_accepts_again() -> None:
    # One client (the per-client share is test_http_abuse's), whose connections are both busy
    # sending a body: none is idle or slow enough to be closed for a newcomer.
    async with serving(max_connections=2, peer_share=1.0) as (server, port):
        first, second = await Client.connect(port), await Client.connect(port)
        try:
            for c in (first, second):
                await c.send(get())
                await c.responses(1)
                await c.send(b"POST /still HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\n12345")
            refused = await Client.connect(port)
            try:
                (resp,) = await refused.until_closed()
                error = assert_json_error(resp, 503)
                assert "connections" in error["message"]
                assert resp.header(b"retry-after") == b"1"
                assert server.refused == 1
            finally:
                refused.close()
            # Still at the cap: the next one is refused too.
            again = await Client.connect(port)
            try:
                (resp,) = await again.until_closed()
                assert_json_error(resp, 503)
            finally:
                again.close()
            first.close()
            assert await eventually(lambda: len(server.connections) == 1)
            async with connected(port) as third:
                await third.send(get(b"/back"))
                (resp,) = await third.responses(1)
                assert resp.status == 200 and resp.header(b"x-url") == b"/back"
            # The connections kept are still served.
            await second.send(b"67890")
            _, resp = await second.responses(2)
            assert resp.header(b"x-url") == b"/still" and resp.body == b"1234567890"
        finally:
            first.close()
            second.close()


# -- bytes in flight, Content-Encoding ----------------------------------------------------------


def _held(release: asyncio.Event, arrived: list[int]) -> Handler:
    async def handler(req: Request, out: Responder) -> None:
        arrived.append(len(req.body))
        await release.wait()
        out.send(200, b"%d" % len(req.body), b"text/plain")

    return handler


async def test_body_bytes_in_flight_budget_503_with_retry_after() -> None:
    release, arrived = asyncio.Event(), []
    budget = {"max_inflight_body_bytes": 1000, "peer_share": 1.0}  # the server-wide bound alone
    async with serving(_held(release, arrived), retry_after_s=3, **budget) as (server, port):
        async with connected(port) as first, connected(port) as second, connected(port) as third:
            await first.send(post(b"/a", b"a" * 600))
            assert await eventually(lambda: arrived == [600])
            assert server.body_bytes == 600
            # Announced: refused before its body is read.
            await second.send(post(b"/b", b"b" * 600))
            (resp,) = await second.until_closed()
            error = assert_json_error(resp, 503)
            assert "too many request bytes" in error["message"] and MARKER not in resp.body
            assert resp.header(b"retry-after") == b"3"
            # Chunked: refused while reading, once the budget is crossed.
            await third.send(
                b"POST /c HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
                + chunked([b"c" * 300, b"c" * 300])
            )
            (resp,) = await third.until_closed()
            assert_json_error(resp, 503)
            assert server.over_budget == 2
            release.set()
            (resp,) = await first.responses(1)
            assert resp.status == 200 and resp.body == b"600"
        # Answered or gone, nothing is held any more: the budget is whole again.
        assert await eventually(lambda: server.body_bytes == 0)
        async with connected(port) as again:
            await again.send(post(b"/d", b"d" * 900))
            (resp,) = await again.responses(1)
            assert resp.status == 200 and resp.body == b"900"
        assert server.body_bytes == 0


async def test_body_bytes_of_a_vanished_client_are_released() -> None:
    release, arrived = asyncio.Event(), []
    async with serving(_held(release, arrived), max_inflight_body_bytes=1000, peer_share=1.0) as (
        server,
        port,
    ):
        client = await Client.connect(port)
        await client.send(post(b"/a", b"a" * 700))
        assert await eventually(lambda: server.body_bytes == 700)
        client.abort()  # its handler is cancelled; its bytes are no longer held
        assert await eventually(lambda: server.body_bytes == 0)
        half = await Client.connect(port)
        # Half a body, then gone: its Content-Length, held from its headers on, is released too.
        await half.send(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 900\r\n\r\n" + b"h" * 400)
        assert await eventually(lambda: server.body_bytes == 900)
        half.abort()
        assert await eventually(lambda: server.body_bytes == 0 and not server.peers)
        # Half a chunked body: what arrived is held, and released.
        half = await Client.connect(port)
        await half.send(
            b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked([b"h" * 300])[:-5]
        )
        assert await eventually(lambda: server.body_bytes == 300)
        half.abort()
        assert await eventually(lambda: server.body_bytes == 0 and not server.peers)


@pytest.mark.parametrize("encoding", [b"gzip", b"deflate", b"br", b"gzip, identity", b"x" * 50])
async def test_content_encoding_415(encoding: bytes) -> None:
    async with serving() as (_server, port), connected(port) as client:
        await client.send(post(b"/", b"not gzip " + MARKER, extra=b"Content-Encoding: " + encoding + b"\r\n"))
        (resp,) = await client.until_closed()
        error = assert_json_error(resp, 415)
        assert "Content-Encoding" in error["message"] and MARKER not in resp.body


async def test_content_encoding_identity_accepted() -> None:
    async with serving() as (_server, port), connected(port) as client:
        await client.send(post(b"/", b"plain", extra=b"Content-Encoding: identity\r\n"))
        (resp,) = await client.responses(1)
        assert resp.status == 200 and resp.body == b"plain"


async def test_send_pieces_one_content_length_body() -> None:
    pieces = [b"ab", memoryview(b"cdef"), b"", b"g" * 70000]

    async def handler(req: Request, out: Responder) -> None:
        out.send_pieces(200, pieces, b"application/octet-stream")

    async with serving(handler) as (_server, port), connected(port) as client:
        await client.send(get() + get())
        responses = await client.responses(2)
    for resp in responses:
        assert resp.header(b"content-length") == b"%d" % (6 + 70000)
        assert resp.body == b"abcdef" + b"g" * 70000


async def test_drain_waits_for_a_slow_reader_and_returns_when_it_leaves() -> None:
    waited = asyncio.Event()
    done: list[str] = []
    piece = b"d" * 65536

    async def handler(req: Request, out: Responder) -> None:
        out.start(200, b"application/octet-stream")
        for _ in range(400):  # bounded: 25 MiB at most
            out.write(piece)
            if out.paused:
                waited.set()
                await out.drain()
                done.append("resumed" if not out.closed else "gone")
                if out.closed:
                    return
        out.end()

    async with serving(handler, write_high_water=64 * 1024) as (_server, port):
        client = await Client.connect(port, rcvbuf=8192)
        await client.send(get())
        await asyncio.wait_for(waited.wait(), 10)
        (resp,) = await client.responses(1, timeout=30)
        assert len(resp.body) == 400 * len(piece) and done and set(done) == {"resumed"}
        client.close()
        waited.clear()
        done.clear()
        gone = await Client.connect(port, rcvbuf=8192)
        await gone.send(get())
        await asyncio.wait_for(waited.wait(), 10)
        gone.abort()
        assert await eventually(lambda: done == ["gone"] or not done)


# -- pipelining, HTTP/1.0, Connection: close, Expect -----------------------------------------------


async def test_pipelined_requests_in_one_write_answered_in_order() -> None:
    """More than max_pipelined in one write: reading pauses and resumes, nothing is lost or reordered."""
    requests = [post(b"/p%d" % i, b"body-%d" % i) if i % 2 else get(b"/g%d" % i) for i in range(60)]
    async with serving(max_pipelined=4) as (_server, port), connected(port) as client:
        await client.send(b"".join(requests))
        responses = await client.responses(60)
        for i, resp in enumerate(responses):
            assert resp.status == 200
            assert resp.header(b"x-url") == (b"/p%d" % i if i % 2 else b"/g%d" % i)
            assert resp.body == (b"body-%d" % i if i % 2 else b"")
        assert await client.silent_for(0.1)


async def test_pipelined_requests_answered_in_order_with_slow_handlers() -> None:
    """A later request never overtakes an earlier one that takes longer."""

    async def varied(req: Request, out: Responder) -> None:
        await asyncio.sleep(0.05 if int(req.path[2:]) % 3 == 0 else 0)
        out.send(200, req.path)

    async with serving(varied) as (_server, port), connected(port) as client:
        await client.send(b"".join(get(b"/r%d" % i) for i in range(12)))
        responses = await client.responses(12)
        assert [r.body for r in responses] == [b"/r%d" % i for i in range(12)]


async def test_request_in_one_byte_writes() -> None:
    data = (
        b"POST /bytewise?q=1 HTTP/1.1\r\nHost: t\r\nX-A: b\r\nTransfer-Encoding: chunked\r\n\r\n"
        + chunked([b"hello", b" ", b"world"])
        + post(b"/second", b"0123456789")
    )
    async with serving() as (_server, port), connected(port) as client:
        await client.send(data, step=1, delay=0.001)
        first, second = await client.responses(2)
        assert first.header(b"x-url") == b"/bytewise?q=1" and first.body == b"hello world"
        assert second.header(b"x-url") == b"/second" and second.body == b"0123456789"


async def test_expect_100_continue_before_the_body() -> None:
    async with serving() as (_server, port), connected(port) as client:
        await client.send(b"POST /e HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n")
        (cont,) = await client.responses(1, timeout=2.0)
        assert cont.status == 100
        assert bytes(client.stream.raw) == b"HTTP/1.1 100 Continue\r\n\r\n"
        await client.send(b"hello")
        _, resp = await client.responses(2)
        assert resp.status == 200 and resp.body == b"hello"


async def test_expect_100_continue_when_pipelined() -> None:
    async def slow(req: Request, out: Responder) -> None:
        if req.path == b"/slow":
            await asyncio.sleep(0.3)
        out.send(200, req.body)

    async with serving(slow) as (_server, port), connected(port) as client:
        await client.send(
            get(b"/slow")
            + b"POST /e HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n"
        )
        first, cont = await client.responses(2, timeout=2.0)
        assert first.status == 200 and cont.status == 100


async def test_no_100_continue_to_http10() -> None:
    async with serving() as (_server, port), connected(port) as client:
        await client.send(b"POST / HTTP/1.0\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n")
        await client.collect_for(0.3)
        assert b"100 Continue" not in bytes(client.stream.raw)
        await client.send(b"hi")
        (resp,) = await client.until_closed()
        assert resp.status == 200 and resp.body == b"hi"


async def test_pipelined_queue_full_stops_reading() -> None:
    """Behind a busy handler, at most max_pipelined requests are read ahead: the client's sending stalls."""
    gate = asyncio.Event()

    async def gated(req: Request, out: Responder) -> None:
        await gate.wait()
        out.send(200, b"")

    one = post(b"/q", b"q" * 4000)
    async with serving(gated, max_pipelined=4) as (_server, port), connected(port) as client:
        sent, stalled = 0, False
        while sent < 8000 and not stalled:  # 32 MB: more than every socket buffer on the way holds
            client.writer.write(one * 50)
            sent += 50
            try:
                await asyncio.wait_for(client.writer.drain(), 0.5)
            except asyncio.TimeoutError:
                stalled = True
        assert stalled, "the server kept reading requests it could not answer"
        gate.set()
        sender = asyncio.ensure_future(client.writer.drain())
        responses = await client.responses(sent, timeout=30.0)
        await sender
        assert all(r.status == 200 for r in responses)


async def test_pipelined_responses_to_a_reader_that_does_not_read_are_bounded() -> None:
    body = b"m" * 65536

    async def big(req: Request, out: Responder) -> None:
        out.send(200, body)

    async with serving(big, write_high_water=64 * 1024) as (server, port):
        client = await Client.connect(port, rcvbuf=8192)
        try:
            peak, sent = 0, 0
            while sent < 1000:  # up to 64 MB of answers
                client.writer.write(get() * 20)
                sent += 20
                try:
                    await asyncio.wait_for(client.writer.drain(), 0.3)
                except asyncio.TimeoutError:
                    break  # the server stopped reading: what it should do
                await asyncio.sleep(0.002)
                peak = max(peak, sum(c.transport.get_write_buffer_size() for c in server.connections))
            await asyncio.sleep(0.1)
            peak = max(peak, sum(c.transport.get_write_buffer_size() for c in server.connections))
            assert peak < 4 * 1024 * 1024, f"{peak / 2**20:.0f} MiB buffered for one client"
        finally:
            client.abort()


async def test_http10_response_then_close() -> None:
    async with serving() as (_server, port), connected(port) as client:
        await client.send(b"POST /old HTTP/1.0\r\nContent-Length: 3\r\n\r\nabc" + get(b"/never"))
        (resp,) = await client.until_closed()
        assert resp.status == 200 and resp.body == b"abc"
        assert resp.header(b"x-version") == b"1.0"
        assert resp.header(b"connection") == b"close"


async def test_http10_streamed_response_is_close_delimited() -> None:
    async def stream(req: Request, out: Responder) -> None:
        out.start(200, b"text/plain")
        for i in range(5):
            out.write(b"piece-%d;" % i)
            await asyncio.sleep(0.01)
        out.end()

    async with serving(stream) as (_server, port), connected(port) as client:
        await client.send(b"GET /s HTTP/1.0\r\n\r\n")
        (resp,) = await client.until_closed()
        assert resp.status == 200
        assert resp.header(b"transfer-encoding") is None and resp.header(b"content-length") is None
        assert resp.header(b"connection") == b"close"
        assert resp.body == b"".join(b"piece-%d;" % i for i in range(5))
        assert b"\r\n0\r\n" not in bytes(client.stream.raw)


async def test_http10_keep_alive_streamed_response_still_closes() -> None:
    async def stream(req: Request, out: Responder) -> None:
        out.start(200, b"text/plain")
        out.write(b"abc")
        out.end()

    async with serving(stream) as (_server, port), connected(port) as client:
        await client.send(b"GET /s HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
        (resp,) = await client.until_closed()
        assert resp.body == b"abc" and resp.header(b"connection") == b"close"


async def test_connection_close_honoured() -> None:
    async with serving() as (_server, port), connected(port) as client:
        await client.send(get(b"/first", extra=b"Connection: close\r\n") + get(b"/never"))
        (resp,) = await client.until_closed()
        assert resp.status == 200 and resp.header(b"x-url") == b"/first"
        assert resp.header(b"connection") == b"close"
        assert b"/never" not in bytes(client.stream.raw)


async def test_keepalive_reuse_many_requests_one_connection() -> None:
    async with serving() as (server, port), connected(port) as client:
        for i in range(200):
            body = (b"%d" % i) * (i % 7)
            await client.send(post(b"/k%d" % i, body) if i % 2 else get(b"/k%d" % i))
            resp = (await client.responses(i + 1))[i]
            assert resp.status == 200 and resp.header(b"x-url") == b"/k%d" % i
            assert resp.body == (body if i % 2 else b"")
            assert resp.header(b"connection") is None
            assert len(server.connections) == 1
        assert not client.eof


async def test_large_bodies_echoed() -> None:
    body = bytes(range(256)) * 4096  # 1 MiB: written as head + body
    async with serving() as (_server, port), connected(port) as client:
        await client.send(post(b"/big", body) + get(b"/small"))
        big, small = await client.responses(2, timeout=10.0)
        assert big.body == body and small.header(b"x-url") == b"/small"


# -- streaming ----------------------------------------------------------------------------------------


def _stream_handler(n: int, piece: Callable[[int], bytes]) -> Handler:
    async def stream(req: Request, out: Responder) -> None:
        out.start(200, b"text/event-stream", b"X-Stream: yes\r\n")
        for i in range(n):
            out.write(piece(i))
            if i % 5 == 0:
                await asyncio.sleep(0)
        out.write(b"")  # empty writes must not end the stream
        out.end()
        out.end()  # idempotent

    return stream


async def test_streamed_response_is_valid_chunked() -> None:
    pieces = [b"data: %d %s\n\n" % (i, b"x" * (i * 37 % 300)) for i in range(50)]
    async with serving(_stream_handler(50, pieces.__getitem__)) as (_server, port), connected(port) as client:
        await client.send(get(b"/s") + get(b"/s"))
        first, second = await client.responses(2)
        for resp in (first, second):
            assert resp.status == 200
            assert resp.header(b"transfer-encoding") == b"chunked"
            assert resp.header(b"content-length") is None
            assert resp.header(b"x-stream") == b"yes"
            assert resp.body == b"".join(pieces)
        # Each write is one chunk, and the body ends with the last chunk.
        raw = bytes(client.stream.raw)
        body = raw.split(b"\r\n\r\n", 1)[1]
        assert body.startswith(b"%x\r\n%s\r\n" % (len(pieces[0]), pieces[0]))
        assert raw.endswith(b"\r\n0\r\n\r\n")


async def test_streamed_response_read_by_http_client() -> None:
    """A second parser (the standard library's) agrees on the chunked framing."""
    pieces = [b"event %d\n" % i for i in range(30)]
    async with serving(_stream_handler(30, pieces.__getitem__)) as (_server, port):

        def fetch() -> tuple[int, bytes, str | None, bytes]:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            try:
                conn.request("GET", "/s")
                resp = conn.getresponse()
                body = resp.read()
                conn.request("POST", "/again", body=b"x")
                again = conn.getresponse().read()  # the same connection after a stream
                return resp.status, body, resp.getheader("Transfer-Encoding"), again
            finally:
                conn.close()

        status, body, framing, again = await asyncio.to_thread(fetch)
        assert status == 200 and framing == "chunked"
        assert body == b"".join(pieces)
        assert again == b"".join(pieces)


async def test_client_disconnect_mid_stream_cancels_handler() -> None:
    cancelled = asyncio.Event()
    started = asyncio.Event()

    async def forever(req: Request, out: Responder) -> None:
        out.start(200, b"text/event-stream")
        out.write(b"data: first\n\n")
        started.set()
        try:
            while True:
                await asyncio.sleep(0.01)
                out.write(b"data: more\n\n")
        except asyncio.CancelledError:
            assert out.closed
            cancelled.set()
            raise

    async with serving(forever) as (server, port):
        client = await Client.connect(port)
        await client.send(get(b"/s"))
        await asyncio.wait_for(started.wait(), 2)
        while b"data: first" not in client.stream.raw:
            await client._read_once(2)
        client.abort()
        await asyncio.wait_for(cancelled.wait(), 2)
        assert await eventually(lambda: not server.connections)


async def test_handler_raising_mid_stream_drops_connection() -> None:
    async def broken(req: Request, out: Responder) -> None:
        out.start(200, b"text/event-stream")
        out.write(b"data: one\n\n")
        raise RuntimeError("boom")

    async with serving(broken) as (_server, port), connected(port) as client:
        await client.send(get(b"/s"))
        responses = await client.until_closed()
        assert responses == []  # never completed: no last chunk
        assert client.stream.current is not None and client.stream.current.body == b"data: one\n\n"
        assert not bytes(client.stream.raw).endswith(b"0\r\n\r\n")


async def test_responder_send_twice_refused() -> None:
    errors: list[Exception] = []

    async def twice(req: Request, out: Responder) -> None:
        out.send(200, b"once")
        for again in (lambda: out.send(200, b"twice"), lambda: out.start(200, b"text/plain")):
            try:
                again()
            except RuntimeError as exc:
                errors.append(exc)

    async with serving(twice) as (_server, port), connected(port) as client:
        await client.send(get() + get())
        a, b = await client.responses(2)
        assert a.body == b.body == b"once"
        assert len(errors) == 4
        assert await client.silent_for(0.1)


# -- backpressure ------------------------------------------------------------------------------------


class Flow:
    def __init__(self) -> None:
        self.pauses = 0
        self.resumes = 0
        self.resumed = asyncio.Event()

    def pause_reading(self) -> None:
        self.pauses += 1
        self.resumed.clear()

    def resume_reading(self) -> None:
        self.resumes += 1
        self.resumed.set()


async def test_backpressure_pauses_and_resumes_flow() -> None:
    flow = Flow()
    paused = asyncio.Event()
    sent = [0]
    piece = b"z" * 65536

    async def firehose(req: Request, out: Responder) -> None:
        out.start(200, b"application/octet-stream")
        out.flow = flow
        assert not out.paused
        while not out.paused and sent[0] < 256 * 1024 * 1024:
            out.write(piece)
            sent[0] += len(piece)
            await asyncio.sleep(0)
        assert out.paused and flow.pauses == 1 and flow.resumes == 0
        paused.set()
        await asyncio.wait_for(flow.resumed.wait(), 10)
        assert not out.paused
        out.flow = None
        out.write(b"END")
        out.end()

    async with serving(firehose, write_high_water=64 * 1024) as (_server, port):
        client = await Client.connect(port, rcvbuf=8192)
        try:
            await client.send(get(b"/fire"))
            await asyncio.wait_for(paused.wait(), 10)
            await asyncio.sleep(0.2)  # the client still reads nothing: no resume
            assert flow.pauses == 1 and flow.resumes == 0
            (resp,) = await client.responses(1, timeout=20.0)
            assert flow.resumes == 1
            assert len(resp.body) == sent[0] + 3 and resp.body.endswith(b"END")
        finally:
            client.close()


# -- handler failures ----------------------------------------------------------------------------------


async def test_handler_exception_500_and_server_keeps_serving() -> None:
    async def flaky(req: Request, out: Responder) -> None:
        if req.path == b"/boom":
            raise ValueError("secret " + MARKER.decode())
        await echo(req, out)

    async with serving(flaky) as (_server, port):
        other = await Client.connect(port)
        try:
            async with connected(port) as client:
                await client.send(get(b"/boom") + get(b"/never"))
                (resp,) = await client.until_closed()
                assert_json_error(resp, 500)
                assert MARKER not in bytes(client.stream.raw)
            await other.send(get(b"/fine"))
            (resp,) = await other.responses(1)
            assert resp.status == 200
            async with connected(port) as fresh:
                await fresh.send(get(b"/fresh"))
                (resp,) = await fresh.responses(1)
                assert resp.status == 200 and resp.header(b"x-url") == b"/fresh"
        finally:
            other.close()


async def test_handler_returning_without_response_500() -> None:
    async def lazy(req: Request, out: Responder) -> None:
        if req.path == b"/lazy":
            await asyncio.sleep(0)
            return
        await echo(req, out)

    async with serving(lazy) as (_server, port), connected(port) as client:
        await client.send(get(b"/lazy") + get(b"/after"))
        first, second = await client.responses(2)
        error = assert_json_error(first, 500, closes=False)
        assert "no response" in error["message"]
        assert second.status == 200 and second.header(b"x-url") == b"/after"


async def test_handler_raising_cancelled_error_does_not_hang_the_connection() -> None:
    async def cancelled(req: Request, out: Responder) -> None:
        raise asyncio.CancelledError()  # e.g. an awaited future someone else cancelled

    async with serving(cancelled, **QUICK) as (_server, port):
        async with connected(port) as client:
            await client.send(get())
            responses = await client.until_closed(timeout=0.2 + SLACK_S)
            assert all(r.status >= 500 for r in responses)


async def test_handler_started_but_not_ended_is_ended() -> None:
    async def unfinished(req: Request, out: Responder) -> None:
        out.start(200, b"text/plain")
        out.write(b"partial")

    async with serving(unfinished) as (_server, port), connected(port) as client:
        await client.send(get() + get())
        a, b = await client.responses(2)
        assert a.body == b.body == b"partial"


async def test_close_lets_inflight_request_finish() -> None:
    started = asyncio.Event()

    async def slow(req: Request, out: Responder) -> None:
        started.set()
        await asyncio.sleep(0.3)
        out.send(200, b"finished")

    server = Server(slow, Limits())
    await server.start("127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    idle = await Client.connect(port)
    busy = await Client.connect(port)
    try:
        await busy.send(get())
        await asyncio.wait_for(started.wait(), 2)
        await eventually(lambda: len(server.connections) == 2)
        await server.close(grace_s=3.0)
        (resp,) = await busy.responses(1)
        assert resp.body == b"finished"
        await idle.until_closed(timeout=2.0)
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", port)
    finally:
        idle.close()
        busy.close()


async def test_a_connection_attached_once_close_began_is_closed_at_once() -> None:
    """A client accepted in the loop pass where close() ran attaches after close() swept the
    connections: no deadline sweeper runs any more, and from Python 3.12.1 the listener's
    wait_closed() waits for every connection, so one left open would hang close(). It is closed as
    it attaches (here a socket accepted after close(), attached as the listener would)."""
    server = Server(echo, Limits())
    await server.start("127.0.0.1", 0)
    await server.close(grace_s=0.5)
    ours, theirs = socket.socketpair()
    try:
        await asyncio.get_running_loop().connect_accepted_socket(
            lambda: server_module._Connection(server), ours
        )
        theirs.settimeout(5.0)
        assert await asyncio.to_thread(theirs.recv, 1) == b""  # closed (a FIN), nothing written
        assert await eventually(lambda: not server.connections)
    finally:
        theirs.close()


# -- properties ------------------------------------------------------------------------------------------

METHODS = [b"GET", b"POST", b"PUT", b"DELETE", b"PATCH", b"OPTIONS"]
_TOKEN = st.text(
    alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-", min_size=1, max_size=12
)
_PATHS = st.builds(
    lambda segs, query: ("/" + "/".join(segs) + (("?" + query) if query else "")).encode(),
    st.lists(
        st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-._~%", min_size=0, max_size=10), max_size=4
    ),
    st.one_of(st.none(), st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789=&", min_size=1, max_size=20)),
)


@st.composite
def requests_(draw: st.DrawFn) -> tuple[bytes, bytes, bytes, bytes]:
    """One valid request: (bytes, method, url, body)."""
    method = draw(st.sampled_from(METHODS))
    url = draw(_PATHS)
    headers = draw(st.lists(st.tuples(_TOKEN, st.text(alphabet="abc xyz/;=,0123", max_size=20)), max_size=5))
    head = b"%s %s HTTP/1.1\r\nHost: test\r\n" % (method, url)
    head += b"".join(b"X-%s: %s\r\n" % (k.encode(), v.strip().encode()) for k, v in headers)
    body = draw(st.binary(max_size=2000))
    framing = draw(st.sampled_from(["length", "chunked", "none"] if not body else ["length", "chunked"]))
    if framing == "length":
        data = head + b"Content-Length: %d\r\n\r\n" % len(body) + body
    elif framing == "chunked":
        cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=4)))
        bounds = [0, *cuts, len(body)]
        pieces = [body[a:b] for a, b in itertools.pairwise(bounds)]
        data = head + b"Transfer-Encoding: chunked\r\n\r\n" + chunked(pieces)
    else:
        data = head + b"\r\n"
    return data, method, url, body


@st.composite
def splits(draw: st.DrawFn, data: bytes) -> list[bytes]:
    """``data`` cut into writes: random cut points, sometimes a run of 1-byte writes."""
    cuts = set(draw(st.lists(st.integers(1, max(1, len(data) - 1)), max_size=8)))
    if draw(st.booleans()):
        start = draw(st.integers(0, max(0, len(data) - 1)))
        cuts.update(range(start, min(len(data), start + draw(st.integers(1, 40)))))
    bounds = [0, *sorted(c for c in cuts if 0 < c < len(data)), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds) if b > a]


async def _write_all(client: Client, writes: Sequence[bytes]) -> None:
    for i, piece in enumerate(writes):
        client.writer.write(piece)
        await client.writer.drain()
        if i % 3 == 0:
            await asyncio.sleep(0.0005)  # let some writes become reads of their own


@settings(
    max_examples=50, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)
@given(data=st.data())
def test_property_pipelined_valid_requests_echoed_in_order(data: st.DataObject) -> None:
    requests = data.draw(st.lists(requests_(), min_size=1, max_size=6), label="requests")
    stream = b"".join(r[0] for r in requests)
    writes = data.draw(splits(stream), label="writes")

    async def case() -> None:
        async with serving() as (server, port), connected(port) as client:
            await asyncio.wait_for(_write_all(client, writes), 5)
            responses = await client.responses(len(requests), timeout=5.0)
            for resp, (_, method, url, body) in zip(responses, requests):
                assert resp.status == 200
                assert resp.header(b"x-method") == method
                assert resp.header(b"x-url") == url
                assert resp.body == body
            assert await client.silent_for(0.02)
            assert server.framing_errors == 0

    asyncio.run(case())


_SPECIAL = [
    b"\r\n",
    b"\n",
    b"\r",
    b"\x00",
    b" ",
    b":",
    b"\t",
    b"\r\n ",
    b"0",
    b"-",
    b"+",
    b"ff",
    b";",
    b"Content-Length: 3\r\n",
    b"Transfer-Encoding: chunked\r\n",
    b"Expect: 100-continue\r\n",
    b"HTTP/1.0",
    b"HTTP/2.0",
    b"\r\n\r\n",
    b"\xff",
    b"Connection: close\r\n",
]


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """Random bytes, or valid requests with bytes flipped, dropped, duplicated or inserted."""
    if draw(st.integers(0, 4)) == 0:
        return draw(st.binary(min_size=1, max_size=300))
    base = bytearray(b"".join(r[0] for r in draw(st.lists(requests_(), min_size=1, max_size=3))))
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.integers(0, 4))
        pos = draw(st.integers(0, len(base)))
        if op == 0 and pos < len(base):
            base[pos] = draw(st.integers(0, 255))
        elif op == 1:
            del base[pos : pos + draw(st.integers(1, 8))]
        elif op == 2:
            base[pos:pos] = draw(st.sampled_from(_SPECIAL))
        elif op == 3:
            base[pos:pos] = base[pos : pos + draw(st.integers(1, 30))]
        else:
            del base[pos:]  # cut short: a request that never completes
    return bytes(base) or b"\r\n"


@settings(
    max_examples=50, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)
@given(data=st.data())
def test_property_garbage_never_crashes_or_hangs(data: st.DataObject) -> None:
    payload = data.draw(mutated(), label="payload")
    writes = data.draw(splits(payload), label="writes")
    timeout = QUICK["header_timeout_s"]

    async def case() -> None:
        async with serving(**QUICK) as (server, port):
            async with connected(port) as client:
                try:
                    await asyncio.wait_for(_write_all(client, writes), 5)
                except (ConnectionResetError, BrokenPipeError):
                    pass  # the server may already have answered and closed
                # Never hangs: every connection ends on a deadline (idle, headers, body, linger).
                responses = await client.until_closed(timeout=timeout + 2.0 + SLACK_S)
                for i, resp in enumerate(responses):
                    if resp.status == 100:
                        continue
                    if resp.status >= 400:
                        assert_json_error(resp, resp.status, closes=resp.status != 500)
                        assert i == len(responses) - 1 or resp.status == 500, responses  # an error ends it
                    else:
                        assert resp.status == 200 and resp.header(b"x-method") is not None
                # Whatever remains after the responses is the start of one cut short (nothing else).
                assert client.stream.error is None
            # Never crashes: a fresh connection is served.
            async with connected(port) as fresh:
                await fresh.send(post(b"/alive", b"yes"))
                (resp,) = await fresh.responses(1, timeout=3.0)
                assert resp.status == 200 and resp.body == b"yes"
            assert await eventually(lambda: len(server.connections) <= 1, timeout=3.0)

    asyncio.run(case())


# -- the server's seams (issue 24) ----------------------------------------------------------------


def test_server_built_where_no_loop_runs_serves_on_the_one_it_starts_on() -> None:
    """Built in a thread with no event loop (asyncio.get_event_loop() raised there), started on
    another: it serves there, and its Date line is its own (no module-level cache)."""
    server = made_in_a_thread(lambda: Server(echo, Limits()))
    assert server.date is not HTTPServer(echo).date

    async def scenario() -> None:
        await server.start("127.0.0.1", 0)
        try:
            assert server.loop is asyncio.get_running_loop()
            async with connected(server.sockets[0].getsockname()[1]) as client:
                await client.send(get(b"/dated"))
                (resp,) = await client.responses(1)
            assert resp.status == 200
            date = resp.header(b"date")
            assert date is not None and parsedate_to_datetime(date.decode()).tzinfo is not None
            assert server.date().startswith(b"Date: ") and server.date().endswith(b" GMT\r\n")
        finally:
            await server.close(grace_s=0.5)

    asyncio.run(scenario())


# -- bodies read into buffers (the compiled parser under uvloop) -------------------------------------


def _buffered_reads_expected(server: HTTPServer) -> bool:
    """uvloop reads into the buffers of a protocol that has get_buffer and is no asyncio.Protocol: a
    connection on the compiled parser; asyncio's loop (and the pure twin's parser) hand bytes objects."""
    on_uvloop = type(asyncio.get_running_loop()).__module__.startswith("uvloop")
    return on_uvloop and hasattr(server.request_parser, "get_buffer")


@pytest.mark.parametrize("size", [1, 70_000, 300_000], ids=["1-byte", "70-kb", "300-kb"])
@pytest.mark.parametrize("step", [0, 4096], ids=["one-write", "dribbled"])
async def test_a_body_of_a_known_length_arrives_whole(size: int, step: int) -> None:
    """A Content-Length body (what the orchestrator's clients send: a prompt of 40k tokens is ~160 KB):
    under uvloop the compiled parser has the socket read it into one bytes object of that length (no
    bytes object per read, no join), its first bytes copied from the read buffer; on every loop and
    parser the handler sees the client's bytes, and a second request behind it on the same
    connection (its head in the read buffer again) is read as well."""
    body = bytes(range(251)) * (size // 251) + b"x" * (size % 251)
    async with serving(echo, max_body_bytes=1 << 20) as (server, port), connected(port) as client:
        await client.send(post(b"/a", body) + post(b"/b", body[::-1]), step=step)
        first, second = await client.responses(2)
        assert first.status == second.status == 200
        assert first.body == body and second.body == body[::-1]
        (conn,) = server.connections
        assert getattr(conn.parser, "buffered", False) == _buffered_reads_expected(server)


async def test_a_declared_length_above_the_read_into_bound_is_kept_as_its_pieces_come() -> None:
    """A Content-Length is the client's word: above ``_parse.WHOLE_READ_MAX`` (within the body bound)
    nothing is allocated at the head; the pieces are kept as they arrive, and the body is whole."""
    bound = 8 * 1024 * 1024
    if hasattr(Server.request_parser, "get_buffer"):
        from server.http import _parse

        bound = _parse.WHOLE_READ_MAX
    body = b"b" * (bound + 1)
    async with serving(echo, max_body_bytes=2 * bound) as (_server, port), connected(port) as client:
        await client.send(post(b"/", body))
        (resp,) = await client.responses(1, timeout=30.0)
        assert resp.status == 200 and resp.body == body


async def test_many_clients_sending_at_once_each_get_their_own_bytes() -> None:
    """Every client connection of the process reads into one read buffer (uvloop: one read at a time,
    each parsed before the next): bodies dribbled on many connections at once, of a known length
    (read into their own bytes) and chunked (copied out piece by piece), are each their sender's."""
    async with serving(echo, max_body_bytes=1 << 20) as (_server, port):
        clients = [await Client.connect(port) for _ in range(8)]
        try:
            bodies = [bytes([65 + i]) * (40_000 + i) for i in range(8)]
            requests = [
                post(b"/", b)
                if i % 2
                else b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
                + chunked([b[:9000], b[9000:]])
                for i, b in enumerate(bodies)
            ]
            await asyncio.gather(*(c.send(r, step=2048) for c, r in zip(clients, requests)))
            answers = await asyncio.gather(*(c.responses(1) for c in clients))
            for (resp,), body in zip(answers, bodies):
                assert resp.status == 200 and resp.body == body
        finally:
            for c in clients:
                c.close()
