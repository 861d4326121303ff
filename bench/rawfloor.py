"""The raw floor: a callback-only pass-through on uvloop and httptools, no task and no object per request.

Benchmark code, not a product mode. Per request it forwards the client's body
to a context worker and reads the whole answer (the context leg), then
forwards the same body to a generation worker and streams its answer back
with chunked encoding (the generation leg), over keep-alive upstream
connections kept per worker. Both legs move on from the protocols' parser
callbacks: the client connection's ``on_message_complete`` writes leg 1 on a
pooled upstream connection, whose ``on_message_complete`` writes leg 2, whose
body callbacks frame chunked pieces for the client, written once per
upstream read. No asyncio task, no
coroutine, no object per request beyond the parsers' bytes (a task opens a
new upstream connection: once per connection, not per request). It carries
nothing from one leg to the other, so it is the least a Python router can
spend per request: the floor of issue 25's "within 2x" target, below the
aiohttp floor (``bench/passthrough.py``). An upstream that fails (refuses,
drops, sends garbage) gets the client a 502 and a close, or, mid-stream, the
close alone. ``ServerProtocol`` is also the PD mocks' server (``bench/pd_mocks.py``).

    python -m bench.rawfloor --port 8100 --context 127.0.0.1:8001 --generation 127.0.0.1:8002
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
from collections.abc import Callable

import httptools

LISTEN_BACKLOG = 4096
ROUTES = (b"/v1/chat/completions", b"/v1/completions")


class ServerProtocol(asyncio.Protocol):
    """One client connection: httptools framing; ``handler(conn, method, path, body, keep_alive)``."""

    def __init__(self, handler: Callable) -> None:
        self.transport: asyncio.Transport | None
        self.body: list[bytes]
        self.handler, self.transport, self.url, self.body = handler, None, b"", []
        self.waiting: list[tuple] = []  # the floor's: pipelined requests behind the one in flight
        self.busy = False
        self.parser = httptools.HttpRequestParser(self)

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.transport = None

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.respond(400, b"text/plain", b"bad request", False)

    def on_message_begin(self) -> None:
        self.url, self.body = b"", []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        p = self.parser
        self.handler(
            self, p.get_method(), self.url.split(b"?", 1)[0], b"".join(self.body), p.should_keep_alive()
        )

    def respond(self, status: int, ctype: bytes, body: bytes, keep_alive: bool = True) -> None:
        if self.transport is None:
            return
        head = b"HTTP/1.1 %d X\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n" % (status, ctype, len(body))
        self.transport.writelines([head, body])
        if not keep_alive:
            self.transport.close()


class Pool:
    """The keep-alive connections to one worker; ``head % (path, length)`` starts a request to it."""

    def __init__(self, address: str) -> None:
        host, port = address.removeprefix("http://").rsplit(":", 1)
        self.idle: list[Upstream] = []
        self.host, self.port = host, int(port)
        host_line = b"Host: %s\r\n" % address.encode().replace(b"%", b"%%")
        self.head = (
            b"POST %s HTTP/1.1\r\n"
            + host_line
            + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
        )


class Upstream(asyncio.Protocol):
    """A keep-alive connection to one worker carrying one leg at a time; its callbacks move the request on."""

    def __init__(self, pool: Pool, floor: Floor) -> None:
        self.transport: asyncio.Transport | None = None
        self.client: ServerProtocol | None = None  # whose leg is in flight (None: idle)
        self.pool, self.floor, self.leg, self.status, self.ctype = pool, floor, 0, 0, b"application/json"
        self.path, self.body, self.keep_alive = b"", b"", True
        self.out: list[bytes] = []  # the generation leg's pieces from one read, written to the client at once
        self.parser = httptools.HttpResponseParser(self)

    def send(self, client: ServerProtocol, leg: int, path: bytes, body: bytes, keep_alive: bool) -> None:
        self.client, self.leg, self.status = client, leg, 0
        self.path, self.body, self.keep_alive = path, body, keep_alive
        self.transport.writelines([self.pool.head % (path, len(body)), body])  # type: ignore[union-attr]  # open

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.transport = None
        if self.client is not None:
            client, self.client = self.client, None
            self.floor.fail(client, self.leg == 2 and self.status != 0)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()  # type: ignore[union-attr]  # set while data arrives; connection_lost fails the leg
        if self.out and self.client is not None:
            self.flush(self.client)

    def flush(self, client: ServerProtocol) -> None:
        if client.transport is not None:
            client.transport.writelines(self.out)
        self.out.clear()

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type":
            self.ctype = value

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        ctype, self.ctype = self.ctype, b"application/json"
        if self.leg == 2:
            self.out.append(
                b"HTTP/1.1 %d X\r\nContent-Type: %s\r\nTransfer-Encoding: chunked\r\n\r\n"
                % (self.status, ctype)
            )

    def on_body(self, body: bytes) -> None:
        if self.leg == 2:
            self.out += (b"%x\r\n" % len(body), body, b"\r\n")

    def on_message_complete(self) -> None:
        client, self.client, path, body, self.body = self.client, None, self.path, self.body, b""
        if self.parser.should_keep_alive():
            self.pool.idle.append(self)
        else:
            self.transport.close()  # type: ignore[union-attr]  # set while data arrives
        if client is None:
            return
        if self.leg == 1 and self.status == 200:
            return self.floor.send(client, 2, path, body, self.keep_alive)
        if self.leg == 1:
            client.respond(502, b"text/plain", b"context leg answered %d" % self.status, self.keep_alive)
        else:
            self.out.append(b"0\r\n\r\n")
            self.flush(client)
        self.floor.finish(client, self.keep_alive)


class Floor:
    """The handler: round-robin over each role's pools, a client's requests one at a time in order."""

    def __init__(self, context: list[str], generation: list[str]) -> None:
        self.loop = asyncio.get_running_loop()
        self.opening: set[asyncio.Future] = set()  # upstream connections being opened (held: tasks)
        self.ctx, self.gen = (
            itertools.cycle([Pool(a) for a in context]),
            itertools.cycle([Pool(a) for a in generation]),
        )

    def __call__(
        self, conn: ServerProtocol, method: bytes, path: bytes, body: bytes, keep_alive: bool
    ) -> None:
        if conn.busy:  # pipelined behind a request in flight
            conn.waiting.append((conn, method, path, body, keep_alive))
        elif method == b"POST" and path in ROUTES:
            conn.busy = True
            self.send(conn, 1, path, body, keep_alive)
        elif path == b"/health":
            conn.respond(200, b"text/plain", b"ok", keep_alive)
        else:
            conn.respond(404, b"text/plain", b"not found", keep_alive)

    def send(self, client: ServerProtocol, leg: int, path: bytes, body: bytes, keep_alive: bool) -> None:
        pool = next(self.ctx if leg == 1 else self.gen)
        while pool.idle:
            up = pool.idle.pop()
            if up.transport is not None:
                return up.send(client, leg, path, body, keep_alive)
        # no idle connection: open one (a task, once per connection), then send on it
        opening = asyncio.ensure_future(
            self.loop.create_connection(lambda: Upstream(pool, self), pool.host, pool.port)
        )
        self.opening.add(opening)

        def opened(f: asyncio.Future) -> None:
            self.opening.discard(f)
            if f.cancelled() or f.exception() is not None:
                return self.fail(client, False)
            f.result()[1].send(client, leg, path, body, keep_alive)

        opening.add_done_callback(opened)

    def fail(self, client: ServerProtocol, streaming: bool) -> None:
        """An upstream failed: a 502 and a close, or, once the generation leg's head went out, the close."""
        if streaming and client.transport is not None:
            client.transport.close()
        else:
            client.respond(502, b"text/plain", b"upstream failed", False)

    def finish(self, client: ServerProtocol, keep_alive: bool) -> None:
        client.busy = False
        if not keep_alive:
            if client.transport is not None:
                client.transport.close()
        elif client.waiting:
            self(*client.waiting.pop(0))


async def serve(host: str, port: int, context: list[str], generation: list[str]) -> None:
    floor = Floor(context, generation)
    server = await asyncio.get_running_loop().create_server(
        lambda: ServerProtocol(floor), host, port, backlog=LISTEN_BACKLOG
    )
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--context", action="append", required=True, help="host:port, repeatable")
    parser.add_argument("--generation", action="append", required=True, help="host:port, repeatable")
    args = parser.parse_args()
    import uvloop

    uvloop.run(serve(args.host, args.port, args.context, args.generation))


if __name__ == "__main__":
    main()
