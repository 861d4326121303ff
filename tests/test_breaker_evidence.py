"""What opens a worker's circuit breaker, and what a pool does when every breaker is open.

A breaker opens only on evidence about its worker (server/orchestrator/legs.py says the rule): a
unary request that outlasts ``request_timeout_s`` because of its own length (its ``max_tokens`` at
the worker's decode rate, while the worker answers other legs) is the client's deadline, not the
worker's; a worker whose answer never comes, or whose stream stalls, is the worker's. A pool whose
breakers are (nearly) all open routes to its workers anyway (panic, envoy's panic threshold) rather
than answering every client 503.

Synthetic workers and the orchestrator run on 127.0.0.1 in this process (``bench.fault_proxy`` in
front of the generation worker); both request paths; nothing asserts a duration (a wait is a poll
for a state, bounded so that a broken build fails instead of hanging).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from helpers import eventually

from bench.fault_proxy import FaultProxy
from server.orchestrator import pools
from server.orchestrator.app import Orchestrator, start_server
from server.orchestrator.config import build_config
from server.orchestrator.pools import Pool
from server.worker.app import WorkerApp, WorkerSettings
from server.worker.synthetic import SyntheticEngine

pytestmark = pytest.mark.usefixtures("request_path")

MESSAGES = [{"role": "user", "content": "say something about kernels and caches " * 20}]
#: a generation worker's time per token: an honest request (HONEST_TOKENS) takes 40 ms, an abusive
#: one (ABUSIVE_TOKENS) 30 s, far past the request_timeout_s of these tests
TOKEN_LATENCY_S = 0.01
HONEST_TOKENS = 4
ABUSIVE_TOKENS = 3000


@dataclass
class Stack:
    orch: Orchestrator
    url: str
    proxy: FaultProxy
    generation: WorkerApp

    @property
    def worker(self) -> Any:
        """The generation pool's one worker (the proxy in front of the generation worker)."""
        return self.orch.generation_pool.workers[0]

    def opened(self) -> int:
        return int(self.worker.breaker.opened)


async def start_app(role: str, **engine: Any) -> tuple[Any, WorkerApp, str]:
    app = WorkerApp(SyntheticEngine(0, **engine), WorkerSettings(role=role, model_name="synthetic",
                                                                 kv_fetch_timeout_s=1.0))  # fmt: skip
    server, port = await app.start("127.0.0.1", 0)
    return server, app, f"http://127.0.0.1:{port}"


@asynccontextmanager
async def stack(**config: Any) -> AsyncIterator[Stack]:
    """A context worker, a generation worker behind a fault proxy, an orchestrator (``config``)."""
    import torch  # noqa: F401  (the KV hand-off's first use imports it: not inside a leg's deadline)

    servers: list[Any] = []
    proxy: FaultProxy | None = None
    orch_server = None
    try:
        server, _context, ctx_url = await start_app("context")
        servers.append(server)
        server, generation, gen_url = await start_app("generation", token_latency_s=TOKEN_LATENCY_S)
        servers.append(server)
        proxy = await FaultProxy(gen_url).start()
        data = {
            "port": 0,
            "health_check_interval_s": 0.1,
            "context_servers": {"urls": [ctx_url]},
            "generation_servers": {"urls": [proxy.url]},
            "context_timeout_per_1k_tokens_s": 0.0,
            "circuit_breaker_open_s": 60.0,  # open for the whole test: only a success closes it
            **config,
        }
        orch_server, orch = await start_server(build_config(data, environ={}))
        port = orch_server.sockets[0].getsockname()[1]
        assert await eventually(lambda: all(w.healthy for p in orch.pools for w in p.workers), timeout=60)
        yield Stack(orch, f"http://127.0.0.1:{port}", proxy, generation)
    finally:
        if orch_server is not None:
            await orch_server.cleanup()
        if proxy is not None:
            await proxy.stop()
        for server in servers:
            await server.cleanup()


async def chat(
    session: aiohttp.ClientSession, url: str, max_tokens: int, stream: bool = False
) -> tuple[int, Any]:
    body = {"model": "synthetic", "messages": MESSAGES, "max_tokens": max_tokens, "stream": stream}
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        if stream and resp.status == 200:
            return resp.status, await resp.text()
        return resp.status, await resp.json(content_type=None)


async def test_a_client_whose_max_tokens_outlasts_the_deadline_does_not_open_the_breaker() -> None:
    """More abusive requests than circuit_breaker_failures, each outlasting request_timeout_s by its
    own max_tokens while the worker answers honest requests: each gets its 504, the breaker stays
    closed, honest requests keep succeeding (before: the first 504 opened the breaker, and every
    client after it got 503 no_healthy_worker)."""
    async with (
        stack(request_timeout_s=4.0, circuit_breaker_failures=2, circuit_breaker_panic_threshold=0.0) as s,
        aiohttp.ClientSession() as session,
    ):
        assert (await chat(session, s.url, HONEST_TOKENS))[0] == 200  # warm: the first KV fetch
        for _round in range(2):
            abusive = [asyncio.ensure_future(chat(session, s.url, ABUSIVE_TOKENS)) for _ in range(3)]
            # each abusive leg reached the generation worker and decodes there
            assert await eventually(lambda: s.generation.engine.running == 3, timeout=30)
            status, got = await chat(session, s.url, HONEST_TOKENS)  # the worker answers meanwhile
            assert status == 200, got
            for status, got in await asyncio.gather(*abusive):
                assert status == 504 and got["error"]["code"] == "generation_leg_timeout", got
            assert s.worker.breaker.state == pools.CircuitBreaker.CLOSED and s.opened() == 0
            status, got = await chat(session, s.url, HONEST_TOKENS)
            assert status == 200, got
            # the timed-out legs were reset: the worker dropped them (the next round counts its own)
            assert await eventually(lambda: s.generation.engine.running == 0)


async def test_a_worker_whose_answer_never_comes_opens_its_breaker_and_panic_still_serves() -> None:
    """A unary leg that times out with its worker answering nothing meanwhile is the worker's (its
    /health passes: only legs are evidence); its breaker opens at once. Every breaker of the pool is
    then open: the next request goes to it anyway (panic) and its success closes the breaker (before:
    503 no_healthy_worker for every client until a probe)."""
    async with stack(request_timeout_s=1.0) as s, aiohttp.ClientSession() as session:
        assert (await chat(session, s.url, HONEST_TOKENS))[0] == 200
        await s.proxy.set_mode("hold")  # the worker decodes, its answer never arrives
        status, got = await chat(session, s.url, HONEST_TOKENS)
        assert status == 504 and got["error"]["code"] == "generation_leg_timeout", got
        assert s.worker.breaker.state == pools.CircuitBreaker.OPEN and s.opened() == 1
        assert s.worker.healthy
        await s.proxy.set_mode("pass")
        posts = s.proxy.seen["post"]
        status, got = await chat(session, s.url, HONEST_TOKENS)
        assert status == 200, got
        assert s.proxy.seen["post"] == posts + 1  # the open worker took it: panic
        assert s.worker.breaker.state == pools.CircuitBreaker.CLOSED


async def test_a_panic_threshold_of_zero_refuses_when_every_breaker_is_open() -> None:
    async with (
        stack(request_timeout_s=1.0, circuit_breaker_panic_threshold=0.0) as s,
        aiohttp.ClientSession() as session,
    ):
        assert (await chat(session, s.url, HONEST_TOKENS))[0] == 200
        await s.proxy.set_mode("hold")
        assert (await chat(session, s.url, HONEST_TOKENS))[0] == 504
        assert s.worker.breaker.state == pools.CircuitBreaker.OPEN
        await s.proxy.set_mode("pass")
        status, got = await chat(session, s.url, HONEST_TOKENS)
        assert status == 503 and got["error"]["code"] == "no_healthy_worker", got


async def test_a_stalled_stream_opens_its_workers_breaker() -> None:
    """A stream whose head and first piece came, then no byte for the stall interval
    (request_timeout_s): the worker's; the client's stream ends with an in-band error."""
    async with (
        stack(request_timeout_s=1.0, circuit_breaker_failures=1) as s,
        aiohttp.ClientSession() as session,
    ):
        assert (await chat(session, s.url, HONEST_TOKENS, stream=True))[0] == 200
        await s.proxy.set_mode("stall")
        status, text = await chat(session, s.url, HONEST_TOKENS, stream=True)
        assert status == 200 and "generation_leg_failed" in text, text
        assert s.worker.breaker.state == pools.CircuitBreaker.OPEN and s.opened() == 1
        await s.proxy.set_mode("pass")
        assert await eventually(lambda: s.worker.healthy)  # out until /health passed again
        status, text = await chat(session, s.url, HONEST_TOKENS, stream=True)
        assert status == 200 and "error" not in text, text  # panic: the open worker serves, and closes
        assert s.worker.breaker.state == pools.CircuitBreaker.CLOSED


# -- the pool's choice, each breaker twin ---------------------------------------------------------------


@pytest.fixture
def breaker_class(tally_twin: Callable[[str], Any]) -> Any:
    """Both twins of CircuitBreaker (conftest's ``tally_twin``)."""
    return tally_twin("CircuitBreaker")


def pool_of(n: int, breaker_class: Any, threshold: float) -> Pool:
    pool = Pool("generation", [f"http://w{i}:1" for i in range(n)], "round_robin", panic_threshold=threshold)
    for worker in pool.workers:
        worker.breaker = breaker_class(1, 60.0)
        worker.healthy = True
    return pool


def chosen(pool: Pool, *, panic: bool = True, exclude: Any = ()) -> set[str]:
    return {w.url for _ in range(12) if (w := pool.choose(exclude=exclude, panic=panic)) is not None}


def test_panic_routes_to_every_up_worker_once_too_few_breakers_let_legs_through(breaker_class: Any) -> None:
    pool = pool_of(3, breaker_class, 0.5)
    w0, w1, w2 = pool.workers
    assert w0.breaker.failed()
    assert chosen(pool) == {w1.url, w2.url}  # 2 of 3 pass: no panic, the open one gets none
    assert w1.breaker.failed()
    assert chosen(pool) == {w0.url, w1.url, w2.url}  # 1 of 3 (< 50%): panic, breakers ignored
    assert chosen(pool, panic=False) == {w2.url}  # a leg with another way out (a fallback)
    assert chosen(pool, exclude=[w2]) == {w0.url, w1.url}  # a retry: the others
    w2.healthy = False  # down by /health: never chosen, panic or not
    assert chosen(pool) == {w0.url, w1.url}
    # a leg that panic sent to an open worker and that succeeded closes its breaker
    w0.breaker.chosen()
    w0.breaker.succeeded()
    assert w0.breaker.state == breaker_class.CLOSED
    assert chosen(pool) == {w0.url}  # 1 of 2 pass: no panic
    assert chosen(pool_of(2, breaker_class, 0.0)) == {"http://w0:1", "http://w1:1"}
    off = pool_of(2, breaker_class, 0.0)
    for worker in off.workers:
        worker.breaker.failed()
    assert chosen(off) == set()  # a threshold of 0: no panic, as before
