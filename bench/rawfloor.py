"""The raw floor: a pass-through on asyncio Protocols, uvloop and httptools, no aiohttp objects.

Benchmark code, not a product mode. Per request it forwards the client's body
to a context worker and reads the whole answer (the context leg), then
forwards the same body to a generation worker and streams its answer back
with chunked encoding (the generation leg), over keep-alive upstream
connections kept per worker. It carries nothing from one leg to the other,
so it is the least a Python router can spend per request: the lower bound for
fastcore, below the aiohttp floor (``bench/passthrough.py``).

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
        self.task: asyncio.Task[None] | None
        self.handler, self.transport, self.url, self.body, self.task = handler, None, b"", [], None
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


class Sink:
    """Where one upstream response goes: collected (context leg) or relayed chunked (generation leg)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, client: ServerProtocol | None = None) -> None:
        self.future: asyncio.Future[bytes]
        self.parts: list[bytes]
        self.future, self.client, self.parts, self.status = loop.create_future(), client, [], 0

    def headers(self, status: int, ctype: bytes) -> None:
        self.status = status
        if self.client is not None and self.client.transport is not None:
            self.client.transport.write(
                b"HTTP/1.1 %d X\r\nContent-Type: %s\r\nTransfer-Encoding: chunked\r\n\r\n" % (status, ctype)
            )

    def data(self, chunk: bytes) -> None:
        if self.client is None:
            self.parts.append(chunk)
        elif self.client.transport is not None:
            self.client.transport.writelines([b"%x\r\n" % len(chunk), chunk, b"\r\n"])

    def done(self, exc: BaseException | None = None) -> None:
        if self.future.done():
            return
        if exc is not None:
            self.future.set_exception(exc)
        else:
            if self.client is not None and self.client.transport is not None:
                self.client.transport.write(b"0\r\n\r\n")
            self.future.set_result(b"".join(self.parts))


class Upstream(asyncio.Protocol):
    """A keep-alive connection to one worker, one request at a time, back to its pool when done."""

    def __init__(self, pool: Pool) -> None:
        self.transport: asyncio.Transport | None
        self.sink: Sink | None
        self.pool, self.transport, self.sink, self.ctype = pool, None, None, b"application/json"
        self.parser = httptools.HttpResponseParser(self)

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.transport = None
        if self.sink is not None:
            self.sink.done(exc or ConnectionError("upstream closed"))

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.transport.close()  # type: ignore[union-attr]  # set while data arrives
            if self.sink:
                self.sink.done(exc)

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type":
            self.ctype = value

    def on_headers_complete(self) -> None:
        self.sink.headers(self.parser.get_status_code(), self.ctype)  # type: ignore[union-attr]  # set in flight

    def on_body(self, body: bytes) -> None:
        self.sink.data(body)  # type: ignore[union-attr]  # set while a response is in flight

    def on_message_complete(self) -> None:
        sink, self.sink = self.sink, None
        if self.parser.should_keep_alive():
            self.pool.idle.append(self)
        else:
            self.transport.close()  # type: ignore[union-attr]  # set while data arrives
        sink.done()  # type: ignore[union-attr]  # set while a response is in flight


class Pool:
    def __init__(self, address: str) -> None:
        host, port = address.removeprefix("http://").rsplit(":", 1)
        self.idle: list[Upstream]
        self.host, self.port, self.idle = host, int(port), []
        self.head = b"POST %%s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n" % address.encode()

    async def send(self, path: bytes, body: bytes, sink: Sink) -> bytes:
        conn: Upstream | None = None
        while self.idle and conn is None:
            c = self.idle.pop()
            conn = c if c.transport is not None and not c.transport.is_closing() else None
        if conn is None:
            _, conn = await asyncio.get_running_loop().create_connection(
                lambda: Upstream(self), self.host, self.port
            )
        conn.sink = sink
        conn.transport.writelines(  # type: ignore[union-attr]  # open: checked or just connected
            [self.head % path, b"Content-Length: %d\r\n\r\n" % len(body), body]
        )
        return await sink.future


def make_handler(context: list[str], generation: list[str]) -> Callable:
    ctx, gen = itertools.cycle([Pool(a) for a in context]), itertools.cycle([Pool(a) for a in generation])
    loop = asyncio.get_running_loop()

    async def relay(conn: ServerProtocol, path: bytes, body: bytes, keep_alive: bool) -> None:
        sink = Sink(loop)
        try:
            answer = await next(ctx).send(path, body, sink)
            if sink.status != 200:
                return conn.respond(502, b"application/json", answer, keep_alive)
            sink = Sink(loop, conn)
            await next(gen).send(path, body, sink)
        except (OSError, httptools.HttpParserError) as exc:
            if sink.client is None or not sink.status:  # nothing sent to the client yet
                return conn.respond(502, b"text/plain", str(exc).encode(), keep_alive)
            if conn.transport:
                conn.transport.close()
        if not keep_alive and conn.transport is not None:
            conn.transport.close()

    def handler(conn: ServerProtocol, method: bytes, path: bytes, body: bytes, keep_alive: bool) -> None:
        if method == b"POST" and path in ROUTES:
            conn.task = loop.create_task(relay(conn, path, body, keep_alive))  # referenced while it runs
        elif path == b"/health":
            conn.respond(200, b"text/plain", b"ok", keep_alive)
        else:
            conn.respond(404, b"text/plain", b"not found", keep_alive)

    return handler


async def serve(host: str, port: int, context: list[str], generation: list[str]) -> None:
    handler = make_handler(context, generation)
    server = await asyncio.get_running_loop().create_server(
        lambda: ServerProtocol(handler), host, port, backlog=LISTEN_BACKLOG
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
