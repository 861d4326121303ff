"""Workers that break the protocol on purpose: two answers in one write, a head that never ends, a
body past the bound. What a proxy does with them: the first answer stands, bytes past it are a
protocol error that closes the connection (never pooled again), a head past its bound
(server/http/limits.py: ``MAX_RESPONSE_HEAD_BYTES``, ``MAX_RESPONSE_HEADERS``) and a body past
``max_worker_body_bytes`` are a 502 at once (not at the request's deadline), counted against the
worker's breaker.

First the upstream client (:mod:`server.http.client`, both twins through ``upstream_stand_ins``'
autouse fixture, both loops), with a request awaited and one started (a listener, no coroutine);
then an orchestrator in process in front of raw-byte stand-in workers on 127.0.0.1 (port 0), on both
twins of the upstream side and both request paths (callbacks, and coroutines with admission on).
Nothing here asserts a duration: a 502 that names the worker's failure, not the deadline's 504, is
what says it came at once.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from helpers import eventually
from upstream_stand_ins import (  # noqa: F401  (fixtures: both twins, both loops)
    Pool,
    Reader,
    Upstream,
    Writer,
    _both_parsers,
    answering,
    chunked_response,
    event_loop_policy,
    fetch,
    ok,
    pool_for,
)

from server.http import UpstreamError, UpstreamResponse
from server.http.limits import MAX_RESPONSE_HEAD_BYTES, MAX_RESPONSE_HEADERS

pytestmark = pytest.mark.filterwarnings('ignore:Overriding the "event_loop_policy" fixture is deprecated')

FIRST, SECOND = b'{"answer": "first"}', b'{"answer": "second"}'
#: two complete answers in one write: the second is no answer anybody asked for
TWO_WHOLE = ok(FIRST) + ok(SECOND)
TWO_STREAMS = chunked_response([b"data: first\n\n"]) + chunked_response([b"data: second\n\n"])


class Recorder:
    """A listener (:class:`server.http.client.Listener`) that releases its response at its end, as
    the orchestrator's exchange does: the connection's events after that see no response."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []
        self.pieces: list[bytes] = []

    def leg_head(self, resp: UpstreamResponse) -> None:
        self.events.append(("head", resp.status))
        resp.sink = self.pieces.append

    def leg_done(self, resp: UpstreamResponse) -> None:
        self.events.append(("done", resp.body()))
        resp.release()

    def leg_error(self, resp: UpstreamResponse, exc: BaseException) -> None:
        self.events.append(("error", exc))
        resp.release()

    async def ended(self) -> bool:
        return await eventually(lambda: any(kind in ("done", "error") for kind, _ in self.events))


# -- 1. two answers in one write --------------------------------------------------------------------


@pytest.mark.parametrize("whole", [True, False], ids=["whole", "streamed"])
async def test_two_answers_in_one_write_awaited_the_first_stands_and_the_connection_goes(whole: bool) -> None:
    """A request awaited (the coroutine path): the first answer's bytes, not the second's appended or
    put in their place; the connection closes and the next request opens a new one."""
    answer = TWO_WHOLE if whole else TWO_STREAMS
    async with Upstream(answering(lambda req: answer)) as up, pool_for(up) as pool:
        for n in (1, 2):
            resp, body = await fetch(pool, body=b"x", max_body=1000 if whole else 0)
            assert resp.status == 200 and resp.complete
            assert body == (FIRST if whole else b"data: first\n\n")
            assert await eventually(lambda: not pool.idle and not pool.open)
            assert up.accepted == n


@pytest.mark.parametrize("whole", [True, False], ids=["whole", "streamed"])
async def test_two_answers_in_one_write_started_the_first_stands_and_the_connection_goes(whole: bool) -> None:
    """A request started (a listener that releases its response at its end, the callback path): the
    second answer's events find no response; the listener hears the first answer once and no error,
    and the connection is not pooled (it was a crash of the compiled connection)."""
    answer = TWO_WHOLE if whole else TWO_STREAMS
    async with Upstream(answering(lambda req: answer)) as up, pool_for(up) as pool:
        for n in (1, 2):
            listener = Recorder()
            pool.start(listener, b"POST", b"/", [b"x"], timeout=5.0, max_body=1000 if whole else 0)
            assert await listener.ended()
            if whole:
                assert listener.events == [("done", FIRST)]
            else:
                assert listener.events == [("head", 200), ("done", b"")]
                assert b"".join(listener.pieces) == b"data: first\n\n"
            assert await eventually(lambda: not pool.idle and not pool.open)
            assert up.accepted == n


async def test_a_second_answer_in_a_later_read_before_the_release_closes_the_connection() -> None:
    """The second answer comes in a read of its own while the first, complete, is not released yet:
    the first stands as read, the connection is not pooled at its release."""

    async def serve(up: Upstream, reader: Reader, writer: Writer, index: int) -> None:
        while await up.next_request(reader) is not None:
            writer.write(ok(FIRST))
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(ok(SECOND))

    async with Upstream(serve) as up, pool_for(up) as pool:
        resp = await pool.request(b"POST", b"/", [b"x"], max_body=1000)
        assert await eventually(lambda: not pool.open)
        assert await resp.read() == FIRST and resp.status == 200
        resp.release()
        assert not pool.idle
        _, body = await fetch(pool, body=b"x", max_body=1000)
        assert body == FIRST and up.accepted == 2


# -- 2. a head past its bound, a body past max_body ---------------------------------------------------


def _endless(name: bytes) -> bytes:
    """A head whose ``name`` header never ends (more bytes than the bound, no line end)."""
    return b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n%s: %s" % (name, b"x" * (MAX_RESPONSE_HEAD_BYTES + 1))


TOO_MANY = (
    b"HTTP/1.1 200 OK\r\n"
    + b"".join(b"X-H%d: %d\r\n" % (i, i) for i in range(MAX_RESPONSE_HEADERS + 1))
    + b"Content-Length: 2\r\n\r\nok"
)
#: a head that ends, past the bound: one long header, or many short ones whose bytes add up past it
ONE_LONG = b"HTTP/1.1 200 OK\r\nX-Long: %s\r\nContent-Length: 2\r\n\r\nok" % (b"y" * MAX_RESPONSE_HEAD_BYTES)
ADDING_UP = (
    b"HTTP/1.1 200 OK\r\n"
    + b"".join(b"X-H%d: %s\r\n" % (i, b"y" * 1000) for i in range(MAX_RESPONSE_HEAD_BYTES // 1000 + 1))
    + b"Content-Length: 2\r\n\r\nok"
)
HEAD_REFUSALS = {
    "endless-content-type": (
        _endless(b"Content-Type"),
        f"response head exceeds {MAX_RESPONSE_HEAD_BYTES} bytes",
    ),
    "endless-retry-after": (
        _endless(b"Retry-After"),
        f"response head exceeds {MAX_RESPONSE_HEAD_BYTES} bytes",
    ),
    "endless-other": (_endless(b"X-Other"), f"response head exceeds {MAX_RESPONSE_HEAD_BYTES} bytes"),
    "one-long-header": (ONE_LONG, f"response head exceeds {MAX_RESPONSE_HEAD_BYTES} bytes"),
    "headers-adding-up": (ADDING_UP, f"response head exceeds {MAX_RESPONSE_HEAD_BYTES} bytes"),
    "too-many-headers": (TOO_MANY, f"more than {MAX_RESPONSE_HEADERS} response headers"),
}


@pytest.mark.parametrize("case", sorted(HEAD_REFUSALS))
@pytest.mark.parametrize("started", [False, True], ids=["awaited", "started"])
async def test_a_head_past_its_bound_is_refused_and_the_connection_closed(case: str, started: bool) -> None:
    """Written in one go (the head never ends, or ends past a bound): refused as a malformed answer
    (``sent``: the worker saw the request), the connection closed, nothing pooled."""
    answer, words = HEAD_REFUSALS[case]
    async with Upstream(answering(lambda req: answer)) as up, pool_for(up) as pool:
        if started:
            listener = Recorder()
            pool.start(listener, b"POST", b"/", [b"x"], timeout=30.0, max_body=1000)
            assert await listener.ended()
            ((kind, exc),) = listener.events
            assert kind == "error"
        else:
            with pytest.raises(UpstreamError) as info:
                await fetch(pool, body=b"x", timeout=30.0, max_body=1000)
            exc = info.value
        assert isinstance(exc, UpstreamError) and exc.sent is True
        assert f"malformed HTTP response: {words}" == str(exc)
        assert await eventually(lambda: not pool.idle and not pool.open)
        assert await eventually(lambda: up.client_closed == 1)


@pytest.mark.parametrize("name", [b"Content-Type", b"X-Other"])
async def test_a_head_that_trickles_forever_is_refused_at_its_bound_not_at_the_deadline(name: bytes) -> None:
    """The head's bytes come a piece per read and never end: refused once they pass the bound (the
    request's deadline, an hour, is not what ends it)."""

    async def serve(up: Upstream, reader: Reader, writer: Writer, index: int) -> None:
        await up.next_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n%s: " % name)
        while True:
            writer.write(b"z" * 4096)
            await writer.drain()
            await asyncio.sleep(0.005)

    async with Upstream(serve) as up, pool_for(up) as pool:
        with pytest.raises(UpstreamError, match=f"response head exceeds {MAX_RESPONSE_HEAD_BYTES} bytes"):
            await fetch(pool, body=b"x", timeout=3600.0, max_body=1000)
        assert not pool.idle and not pool.open


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
@pytest.mark.parametrize("started", [False, True], ids=["awaited", "started"])
async def test_a_body_past_max_body_is_refused_and_the_connection_closed(framing: str, started: bool) -> None:
    """A declared length past ``max_body`` is refused at the head (nothing of it read); a chunked body
    once its bytes pass it. Either way the connection closes."""
    body = b"b" * 5000
    answer = ok(body) if framing == "content-length" else chunked_response([body[:2500], body[2500:]])
    async with Upstream(answering(lambda req: answer)) as up, pool_for(up) as pool:
        if started:
            listener = Recorder()
            pool.start(listener, b"POST", b"/", [b"x"], timeout=30.0, max_body=4000)
            assert await listener.ended()
            ((kind, exc),) = listener.events
            assert kind == "error"
        else:
            with pytest.raises(UpstreamError) as info:
                await fetch(pool, body=b"x", timeout=30.0, max_body=4000)
            exc = info.value
        assert isinstance(exc, UpstreamError) and "response body exceeds 4000 bytes" in str(exc)
        assert await eventually(lambda: not pool.idle and not pool.open)
