"""server.http.client (UpstreamPool) against small raw-byte servers on 127.0.0.1.

Each test runs an asyncio server (:mod:`upstream_stand_ins`) whose every byte is
the test's, so framing (Content-Length, chunked, close-delimited, malformed),
timing (silence, drip-feeding) and connection handling (keep-alive, closing
an idle connection, a reset mid-body) are exact. The server counts the
connections it accepts, which is how reuse is checked. Every test runs on
both twins of the upstream side (conftest's ``upstream_twin``, set on :class:`Pool`).
``UpstreamPool.start`` (a listener, no coroutine): test_http_client_start.
"""

from __future__ import annotations

import asyncio
import importlib
import time
from types import SimpleNamespace

import pytest
from helpers import REQUIRE_EXTENSIONS, eventually, free_port, made_in_a_thread
from upstream_stand_ins import (  # noqa: F401  (fixtures: both twins, both loops)
    SLACK_S,
    Pool,
    Reader,
    RequestLine,
    Serve,
    Upstream,
    Writer,
    _both_twins,
    answering,
    chunked_response,
    echo_response,
    event_loop_policy,
    fetch,
    ok,
    pool_for,
    read_request,
    reset,
)

from server.http import Deadlines, UpstreamError, UpstreamPool, UpstreamTimeout, client, upstream

# Both loops through raw_http's event_loop_policy fixture (uvloop: the compiled connection's buffered reads).
pytestmark = pytest.mark.filterwarnings('ignore:Overriding the "event_loop_policy" fixture is deprecated')

# -- requests and keep-alive ------------------------------------------------------------------


async def test_request_bytes_on_the_wire() -> None:
    """Method, prefix + path, Host, Content-Length of all pieces, extra headers, pieces in order."""
    async with (
        Upstream(answering(echo_response)) as up,
        pool_for(up, "/prefix/", extra_headers=b"X-Fixed: 1\r\n") as pool,
    ):
        pieces = [b"abc", bytearray(b"def"), memoryview(b"--ghi--")[2:5], b""]
        resp = await pool.request(b"PUT", b"/v1/x?y=1", pieces, headers=b"X-Extra: 2\r\n")
        body = await resp.read()
        resp.release()
        assert body == b"abcdefghi"
        line, headers, sent = up.requests[0]
        assert line == b"PUT /prefix/v1/x?y=1 HTTP/1.1"
        assert headers[b"host"] == b"127.0.0.1:%d" % up.port
        assert headers[b"content-length"] == b"9"
        assert headers[b"x-fixed"] == b"1" and headers[b"x-extra"] == b"2"
        assert sent == b"abcdefghi"


async def test_keepalive_reuses_one_connection() -> None:
    async with Upstream(answering(echo_response)) as up, pool_for(up) as pool:
        for i in range(30):
            resp, body = await fetch(pool, b"/r%d" % i, b"body %d" % i)
            assert resp.status == 200 and body == b"body %d" % i
            assert resp.complete and resp.keep_alive
        assert up.accepted == 1
        assert len(pool.idle) == 1 and len(pool.open) == 1
        assert [r[0] for r in up.requests] == [b"POST /r%d HTTP/1.1" % i for i in range(30)]


async def test_concurrent_requests_use_separate_connections_then_pool_them() -> None:
    gate = asyncio.Event()

    async def serve(up: Upstream, reader: Reader, writer: Writer, index: int) -> None:
        while (req := await up.next_request(reader)) is not None:
            await gate.wait()
            writer.write(echo_response(req))

    async with Upstream(serve) as up, pool_for(up) as pool:
        tasks = [asyncio.ensure_future(fetch(pool, b"/c", b"%d" % i)) for i in range(5)]
        assert await eventually(lambda: len(up.requests) == 5)
        gate.set()
        results = await asyncio.gather(*tasks)
        assert sorted(body for _, body in results) == [b"%d" % i for i in range(5)]
        assert up.accepted == 5 and len(pool.idle) == 5
        await fetch(pool)
        assert up.accepted == 5


async def test_max_idle_bounds_the_pool() -> None:
    gate = asyncio.Event()

    async def serve(up: Upstream, reader: Reader, writer: Writer, index: int) -> None:
        while await up.next_request(reader) is not None:
            await gate.wait()
            writer.write(ok())

    async with Upstream(serve) as up, pool_for(up, max_idle=2) as pool:
        tasks = [asyncio.ensure_future(fetch(pool)) for _ in range(4)]
        assert await eventually(lambda: len(up.requests) == 4)
        gate.set()
        await asyncio.gather(*tasks)
        assert len(pool.idle) == 2
        assert await eventually(lambda: up.client_closed == 2)


async def test_idle_timeout_drops_old_connections() -> None:
    async with Upstream(answering(echo_response)) as up, pool_for(up, idle_timeout_s=0.2) as pool:
        await fetch(pool)
        await fetch(pool)
        assert up.accepted == 1
        await asyncio.sleep(0.3)
        await fetch(pool)
        assert up.accepted == 2
        assert await eventually(lambda: up.client_closed == 1)


# -- response framing -------------------------------------------------------------------------


async def test_content_length_response() -> None:
    body = bytes(range(256)) * 1000
    async with Upstream(
        answering(lambda req: ok(body, b"Application/JSON; charset=utf-8", b"Retry-After: 3\r\n"))
    ) as up:
        async with pool_for(up) as pool:
            resp, got = await fetch(pool)
            assert got == body
            assert resp.status == 200 and resp.content_length == len(body)
            assert resp.content_type == b"Application/JSON; charset=utf-8"
            assert resp.media_type == b"application/json"
            assert resp.retry_after == b"3"
            assert resp.complete and resp.keep_alive and not resp.truncated


async def test_error_status_relayed() -> None:
    answer = b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 7\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
    async with Upstream(answering(lambda req: answer)) as up, pool_for(up) as pool:
        resp, body = await fetch(pool)
        assert resp.status == 503 and resp.retry_after == b"7" and body == b"{}"
        await fetch(pool)
        assert up.accepted == 1  # an error response does not spoil the connection


async def test_chunked_response() -> None:
    pieces = [b"data: %d\n\n" % i for i in range(40)]
    async with Upstream(answering(lambda req: chunked_response(pieces))) as up, pool_for(up) as pool:
        for _ in range(3):
            resp, body = await fetch(pool)
            assert body == b"".join(pieces)
            assert resp.content_length == -1 and resp.media_type == b"text/event-stream"
        assert up.accepted == 1


async def test_chunked_response_dripped() -> None:
    """Chunks split across reads at every position (sizes, CRLFs, data)."""
    raw = chunked_response([b"alpha", b"b" * 300, b"gamma"])

    async def serve(up: Upstream, reader: Reader, writer: Writer, index: int) -> None:
        while await up.next_request(reader) is not None:
            for i in range(0, len(raw), 7):
                writer.write(raw[i : i + 7])
                await writer.drain()
                await asyncio.sleep(0.001)

    async with Upstream(serve) as up, pool_for(up) as pool:
        _, body = await fetch(pool)
        assert body == b"alpha" + b"b" * 300 + b"gamma"


async def test_close_delimited_response() -> None:
    async def serve(up: Upstream, reader: Reader, writer: Writer, index: int) -> None:
        if await up.next_request(reader) is None:
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil ")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"the end")
        await writer.drain()
        writer.close()

    async with Upstream(serve) as up, pool_for(up) as pool:
        resp, body = await fetch(pool)
        assert body == b"until the end"
        assert resp.complete and resp.content_length is None and not resp.keep_alive
        assert not pool.idle
        _, body = await fetch(pool)
        assert body == b"until the end" and up.accepted == 2


async def test_http10_response_not_reused() -> None:
    async with (
        Upstream(answering(lambda req: b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok")) as up,
        pool_for(up) as pool,
    ):
        resp, body = await fetch(pool)
        assert body == b"ok" and resp.complete and not resp.keep_alive
        await fetch(pool)
        assert up.accepted == 2 and not pool.idle


async def test_connection_close_response_not_reused() -> None:
    async with (
        Upstream(answering(lambda req: ok(extra=b"Connection: close\r\n"))) as up,
        pool_for(up) as pool,
    ):
        resp, body = await fetch(pool)
        assert body == b"ok" and resp.complete and not resp.keep_alive
        assert not pool.idle and not pool.open
        assert await eventually(lambda: up.client_closed == 1)  # the pool closed it
        await fetch(pool)
        assert up.accepted == 2


async def test_response_without_body_statuses() -> None:
    answers = [
        b"HTTP/1.1 204 No Content\r\n\r\n",
        b"HTTP/1.1 304 Not Modified\r\nContent-Length: 10\r\n\r\n",
        ok(b""),
    ]
    it = iter(answers)
    async with Upstream(answering(lambda req: next(it))) as up, pool_for(up) as pool:
        for status in (204, 304, 200):
            resp, body = await fetch(pool)
            assert resp.status == status and body == b"" and resp.complete
        assert up.accepted == 1


async def test_interim_100_continue_skipped() -> None:
    async def serve(up: Upstream, reader: Reader, writer: Writer, index: int) -> None:
        while await up.next_request(reader) is not None:
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(ok(b"final"))

    async with Upstream(serve) as up, pool_for(up) as pool:
        resp, body = await fetch(pool, body=b"x")
        assert resp.status == 200 and body == b"final"


# -- read(limit), max_body, stream(sink) ----------------------------------------------------------


@pytest.mark.parametrize("dripped", [False, True], ids=["whole", "dripped"])
async def test_read_limit_truncates_and_drops_connection(dripped: bool) -> None:
    body = b"0123456789" * 1000

    async def serve(up: Upstream, reader: Reader, writer: Writer, index: int) -> None:
        while await up.next_request(reader) is not None:
            answer = ok(body)
            if not dripped:
                writer.write(answer)
                continue
            writer.write(answer[: -len(body)])
            for i in range(0, len(body), 500):
                await asyncio.sleep(0.002)
                if writer.is_closing():  # the client dropped it (uvloop raises on a write then)
                    break
                writer.write(body[i : i + 500])

    async with Upstream(serve) as up, pool_for(up) as pool:
        resp = await pool.request(b"GET", b"/big")
        if not dripped:
            await asyncio.sleep(0.05)  # the whole body is in before read() is called
        got = await resp.read(1234)
        assert got == body[:1234]
        assert resp.truncated
        resp.release()
        assert not pool.idle
        assert await eventually(lambda: up.client_closed == 1)  # the pool dropped it
        _, whole = await fetch(pool)
        assert whole == body and up.accepted == 2


async def test_read_limit_not_reached_keeps_connection() -> None:
    async with Upstream(answering(lambda req: ok(b"small"))) as up, pool_for(up) as pool:
        for _ in range(3):
            resp = await pool.request(b"GET", b"/")
            assert await resp.read(1000) == b"small" and not resp.truncated
            resp.release()
        assert up.accepted == 1


async def test_max_body_whole_response_at_once() -> None:
    body = b"x" * 5000
    async with Upstream(answering(lambda req: ok(body))) as up, pool_for(up) as pool:
        resp = await pool.request(b"POST", b"/", [b"q"], max_body=5000)
        assert resp.complete  # returned with the whole body in
        assert await resp.read() == body
        resp.release()
        with pytest.raises(UpstreamError, match="exceeds"):
            await pool.request(b"POST", b"/", [b"q"], max_body=4999)
        assert not pool.open  # the connection of the failed one was dropped
        resp, got = await fetch(pool, max_body=5000)
        assert got == body and up.accepted == 2


async def test_stream_delivers_every_piece() -> None:
    pieces = [b"data: %d %s\n\n" % (i, b"p" * i) for i in range(30)]

    async def serve(up: Upstream, reader: Reader, writer: Writer, index: int) -> None:
        while await up.next_request(reader) is not None:
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            )
            for p in pieces:
                writer.write(b"%x\r\n%s\r\n" % (len(p), p))
                await writer.drain()
                await asyncio.sleep(0.002)
            writer.write(b"0\r\n\r\n")

    async with Upstream(serve) as up, pool_for(up) as pool:
        for _ in range(2):
            resp = await pool.request(b"POST", b"/stream", [b"{}"])
            got: list[bytes] = []
            await resp.stream(got.append)
            assert b"".join(got) == b"".join(pieces)
            assert len(got) > 1  # handed over as it arrived, not at the end
            assert all(isinstance(g, bytes) and g for g in got)
            assert resp.complete and resp.size == sum(map(len, pieces))
            resp.release()
        assert up.accepted == 1


async def test_stream_after_body_already_arrived() -> None:
    async with (
        Upstream(answering(lambda req: chunked_response([b"one", b"two", b"three"]))) as up,
        pool_for(up) as pool,
    ):
        resp = await pool.request(b"GET", b"/")
        await asyncio.sleep(0.05)
        got: list[bytes] = []
        await resp.stream(got.append)
        assert b"".join(got) == b"onetwothree"
        resp.release()
        assert len(pool.idle) == 1


async def test_stream_content_length_body() -> None:
    body = b"y" * 200_000
    async with Upstream(answering(lambda req: ok(body))) as up, pool_for(up) as pool:
        resp = await pool.request(b"GET", b"/")
        got: list[bytes] = []
        await resp.stream(got.append)
        assert b"".join(got) == body
        resp.release()


# -- timeouts -------------------------------------------------------------------------------------


async def _silent(up: Upstream, reader: Reader, writer: Writer, index: int) -> None:
    """Reads the request, never answers; ends when the client closes."""
    await up.next_request(reader)
    await reader.read()


async def _headers_then_silent(up: Upstream, reader: Reader, writer: Writer, index: int) -> None:
    await up.next_request(reader)
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nfirst")
    await reader.read()


async def _drip(up: Upstream, reader: Reader, writer: Writer, index: int) -> None:
    """Headers, then a chunk every 50 ms, ending after 1 s."""
    await up.next_request(reader)
    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    for _ in range(20):
        await asyncio.sleep(0.05)
        writer.write(b"1\r\n.\r\n")
    writer.write(b"0\r\n\r\n")
    await reader.read()


async def test_timeout_before_headers() -> None:
    async with Upstream(_silent) as up, pool_for(up) as pool:
        start = time.monotonic()
        with pytest.raises(UpstreamTimeout):
            await pool.request(b"POST", b"/", [b"x"], timeout=0.3)
        assert 0.28 <= time.monotonic() - start < 0.3 + SLACK_S
        assert not pool.open and not pool.idle
        assert await eventually(lambda: not up.tasks)  # the connection was closed


async def test_timeout_is_total_even_while_bytes_arrive() -> None:
    async with Upstream(_drip) as up, pool_for(up) as pool:
        start = time.monotonic()
        resp = await pool.request(b"GET", b"/", timeout=0.4)
        with pytest.raises(UpstreamTimeout):
            await resp.read()
        assert 0.38 <= time.monotonic() - start < 0.4 + SLACK_S
        resp.release()
        assert not pool.idle


async def test_read_timeout_on_silence() -> None:
    async with Upstream(_headers_then_silent) as up, pool_for(up) as pool:
        resp = await pool.request(b"GET", b"/", read_timeout=0.3)
        start = time.monotonic()
        got: list[bytes] = []
        with pytest.raises(UpstreamTimeout):
            await resp.stream(got.append)
        assert 0.2 <= time.monotonic() - start < 0.3 + SLACK_S
        assert got == [b"first"]
        resp.release()
        assert not pool.open


async def test_read_timeout_tolerates_a_steady_stream() -> None:
    """A stream that runs longer than read_timeout but never goes silent that long is not cut."""
    async with Upstream(_drip) as up, pool_for(up) as pool:
        resp = await pool.request(b"GET", b"/", read_timeout=0.3)
        assert await resp.read() == b"." * 20
        resp.release()


async def test_timeout_not_applied_to_the_next_request() -> None:
    """A deadline ends with its response: an idle pooled connection is not timed out."""
    async with Upstream(answering(echo_response)) as up, pool_for(up) as pool:
        await fetch(pool, timeout=0.2, read_timeout=0.1)
        await asyncio.sleep(0.4)
        _, body = await fetch(pool, body=b"again")
        assert body == b"again" and up.accepted == 1


# -- connection failures --------------------------------------------------------------------------


async def test_connect_refused_not_sent() -> None:
    pool = Pool(f"http://127.0.0.1:{free_port()}")
    with pytest.raises(UpstreamError) as info:
        await pool.request(b"POST", b"/", [b"x"])
    assert info.value.sent is False
    assert not pool.open


def test_bad_worker_url_refused() -> None:
    for url in ("https://127.0.0.1:1", "127.0.0.1:8000", "http://"):
        with pytest.raises(ValueError):
            Pool(url)


async def test_idle_connection_closed_by_server_next_request_succeeds() -> None:
    """The server closes an idle keep-alive connection: the pool notices and connects afresh."""

    async def serve(up: Upstream, reader: Reader, writer: Writer, index: int) -> None:
        req = await up.next_request(reader)
        assert req is not None
        writer.write(echo_response(req))
        await writer.drain()
        await asyncio.sleep(0.05)  # then close the idle connection (an idle timeout)

    async with Upstream(serve) as up, pool_for(up) as pool:
        await fetch(pool, body=b"1")
        assert await eventually(lambda: not pool.open)
        _, body = await fetch(pool, body=b"2")
        assert body == b"2" and up.accepted == 2


async def test_stale_connection_retried_on_a_fresh_one() -> None:
    """The race: the server drops the idle connection just as a request is written on it."""

    async def serve(up: Upstream, reader: Reader, writer: Writer, index: int) -> None:
        while (req := await up.next_request(reader)) is not None:
            if index == 0 and len(up.requests) == 2:
                return  # closed without an answer: the request never reached a handler
            writer.write(echo_response(req))

    async with Upstream(serve) as up, pool_for(up) as pool:
        await fetch(pool, body=b"first")
        _, body = await fetch(pool, body=b"second")
        assert body == b"second"
        assert up.accepted == 2
        assert [r[2] for r in up.requests] == [b"first", b"second", b"second"]


async def test_reused_connection_reset_before_any_byte_is_not_sent_again() -> None:
    """A reset (not a clean close) on a reused connection before any byte of an answer: the worker
    may have read the request and acted on it (vLLM's decode had pulled its prefill's blocks, then
    failed), so it is not sent again (RFC 9110 9.2.2: only a request known not to have been
    processed is retried); the caller hears an error that says it was sent."""

    async def serve(up: Upstream, reader: Reader, writer: Writer, index: int) -> None:
        while (req := await up.next_request(reader)) is not None:
            if index == 0 and len(up.requests) == 2:
                reset(writer)
                return
            writer.write(echo_response(req))

    async with Upstream(serve) as up, pool_for(up) as pool:
        await fetch(pool, body=b"first")
        with pytest.raises(UpstreamError) as info:
            await fetch(pool, body=b"second")
        assert info.value.sent is True
        assert up.accepted == 1 and [r[2] for r in up.requests] == [b"first", b"second"]


async def test_no_retry_once_the_server_answered_part() -> None:
    """Bytes of an answer came back: the request was seen, so it is not sent again."""

    async def serve(up: Upstream, reader: Reader, writer: Writer, index: int) -> None:
        while (req := await up.next_request(reader)) is not None:
            if len(up.requests) == 2:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Le")
                await writer.drain()
                return
            writer.write(echo_response(req))

    async with Upstream(serve) as up, pool_for(up) as pool:
        await fetch(pool, body=b"first")
        with pytest.raises(UpstreamError) as info:
            await fetch(pool, body=b"second")
        assert info.value.sent is True
        assert up.accepted == 1 and len(up.requests) == 2


async def test_fresh_connection_closed_before_answer_not_retried() -> None:
    async def serve(up: Upstream, reader: Reader, writer: Writer, index: int) -> None:
        await up.next_request(reader)

    async with Upstream(serve) as up, pool_for(up) as pool:
        with pytest.raises(UpstreamError) as info:
            await fetch(pool, body=b"x")
        assert info.value.sent is True
        assert up.accepted == 1


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 abc OK\r\nContent-Length: 0\r\n\r\n",
        b"hello world\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: ten\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nabc",
        b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nBad Header\r\n\r\n",
        b"HTTP/1.1 200 OK\nContent-Length: 0\n\n",
    ],
    ids=[
        "status-not-a-number",
        "not-http",
        "length-not-a-number",
        "two-lengths",
        "length-and-chunked",
        "bad-chunk-size",
        "header-without-colon",
        "bare-lf",
    ],
)
async def test_malformed_response_raises(answer: bytes) -> None:
    async with Upstream(answering(lambda req: answer)) as up, pool_for(up) as pool:
        with pytest.raises(UpstreamError) as info:
            await fetch(pool)
        assert info.value.sent is True
        assert not pool.idle and not pool.open
        assert await eventually(lambda: up.client_closed == 1)


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
@pytest.mark.parametrize("how", ["reset", "close"])
async def test_connection_lost_mid_body_raises(framing: str, how: str) -> None:
    async def serve(up: Upstream, reader: Reader, writer: Writer, index: int) -> None:
        await up.next_request(reader)
        if framing == "chunked":
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\nfirst")
        await writer.drain()
        await asyncio.sleep(0.1)
        if how == "reset":
            reset(writer)
        else:
            writer.close()

    async with Upstream(serve) as up, pool_for(up) as pool:
        resp = await pool.request(b"GET", b"/")
        assert resp.status == 200
        with pytest.raises(UpstreamError, match="mid-response"):
            await resp.read()
        assert not resp.complete
        resp.release()
        assert not pool.idle and not pool.open
        # A streamed read fails the same way.
        resp = await pool.request(b"GET", b"/")
        got: list[bytes] = []
        with pytest.raises(UpstreamError):
            await resp.stream(got.append)
        assert got == [b"first"]
        resp.release()


async def test_reset_mid_close_delimited_body_raises() -> None:
    async def serve(up: Upstream, reader: Reader, writer: Writer, index: int) -> None:
        await up.next_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\npartial")
        await writer.drain()
        await asyncio.sleep(0.1)
        reset(writer)

    async with Upstream(serve) as up, pool_for(up) as pool:
        resp = await pool.request(b"GET", b"/")
        with pytest.raises(UpstreamError):
            await resp.read()
        resp.release()


async def test_unsolicited_bytes_on_idle_connection_drop_it() -> None:
    async def serve(up: Upstream, reader: Reader, writer: Writer, index: int) -> None:
        while (req := await up.next_request(reader)) is not None:
            writer.write(echo_response(req))
            await writer.drain()
            if index == 0:
                await asyncio.sleep(0.05)
                writer.write(ok(b"nobody asked"))

    async with Upstream(serve) as up, pool_for(up) as pool:
        await fetch(pool, body=b"1")
        assert await eventually(lambda: not pool.open)
        _, body = await fetch(pool, body=b"2")
        assert body == b"2" and up.accepted == 2


# -- release, cancel, pause -------------------------------------------------------------------------


async def test_release_before_the_end_closes_the_connection() -> None:
    async with Upstream(_headers_then_silent) as up, pool_for(up) as pool:
        resp = await pool.request(b"GET", b"/")
        assert resp.status == 200 and not resp.complete
        resp.release()
        assert not pool.idle and not pool.open
        assert await eventually(lambda: not up.tasks)  # the worker sees the client leave
        resp.release()  # twice: harmless


async def test_release_of_complete_keepalive_response_pools_it() -> None:
    async with Upstream(answering(echo_response)) as up, pool_for(up) as pool:
        resp = await pool.request(b"GET", b"/")
        await resp.read()
        assert not pool.idle
        resp.release()
        assert len(pool.idle) == 1
        resp.release()  # a second release does not pool it twice
        assert len(pool.idle) == 1


async def test_cancelled_read_does_not_pool_the_connection() -> None:
    async with Upstream(_headers_then_silent) as up, pool_for(up) as pool:
        resp = await pool.request(b"GET", b"/")
        task = asyncio.ensure_future(resp.read())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        resp.release()
        assert not pool.idle
        assert await eventually(lambda: not up.tasks)


async def test_cancelled_request_closes_the_connection() -> None:
    async with Upstream(_silent) as up, pool_for(up) as pool:
        task = asyncio.ensure_future(pool.request(b"POST", b"/", [b"x"]))
        assert await eventually(lambda: len(up.requests) == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not pool.open and not pool.idle
        assert await eventually(lambda: not up.tasks)


async def test_pause_and_resume_reading() -> None:
    go = asyncio.Event()

    async def serve(up: Upstream, reader: Reader, writer: Writer, index: int) -> None:
        while await up.next_request(reader) is not None:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nfirst")
            await writer.drain()
            await go.wait()
            writer.write(b"-rest")

    async with Upstream(serve) as up, pool_for(up) as pool:
        resp = await pool.request(b"GET", b"/")
        await asyncio.sleep(0.05)
        assert resp.size == 5
        resp.pause_reading()
        resp.pause_reading()  # idempotent
        go.set()
        await asyncio.sleep(0.2)
        assert resp.size == 5 and not resp.complete  # the rest waits in the socket
        resp.resume_reading()
        assert await resp.read() == b"first-rest"
        resp.release()
        assert len(pool.idle) == 1
        # The pooled connection reads again on its next request.
        go.clear()
        resp = await pool.request(b"GET", b"/")
        go.set()
        assert await resp.read() == b"first-rest"
        resp.release()
        assert up.accepted == 1


async def test_read_timeout_not_counted_while_paused() -> None:
    """The orchestrator pauses a worker's stream while its client is slow; the worker was not silent."""

    async def serve(up: Upstream, reader: Reader, writer: Writer, index: int) -> None:
        await up.next_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(40):
            writer.write(b"1\r\n.\r\n")
            await writer.drain()
            await asyncio.sleep(0.02)
        writer.write(b"0\r\n\r\n")
        await reader.read()

    async with Upstream(serve) as up, pool_for(up) as pool:
        resp = await pool.request(b"GET", b"/", read_timeout=0.3)
        got: list[bytes] = []
        streaming = asyncio.ensure_future(resp.stream(got.append))
        await asyncio.sleep(0.05)
        resp.pause_reading()
        await asyncio.sleep(0.6)  # the client is slow for twice the read timeout
        resp.resume_reading()
        try:
            await streaming
        finally:
            resp.release()
        assert b"".join(got) == b"." * 40


async def test_release_while_paused_resumes_for_the_next_request() -> None:
    async with Upstream(answering(lambda req: ok(b"done"))) as up, pool_for(up) as pool:
        resp = await pool.request(b"GET", b"/")
        await resp.read()
        resp.pause_reading()
        resp.release()
        _, body = await fetch(pool)
        assert body == b"done" and up.accepted == 1


async def test_pool_close_closes_every_connection() -> None:
    async with Upstream(answering(echo_response)) as up:
        pool = Pool(up.url)
        await asyncio.gather(*(fetch(pool) for _ in range(3)))
        assert len(pool.open) == 3
        pool.close()
        assert not pool.open and not pool.idle
        assert await eventually(lambda: up.client_closed == 3)


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_an_idle_connection_whose_transport_is_closing_is_not_written_to(loop_kind: str) -> None:
    """A worker dies: its idle connection's transport is closing before connection_lost has run.
    Writing there raises under uvloop (it did: a 500 from the orchestrator); the pool skips it,
    and a request that finds one is retried on a fresh connection, never sent into the void."""
    if loop_kind == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        factory = uvloop.new_event_loop
    else:
        factory = asyncio.new_event_loop

    async def serve(up: Upstream, reader: Reader, writer: Writer, index: int) -> None:
        while (req := await up.next_request(reader)) is not None:
            writer.write(echo_response(req))

    async def scenario() -> None:
        async with Upstream(serve) as up, pool_for(up) as pool:
            await fetch(pool, body=b"first")
            (conn,) = pool.idle
            assert conn.transport is not None
            conn.transport.abort()  # closing now; connection_lost comes on a later loop turn
            _, body = await fetch(pool, body=b"second")
            assert body == b"second" and up.accepted == 2
            # and a connection that closes between the pool's check and the write: not sent
            await fetch(pool, body=b"third")
            (conn,) = pool.idle
            assert conn.transport is not None
            conn.transport.abort()
            with pytest.raises(UpstreamError) as info:
                resp = pool.response_class(conn)
                resp.sending = (b"POST / HTTP/1.1\r\n\r\n", (), 0, None, None, None)
                conn.send(resp)
            assert info.value.sent is False

    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(scenario())


# -- the pool's seams (issue 24) ------------------------------------------------------------------


def test_pool_built_where_no_loop_runs_then_used_on_one() -> None:
    """A pool is built in a thread with no event loop (asyncio.get_event_loop() raised there),
    then used on the loop that runs its requests."""
    assert isinstance(made_in_a_thread(lambda: Pool("http://127.0.0.1:1")), UpstreamPool)

    async def scenario() -> None:
        async with Upstream(answering(echo_response)) as up:
            pool = Pool(up.url)
            try:
                _, body = await fetch(pool, body=b"x", timeout=5.0)
                assert body == b"x" and pool.loop is asyncio.get_running_loop()
            finally:
                pool.close()

    asyncio.run(scenario())


async def test_pools_may_share_one_deadline_sweeper() -> None:
    """Two pools given one Deadlines: both requests' deadlines are watched by it, one tick."""
    deadlines = Deadlines()
    async with (
        Upstream(_silent) as up,
        pool_for(up, deadlines=deadlines) as a,
        pool_for(up, deadlines=deadlines) as b,
    ):
        assert a.deadlines is b.deadlines is deadlines
        tasks = [asyncio.ensure_future(p.request(b"GET", b"/", timeout=0.2)) for p in (a, b)]
        await eventually(lambda: len(deadlines.active) == 2)
        for task in tasks:
            with pytest.raises(UpstreamTimeout):
                await task
        assert not deadlines.active and deadlines.handle is None
    async with Upstream(_silent) as up, pool_for(up) as c:
        assert c.deadlines is not deadlines  # a pool given none makes its own


async def test_request_options_are_keyword_only() -> None:
    """Everything after the body goes by keyword (issue 24: seven positional arguments, one
    misplaced value from a wrong deadline or body bound): a positional option or headers line is a
    TypeError before anything is sent; by keyword, the same request goes."""
    async with Upstream(answering(lambda req: ok(b"x" * 5000))) as up, pool_for(up) as pool:
        with pytest.raises(TypeError):
            await pool.request(b"POST", b"/", [b"q"], b"", 5.0, None, 5000)  # type: ignore[misc]
        with pytest.raises(TypeError):
            await pool.request(b"POST", b"/", [b"q"], b"X-Extra: 1\r\n")  # type: ignore[misc]
        assert not pool.open and up.requests == []  # nothing was sent
        resp = await pool.request(
            b"POST", b"/", [b"q"], headers=b"X-Extra: 1\r\n", timeout=5.0, max_body=5000
        )
        assert resp.complete and await resp.read() == b"x" * 5000
        resp.release()
        assert up.requests[0][1][b"x-extra"] == b"1"


def test_the_compiled_connection_and_response_have_the_pure_ones_surface(
    upstream_twin: SimpleNamespace,
) -> None:
    """The compiled twin is upstream.py itself, compiled in Cython's pure-Python mode (typed by
    _upstream.pxd), not a hand-written copy; whatever the pool, the sweeper, the exchange and the leg
    runner may use of a connection or a response, and of the deadline sweeper, exists on both twins;
    only the pure connection's parser, the parser events it takes from it as Python calls and its C
    methods (cdef in the compiled twin) are its own."""
    if upstream_twin.kind == "py":
        pytest.skip("compares the compiled twins with the pure ones")
    compiled = importlib.import_module("server.http._upstream")
    for name in ("pool_start", "idle_connection", "outgoing"):
        assert getattr(compiled, name).__code__.co_filename.endswith("server/http/upstream.py"), name

    def surface(obj: object) -> set[str]:
        return {name for name in dir(obj) if not name.startswith("__")}

    pool = UpstreamPool("http://127.0.0.1:1")
    assert surface(Pool.response_class(None)) == surface(client.UpstreamResponse(None))
    pure_only = {"parser", "reader", "on_head", "on_body", "on_message_complete", "_received", "_flush"}
    pure_only.add("_cancel_timer")
    # the compiled one is its parser (feed, ended), and reads into its buffers where uvloop lets it
    compiled_only = {"feed", "ended", "get_buffer", "buffer_updated"}
    assert (
        surface(Pool.connection_class(pool))
        == (surface(client._Connection(pool)) - pure_only) | compiled_only
    )
    assert surface(upstream_twin.Deadlines()) == surface(upstream.DeadlineSweeper())


async def test_a_pool_closed_while_a_request_connects_fails_it_not_sent_and_keeps_nothing() -> None:
    """close() while request() is connecting: the request fails (UpstreamError, not sent), and the
    connection made meanwhile is closed, not kept by a closed pool."""
    async with Upstream(answering(echo_response)) as up:
        pool = Pool(up.url)
        pending = asyncio.ensure_future(fetch(pool, body=b"x"))
        await asyncio.sleep(0)  # the connect has started
        pool.close()
        with pytest.raises(UpstreamError) as info:
            await pending
        assert info.value.sent is False and "closed" in str(info.value)
        assert not pool.open and not pool.idle
        assert await eventually(lambda: up.client_closed == up.accepted)
        assert up.requests == []


# -- a whole body read into its own bytes (the compiled connection under uvloop) --------------------


def _buffered_reads_expected() -> bool:
    """uvloop calls get_buffer/buffer_updated on a protocol that has them and is no asyncio.Protocol:
    the compiled connection; asyncio's loop (and the pure connection) get data_received."""
    on_uvloop = type(asyncio.get_running_loop()).__module__.startswith("uvloop")
    return on_uvloop and Pool.connection_class is not client._Connection


@pytest.mark.parametrize("writes", [1, 7, 64], ids=["one-write", "seven-writes", "dribbled"])
async def test_a_whole_body_of_a_known_length_arrives_whole_in_one_piece(writes: int) -> None:
    """max_body and a Content-Length (a context answer): under uvloop the compiled connection reads
    the body into one bytes object of that length (the socket's bytes land in it: no piece kept, no
    join), its head and first bytes copied from the read buffer; on every loop and twin the body is
    the worker's byte for byte, and the connection goes back to the pool and serves the next."""
    body = bytes(range(256)) * 1200  # 300 KB: several reads of the 64 KB read buffer and of the socket
    answer = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (
        len(body),
        body,
    )

    async def serve(up: Upstream, reader: Reader, writer: Writer, index: int) -> None:
        step = -(-len(answer) // writes)
        while await up.next_request(reader) is not None:
            for at in range(0, len(answer), step):
                writer.write(answer[at : at + step])
                await writer.drain()

    async with Upstream(serve) as up, pool_for(up) as pool:
        for _ in range(2):
            resp, got = await fetch(pool, body=b"x", max_body=1 << 20)
            assert got == body and resp.size == len(body) and resp.complete
            if _buffered_reads_expected():
                assert resp.chunks == [body]  # one object, read into
        assert up.accepted == 1 and len(pool.idle) == 1
        assert getattr(pool.idle[0], "buffered", False) == _buffered_reads_expected()


async def test_a_declared_length_above_the_read_into_bound_is_kept_as_its_pieces_come() -> None:
    """A Content-Length is the worker's word: above ``_parse.WHOLE_READ_MAX`` (but within max_body)
    nothing is allocated at the head (a worker declaring 256 MB per answer would have the
    orchestrator hold that much per request before a byte came); the pieces are kept as they
    arrive, as on every other path, and the body is the worker's all the same."""
    bound = 8 * 1024 * 1024
    if Pool.connection_class is not client._Connection:
        from server.http import _parse

        bound = _parse.WHOLE_READ_MAX
    body = b"q" * (bound + 1)
    async with Upstream(answering(lambda req: ok(body))) as up, pool_for(up) as pool:
        resp, got = await fetch(pool, body=b"x", max_body=2 * bound)
        assert got == body and up.accepted == 1
        if _buffered_reads_expected():
            assert len(resp.chunks) > 1  # its pieces, not one object read into


async def test_a_whole_body_over_max_body_is_refused_before_it_is_read() -> None:
    """A Content-Length above max_body is no body to read into: the response fails at its head, before
    any of it is read (a chunked one as its bytes pass the bound: test_hostile_workers)."""
    async with Upstream(answering(lambda req: ok(b"y" * 5000))) as up, pool_for(up) as pool:
        with pytest.raises(UpstreamError, match="exceeds 4000 bytes"):
            await fetch(pool, body=b"x", max_body=4000)


async def test_bytes_past_a_whole_body_close_the_connection() -> None:
    """A worker that writes more than its Content-Length: the rest is no response anybody asked for;
    the answer read is the declared body, and the connection is not used again."""
    body = b"z" * 100_000
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%sEXTRA" % (len(body), body)
    async with Upstream(answering(lambda req: answer)) as up, pool_for(up) as pool:
        _, got = await fetch(pool, body=b"x", max_body=1 << 20)
        assert got == body
        assert await eventually(lambda: not pool.idle and not pool.open)
        _, again = await fetch(pool, body=b"x", max_body=1 << 20)
        assert again == body and up.accepted == 2


async def test_many_connections_reading_at_once_each_get_their_own_bytes() -> None:
    """Every upstream connection of the process reads into one read buffer (uvloop: one read at a
    time, each parsed before the next): answers that arrive interleaved on many connections, whole
    bodies (read into their own bytes) and chunked streams (copied out piece by piece), are each
    their own worker's, byte for byte."""

    def answer_for(tag: bytes) -> bytes:
        if tag.startswith(b"w"):
            return ok(tag * 20_000)  # ~40-60 KB whole bodies
        return chunked_response([tag * 700 + b"%d" % i for i in range(12)])

    async def serve(up: Upstream, reader: Reader, writer: Writer, index: int) -> None:
        while (req := await up.next_request(reader)) is not None:
            data = answer_for(req[2])
            for at in range(0, len(data), 4096):  # dribbled: the connections' reads interleave
                writer.write(data[at : at + 4096])
                await writer.drain()
                await asyncio.sleep(0)

    tags = [b"w%d" % i for i in range(6)] + [b"s%d" % i for i in range(6)]
    async with Upstream(serve) as up, pool_for(up) as pool:

        async def one(tag: bytes) -> bytes:
            resp = await pool.request(b"POST", b"/", [tag], max_body=1 << 20 if tag.startswith(b"w") else 0)
            try:
                return await resp.read()
            finally:
                resp.release()

        bodies = await asyncio.gather(*(one(tag) for tag in tags))
        for tag, body in zip(tags, bodies):
            if tag.startswith(b"w"):
                assert body == tag * 20_000, tag
            else:
                assert body == b"".join(tag * 700 + b"%d" % i for i in range(12)), tag
        assert up.accepted == len(tags)


def test_the_pool_takes_the_twins_its_upstream_module_chose() -> None:
    """server.http.upstream chooses the connection, the response and the pool's ``start`` once, at its
    end (fastcore.compiled_twin: the compiled _upstream unless FASTCORE_NO_EXTENSIONS=1 or unbuilt);
    UpstreamPool's class body takes them, and nothing rebinds the class after."""
    import fastcore
    from server.http import upstream

    if upstream.backend == "cython":
        compiled = importlib.import_module("server.http._upstream")
        chosen = (compiled._Connection, compiled.UpstreamResponse, compiled.pool_start)
    else:
        assert fastcore.NO_EXTENSIONS or not REQUIRE_EXTENSIONS
        chosen = (upstream._Connection, upstream.UpstreamResponse, upstream.pool_start)
    assert (upstream.Connection, upstream.Response, upstream.start) == chosen
    assert (
        UpstreamPool.connection_class,
        UpstreamPool.response_class,
        UpstreamPool.__dict__["start"],
    ) == chosen
    assert client.pool_start is upstream.pool_start and client._Connection is upstream._Connection


def test_compiled_twin_is_none_without_extensions(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one helper every pure module picks its twin with: None when told to run pure or unbuilt."""
    import fastcore

    monkeypatch.setattr(fastcore, "NO_EXTENSIONS", True)
    assert fastcore.compiled_twin("server.http._upstream") is None
    monkeypatch.setattr(fastcore, "NO_EXTENSIONS", False)
    assert fastcore.compiled_twin("server.http._no_such_twin") is None
