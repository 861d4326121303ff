"""server.http.server: a client's FIN in the middle of a streamed response (its eof_received's probe).

A FIN is what a client that half-closed (RFC 9112 9.6: it still reads) and one that closed
altogether both send; the second resets the connection when bytes reach it. Mid-stream, the
probe that tells them apart is an SSE comment (``:`` then a blank line), written only where it
changes nothing a client parses: in an event stream, after a whole event. Real sockets on
127.0.0.1, the server in the test's event loop, on asyncio's default loop and on uvloop (what
the processes run), on both request parsers; responses parsed by tests/raw_http.py's client
(llhttp), the events by the SSE rules (HTML living standard, server-sent events). No timing
margins: each test waits for a state (its bounds are generous), never for silence.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable

import pytest
from helpers import eventually
from raw_http import (  # noqa: F401  (fixtures: both loops, both request parsers)
    Client,
    Server,
    _both_parsers,
    event_loop_policy,
    get,
    serving,
)

from server.http import Handling, HTTPServer, Request, Responder
from server.http.responder import EVENT_STREAM
from server.http.server import SSE_PROBE

pytestmark = pytest.mark.filterwarnings('ignore:Overriding the "event_loop_policy" fixture is deprecated')

SSE = EVENT_STREAM
FIRST, REST = b"data: first\n\n", b"data: second\n\n"
#: the probe as one chunk of a chunked body
PROBE_CHUNK = b"%x\r\n%s\r\n" % (len(SSE_PROBE), SSE_PROBE)


def sse_events(body: bytes) -> list[str]:
    """The data of each event a conforming client dispatches (HTML living standard 9.2.6:
    comments ignored, a blank line dispatches the data buffer unless it is empty)."""
    events, data = [], list[str]()
    for line in re.split(r"\r\n|\r|\n", body.decode())[:-1]:  # the part after the last end is no line
        if not line:
            if data:
                events.append("\n".join(data))
            data = []
        elif not line.startswith(":"):
            name, _, value = line.partition(":")
            if name == "data":
                data.append(value[1:] if value.startswith(" ") else value)
    return events


class _Stalled(Handling):
    __slots__ = ("stream",)

    def __init__(self, stream: Stalled) -> None:
        self.stream = stream

    def cancel(self) -> None:
        self.stream.cancelled = True
        self.stream.out.abort()  # a Handling's cancel ends it (server.http.Handling)


class Stalled:
    """A streamed response whose handler writes ``first``, then nothing (a long prefill, a stalled
    worker) until :meth:`go_on` has it write ``rest`` and end: served in a task, or from callbacks
    (a :class:`Handling`, as the orchestrator's exchanges are). ``held``: written after ``first``
    while the responder holds its writes (:meth:`Responder.hold`), flushed by :meth:`go_on`."""

    def __init__(
        self,
        served: str,
        content_type: bytes = SSE,
        first: bytes = FIRST,
        rest: bytes = REST,
        held: bytes = b"",
    ) -> None:
        self.served = served
        self.content_type, self.first, self.rest, self.held = content_type, first, rest, held
        self.out: Responder = None  # type: ignore[assignment]
        self.cancelled = False
        self.released = asyncio.Event()

    def handler(self, req: Request, out: Responder) -> Awaitable[None] | Handling:
        self.out = out
        out.start(200, self.content_type)
        out.write(self.first)
        if self.held:
            out.hold()
            out.write(self.held)
        return _Stalled(self) if self.served == "handling" else self._wait()

    async def _wait(self) -> None:
        try:
            await self.released.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        self._finish()

    def _finish(self) -> None:
        self.out.flush()
        self.out.write(self.rest)
        self.out.end()

    def go_on(self) -> None:
        if self.served == "handling":
            self._finish()
            self.out.done()
        else:
            self.released.set()


async def first_part_read(stream: Stalled, port: int, *, http10: bool = False) -> Client:
    """A client that asked for the stream and read its first part to the last byte written: nothing
    unread is left in its socket (its close then sends a FIN, not a reset)."""
    client = await Client.connect(port)
    await client.send(get(b"/s", version=b"1.0" if http10 else b"1.1"))
    last = stream.first if http10 else stream.first + b"\r\n"  # raw, or the end of its chunk
    await client.read_until(lambda: client.stream.raw.endswith(last))
    return client


async def fin_seen(server: HTTPServer) -> bool:
    """The server's connection handled the FIN (its probe, if any, is written by then)."""
    return await eventually(lambda: any(c.client_eof for c in server.connections))


@pytest.mark.parametrize("served", ["task", "handling"])
async def test_a_client_that_closed_mid_stream_has_its_request_cancelled(served: str) -> None:
    """It closed (FIN) while its handler writes nothing: the probe's reset cancels the request."""
    stream = Stalled(served)
    async with serving(stream.handler) as (server, port):  # type: ignore[arg-type]
        client = await first_part_read(stream, port)
        client.close()  # FIN; the client's kernel answers what comes after it with a reset
        assert await eventually(lambda: stream.cancelled), "the request outlived its client"
        assert await eventually(lambda: not server.connections)


@pytest.mark.parametrize("served", ["task", "handling"])
async def test_a_client_that_half_closed_mid_stream_reads_the_probe_then_the_rest(served: str) -> None:
    stream = Stalled(served)
    async with serving(stream.handler) as (server, port):  # type: ignore[arg-type]
        client = await first_part_read(stream, port)
        client.writer.transport.write_eof()  # shutdown(SHUT_WR): it still reads
        await client.read_until(lambda: client.stream.raw.endswith(PROBE_CHUNK))
        stream.go_on()
        (resp,) = await client.until_closed()  # answered, then closed (it sends nothing more)
        assert resp.status == 200 and resp.header(b"transfer-encoding") == b"chunked"
        assert resp.body == FIRST + SSE_PROBE + REST  # one chunk of its own, between two events
        assert sse_events(resp.body) == sse_events(FIRST + REST) == ["first", "second"]
        assert not stream.cancelled and not client.reset
        assert await eventually(lambda: not server.connections)


async def test_an_http10_event_stream_gets_the_probe_in_its_close_delimited_body() -> None:
    """No framing to break: the comment goes as raw bytes between two events."""
    stream = Stalled("task")
    async with serving(stream.handler) as (_server, port):  # type: ignore[arg-type]
        client = await first_part_read(stream, port, http10=True)
        client.writer.transport.write_eof()
        await client.read_until(lambda: client.stream.raw.endswith(FIRST + SSE_PROBE))
        stream.go_on()
        (resp,) = await client.until_closed()
        assert resp.header(b"transfer-encoding") is None and resp.header(b"content-length") is None
        assert resp.body == FIRST + SSE_PROBE + REST
        assert sse_events(resp.body) == ["first", "second"]


@pytest.mark.parametrize(
    ("content_type", "first", "held", "rest"),
    [
        pytest.param(b"application/x-ndjson", b'{"a": 1}\n\n', b"", b'{"b": 2}\n', id="not-an-event-stream"),
        pytest.param(SSE, b"data: fir", b"", b"st\n\n", id="half-an-event"),
        pytest.param(SSE, b"data: first\n", b"", b"data: more\n\n", id="an-event-not-ended"),
        # The event's end is held, not written: a probe now would land inside the event.
        pytest.param(SSE, b"data: fir", b"st\n\n", REST, id="writes-held"),
    ],
)
async def test_no_probe_where_a_byte_would_change_what_the_client_parses(
    content_type: bytes, first: bytes, held: bytes, rest: bytes
) -> None:
    """Mid-body of another format, mid-event, or while the responder holds writes: nothing is
    written at the FIN (the handler's next write is the probe then), and the body is exactly the
    handler's."""
    stream = Stalled("task", content_type, first, rest, held)
    async with serving(stream.handler) as (server, port):  # type: ignore[arg-type]
        client = await first_part_read(stream, port)
        client.writer.transport.write_eof()
        assert await fin_seen(server)
        stream.go_on()
        (resp,) = await client.until_closed()
        assert resp.body == first + held + rest
        assert not stream.cancelled


async def test_no_probe_after_the_stream_ended_while_its_handler_runs_on() -> None:
    """Ended (its last chunk written), its handler still busy: a chunk now would follow the
    response, where the client expects the next one."""
    released = asyncio.Event()

    async def ends_then_waits(req: Request, out: Responder) -> None:
        out.start(200, SSE)
        out.write(FIRST)
        out.end()
        await released.wait()  # bookkeeping after the answer

    async with serving(ends_then_waits) as (server, port):
        client = await Client.connect(port)
        await client.send(get(b"/s"))
        await client.read_until(lambda: client.stream.raw.endswith(b"0\r\n\r\n"))
        client.writer.transport.write_eof()
        assert await fin_seen(server)
        released.set()
        (resp,) = await client.until_closed()  # and nothing after it: stray bytes would not parse
        assert resp.body == FIRST
