"""``UpstreamPool.start`` (server.http.client): a response's events told to a Listener, no coroutine
(what server/orchestrator/exchange.py runs on), against the raw-byte stand-ins of
:mod:`upstream_stand_ins` on 127.0.0.1. Every test runs on both response parsers.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from helpers import eventually, free_port
from upstream_stand_ins import (  # noqa: F401  (fixtures: both twins, both loops)
    Pool,
    Reader,
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
    reset,
)

from server.http import UpstreamError, UpstreamResponse

# Both loops through raw_http's event_loop_policy fixture (uvloop: the compiled connection's buffered reads).
pytestmark = pytest.mark.filterwarnings('ignore:Overriding the "event_loop_policy" fixture is deprecated')


class Recorder:
    """A :class:`server.http.client.Listener` that records what it is told; a streamed body goes to
    ``pieces`` through the sink it sets at the head (as the orchestrator's exchange does)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []
        self.pieces: list[bytes] = []

    def response_head(self, resp: UpstreamResponse) -> None:
        self.events.append(("head", resp.status))
        resp.sink = self.pieces.append

    def response_done(self, resp: UpstreamResponse) -> None:
        self.events.append(("done", resp.body()))
        resp.release()

    def response_error(self, resp: UpstreamResponse, exc: BaseException) -> None:
        self.events.append(("error", exc))
        resp.release()

    async def ended(self) -> bool:
        return await eventually(lambda: any(kind in ("done", "error") for kind, _ in self.events))


async def test_start_tells_a_streamed_and_a_whole_response_to_its_listener() -> None:
    """A streamed response: its head, its pieces through the sink, its end; a whole-body one
    (``max_body``): its end only, with the body. No event before start() returns, even on a pooled
    connection; each connection goes back to the pool once its response is told."""
    stream = chunked_response([b"data: 1\n\n", b"data: 2\n\n"])
    async with (
        Upstream(answering(lambda req: stream if req[2] == b"s" else ok(b"whole"))) as up,
        pool_for(up) as pool,
    ):
        streamed = Recorder()
        resp = pool.start(streamed, b"POST", b"/", [b"s"], read_timeout=5.0)
        assert streamed.events == []
        assert await streamed.ended()
        assert streamed.events == [("head", 200), ("done", b"")]
        assert b"".join(streamed.pieces) == b"data: 1\n\ndata: 2\n\n" and resp.complete
        assert await eventually(lambda: len(pool.idle) == 1)
        whole = Recorder()
        pool.start(whole, b"POST", b"/", [b"w"], timeout=5.0, max_body=1000)
        assert whole.events == []  # on the pooled connection too
        assert await whole.ended()
        assert whole.events == [("done", b"whole")] and not whole.pieces
        assert await eventually(lambda: len(pool.idle) == 1)
        assert up.accepted == 1


async def test_start_skips_a_pooled_connection_whose_transport_is_closing() -> None:
    async with Upstream(answering(echo_response)) as up, pool_for(up) as pool:
        await fetch(pool, body=b"first")
        (conn,) = pool.idle
        assert conn.transport is not None
        conn.transport.abort()  # closing now; connection_lost comes on a later loop turn
        listener = Recorder()
        pool.start(listener, b"POST", b"/", [b"second"], timeout=5.0, max_body=1000)
        assert await listener.ended()
        assert listener.events == [("done", b"second")]
        assert up.accepted == 2 and [r[2] for r in up.requests] == [b"first", b"second"]


async def test_start_closes_pooled_connections_idle_too_long_and_sends_on_the_newest_fresh_one() -> None:
    """Pooled connections are taken newest first; one idle longer than ``idle_timeout_s`` is closed
    on the way (never written to), and the request goes on the next one: no new connection."""
    async with Upstream(answering(echo_response)) as up, pool_for(up, idle_timeout_s=60.0) as pool:
        (_, first), (_, second) = await asyncio.gather(fetch(pool, body=b"a"), fetch(pool, body=b"b"))
        assert (first, second) == (b"a", b"b") and up.accepted == 2 and len(pool.idle) == 2
        stale = list(pool.idle)
        for conn in stale:  # both idle a second past the bound
            conn.idle_since -= 61.0
        fresh = await pool._connect()
        fresh.idle_since = asyncio.get_running_loop().time()
        pool.idle.insert(0, fresh)  # the oldest in the pool: taken after the stale ones
        listener = Recorder()
        pool.start(listener, b"POST", b"/", [b"c", b"d"], timeout=5.0, max_body=1000)
        assert all(conn.closed for conn in stale) and not fresh.closed and pool.idle == []
        assert await listener.ended()
        assert listener.events == [("done", b"cd")]
        assert up.accepted == 3 and [r[2] for r in up.requests] == [b"a", b"b", b"cd"]


@pytest.mark.parametrize("answered", [False, True, "reset"], ids=["unanswered", "part-answered", "reset"])
async def test_start_sends_again_on_a_fresh_connection_when_a_reused_one_closes_unanswered(
    answered: bool | str,
) -> None:
    """The worker closes the kept-alive connection as the second request arrives (it never reached a
    handler): sent once more on a fresh connection and answered; the listener hears no error. Once
    bytes of an answer came back the request was seen: an error (``sent``), not sent again; and so is
    a reset before any byte (the worker may have read it and acted: only a clean close is unseen)."""

    async def serve(up: Upstream, reader: Reader, writer: Writer, index: int) -> None:
        while (req := await up.next_request(reader)) is not None:
            if index == 0 and len(up.requests) == 2:
                if answered == "reset":
                    reset(writer)
                elif answered:
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Le")
                    await writer.drain()
                return  # closed before the answer's end
            writer.write(echo_response(req))

    async with Upstream(serve) as up, pool_for(up) as pool:
        first = Recorder()
        pool.start(first, b"POST", b"/", [b"first"], timeout=5.0, max_body=1000)
        assert await first.ended() and first.events == [("done", b"first")]
        assert await eventually(lambda: len(pool.idle) == 1)
        second = Recorder()
        pool.start(second, b"POST", b"/", [b"second"], timeout=5.0, max_body=1000)
        assert await second.ended()
        if answered:
            ((kind, exc),) = second.events
            assert kind == "error" and isinstance(exc, UpstreamError) and exc.sent is True
            assert up.accepted == 1 and [r[2] for r in up.requests] == [b"first", b"second"]
        else:
            assert second.events == [("done", b"second")]
            assert up.accepted == 2 and [r[2] for r in up.requests] == [b"first", b"second", b"second"]


async def test_start_where_nothing_listens_is_an_error_not_sent() -> None:
    pool = Pool(f"http://127.0.0.1:{free_port()}")
    listener = Recorder()
    pool.start(listener, b"POST", b"/", [b"x"], timeout=5.0)
    assert listener.events == []  # the connection is opened after start() returns
    assert await listener.ended()
    ((kind, exc),) = listener.events
    assert kind == "error" and isinstance(exc, UpstreamError) and exc.sent is False
    assert not pool.open and not pool.idle


async def test_start_released_before_its_connection_opened_tells_nothing_and_pools_it() -> None:
    """The leg is given up (the client left) while its connection is being opened: no event, nothing
    sent, and the connection, once open, is the pool's (the next request uses it)."""
    async with Upstream(answering(echo_response)) as up, pool_for(up) as pool:
        listener = Recorder()
        resp = pool.start(listener, b"POST", b"/", [b"lost"], timeout=5.0)
        resp.release()
        assert await eventually(lambda: len(pool.idle) == 1)
        assert listener.events == [] and up.requests == []
        _, body = await fetch(pool, body=b"next")
        assert body == b"next" and up.accepted == 1
        assert [r[2] for r in up.requests] == [b"next"]


async def test_a_pool_closed_while_a_connection_opens_closes_it_and_the_leg_fails_not_sent() -> None:
    """close() while a started leg's connection is being opened: the connection, once open, is
    closed (not kept by a closed pool, the worker sees it end), and the listener hears an error
    that says the request was not sent (the caller may send it elsewhere)."""
    async with Upstream(answering(echo_response)) as up:
        pool = Pool(up.url)
        listener = Recorder()
        pool.start(listener, b"POST", b"/", [b"x"], timeout=5.0)
        pool.close()  # before the loop ran the connect
        assert await listener.ended()
        ((kind, exc),) = listener.events
        assert kind == "error" and isinstance(exc, UpstreamError) and exc.sent is False
        assert "closed" in str(exc)
        assert not pool.open and not pool.idle
        assert await eventually(lambda: up.client_closed == up.accepted)
        assert up.requests == []
