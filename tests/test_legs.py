"""The orchestrator's one leg runner (server/orchestrator/legs.py) and its worker leases.

Stand-in workers on 127.0.0.1 (port 0), each answering one way: 200, a refusal, a 5xx, a
4xx, a reset, silence. Each test runs a leg over a pool of them through the real upstream
connections and checks what the leg ends with, which workers it tried, and that every
worker's in-flight counts are back to zero and no breaker probe is left held, whatever the
path (the counts that were once decremented by hand on five paths).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

import pytest
from helpers import eventually

from server.errors import HTTPError
from server.http import Deadlines, UpstreamPool, UpstreamResponse
from server.metrics import Registry
from server.orchestrator.app import start_server
from server.orchestrator.config import build_config
from server.orchestrator.legs import LegRunner, LegUnavailable, WorkerAnswer
from server.orchestrator.metrics import OrchestratorMetrics
from server.orchestrator.pools import CircuitBreaker, Pool, Worker


def answer(status: bytes, body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s" % (
        status,
        len(body),
        extra,
        body,
    )


OK_BODY = b'{"ok": true}'
ANSWERS = {
    "ok": answer(b"200 OK", OK_BODY),
    "refused": answer(b"503 Service Unavailable", b"", b"Retry-After: 2\r\n"),
    "broken": answer(b"500 Internal Server Error", b"oops"),
    "bad": answer(b"400 Bad Request", b'{"error": "too long"}'),
}


async def _serve(how: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """One stand-in worker's connection: read a request, answer ``how``."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lengths = [int(h[15:]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length:")]
            await reader.readexactly(lengths[0] if lengths else 0)  # a GET has none
            if how == "reset":
                writer.transport.abort()
                return
            if how == "silent":
                await asyncio.sleep(3600)
            writer.write(ANSWERS[how])
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


@asynccontextmanager
async def workers(*hows: str) -> AsyncIterator[list[str]]:
    """Stand-in workers answering ``hows`` (one each): their URLs."""
    servers = []
    tasks: set[asyncio.Task[None]] = set()

    def start(how: str) -> Any:
        async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            tasks.add(task)
            await _serve(how, reader, writer)

        return asyncio.start_server(on_connection, "127.0.0.1", 0)

    try:
        for how in hows:
            servers.append(await start(how))
        yield [f"http://127.0.0.1:{s.sockets[0].getsockname()[1]}" for s in servers]
    finally:
        for server in servers:
            server.close()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class Harness:
    """A pool of ``urls`` (all healthy, in turn) and a runner with what it calls recorded."""

    def __init__(self, urls: list[str], *, retries: int = 3) -> None:
        self.pool = Pool("context", urls, "round_robin", breaker_failures=1)
        for worker in self.pool.workers:
            worker.healthy = True
        self.marked: list[str] = []
        self.released: list[tuple[str, int]] = []
        self.upstreams: dict[str, UpstreamPool] = {}
        self.deadlines = Deadlines()
        observed = SimpleNamespace(in_flight=0, pools=[self.pool], discovery=None, server=None)
        self.registry = Registry()
        self.metrics = OrchestratorMetrics(self.registry, observed)
        self.runner = LegRunner(
            max_retries=retries,
            metrics=self.metrics,
            upstream=self.upstream,
            secret=b"s" * 32,
            mark_failed=lambda pool, worker: self.marked.append(worker.url),
            release_lost_kv=lambda worker, disagg_id: self.released.append((worker.url, disagg_id)),
            unavailable=lambda message: HTTPError(503, message, code="no_healthy_worker"),
        )
        #: in-flight counts (legs, tokens) seen while a 200 was being read
        self.held: list[tuple[int, int]] = []

    def upstream(self, worker: Worker) -> UpstreamPool:
        if worker.url not in self.upstreams:
            self.upstreams[worker.url] = UpstreamPool(worker.url, deadlines=self.deadlines)
        return self.upstreams[worker.url]

    def leg(self, **kw: Any) -> dict[str, Any]:
        """A context leg's arguments (``tried``: the list the runner appends to)."""
        return {"headers": b"", "timeout": 5.0, "tokens": 7, "disagg_id": 42, "tried": [], **kw}

    def run(self, leg: dict[str, Any]) -> Any:
        return self.runner.run("context", self.pool, b"/v1/chat/completions", b"{}", self.answered, **leg)

    async def answered(self, worker: Worker, resp: UpstreamResponse) -> bytes:
        self.held.append((worker.in_flight, worker.in_flight_tokens))
        return await resp.read()

    def url(self, index: int) -> str:
        return self.pool.workers[index].url

    def released_everything(self) -> bool:
        return all(
            w.in_flight == 0 and w.in_flight_tokens == 0 and not w.breaker.probing for w in self.pool.workers
        )

    def close(self) -> None:
        for upstream in self.upstreams.values():
            upstream.close()


async def run(h: Harness, leg: dict[str, Any]) -> tuple[str, Any]:
    try:
        return "answer", await h.run(leg)
    except LegUnavailable as exc:
        return "unavailable", exc
    except WorkerAnswer as exc:
        return "worker_answer", exc


async def test_a_200_is_read_under_the_lease_then_every_count_is_back() -> None:
    async with workers("ok") as urls:
        h = Harness(urls)
        kind, body = await run(h, h.leg())
        assert (kind, body) == ("answer", OK_BODY)
        assert h.held == [(1, 7)]  # the answer was read while the worker still counted the leg
        assert h.released_everything() and h.pool.workers[0].served == 1
        assert not h.released and not h.marked
        h.close()


@pytest.mark.parametrize(
    ("hows", "reason", "tried", "marked", "released"),
    [
        # each refuses: every worker is tried, then the leg gives up as refused
        (("refused", "refused"), "refused", 2, 0, 0),
        # a 5xx ends the leg on the worker that gave it (the body may be the cause)
        (("broken", "ok"), "failed", 1, 0, 0),
        # a reset after the request was sent: the worker is out, its lost answer's KV released,
        # and the leg goes on to the next one
        (("reset", "refused"), "refused", 2, 1, 1),
        # silence: the deadline is spent, no other worker; the lost answer's KV released
        (("silent", "ok"), "timeout", 1, 0, 1),
    ],
)
async def test_each_failure_path_gives_every_count_back(
    hows: tuple[str, ...], reason: str, tried: int, marked: int, released: int
) -> None:
    async with workers(*hows) as urls:
        h = Harness(urls)
        leg = h.leg(timeout=0.3 if "silent" in hows else 5.0)
        kind, exc = await run(h, leg)
        assert kind == "unavailable" and exc.reason == reason
        assert len(leg["tried"]) == tried
        assert len(h.marked) == marked and len(h.released) == released
        assert all(disagg_id == 42 for _, disagg_id in h.released)
        assert h.released_everything()
        retries = {m.name: m for m in h.registry.metrics}["fastcore_orchestrator_retries_total"]
        assert retries.get(leg="context") == tried - 1
        h.close()


async def test_the_clients_4xx_is_its_answer_and_the_lease_is_back() -> None:
    async with workers("bad", "ok") as urls:
        h = Harness(urls)
        leg = h.leg()
        kind, exc = await run(h, leg)
        assert kind == "worker_answer" and exc.status == 400
        assert [w.url for w in leg["tried"]] == [h.url(0)]  # another worker would answer the same
        assert h.released_everything()
        h.close()


async def test_a_stream_without_a_first_byte_goes_to_the_next_worker() -> None:
    async with workers("silent", "ok") as urls:
        h = Harness(urls)
        leg = h.leg(timeout=None, read_timeout=5.0, max_body=0, first_byte=0.3, disagg_id=None)
        kind, body = await run(h, leg)
        assert (kind, body) == ("answer", OK_BODY)
        assert [w.url for w in leg["tried"]] == [h.url(0), h.url(1)]
        assert h.pool.workers[0].breaker.state == CircuitBreaker.OPEN  # a timed-out leg opens it at once
        assert h.released_everything()
        h.close()


async def test_a_cancelled_leg_gives_its_counts_back_and_releases_the_lost_answer() -> None:
    async with workers("silent") as urls:
        h = Harness(urls)
        task = asyncio.ensure_future(h.run(h.leg()))
        while h.pool.workers[0].in_flight == 0:  # the leg holds its worker
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert h.released == [(h.url(0), 42)]
        assert h.released_everything()
        h.close()


async def test_no_worker_left_says_why() -> None:
    async with workers("ok") as urls:
        h = Harness(urls)
        h.pool.workers[0].healthy = False
        kind, exc = await run(h, h.leg())
        assert kind == "unavailable" and exc.reason == "no_worker" and exc.error.status == 503


async def test_a_half_open_workers_probe_ends_with_its_leg() -> None:
    """In half-open, the leg chosen is the probe (no other leg goes there meanwhile); however it
    ends, the next leg may probe."""
    async with workers("bad") as urls:
        h = Harness(urls)
        worker = h.pool.workers[0]
        worker.breaker.state = CircuitBreaker.HALF_OPEN
        kind, exc = await run(h, h.leg())
        assert kind == "worker_answer" and exc.status == 400  # no verdict on the worker
        assert h.released_everything() and worker.breaker.allows(0.0)
        h.close()


async def test_the_orchestrators_upstream_connections_share_one_deadline_sweeper() -> None:
    """One tick serves every worker's connections, the legs' and the cache events' long polls,
    not one timer loop per worker."""
    async with workers("ok", "ok", "ok") as urls:
        router = {"type": "kv_cache_aware"}
        config = build_config(
            {
                "port": 0,
                "context_servers": {"urls": urls[:2], "router": router},
                "generation_servers": {"urls": urls[2:]},
            },
            environ={},
        )
        server, orchestrator = await start_server(config)
        try:
            upstreams = [orchestrator._upstream(w) for p in orchestrator.pools for w in p.workers]
            assert len({id(u) for u in upstreams}) == 3
            assert all(u.deadlines is orchestrator.deadlines for u in upstreams)
            view = orchestrator.cache_view
            assert view is not None and view.deadlines is orchestrator.deadlines

            def followers() -> list[Any]:
                return [f for f, _ in view._followers.values() if f.upstream is not None]

            assert await eventually(lambda: len(followers()) == 2)  # each context worker's long poll
            assert all(f.upstream.deadlines is orchestrator.deadlines for f in followers())
        finally:
            await server.cleanup()
