"""server.http.server against hostile clients (issue 19): trailers, per-client shares, Host, half-close, chunk sizes.

Real sockets on 127.0.0.1, the server in the test's event loop, each test on
asyncio's default loop and on uvloop (what the processes run). Clients that
must count as other clients bind other loopback addresses (127.0.0.2, ...:
Linux routes all of 127/8 to lo), so the per-IP bounds are seen as they are in
production. The client, the response parser and the helpers are
tests/raw_http.py's, shared with test_http_server.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from helpers import eventually
from raw_http import (  # noqa: F401  (fixtures: both loops, both request parsers)
    MARKER,
    Client,
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

from server.http import Request, Responder
from server.http.memory import malloc_trim
from server.http.server import LINGER_HEAD_BYTES, LINGER_S, SWEEP_BATCH

# Both loops through raw_http's event_loop_policy fixture.
pytestmark = pytest.mark.filterwarnings('ignore:Overriding the "event_loop_policy" fixture is deprecated')


async def connect_from(ip: str, port: int) -> Client:
    """A client connection from ``ip`` (a loopback address other than 127.0.0.1 is another client)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((ip, 0))
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    return Client(*await asyncio.open_connection(sock=sock))


@asynccontextmanager
async def clients_from(ip: str, port: int, n: int) -> AsyncIterator[list[Client]]:
    clients = [await connect_from(ip, port) for _ in range(n)]
    try:
        yield clients
    finally:
        for c in clients:
            c.close()


CHUNKED_HEAD = b"POST /te HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"


# -- trailers -----------------------------------------------------------------------------------


async def test_trailer_fields_are_never_merged_into_the_headers() -> None:
    seen: list[list[tuple[bytes, bytes]]] = []

    async def handler(req: Request, out: Responder) -> None:
        seen.append(list(req.headers))
        await echo(req, out)

    async with serving(handler) as (_server, port), connected(port) as client:
        # Each of these in a header would route, refuse (415) or re-frame the request.
        # (llhttp itself refuses Content-Length and Transfer-Encoding there.)
        trailers = b"X-Conversation-Id: c1\r\nContent-Encoding: gzip\r\nHost: other\r\n"
        await client.send(CHUNKED_HEAD + chunked([b"abc"])[:-2] + trailers + b"\r\n")
        (resp,) = await client.responses(1)
        assert resp.status == 200 and resp.body == b"abc", resp
        assert resp.header(b"x-headers") == b"2"
        assert seen == [[(b"Host", b"t"), (b"Transfer-Encoding", b"chunked")]]
        await client.send(get(b"/after"))  # the connection goes on
        (_, after) = await client.responses(2)
        assert after.status == 200


async def test_trailer_over_the_header_limit_431() -> None:
    """A 20 KB trailer field where a 17 KB header gets 431: it gets 431 too."""
    async with serving(max_header_bytes=16 * 1024) as (_server, port), connected(port) as client:
        field = b"X-Big: " + b"t" * (20 * 1024) + b"\r\n"
        await client.send(CHUNKED_HEAD + chunked([b"abc"])[:-2] + field + b"X: " + MARKER + b"\r\n\r\n")
        (resp,) = await client.until_closed()
        error = assert_json_error(resp, 431)
        assert "trailers exceed 16384 bytes" in error["message"]
        assert MARKER not in bytes(client.stream.raw)


async def test_endless_trailer_refused_while_it_arrives() -> None:
    """A trailer field that never ends is refused after about the header limit, not read to its end."""
    async with serving(max_header_bytes=4096) as (server, port), connected(port) as client:
        await client.send(CHUNKED_HEAD + b"3\r\nabc\r\n0\r\nX-Endless: ")
        sent = 0
        answer = asyncio.ensure_future(client.until_closed(timeout=10.0))
        try:
            while not answer.done() and sent < 64 << 20:
                try:
                    await client.send(b"t" * 4096)
                except (ConnectionResetError, BrokenPipeError):
                    break  # closed after its answer
                sent += 4096
                await asyncio.sleep(0)
            (resp,) = await answer
        finally:
            answer.cancel()
        assert_json_error(resp, 431)
        assert sent < 8 << 20, f"{sent} trailer bytes read before the 431"
        assert server.framing_errors == 1


async def test_a_refused_trailer_flood_is_not_read_on_while_its_connection_lingers() -> None:
    """After a 431 the connection lingers (LINGER_S) for the client to read it, dropping what still
    comes, but only LINGER_HEAD_BYTES of it: then it stops reading (a flood of 128 MiB trailers cost
    a core to read and drop)."""
    async with serving(max_header_bytes=4096) as (server, port), connected(port) as client:
        await client.send(CHUNKED_HEAD + b"3\r\nabc\r\n0\r\nX-Endless: ")
        answer = asyncio.ensure_future(client.responses(1))
        while not answer.done():  # a read that began in the trailer section counts whole
            await client.send(b"t" * 1024)
            await asyncio.sleep(0.01)
        (resp,) = await answer
        assert_json_error(resp, 431)
        (conn,) = server.connections
        assert conn.lingering
        client.writer.write(b"t" * LINGER_HEAD_BYTES * 8)  # more than it reads: it pauses
        assert await eventually(lambda: conn.reading_paused)
        assert await eventually(lambda: not server.connections, timeout=LINGER_S + 3)  # closed at LINGER_S


@pytest.mark.skipif(malloc_trim is None, reason="glibc's malloc_trim: elsewhere there is no trim")
@pytest.mark.parametrize("status", [431, 413])
async def test_a_request_refused_at_a_size_limit_gives_its_heap_back(status: int) -> None:
    """A 431 trailer or a 413 chunked body read its limit's worth of bytes piece by piece; the C heap
    is trimmed once such requests stop (a trailer flood left RSS 23 MiB up, 6 MiB with the trim)."""
    async with (
        serving(max_header_bytes=4096, max_body_bytes=4096) as (server, port),
        connected(port) as client,
    ):
        if status == 431:
            await client.send(CHUNKED_HEAD + b"3\r\nabc\r\n0\r\nX-Big: " + b"t" * 8192 + b"\r\n\r\n")
        else:
            await client.send(CHUNKED_HEAD + chunked([b"b" * 1000] * 5))
        (resp,) = await client.until_closed()
        assert_json_error(resp, status)
        assert await eventually(lambda: server.trims == 1)


async def test_too_many_trailer_fields_431() -> None:
    async with serving(max_headers=10) as (_server, port), connected(port) as client:
        fields = b"".join(b"X-T%d: 1\r\n" % i for i in range(11))
        await client.send(CHUNKED_HEAD + chunked([b"abc"])[:-2] + fields + b"\r\n")
        (resp,) = await client.until_closed()
        assert "more than 10 request trailer fields" in assert_json_error(resp, 431)["message"]


async def test_trailers_under_the_limits_accepted() -> None:
    async with serving(max_headers=10, max_header_bytes=4096) as (_server, port), connected(port) as client:
        fields = b"".join(b"X-T%d: %s\r\n" % (i, b"v" * 300) for i in range(10))
        for step in (0, 7):  # in one write, and in 7-byte writes
            await client.send(CHUNKED_HEAD + chunked([b"abc"])[:-2] + fields + b"\r\n", step=step)
        first, second = await client.responses(2)
        assert first.status == second.status == 200 and first.body == second.body == b"abc"


# -- chunk sizes ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pieces",
    [
        [b"100000000\r\n"],  # 4 GiB
        [b"1000", b"000\r\n"],  # 256 MiB, its size line split over two reads
        [b"3\r\nabc\r\n", b"FFF;ext=1\r\nxy"],  # 3 + 4095 bytes past a 4 KiB limit, with an extension
        # 16 MiB, a byte a read: no two reads hold the whole size line
        [b"1", b"0", b"0", b"0", b"0", b"0", b"0", b"\r", b"\n"],
        [b"10", b"01;a=", b"b\r", b"\n"],  # 4097 bytes, its size line and extension over four reads
    ],
    ids=["4GiB", "split", "second-chunk", "split-bytewise", "split-extension"],
)
async def test_declared_chunk_past_the_body_limit_413_at_once(pieces: list[bytes]) -> None:
    async with serving(max_body_bytes=4096) as (_server, port), connected(port) as client:
        await client.send(CHUNKED_HEAD)
        for piece in pieces:
            await client.send(piece)
            await asyncio.sleep(0.05)  # separate reads
        (resp,) = await client.until_closed()  # no body bytes are waited for
        error = assert_json_error(resp, 413)
        # refused from the chunk's declared size, not from the bytes read
        assert error["message"].startswith("a chunk of "), error
        assert "past the limit of 4096 bytes" in error["message"], error


async def test_chunks_up_to_the_body_limit_accepted() -> None:
    body = b"b" * 4096
    async with serving(max_body_bytes=4096) as (_server, port), connected(port) as client:
        await client.send(CHUNKED_HEAD + b"%x;name=value\r\n%s\r\n0\r\n\r\n" % (len(body), body), step=1000)
        (resp,) = await client.responses(1)
        assert resp.status == 200 and resp.body == body


# -- Host -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET / HTTP/1.1\r\nX: 1\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
        b"GET / HTTP/1.0\r\nHost: a\r\nhost: a\r\n\r\n",
    ],
    ids=["missing", "two", "two-http10"],
)
async def test_missing_or_duplicate_host_400(request_bytes: bytes) -> None:
    async with serving() as (_server, port), connected(port) as client:
        await client.send(request_bytes)
        (resp,) = await client.until_closed()
        assert "Host headers; send exactly one" in assert_json_error(resp, 400)["message"]


async def test_http10_without_host_accepted() -> None:
    async with serving() as (_server, port), connected(port) as client:
        await client.send(b"GET / HTTP/1.0\r\n\r\n")
        (resp,) = await client.until_closed()
        assert resp.status == 200


# -- half-close ----------------------------------------------------------------------------------


async def _slow_echo(req: Request, out: Responder) -> None:
    await asyncio.sleep(0.2)  # the FIN arrives while the request is being answered
    await echo(req, out)


@pytest.mark.parametrize("stage", ["queued", "running"])
async def test_half_closed_client_gets_its_answers_then_the_close(stage: str) -> None:
    async with serving(_slow_echo) as (_server, port), connected(port) as client:
        await client.send(post(b"/a", b"first") + post(b"/b", b"second"))
        if stage == "running":
            await asyncio.sleep(0.05)
        client.writer.transport.write_eof()  # shutdown(SHUT_WR)
        responses = await client.until_closed()
        # The probe (an interim 100, which an HTTP/1.1 client parses unasked), then the answers.
        assert [r.status for r in responses] == [100, 200, 200]
        assert [r.body for r in responses[1:]] == [b"first", b"second"]


async def test_client_gone_altogether_has_its_request_cancelled() -> None:
    """A FIN from a client that closed (not half-closed): the probe's reset cancels its request."""
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def forever(req: Request, out: Responder) -> None:
        started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async with serving(forever) as (server, port):
        client = await Client.connect(port)
        await client.send(post(b"/", b"x"))
        await asyncio.wait_for(started.wait(), 5)
        client.close()
        await asyncio.wait_for(cancelled.wait(), 5)
        assert await eventually(lambda: not server.connections and server.body_bytes == 0)


async def test_half_close_with_nothing_due_closes() -> None:
    async with serving() as (server, port), connected(port) as client:
        await client.send(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\nabc")  # incomplete
        client.writer.transport.write_eof()
        assert await client.until_closed() == []
        assert await eventually(lambda: server.body_bytes == 0 and not server.connections)


# -- one client's share of the body budget --------------------------------------------------------


def _held(release: asyncio.Event, arrived: list[int] | None = None) -> object:
    async def handler(req: Request, out: Responder) -> None:
        if arrived is not None:
            arrived.append(len(req.body))
        await release.wait()
        out.send(200, b"%d" % len(req.body))

    return handler


async def test_one_client_cannot_hold_the_whole_body_budget() -> None:
    release, arrived = asyncio.Event(), list[int]()
    limits = {"max_inflight_body_bytes": 1000, "peer_share": 0.25, "retry_after_s": 2}
    async with serving(_held(release, arrived), **limits) as (server, port):  # type: ignore[arg-type]
        async with clients_from("127.0.0.2", port, 5) as heavy, clients_from("127.0.0.3", port, 2) as light:
            for c in heavy[:3]:  # up to 3/4 of the budget while nobody else holds any
                await c.send(post(b"/", b"h" * 250))
            assert await eventually(lambda: server.body_bytes == 750)
            await heavy[3].send(post(b"/", b"h" * 100))  # past the share, into the last quarter
            (resp,) = await heavy[3].until_closed()
            error = assert_json_error(resp, 429)
            assert "this client" in error["message"] and resp.header(b"retry-after") == b"2"
            await light[0].send(post(b"/", b"l" * 250))  # the last quarter: another client's
            assert await eventually(lambda: server.body_bytes == 1000)
            await light[1].send(post(b"/", b"l"))  # the server-wide bound still holds
            (resp,) = await light[1].until_closed()
            assert "the server holds too many" in assert_json_error(resp, 503)["message"]
            await heavy[4].send(post(b"/", b""))  # no body, nothing to hold: served whatever the share
            assert await eventually(lambda: 0 in arrived)
            release.set()
            for c in (*heavy[:3], heavy[4], light[0]):
                (resp,) = await c.responses(1)
                assert resp.status == 200
        assert await eventually(lambda: server.body_bytes == 0 and not server.peers)


async def test_a_lone_client_has_all_but_the_last_share() -> None:
    """Everything from one IP (a proxy, loopback): 3/4 of the budget, and all of it with peer_share 1."""
    release = asyncio.Event()
    for share, admitted, refused in ((0.25, 3, 429), (1.0, 4, 503)):
        async with serving(_held(release), max_inflight_body_bytes=1000, peer_share=share) as (_server, port):  # type: ignore[arg-type]
            async with clients_from("127.0.0.1", port, 5) as cs:
                for c in cs:
                    await c.send(post(b"/", b"x" * 250))
                    await asyncio.sleep(0.05)
                statuses = []
                release.set()
                for c in cs:
                    (resp,) = await c.responses(1)
                    statuses.append(resp.status)
                release.clear()
            assert statuses == [200] * admitted + [refused] * (5 - admitted), (share, statuses)


# -- one client's share of the connections ------------------------------------------------------


async def test_one_client_cannot_take_every_connection_and_its_slow_ones_make_room() -> None:
    async with serving(max_connections=8, peer_share=0.25) as (server, port):
        slow = [await connect_from("127.0.0.2", port) for _ in range(7)]
        try:
            for c in slow:
                await c.send(b"GET / HTTP/1.1\r\nHost: t\r\nX-Slow: ")  # headers that never end
            # 6 of 8 while nobody else holds any (the last quarter is kept): the 7th is refused.
            (resp,) = await slow[6].until_closed()
            assert (
                "this client" in assert_json_error(resp, 429)["message"]
                and resp.header(b"retry-after") == b"1"
            )
            assert await eventually(lambda: len(server.connections) == 6)
            async with clients_from("127.0.0.3", port, 2) as others:
                for c in others:  # the kept quarter
                    await c.send(get(b"/other"))
                    (resp,) = await c.responses(1)
                    assert resp.status == 200
                # At the cap, a newcomer under its share closes a slow connection of the heaviest client.
                async with clients_from("127.0.0.4", port, 1) as (newcomer,):
                    await newcomer.send(get(b"/new"))
                    (resp,) = await newcomer.responses(1)
                    assert resp.status == 200
                assert server.evicted == 1
                closed = [c for c in slow[:6] if not await c.silent_for(0.01)]
                assert len(closed) == 1 and closed[0].stream.responses == []
        finally:
            for c in slow:
                c.close()


async def test_deadlines_missed_together_are_handled_a_batch_per_loop_turn() -> None:
    """Thousands of slowloris connections opened together expire together: SWEEP_BATCH of them are
    answered per callback, the rest after the I/O ready meanwhile (one callback for all of them
    stalled every other client for the time it took)."""
    n = SWEEP_BATCH * 2 + 10
    async with serving(header_timeout_s=30.0, peer_share=1.0) as (server, port):
        clients = [await Client.connect(port) for _ in range(n)]
        try:
            assert await eventually(lambda: len(server.connections) == n)
            past = asyncio.get_running_loop().time() - 1
            for conn in server.connections:
                conn.deadline = past  # as if the header timeout had passed for all of them at once
            server._expire(list(server.connections))
            assert sum(conn.closed for conn in server.connections) == SWEEP_BATCH
            assert await eventually(lambda: not server.connections)
        finally:
            for c in clients:
                c.close()


async def test_at_the_cap_a_lone_client_s_idle_connection_makes_room() -> None:
    """Everything from 127.0.0.1 with peer_share 1: at the cap an idle connection closes, the newcomer is served."""
    async with serving(max_connections=2, peer_share=1.0) as (server, port):
        async with connected(port) as busy, connected(port):
            await busy.send(get(b"/1"))
            (resp,) = await busy.responses(1)  # an idle keep-alive connection now, like `idle`
            assert resp.status == 200
            async with connected(port) as newcomer:
                await newcomer.send(get(b"/2"))
                (resp,) = await newcomer.responses(1)
                assert resp.status == 200
            assert server.evicted == 1 and server.refused == 0
