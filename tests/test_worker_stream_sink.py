"""A started stream's events written from the engine's delivery callback (server/worker/stream_sink.py).

The engine calls a request's ``on_delta`` from one loop callback a step; a started stream's sink
writes its event right there, without waking its handler task, until the stream ends or its
client's buffer fills (the handler then waits for the drain, and the deltas queue meanwhile)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from server import openai_shapes
from server.worker import stream_sink
from server.worker.output import Delta
from server.worker.responses import StreamWriterState
from server.worker.stream_sink import DeltaRelay, StreamSink
from server.worker.tokenizer import ByteTokenizer


class _Out:
    """The Responder's part a sink uses: written bytes and the paused flag."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.paused = False

    def write(self, data: bytes) -> None:
        self.written.append(data)


class _Writer:
    def delta(self, delta: Delta) -> bytes:
        return f"data: {delta.text}\n\n".encode()

    def end(self, usage: dict[str, Any]) -> bytes:
        return f"data: usage {usage['completion_tokens']}\n\ndata: [DONE]\n\n".encode()


@pytest.fixture
def sink(monkeypatch: pytest.MonkeyPatch) -> tuple[StreamSink, DeltaRelay, asyncio.Queue[Delta], _Out]:
    monkeypatch.setattr(stream_sink, "request_usage", lambda req, n, engine_req: {"completion_tokens": n})
    queue: asyncio.Queue[Delta] = asyncio.Queue()
    relay = DeltaRelay(queue.put_nowait)
    out = _Out()
    return StreamSink(out, _Writer(), None, None, relay, queue), relay, queue, out  # type: ignore[arg-type]


def _d(text: str, finish: str | None = None, error: str | None = None) -> Delta:
    return Delta(text, [1] if text else [], [], finish_reason=finish, error=error)


async def test_the_callback_writes_each_event_without_waking_the_handler(sink: Any) -> None:
    s, relay, queue, out = sink
    relay(_d("a"))  # before the handler runs: queued
    handler = asyncio.create_task(s.run())
    await asyncio.sleep(0)  # the handler wrote what was queued and waits
    assert out.written == [b"data: a\n\n"] and queue.empty()
    for text in "bcd":
        relay(_d(text))  # the engine's callback: written here and now, the handler not woken
        assert out.written[-1] == f"data: {text}\n\n".encode() and not handler.done()
    relay(_d("e", finish="length"))
    assert out.written[-2:] == [b"data: e\n\n", b"data: usage 5\n\ndata: [DONE]\n\n"]
    await asyncio.wait_for(handler, 1)
    assert s.ended and s.num_tokens == 5 and relay.target == queue.put_nowait


async def test_a_full_buffer_wakes_the_handler_and_later_deltas_queue_in_order(sink: Any) -> None:
    s, relay, queue, out = sink
    handler = asyncio.create_task(s.run())
    await asyncio.sleep(0)
    out.paused = True
    relay(_d("a"))  # written; the buffer is full now: the handler wakes
    relay(_d("b"))  # before it ran: queued, not written past the mark
    await asyncio.wait_for(handler, 1)
    assert out.written == [b"data: a\n\n"] and queue.qsize() == 1 and not s.ended
    relay(_d("c"))  # the handler waits for the drain: the queue takes it
    out.paused = False
    handler = asyncio.create_task(s.run())
    await asyncio.sleep(0)
    assert out.written == [b"data: a\n\n", b"data: b\n\n", b"data: c\n\n"] and queue.empty()
    relay(_d("", error="decode step failed"))
    await asyncio.wait_for(handler, 1)
    assert s.ended and out.written[-1].startswith(b"data: {") and b"decode step failed" in out.written[-1]


async def test_a_cancelled_handler_gives_the_deltas_back_to_the_queue(sink: Any) -> None:
    """The client left: its handler is cancelled while the callback writes; what comes after is
    queued (nobody reads it), not written."""
    s, relay, queue, out = sink
    handler = asyncio.create_task(s.run())
    await asyncio.sleep(0)
    handler.cancel()
    with pytest.raises(asyncio.CancelledError):
        await handler
    relay(_d("x"))
    assert out.written == [] and queue.qsize() == 1


async def test_a_unary_answer_is_collected_with_one_wake_of_its_handler() -> None:
    """A unary answer: what was queued, then what the callback appends, the handler woken once at
    the last delta (not a task step a delta, as the queue's get); the queue takes deltas again after."""
    queue: asyncio.Queue[Delta] = asyncio.Queue()
    relay = DeltaRelay(queue.put_nowait)
    relay(_d("a"))
    handler = asyncio.create_task(stream_sink.collect_answer(relay, queue))
    await asyncio.sleep(0)
    assert queue.empty() and relay.target != queue.put_nowait
    for text in "bcd":
        relay(_d(text))  # appended in the callback: the handler is not woken
        await asyncio.sleep(0)
        assert not handler.done()
    before = time.monotonic()
    relay(_d("e", finish="length"))
    deltas, first_at = await asyncio.wait_for(handler, 1)
    assert [d.text for d in deltas] == list("abcde") and deltas[-1].finish_reason == "length"
    assert 0 < first_at <= before and relay.target == queue.put_nowait
    relay(_d("late"))
    assert queue.qsize() == 1


async def test_a_unary_answer_ends_at_an_error_and_a_cancelled_handler_frees_the_relay() -> None:
    queue: asyncio.Queue[Delta] = asyncio.Queue()
    relay = DeltaRelay(queue.put_nowait)
    handler = asyncio.create_task(stream_sink.collect_answer(relay, queue))
    await asyncio.sleep(0)
    relay(_d("a"))
    relay(_d("", error="decode step failed"))
    relay(_d("b"))  # past the end, before the handler ran: dropped, as the queue's reader left it
    deltas, _ = await asyncio.wait_for(handler, 1)
    assert [(d.text, d.error) for d in deltas] == [("a", None), ("", "decode step failed")]
    queue.put_nowait(_d("x", finish="stop"))  # all there already: no wait
    assert [d.text for d in (await stream_sink.collect_answer(relay, queue))[0]] == ["x"]
    handler = asyncio.create_task(stream_sink.collect_answer(relay, queue))
    await asyncio.sleep(0)
    handler.cancel()
    with pytest.raises(asyncio.CancelledError):
        await handler
    assert relay.target == queue.put_nowait


class _Parsed:
    """The ParsedRequest fields a StreamWriterState reads."""

    def __init__(self, route: str, model: str, want_logprobs: bool = False) -> None:
        self.route = route
        self.model = model
        self.want_logprobs = want_logprobs
        self.tools = None


@given(
    st.sampled_from(["chat", "completions"]),
    st.text(max_size=12) | st.just("\x00\x01"),
    st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=4),
)
def test_a_text_deltas_event_is_the_chunk_made_whole(route: str, model: str, texts: list[str]) -> None:
    """A text delta's event (the writer's cut template) is, byte for byte, the chunk openai_shapes
    builds, whatever the text (quotes, escapes, controls, past the BMP) and the model name (one
    that is the template's own marker too), and later chunks' text offsets are unchanged."""
    writer = StreamWriterState(_Parsed(route, model), ByteTokenizer())  # type: ignore[arg-type]
    for text in texts:
        chunk = openai_shapes.stream_chunk(
            chat=route == "chat",
            response_id=writer.response_id,
            created=writer.created,
            model=model,
            text=text,
        )
        expected = openai_shapes.sse_event(chunk)
        assert writer.delta(Delta(text, [1], [])) == expected
    assert writer.text_offset == sum(map(len, texts))


def test_a_text_deltas_event_builds_no_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step's usual delta (text, not the last, no logprobs asked, no tool parser) costs no
    chunk dicts nor their JSON encoding (~5 us a delta on the loop, 32 deltas a step at 32
    streams); the last delta and a logprobs request still build theirs."""
    plain = StreamWriterState(_Parsed("completions", "tiny"), ByteTokenizer())  # type: ignore[arg-type]
    asked = StreamWriterState(_Parsed("completions", "tiny", True), ByteTokenizer())  # type: ignore[arg-type]
    built: list[dict[str, Any]] = []
    real = openai_shapes.stream_chunk

    def counted(**kw: Any) -> dict[str, Any]:
        built.append(kw)
        return real(**kw)

    monkeypatch.setattr(openai_shapes, "stream_chunk", counted)
    assert plain.delta(Delta("a", [97], [])).startswith(b"data: {") and built == []
    plain.delta(Delta("b", [98], [], finish_reason="length"))
    assert [kw.get("finish_reason") for kw in built] == [None, "length"]
    asked.delta(Delta("c", [99], []))
    assert len(built) == 3
