"""A streamed completion's SSE events written from the engine's delivery callback.

The engine hands a step's outputs to the event loop in one ``call_soon_threadsafe`` that calls
every request's ``on_delta`` (server/worker/engine.py). Through a queue, each of those woke the
stream's handler task, which wrote one event and went back to waiting: at 32 streams, 32 task
steps a decode step on the loop, which shares the GIL with the engine thread. Once a stream has
started, :class:`StreamSink` writes its events inside that callback instead (the same bytes, in
the same order); its handler waits only for the end, an error, or a client whose write buffer
is full (:attr:`~server.http.Responder.paused`: the handler waits for it to drain, as before).

:class:`DeltaRelay` is what the engine calls: the queue's ``put_nowait`` until the handler hands
the stream to a sink, and again while the handler holds it (before the first token, while paused).

A unary answer's deltas are gathered the same way (:func:`collect_answer`): the callback appends
them and wakes the handler once, at the last (through the queue, each woke it: a task step a delta,
~3.5 us of the loop's CPU on asyncio's loop, 32 a step at 32 requests).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from server.errors import error_body
from server.http import Responder

from .engine_api import EngineRequest
from .output import Delta
from .request import ParsedRequest
from .responses import StreamWriterState, request_usage


class DeltaRelay:
    """A request's ``on_delta``: passes each delta to its current target."""

    __slots__ = ("target",)

    def __init__(self, target: Callable[[Delta], None]) -> None:
        self.target = target

    def __call__(self, delta: Delta) -> None:
        self.target(delta)


class StreamSink:
    """Writes one started stream's events; :attr:`ended` once its last event (or an error) is out."""

    __slots__ = ("ended", "engine_req", "num_tokens", "out", "queue", "relay", "req", "waiter", "writer")

    def __init__(
        self,
        out: Responder,
        writer: StreamWriterState,
        req: ParsedRequest,
        engine_req: EngineRequest,
        relay: DeltaRelay,
        queue: asyncio.Queue[Delta],
    ) -> None:
        self.out = out
        self.relay = relay
        self.queue = queue
        self.writer = writer
        self.req = req
        self.engine_req = engine_req
        self.num_tokens = 0
        self.ended = False
        self.waiter: asyncio.Future[None] | None = None

    def write(self, delta: Delta) -> None:
        """One delta's event (and the closing events with the last one)."""
        out = self.out
        if delta.error is not None:
            out.write(b"data: " + error_body(500, delta.error) + b"\n\n")
            self.ended = True
            return
        self.num_tokens += len(delta.token_ids)
        out.write(self.writer.delta(delta))
        if delta.finish_reason is not None:
            out.write(self.writer.end(request_usage(self.req, self.num_tokens, self.engine_req)))
            self.ended = True

    def deliver(self, delta: Delta) -> None:
        """The relay's target while the handler waits: write, and wake the handler at the end or
        when the client's buffer is full; once woken, deltas queue until the handler runs."""
        waiter = self.waiter
        if waiter is None or waiter.done():
            self.queue.put_nowait(delta)
            return
        self.write(delta)
        if self.ended or self.out.paused:
            waiter.set_result(None)

    async def run(self) -> None:
        """Write what is queued, then let the engine's callback write the rest until the stream ends
        or its client's buffer fills; the queue takes the deltas again after."""
        queue = self.queue
        while not self.ended and not queue.empty():
            self.write(queue.get_nowait())
        if self.ended or self.out.paused:
            return
        self.waiter = asyncio.get_running_loop().create_future()
        self.relay.target = self.deliver
        try:
            await self.waiter
        finally:
            self.relay.target = queue.put_nowait
            self.waiter = None


async def collect_answer(relay: DeltaRelay, queue: asyncio.Queue[Delta]) -> tuple[list[Delta], float]:
    """A unary answer's deltas up to its last (a finish or an error), and ``time.monotonic()`` when
    the first came: what the queue holds, then what the engine's callback appends through ``relay``
    (the queue takes the deltas again after, or when the handler is cancelled)."""
    deltas: list[Delta] = []
    first_at = 0.0
    ended = asyncio.get_running_loop().create_future()

    def add(delta: Delta) -> None:
        nonlocal first_at
        if ended.done():
            return  # nothing comes after the last; the queue's reader stopped there too
        if not deltas:
            first_at = time.monotonic()
        deltas.append(delta)
        if delta.finish_reason is not None or delta.error is not None:
            ended.set_result(None)

    while not queue.empty():
        add(queue.get_nowait())
    if not ended.done():
        relay.target = add
        try:
            await ended
        finally:
            relay.target = queue.put_nowait
    return deltas, first_at


__all__ = ["DeltaRelay", "StreamSink", "collect_answer"]
