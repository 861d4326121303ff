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
import json
from types import SimpleNamespace
from typing import Any

import pytest
from exchange_stand_ins import (
    CONTEXT_OK,
    GENERATION_BODY,
    GENERATION_OK,
    STREAM_OK,
    StandIn,
    ask,
    assert_answer,
    completion,
    error_of,
    generation,
    generation_default,
    orchestrator,
)
from helpers import eventually
from upstream_stand_ins import (  # noqa: F401  (fixtures: both twins, both loops)
    Pool,
    Reader,
    Upstream,
    Writer,
    _both_twins,
    answering,
    chunked_response,
    event_loop_policy,
    fetch,
    ok,
    pool_for,
    set_twin,
)

from bench.orchestrator_work import context_response
from bench.request_path import http, sse_answer
from server.http import UpstreamError, UpstreamPool, UpstreamResponse
from server.http.limits import MAX_RESPONSE_HEAD_BYTES, MAX_RESPONSE_HEADERS
from server.orchestrator.app import Orchestrator

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


# -- 3. an orchestrator in front of hostile workers ---------------------------------------------------
# (test_exchange's stand-ins and orchestrator: a worker answers its POSTs from a script of raw bytes)

IDS_2 = [7] * 250
CONTEXT_2 = http(b"200 OK", context_response(IDS_2, b64=True))
GENERATION_2 = http(b"200 OK", GENERATION_BODY.replace(b"The answer is short.", b"A second, wrong one."))
STREAM_2 = sse_answer(2)
#: a worker's answer, then a second one in the same write, per leg
DOUBLED = {
    "context": (CONTEXT_OK + CONTEXT_2, False),
    "generation": (GENERATION_OK + GENERATION_2, False),
    "stream": (STREAM_OK + STREAM_2, True),
}


@pytest.fixture(params=["callbacks", "coroutines-admission"])
def orchestrator_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The orchestrator's two request paths: from callbacks (exchange.py), or in coroutines, where a
    completion waits for its admission slot (admission on). The config it takes."""
    monkeypatch.setattr(Orchestrator, "serve_from_callbacks", True)
    if request.param == "callbacks":
        return {}
    return {"admission": {"max_inflight": 4}}


@pytest.fixture
def orchestrator_twin(upstream_twin: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every orchestrator's upstream connections on conftest's ``upstream_twin`` (compiled or pure)."""
    set_twin(UpstreamPool, upstream_twin, monkeypatch)


def _b64_ids(answer: bytes) -> bytes:
    """The prompt_token_ids_b64 value of a context answer."""
    body = answer.split(b"\r\n\r\n", 1)[1]
    return json.loads(body)["prompt_token_ids_b64"].encode()


@pytest.mark.usefixtures("orchestrator_twin")
@pytest.mark.parametrize("leg", sorted(DOUBLED))
async def test_a_worker_that_answers_twice_in_one_write_the_first_answer_stands(
    leg: str, orchestrator_path: dict[str, Any]
) -> None:
    """Two complete answers in one write, on the context leg, the generation leg or a streamed one:
    the orchestrator lives on (the compiled connection crashed it), the client gets what the first
    answer makes, and that connection is not used again (the next leg opens another)."""
    answer, stream = DOUBLED[leg]
    ctx = StandIn(answer) if leg == "context" else StandIn()
    gen = generation() if leg == "context" else generation(answer)
    async with ctx, gen, orchestrator([ctx], [gen], **orchestrator_path) as (orch, port):
        (first,) = await ask(port, completion(stream))
        assert_answer(first, stream)
        if leg == "context":
            assert _b64_ids(CONTEXT_OK) in gen.posts[0] and _b64_ids(CONTEXT_2) not in gen.posts[0]
        (second,) = await ask(port, completion(stream))
        assert_answer(second, stream)
        doubled = ctx if leg == "context" else gen
        assert doubled.leg_connections == 2, "the connection of the doubled answer was pooled"
        assert all(w.healthy for p in orch.pools for w in p.workers)


class Trickle:
    """A head that never ends: ``start``, then ``piece`` per write, forever."""

    def __init__(self, start: bytes, piece: bytes) -> None:
        self.start, self.piece = start, piece


class HostileStandIn(StandIn):
    """test_exchange's stand-in, whose script may also trickle a head forever (:class:`Trickle`)."""

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not (self.script and isinstance(self.script[0], Trickle)):
            await super().serve(reader, writer)
            return
        while True:  # health checks until the POST
            head = await reader.readuntil(b"\r\n\r\n")
            if head.startswith(b"GET"):
                writer.write(http(b"200 OK", b'{"status": "ok"}' if b" /health" in head else b"{}"))
                continue
            lengths = [int(h[15:]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")]
            self.posts.append(await reader.readexactly(lengths[0] if lengths else 0))
            break
        trickle = self.script.pop(0)
        assert isinstance(trickle, Trickle)
        writer.write(trickle.start)
        while True:
            writer.write(trickle.piece)
            await writer.drain()
            await asyncio.sleep(0.002)


_LINE = b"HTTP/1.1 200 OK\r\n"
#: what a worker answers past the bounds, on a leg (the head's bound, or max_worker_body_bytes: 64 KiB here)
HOSTILE = {
    "endless-content-type": _LINE + b"Content-Type: " + b"a" * (MAX_RESPONSE_HEAD_BYTES + 1),
    "endless-other-header": _LINE + b"X-Other: " + b"a" * (MAX_RESPONSE_HEAD_BYTES + 1),
    "too-many-headers": _LINE
    + b"".join(b"X-%d: 1\r\n" % i for i in range(MAX_RESPONSE_HEADERS + 1))
    + b"\r\n",
    "trickling-head": Trickle(_LINE + b"Content-Type: ", b"a" * 1024),
    "body-over-the-bound": http(b"200 OK", b"{" + b" " * (64 * 1024) + b"}"),
}


@pytest.mark.usefixtures("orchestrator_twin")
@pytest.mark.parametrize("case", sorted(HOSTILE))
@pytest.mark.parametrize("leg", ["context", "generation", "stream"])
async def test_a_worker_answer_past_its_bounds_is_a_502_at_once_counted_against_the_worker(
    leg: str, case: str, orchestrator_path: dict[str, Any]
) -> None:
    """An endless or oversized head, or a whole answer past max_worker_body_bytes: the client gets the
    API's 502 for the leg (not the deadline's 504: the deadlines are far), the worker's breaker
    counts a failure and the worker leaves the pool until its /health passes."""
    hostile = HOSTILE[case]
    stream = leg == "stream"
    if case == "body-over-the-bound" and stream:
        hostile = http(b"200 OK", b"data: " + b"x" * (64 * 1024) + b"\n\n", b"text/event-stream")
    ctx = HostileStandIn(hostile) if leg == "context" else StandIn()
    gen = HostileStandIn(hostile, default=generation_default) if leg != "context" else generation()
    config = {
        "context_fallback": "fail",
        "request_timeout_s": 600,
        "context_timeout_s": 300,
        "max_worker_body_bytes": 64 * 1024,
        **orchestrator_path,
    }
    async with ctx, gen, orchestrator([ctx], [gen], **config) as (orch, port):
        (resp,) = await ask(port, completion(stream))
        if case == "body-over-the-bound" and stream:
            # a stream is relayed as it comes: no bound on it, the whole answer reaches the client
            assert resp.status == 200 and len(resp.body) > 64 * 1024
            return
        name = "context" if leg == "context" else "generation"
        error = error_of(resp, 502)
        assert error["code"] == f"{name}_leg_failed", error
        (worker,) = (orch.context_pool if name == "context" else orch.generation_pool).workers
        assert worker.breaker.failures == 1 and not worker.healthy
