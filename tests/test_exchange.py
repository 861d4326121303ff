"""The orchestrator's callback request path (server/orchestrator/exchange.py) against its task path.

A real orchestrator (``start_server``, both gates on) in front of stand-in workers on 127.0.0.1
(port 0, ``asyncio.start_server``): each answers ``GET /health`` and ``/server_info``, a ``DELETE``
(a KV release) with a 404, and its ``POST``s from a script: canned answers of ``bench`` (a context
response of 250 base64 prompt ids, a generation response, an SSE stream), a refusal, a 4xx, a 5xx,
a reset, silence, an answer held until the test lets it go (or its head first, its body later), a
stream cut. The client writes raw bytes and parses what comes back (``raw_http``); one that leaves
resets its connection (a FIN alone may be a half-close, which the server answers to the end).

Each test runs on both request paths (conftest's ``request_path``) and pins what the client gets,
which workers were tried and that every worker's in-flight counts are back to zero, with no breaker
probe held, once the answer is in (a few also count the orchestrator's writes to its client: a
stream's are held across each read of its worker's socket). Two tests are not run twice: one starts
an orchestrator per path and compares their answers byte for byte, one looks at the callback path
alone (one ``Exchange``, no task). Nothing here asserts a duration: waits poll for a state, bounded
only so that a broken build fails instead of hanging.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from exchange_stand_ins import (
    BAD,
    BROKEN,
    CONTEXT_OK,
    CUT,
    DEFAULT,
    EMPTY_STREAM,
    EVENT,
    GENERATION_OK,
    REFUSED,
    RESET,
    SILENT,
    STREAM_OK,
    TOO_LONG,
    Cut,
    Hold,
    StandIn,
    Step,
    ask,
    assert_answer,
    completion,
    error_of,
    generation,
    in_band_error,
    orchestrator,
    released_everything,
    reset,
)
from helpers import eventually
from raw_http import Client, Response, connected, post

from bench.request_path import http
from server.http import Responder
from server.orchestrator.app import Orchestrator
from server.orchestrator.exchange import Exchange

both_paths = pytest.mark.usefixtures("request_path")

# -- 1. both paths answer the same -------------------------------------------------------------------


async def test_both_paths_answer_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """One orchestrator per path on the same workers: the same status, headers (but Date) and body,
    unary and streamed; the stream's events are the worker's."""
    answers: dict[bool, list[Response]] = {}
    async with StandIn() as ctx, generation() as gen:
        for callbacks in (True, False):
            monkeypatch.setattr(Orchestrator, "serve_from_callbacks", callbacks)
            async with orchestrator([ctx], [gen]) as (orch, port):
                assert orch.callbacks is callbacks
                answers[callbacks] = await ask(port, completion(), completion(stream=True))
    for unary, streamed in answers.values():
        assert_answer(unary, stream=False)
        assert_answer(streamed, stream=True)
    for mine, theirs in zip(answers[True], answers[False]):
        assert mine.status == theirs.status
        assert [h for h in mine.headers if h[0].lower() != b"date"] == [
            h for h in theirs.headers if h[0].lower() != b"date"
        ]
        assert mine.body == theirs.body
    assert len(ctx.posts) == len(gen.posts) == 4


# -- 2. the callback path: one Exchange, no task --------------------------------------------------------


async def test_a_completion_from_callbacks_holds_one_exchange_and_no_task(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While the context worker holds its answer the request is one Exchange (no task of its own), on
    warm keep-alive connections; then the answer arrives as the warm-up's did."""
    monkeypatch.setattr(Orchestrator, "serve_from_callbacks", True)
    held = Hold(CONTEXT_OK)
    async with StandIn(DEFAULT, held) as ctx, generation() as gen, orchestrator([ctx], [gen]) as (orch, port):
        client = await Client.connect(port)
        try:
            await client.send(completion())
            (warm,) = await client.responses(1, timeout=30)
            assert_answer(warm, stream=False)
            before = asyncio.all_tasks()
            await client.send(completion())
            assert await eventually(lambda: ctx.held == 1)
            serving = list(orch._serving)
            assert len(serving) == 1 and isinstance(serving[0], Exchange) and serving[0].task is None
            assert asyncio.all_tasks() - before == set()  # no task made for the request
            assert ctx.leg_connections == gen.leg_connections == 1  # the warm ones
            held.release.set()
            _, answer = await client.responses(2, timeout=30)
            assert answer.status == 200 and answer.body == warm.body
        finally:
            client.close()


# -- 3. leg (1)'s first attempt -------------------------------------------------------------------------


@both_paths
@pytest.mark.parametrize("first", ["refused", "reset"])
async def test_a_context_refusal_or_reset_goes_to_the_next_worker(first: str) -> None:
    step = REFUSED if first == "refused" else RESET
    async with StandIn(step) as one, StandIn() as two, generation() as gen:
        async with orchestrator([one, two], [gen]) as (orch, port):
            (resp,) = await ask(port, completion())
            assert_answer(resp, stream=False)
            assert len(one.posts) == len(two.posts) == len(gen.posts) == 1
            first_worker = orch.context_pool.workers[0]
            if first == "reset":  # out until its /health passes; what it may have parked, released
                assert not first_worker.healthy
                assert await eventually(lambda: len(one.deletes) == 1)
                assert one.deletes[0].startswith(b"/kv/by-request/")
            else:  # a refusal says nothing against the worker
                assert first_worker.healthy and not one.deletes


@both_paths
@pytest.mark.parametrize(
    ("step", "status", "code", "config"),
    [
        (BROKEN, 502, "context_leg_failed", {}),
        (BAD, 400, "too_long", {}),
        (
            SILENT,
            504,
            "context_leg_timeout",
            {"context_timeout_s": 0.3, "context_timeout_per_1k_tokens_s": 0},
        ),
    ],
    ids=["500", "400", "silent"],
)
async def test_a_context_failure_is_the_clients_answer(
    step: Step, status: int, code: str, config: dict[str, Any]
) -> None:
    """A 5xx, the client's 4xx and a spent deadline end the leg on the worker that gave them: no other
    worker gets the POST (it may have run, or the body is the cause), no generation leg."""
    async with StandIn(step) as one, StandIn() as two, generation() as gen:
        async with orchestrator([one, two], [gen], **config) as (_, port):
            (resp,) = await ask(port, completion())
            error = error_of(resp, status)
            assert error["code"] == code
            if status == 400:
                assert error["message"] == TOO_LONG  # the worker's own words
            assert len(one.posts) == 1 and not two.posts and not gen.posts
            if step == SILENT:  # the lost answer's KV, released by its id
                assert await eventually(lambda: len(one.deletes) == 1)
                assert one.deletes[0].startswith(b"/kv/by-request/")


# -- 4. leg (3)'s first attempt -------------------------------------------------------------------------


@both_paths
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("first", ["refused", "reset"])
async def test_a_generation_refusal_or_reset_goes_to_the_next_worker(first: str, stream: bool) -> None:
    step = REFUSED if first == "refused" else RESET
    async with StandIn() as ctx, generation(step) as one, generation() as two:
        async with orchestrator([ctx], [one, two]) as (orch, port):
            (resp,) = await ask(port, completion(stream))
            assert_answer(resp, stream)
            assert len(ctx.posts) == len(one.posts) == len(two.posts) == 1
            assert orch.generation_pool.workers[0].healthy is (first == "refused")
            assert not ctx.deletes  # the KV was fetched by the worker that served


@both_paths
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize(("step", "status", "code"), [(BAD, 400, "too_long"), (BROKEN, 502, "generation_leg_failed")],
                         ids=["400", "500"])  # fmt: skip
async def test_a_generation_failure_is_the_clients_answer(
    step: bytes, status: int, code: str, stream: bool
) -> None:
    """Nothing reached the client yet: a plain error answer, stream or not; the context worker's parked
    KV, which no generation worker will fetch now, is released."""
    async with StandIn() as ctx, generation(step) as one, generation() as two:
        async with orchestrator([ctx], [one, two]) as (_, port):
            (resp,) = await ask(port, completion(stream))
            error = error_of(resp, status)
            assert error["code"] == code
            if status == 400:
                assert error["message"] == TOO_LONG
            assert len(one.posts) == 1 and not two.posts
            assert await eventually(lambda: ctx.deletes == [b"/kv/12345"])


# -- 5. streams ------------------------------------------------------------------------------------------


@both_paths
@pytest.mark.parametrize("how", ["cut", "empty"])
async def test_a_stream_its_worker_cuts_or_leaves_empty_ends_with_an_in_band_error(how: str) -> None:
    """The head is gone to the client: the error is the stream's last event, then the chunked end."""
    step: Step = Cut(CUT) if how == "cut" else EMPTY_STREAM
    async with StandIn() as ctx, generation(step) as gen, orchestrator([ctx], [gen]) as (orch, port):
        async with connected(port) as client:
            await client.send(completion(stream=True))
            (resp,) = await client.responses(1, timeout=30)
            raw = bytes(client.stream.raw)
        assert resp.body.startswith(EVENT if how == "cut" else b"data: {")
        error = in_band_error(resp)
        assert error["code"] == "generation_leg_failed" and error["type"]
        assert ("mid-stream" if how == "cut" else "empty stream") in error["message"]
        assert resp.header(b"transfer-encoding") == b"chunked" and raw.endswith(b"\r\n0\r\n\r\n")
        assert not orch.generation_pool.workers[0].healthy


@both_paths
async def test_a_json_answer_to_a_stream_request_is_relayed_as_json() -> None:
    async with StandIn() as ctx, generation(GENERATION_OK) as gen, orchestrator([ctx], [gen]) as (orch, port):
        (resp,) = await ask(port, completion(stream=True))
        assert_answer(resp, stream=False)
        assert orch.generation_pool.workers[0].healthy


def handed_over(orch: Orchestrator) -> bool:
    """The completion in flight goes on in coroutines: its task (the task path's, or the one an
    Exchange handed its leg's attempt to)."""
    return bool(orch._serving) and all(getattr(s, "task", s) is not None for s in orch._serving)


@both_paths
@pytest.mark.parametrize(("answer", "status"), [(GENERATION_OK, 200), (BAD, 400)], ids=["json", "400"])
async def test_a_stream_legs_other_answer_is_read_to_its_end_when_its_body_comes_later(
    answer: bytes, status: int
) -> None:
    """A stream leg's head that is not a 200 SSE goes on in coroutines at once (exchange.response_head);
    its body, in a later read, wakes them there (the response's futures, not the exchange)."""
    late = Hold(answer, head=True)
    async with StandIn() as ctx, generation(late) as gen, orchestrator([ctx], [gen]) as (orch, port):
        async with connected(port) as client:
            await client.send(completion(stream=True))
            assert await eventually(lambda: gen.held == 1 and handed_over(orch))
            late.release.set()
            (resp,) = await client.responses(1, timeout=30)
        if status == 200:
            assert_answer(resp, stream=False)
        else:
            assert error_of(resp, 400)["message"] == TOO_LONG


@both_paths
@pytest.mark.parametrize("where", ["context", "stream"])
async def test_a_client_that_leaves_ends_the_leg_and_releases_the_kv(where: str) -> None:
    """The client goes while its context answer is held, or mid-stream: the leg's connection is reset,
    the KV the context worker may hold released (by the request's id, or by the answer's endpoint)."""
    held = Hold(CUT + b"0\r\n\r\n", at=len(CUT)) if where == "stream" else Hold(CONTEXT_OK)
    ctx = StandIn(held) if where == "context" else StandIn()
    gen = generation(held) if where == "stream" else generation()
    async with ctx, gen, orchestrator([ctx], [gen]) as (orch, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(completion(stream=True))
        if where == "context":
            assert await eventually(lambda: ctx.held == 1)
        else:  # the stream's first event reached the client
            got = b""
            while EVENT not in got:
                got += await asyncio.wait_for(reader.read(65536), 30)
            assert got.startswith(b"HTTP/1.1 200")
        reset(writer)  # a FIN alone may be a half-close (RFC 9112 9.6): the server waits for the answer
        if where == "context":
            assert await eventually(lambda: len(ctx.deletes) == 1)
            assert ctx.deletes[0].startswith(b"/kv/by-request/") and not gen.posts
        else:
            assert await eventually(lambda: ctx.deletes == [b"/kv/12345"])
            assert await eventually(lambda: not orch.upstreams[gen.url].open)  # reset, not pooled


class Recorded:
    """A client connection's transport that records what is written (then writes it, as it is)."""

    def __init__(self, transport: Any, writes: list[bytes]) -> None:
        self._transport = transport
        self.writes = writes

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))
        self._transport.write(data)

    def writelines(self, pieces: Any) -> None:
        pieces = list(pieces)
        self.writes.append(b"".join(pieces))
        self._transport.writelines(pieces)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


@pytest.fixture
def client_writes(request_path: str, monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every write of the orchestrator to its clients (on both request paths)."""
    writes: list[bytes] = []
    made = Responder.__init__

    def recording(self: Responder, *args: Any, **kwargs: Any) -> None:
        made(self, *args, **kwargs)
        self._transport = Recorded(self._transport, writes)  # type: ignore[assignment]

    monkeypatch.setattr(Responder, "__init__", recording)
    return writes


async def test_a_stream_that_comes_in_one_read_goes_to_the_client_in_one_write(
    client_writes: list[bytes],
) -> None:
    """The worker writes its whole stream at once: its head, events and end reach the client in one
    write (Responder.hold, flushed after the read), not one per piece."""
    async with StandIn() as ctx, generation() as gen, orchestrator([ctx], [gen]) as (_, port):
        async with connected(port) as client:
            await client.send(completion(stream=True))
            (resp,) = await client.responses(1, timeout=30)
            assert_answer(resp, stream=True)
            assert client_writes == [bytes(client.stream.raw)]


async def test_a_streams_head_that_comes_alone_is_not_held_for_its_body(
    client_writes: list[bytes], request_path: str
) -> None:
    """The worker sends its stream's head and holds the events: the client has the head meanwhile."""
    late = Hold(STREAM_OK, head=True)
    async with StandIn() as ctx, generation(late) as gen, orchestrator([ctx], [gen]) as (_, port):
        async with connected(port) as client:
            await client.send(completion(stream=True))
            stream = client.stream
            await client.read_until(lambda: stream.current is not None and stream.current.headers_done, 30)
            assert gen.held == 1 and not stream.current.pieces
            late.release.set()
            (resp,) = await client.responses(1, timeout=30)
        assert_answer(resp, stream=True)
        # the head, then the events and the end; on the task path the end is written when its
        # coroutine wakes, after the read that brought the events was flushed
        assert len(client_writes) == (2 if request_path == "callbacks" else 3)


async def test_a_large_event_in_the_read_with_the_head_is_written_after_it(
    client_writes: list[bytes],
) -> None:
    """A piece too large to copy into what is held: the held head is written first, then the piece
    as it is, then the end."""
    big = b'data: {"choices":[{"index":0,"delta":{"content":"%s"}}]}\n\n' % (b"x" * 6000)
    events = big + b"data: [DONE]\n\n"
    async with StandIn() as ctx, generation(http(b"200 OK", events, b"text/event-stream")) as gen:
        async with orchestrator([ctx], [gen]) as (_, port), connected(port) as client:
            await client.send(completion(stream=True))
            (resp,) = await client.responses(1, timeout=30)
            assert resp.status == 200 and resp.body == events
            assert b"".join(client_writes) == bytes(client.stream.raw)
            assert len(client_writes) == 3  # the head, the piece, the end


async def test_an_answer_pipelined_behind_a_stream_is_written_after_all_of_it(
    client_writes: list[bytes],
) -> None:
    """A stream, then a request refused at once (its 400 is written as the stream's exchange ends,
    inside the worker's read): the whole stream first, then the 400."""
    bad = post(b"/v1/chat/completions", b'{"messages": [}', extra=b"Content-Type: application/json\r\n")
    async with StandIn() as ctx, generation() as gen, orchestrator([ctx], [gen]) as (_, port):
        async with connected(port) as client:
            await client.send(completion(stream=True) + bad)
            first, second = await client.responses(2, timeout=30)
        assert_answer(first, stream=True)
        error_of(second, 400)
        assert len(client_writes) == 2


# -- 6. pipelining ---------------------------------------------------------------------------------------


@both_paths
async def test_pipelined_completions_are_answered_in_order() -> None:
    """Two completions written at once, the first held at its context worker: the stream first, then
    the unary answer, on the one connection."""
    held = Hold(CONTEXT_OK)
    async with StandIn(held) as ctx, generation() as gen, orchestrator([ctx], [gen]) as (_, port):
        async with connected(port) as client:
            await client.send(completion(stream=True) + completion())
            assert await eventually(lambda: ctx.held == 1)
            assert not client.stream.responses
            held.release.set()
            first, second = await client.responses(2, timeout=30)
        assert_answer(first, stream=True)
        assert_answer(second, stream=False)
        assert len(ctx.posts) == len(gen.posts) == 2


# -- 7. a bug in a step --------------------------------------------------------------------------------


@both_paths
async def test_a_bug_in_a_step_is_a_500_and_the_next_request_is_served() -> None:
    def broken(req: Any, body: bytes) -> bytes:
        raise RuntimeError("a bug")

    async with StandIn() as ctx, generation() as gen, orchestrator([ctx], [gen]) as (orch, port):
        orch.relay.client_answer = broken  # on the instance: the class's is back once deleted
        try:
            async with connected(port) as client:
                await client.send(completion())
                responses = await client.until_closed(timeout=30)
        finally:
            del orch.relay.client_answer
        assert len(responses) == 1
        error = error_of(responses[0], 500)
        assert error["message"] == "internal error"
        assert responses[0].header(b"connection") == b"close"
        assert await eventually(lambda: released_everything(orch))
        assert await eventually(lambda: ctx.deletes == [b"/kv/12345"])  # its parked KV released
        (resp,) = await ask(port, completion())
        assert_answer(resp, stream=False)


def test_one_completion_object_both_drivers_pass_to_the_steps() -> None:
    """A completion's state is one Completion (issue 37 item 1): an Exchange is one (slots only: no
    per-request dict on the callback path), and the shared steps take it, not its parts."""
    import inspect

    from server.orchestrator.completion import Completion, CompletionDriver
    from server.orchestrator.pair import PairExchange, PairRunner

    assert issubclass(Exchange, Completion) and issubclass(PairExchange, Completion)
    assert Exchange.__dictoffset__ == 0 and PairExchange.__dictoffset__ == 0
    steps = (
        CompletionDriver.prepared,
        CompletionDriver.context_begins,
        CompletionDriver.context_leg,
        CompletionDriver.context_answered,
        CompletionDriver.generation_after_context,
        PairRunner.run,
    )
    for step in steps:
        params = list(inspect.signature(step).parameters)
        assert params[1] == "c", step.__qualname__
        assert len(params) <= 5, step.__qualname__
