"""The floor: a bare aiohttp proxy that forwards bytes to both legs without reading them.

Benchmark code, not a product mode. Per request it sends the client's body to
a context worker, reads the answer as opaque bytes, sends the same client
body to a generation worker and relays its stream byte for byte. It carries no
token ids from one leg to the other, so it is the least a Python orchestrator
built on aiohttp can spend per request: fastcore's fast path is measured
against it.

    python -m bench.passthrough --port 8100 --context 127.0.0.1:8001 --generation 127.0.0.1:8002
"""

from __future__ import annotations

import argparse
import asyncio
import itertools

import aiohttp
from aiohttp import web

from server.orchestrator.app import LISTEN_BACKLOG, READ_BUFSIZE

_HOP_HEADERS = {"Content-Type": "application/json"}


def make_app(context_urls: list[str], generation_urls: list[str]) -> web.Application:
    ctx_cycle = itertools.cycle([u if "://" in u else f"http://{u}" for u in context_urls])
    gen_cycle = itertools.cycle([u if "://" in u else f"http://{u}" for u in generation_urls])
    app = web.Application(client_max_size=256 * 1024 * 1024)

    async def on_startup(app: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None)
        app["session"] = aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=600), read_bufsize=READ_BUFSIZE
        )

    async def on_cleanup(app: web.Application) -> None:
        await app["session"].close()

    async def relay(request: web.Request) -> web.StreamResponse:
        session: aiohttp.ClientSession = request.app["session"]
        body = await request.read()
        async with session.post(next(ctx_cycle) + request.path, data=body, headers=_HOP_HEADERS) as ctx:
            await ctx.read()
        async with session.post(next(gen_cycle) + request.path, data=body, headers=_HOP_HEADERS) as gen:
            response = web.StreamResponse(status=gen.status)
            response.content_type = gen.content_type
            await response.prepare(request)
            async for chunk in gen.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app.router.add_post("/v1/chat/completions", relay)
    app.router.add_post("/v1/completions", relay)
    app.router.add_get("/health", health)
    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--context", action="append", required=True, help="host:port, repeatable")
    parser.add_argument("--generation", action="append", required=True, help="host:port, repeatable")
    args = parser.parse_args()
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    # The orchestrator's socket settings (server/orchestrator/app.py), so the floor is like for like.
    web.run_app(
        make_app(args.context, args.generation),
        host=args.host,
        port=args.port,
        print=None,
        backlog=LISTEN_BACKLOG,
        access_log=None,
        read_bufsize=READ_BUFSIZE,  # run_app hands extra kwargs to each RequestHandler
    )


if __name__ == "__main__":
    main()
