"""A fault-injecting HTTP proxy on 127.0.0.1, in front of one worker (``bench.faults`` and tests).

It forwards every request to its worker (bodies and streamed answers as they
come, the client's ``Host`` kept, so a context worker behind it names the
proxy in ``ctx_info_endpoint`` and the KV fetch comes through it too) until a
fault is set. Faults apply to new requests; ``mode`` is one of:

- ``pass``: forward;
- ``status:<code>``: answer the completion POSTs ``<code>`` with an OpenAI
  error body (``/health`` still forwarded: the worker looks alive);
- ``reset``: forward a completion POST, then cut its answer mid-body (the
  status line and half of the body, then the connection closes);
- ``hold``: forward a completion POST, keep its answer (the worker has done
  the work, parked the KV; its answer never arrives);
- ``stall``: forward a completion POST, relay its head and its first piece,
  then nothing more (a stream that stalls: no bytes, the connection open);
- ``freeze``: accept and read every request, answer none (what a SIGSTOPped
  worker's kernel does; ``/health`` hangs too);
- ``refuse``: stop listening and drop every connection (connections refused);
- ``kv_refuse``: a KV fetch (``GET /kv/...``) is dropped as it arrives;
- ``kv_timeout``: a KV fetch is read and never answered;
- ``kv_truncate``: a KV fetch is forwarded and cut after half of its body;
- ``kv_delay``: a KV fetch is forwarded after ``delay_s`` (a slow transfer).

A worker that cannot be reached (killed) or breaks a connection makes the
proxy reset the client's connection, as the worker itself would have.

Everything runs on the caller's event loop: ``await FaultProxy(url).start()``.
"""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
from aiohttp import web

from server.errors import error_body

#: headers never forwarded (hop-by-hop, or recomputed by aiohttp)
_HOP = frozenset(("connection", "keep-alive", "transfer-encoding", "content-length", "te", "upgrade"))
MODES = (
    "pass",
    "reset",
    "hold",
    "stall",
    "freeze",
    "refuse",
    "kv_refuse",
    "kv_timeout",
    "kv_truncate",
    "kv_delay",
)


class FaultProxy:
    def __init__(self, target: str, mode: str = "pass", delay_s: float = 0.3) -> None:
        self.target = target.rstrip("/")
        self.mode = mode
        self.delay_s = delay_s
        self.port = 0
        #: requests seen by kind ("post", "kv", "other")
        self.seen: dict[str, int] = {"post": 0, "kv": 0, "other": 0}
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._session: aiohttp.ClientSession | None = None
        self._hung: set[asyncio.Future[None]] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self, port: int = 0) -> FaultProxy:
        self._session = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, "127.0.0.1", port or self.port, reuse_address=True)
        await self._site.start()
        self.port = int(self._runner.addresses[0][1])
        return self

    async def set_mode(self, mode: str) -> None:
        """Switch fault; ``refuse`` closes the listener (and every connection), leaving it reopens it."""
        if not (mode in MODES or mode.startswith("status:")):
            raise ValueError(f"unknown fault mode {mode!r}")
        was = self.mode
        self.mode = mode
        if mode == "refuse" and was != "refuse":
            await self._close_listener()
        elif was == "refuse" and mode != "refuse":
            await self._reopen()
        if was in ("freeze", "hold", "stall", "kv_timeout") and mode != was:
            self._release_hung()

    async def _close_listener(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()  # the listener and every open connection
            self._runner = None
        self._release_hung()

    async def _reopen(self) -> None:
        assert self._session is not None
        await self._session.close()
        await self.start(self.port)

    def _release_hung(self) -> None:
        for fut in self._hung:
            if not fut.done():
                fut.set_result(None)
        self._hung.clear()

    async def stop(self) -> None:
        self._release_hung()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()

    async def _hang(self) -> None:
        fut = asyncio.get_running_loop().create_future()
        self._hung.add(fut)
        try:
            await fut
        finally:
            self._hung.discard(fut)

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        mode = self.mode
        kv = request.method == "GET" and request.path.startswith("/kv/")
        post = request.method == "POST"
        self.seen["kv" if kv else "post" if post else "other"] += 1
        if mode == "freeze":
            await self._hang()
            raise web.HTTPServiceUnavailable()  # only when the freeze ends: the worker thawed
        if post and mode.startswith("status:"):
            status = int(mode.split(":", 1)[1])
            headers = {"Retry-After": "1"} if status in (429, 503) else {}
            return web.Response(
                status=status,
                body=error_body(status, "injected fault"),
                content_type="application/json",
                headers=headers,
            )
        if kv and mode == "kv_refuse":
            assert request.transport is not None
            request.transport.abort()
            return web.Response(status=502)  # never reaches anyone: the connection is gone
        if kv and mode == "kv_timeout":
            await self._hang()
            raise web.HTTPServiceUnavailable()
        if kv and mode == "kv_delay":
            await asyncio.sleep(self.delay_s)
        cut = (post and mode == "reset") or (kv and mode == "kv_truncate")
        return await self._relay(request, body, cut)

    async def _relay(self, request: web.Request, body: bytes, cut: bool) -> web.StreamResponse:
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        try:
            return await self._exchange(request, body or None, headers, cut)
        except aiohttp.ClientError:
            # The worker is gone or broke the connection: so does the proxy.
            assert request.transport is not None
            request.transport.abort()
            return web.Response(status=502)

    async def _exchange(
        self, request: web.Request, body: bytes | None, headers: dict[str, str], cut: bool
    ) -> web.StreamResponse:
        assert self._session is not None
        async with self._session.request(
            request.method, self.target + request.path_qs, data=body, headers=headers, allow_redirects=False
        ) as up:
            out = web.StreamResponse(status=up.status)
            for name, value in up.headers.items():
                if name.lower() not in _HOP:
                    out.headers[name] = value
            if request.method == "POST" and self.mode == "hold":
                await up.read()
                await self._hang()
                raise web.HTTPServiceUnavailable()
            if cut:
                data = await up.read()
                out.content_length = len(data)
                await out.prepare(request)
                await out.write(data[: len(data) // 2])
                assert request.transport is not None
                request.transport.abort()
                return out
            await out.prepare(request)
            stall = request.method == "POST" and self.mode == "stall"
            async for chunk in up.content.iter_any():
                await out.write(chunk)
                if stall:  # the head and one piece went out: the rest never does
                    await self._hang()
                    raise web.HTTPServiceUnavailable()
            await out.write_eof()
            return out


async def start_proxies(targets: dict[str, str]) -> dict[str, FaultProxy]:
    """One passing proxy per target URL, by name."""
    proxies = {name: FaultProxy(url) for name, url in targets.items()}
    for proxy in proxies.values():
        await proxy.start()
    return proxies


async def stop_proxies(proxies: dict[str, FaultProxy] | list[FaultProxy]) -> None:
    for proxy in proxies.values() if isinstance(proxies, dict) else proxies:
        with contextlib.suppress(Exception):
            await proxy.stop()


__all__ = ["MODES", "FaultProxy", "start_proxies", "stop_proxies"]
