"""Fault-safe disaggregation (docs/protocol.md#faults): fallback to local prefill, the context leg's
own deadline, per-worker circuit breakers, aborts that free both workers' KV, graceful drain.

Synthetic workers (the worker's whole protocol and KV hand-off, timers instead of a model) and the
orchestrator run on real sockets on 127.0.0.1, in this process so a test can read their engines and
pools; faults come from ``bench.fault_proxy`` in front of a worker. The SIGTERM tests run real
processes. Nothing here asserts a duration: a wait is a poll for a state, bounded only so that a
broken build fails instead of hanging.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from helpers import eventually, free_port

from bench.fault_proxy import FaultProxy
from server.orchestrator.app import Orchestrator, start_server
from server.orchestrator.config import build_config
from server.orchestrator.pools import CircuitBreaker
from server.worker.app import WorkerApp, WorkerSettings
from server.worker.synthetic import SyntheticEngine

# every fault on both request paths: from callbacks (exchange.py) and in a task per request
pytestmark = pytest.mark.usefixtures("request_path")

MESSAGES = [{"role": "user", "content": "say something about kernels and caches " * 20}]
BODY = {"model": "synthetic", "messages": MESSAGES, "max_tokens": 8}


@dataclass
class Stack:
    """Context worker(s) behind fault proxies, a generation worker, a reference ``both`` worker, an
    orchestrator; every engine readable."""

    orch: Orchestrator
    url: str
    proxies: list[FaultProxy]
    context: list[WorkerApp]
    generation: WorkerApp
    reference: WorkerApp
    ref_url: str
    servers: list[Any] = field(default_factory=list)

    def engines(self) -> list[Any]:
        return [a.engine for a in (*self.context, self.generation)]

    def kv_left(self) -> int:
        """Sequences running and KV parked on the context and generation workers."""
        return sum(e.running + e.parked_count for e in self.engines())


async def start_app(role: str, **engine: Any) -> tuple[Any, WorkerApp, str]:
    app = WorkerApp(SyntheticEngine(0, **engine), WorkerSettings(role=role, model_name="synthetic",
                                                                 kv_fetch_timeout_s=1.0))  # fmt: skip
    server, port = await app.start("127.0.0.1", 0)
    return server, app, f"http://127.0.0.1:{port}"


@asynccontextmanager
async def stack(
    contexts: int = 1, proxied: bool = True, context_engine: dict[str, Any] | None = None,
    generation_engine: dict[str, Any] | None = None, frozen_generation: bool = False, **config: Any,
) -> AsyncIterator[Stack]:  # fmt: skip
    """``frozen_generation``: the generation pool lists a frozen proxy of its worker first."""
    servers: list[Any] = []
    proxies: list[FaultProxy] = []
    orch_server = None
    try:
        context = []
        ctx_urls = []
        for _ in range(contexts):
            server, app, url = await start_app("context", **(context_engine or {}))
            servers.append(server)
            context.append(app)
            if proxied:
                proxy = await FaultProxy(url).start()
                proxies.append(proxy)
                url = proxy.url
            ctx_urls.append(url)
        server, generation, gen_url = await start_app("generation", **(generation_engine or {}))
        servers.append(server)
        gen_urls = [gen_url]
        if frozen_generation:
            frozen = await FaultProxy(gen_url).start()
            proxies.append(frozen)
            gen_urls.insert(0, frozen.url)
        server, reference, ref_url = await start_app("both")
        servers.append(server)
        data = {
            "port": 0,
            "health_check_interval_s": 0.1,
            "context_servers": {"urls": ctx_urls},
            "generation_servers": {"urls": gen_urls},
            **config,
        }
        orch_server, orch = await start_server(build_config(data, environ={}))
        port = orch_server.sockets[0].getsockname()[1]
        assert await eventually(lambda: all(w.healthy for p in orch.pools for w in p.workers), timeout=60)
        yield Stack(
            orch, f"http://127.0.0.1:{port}", proxies, context, generation, reference, ref_url, servers
        )
    finally:
        if orch_server is not None:
            await orch_server.cleanup()
        for proxy in proxies:
            await proxy.stop()
        for server in servers:
            await server.cleanup()


async def chat(
    session: aiohttp.ClientSession, url: str, stream: bool = False, **extra: Any
) -> tuple[int, Any]:
    body = {**BODY, "stream": stream, **extra}
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200 or not stream:
            return resp.status, await resp.json(content_type=None)
        text = ""
        usage = None
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                text += choice.get("delta", {}).get("content") or ""
        return resp.status, {"text": text, "usage": usage}


async def same_as_reference(session: aiohttp.ClientSession, s: Stack) -> None:
    """Unary and streamed answers through the orchestrator equal the single worker's."""
    for stream in (False, True):
        extra = {"stream_options": {"include_usage": True}} if stream else {}
        status, got = await chat(session, s.url, stream, **extra)
        assert status == 200, got
        _, want = await chat(session, s.ref_url, stream, **extra)
        for answer in (got, want):  # which prefix each worker had cached is no part of the answer
            (answer.get("usage") or {}).pop("prompt_tokens_details", None)
        if stream:
            assert got == want
        else:
            assert got["choices"][0]["message"] == want["choices"][0]["message"]
            assert got["usage"] == want["usage"]


async def metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    out = {}
    for row in text.splitlines():
        if row and not row.startswith("#"):
            name, value = row.rsplit(" ", 1)
            out[name] = float(value)
    return out


def fallbacks(page: dict[str, float], reason: str) -> float:
    return page[f'fastcore_orchestrator_context_fallbacks_total{{reason="{reason}"}}']


# -- the breaker alone ------------------------------------------------------------------------------------


def test_breaker_opens_after_failures_in_a_row_or_one_timeout() -> None:
    breaker = CircuitBreaker(threshold=3, open_s=5.0)
    assert not breaker.failed() and not breaker.failed()
    breaker.succeeded()  # a success in between: the count starts over
    assert not breaker.failed() and not breaker.failed()
    assert breaker.failed() and breaker.state == CircuitBreaker.OPEN
    assert not breaker.allows(time.monotonic())
    other = CircuitBreaker(threshold=3, open_s=5.0)
    assert other.failed(at_once=True) and other.state == CircuitBreaker.OPEN


def test_breaker_half_open_lets_one_probe_through_and_its_verdict_decides() -> None:
    breaker = CircuitBreaker(threshold=1, open_s=5.0)
    breaker.failed()
    later = breaker.opened_at + 5.0
    assert breaker.allows(later) and breaker.state == CircuitBreaker.HALF_OPEN
    breaker.chosen()
    assert not breaker.allows(later)  # one probe at a time
    breaker.ended()  # no verdict (the client left): the next leg probes
    assert breaker.allows(later)
    breaker.chosen()
    assert breaker.failed()  # a failed probe opens it again, for twice as long
    assert breaker.state == CircuitBreaker.OPEN and breaker.open_for == 10.0
    assert not breaker.allows(breaker.opened_at + 5.0) and breaker.allows(breaker.opened_at + 10.0)
    for _ in range(10):
        breaker.allows(breaker.opened_at + breaker.open_for)
        breaker.chosen()
        breaker.failed()
    assert breaker.open_for == 5.0 * CircuitBreaker.MAX_OPEN_FACTOR
    breaker.allows(breaker.opened_at + breaker.open_for)
    breaker.chosen()
    breaker.succeeded()
    assert breaker.state == CircuitBreaker.CLOSED and breaker.open_for == 5.0 and breaker.allows(0.0)


# -- fallback to local prefill -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fault", "reason"),
    [("status:503", "refused"), ("status:429", "refused"), ("status:500", "failed"), ("reset", "failed"),
     ("refuse", "failed")],
)  # fmt: skip
async def test_a_context_fault_falls_back_to_local_prefill_with_the_same_answers(
    fault: str, reason: str
) -> None:
    async with stack() as s, aiohttp.ClientSession() as session:
        await same_as_reference(session, s)  # disaggregated first
        await s.proxies[0].set_mode(fault)
        status, got = await chat(session, s.url)
        assert status == 200, got
        page = await metrics(session, s.url)
        assert fallbacks(page, reason) == 1
        # Answers, streams and usage as a single worker's, whatever the path.
        await same_as_reference(session, s)
        page = await metrics(session, s.url)
        assert page['fastcore_orchestrator_requests_by_path_total{path="context_fallback"}'] == 3
        assert page['fastcore_orchestrator_requests_by_path_total{path="disaggregated"}'] == 2
        assert s.generation.engine.prefill_computed_tokens > 0
        assert await eventually(lambda: s.kv_left() == 0)


@pytest.mark.parametrize(
    "mode",
    [{"relay": "parsed-msgpack", "gen_tokids_ctxbytes": True, "gen_strip_message_history": True},
     {"relay": "fast", "gen_tokids_ctxbytes": True, "gen_strip_message_history": True}],
)  # fmt: skip
async def test_the_fallback_answers_the_same_whatever_the_relay_mode_and_gates(mode: dict[str, Any]) -> None:
    async with stack(**mode) as s, aiohttp.ClientSession() as session:
        await same_as_reference(session, s)
        await s.proxies[0].set_mode("status:500")
        await same_as_reference(session, s)
        assert fallbacks(await metrics(session, s.url), "failed") == 2


async def test_no_healthy_context_worker_falls_back_and_fail_mode_does_not() -> None:
    async with stack(proxied=True) as s, aiohttp.ClientSession() as session:
        await s.proxies[0].set_mode("refuse")
        assert await eventually(lambda: not s.orch.context_pool.ready)
        await same_as_reference(session, s)
        assert fallbacks(await metrics(session, s.url), "no_worker") == 2
        async with session.get(s.url + "/health") as resp:  # it serves every request: up, degraded
            assert resp.status == 200 and (await resp.json())["status"] == "degraded"
    async with stack(context_fallback="fail") as s, aiohttp.ClientSession() as session:
        await s.proxies[0].set_mode("status:500")
        status, got = await chat(session, s.url)
        assert status == 502 and got["error"]["code"] == "context_leg_failed"
        await s.proxies[0].set_mode("refuse")
        assert await eventually(lambda: not s.orch.context_pool.ready)
        status, got = await chat(session, s.url)
        assert status == 503 and "context" in got["error"]["message"]
        async with session.get(s.url + "/health") as resp:
            assert resp.status == 503
        assert fallbacks(await metrics(session, s.url), "failed") == 0


async def test_health_is_degraded_only_once_the_context_workers_were_checked() -> None:
    """At start a context worker not checked yet is unknown, not down: /health is 503 until its first
    check ends, then 200 "degraded" (requests fall back) if it failed."""
    answer = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await answer.wait()  # the health check hangs until the test lets it fail
        writer.close()

    context = await asyncio.start_server(silent, "127.0.0.1", 0)
    server, _app, gen_url = await start_app("generation")
    data = {
        "port": 0,
        "health_check_interval_s": 0.1,
        "health_check_timeout_s": 60,
        "context_servers": {"urls": [f"127.0.0.1:{context.sockets[0].getsockname()[1]}"]},
        "generation_servers": {"urls": [gen_url]},
    }
    orch_server, orch = await start_server(build_config(data, environ={}))
    url = f"http://127.0.0.1:{orch_server.sockets[0].getsockname()[1]}"
    try:
        generation = orch.generation_pool.workers[0]
        assert await eventually(lambda: generation.healthy and generation.local_prefill)
        async with aiohttp.ClientSession() as session:
            async with session.get(url + "/health") as resp:
                assert resp.status == 503, await resp.text()
            answer.set()
            assert await eventually(lambda: orch.context_pool.workers[0].checked)
            async with session.get(url + "/health") as resp:
                assert resp.status == 200 and (await resp.json())["status"] == "degraded"
    finally:
        answer.set()
        await orch_server.cleanup()
        await server.cleanup()
        context.close()
        await context.wait_closed()


async def test_a_process_joining_a_shared_port_listens_once_its_workers_were_checked() -> None:
    """--workers N: a process that joins the port (reuse_port) takes no connection before its first
    health round has ended: before, its siblings' clients met its 503 no_healthy_worker meanwhile."""
    arrived, answer = asyncio.Event(), asyncio.Event()

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        arrived.set()
        await answer.wait()  # the health check hangs until the test lets it fail
        writer.close()

    worker = await asyncio.start_server(slow, "127.0.0.1", 0)
    port = free_port()
    url = f"127.0.0.1:{worker.sockets[0].getsockname()[1]}"
    data = {"port": port, "health_check_interval_s": 0.1, "health_check_timeout_s": 60,
            "context_servers": {"urls": [url]}, "generation_servers": {"urls": [url]}}  # fmt: skip
    starting = asyncio.get_running_loop().create_task(start_server(build_config(data, environ={}), reuse_port=True))
    try:
        await arrived.wait()
        await asyncio.sleep(0)  # the start task runs on up to its wait
        assert not starting.done()
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", port)  # nothing listens yet
        answer.set()
        orch_server, _orch = await starting
        _reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.close()
        await orch_server.cleanup()
    finally:
        answer.set()
        if not starting.done():
            starting.cancel()
        worker.close()
        await worker.wait_closed()


async def test_a_4xx_the_body_caused_is_the_clients_answer_not_a_fallback() -> None:
    async with stack() as s, aiohttp.ClientSession() as session:
        await s.proxies[0].set_mode("status:400")
        status, got = await chat(session, s.url)
        assert status == 400 and got["error"]["message"] == "injected fault"
        page = await metrics(session, s.url)
        assert (
            sum(fallbacks(page, r) for r in ("refused", "failed", "timeout", "no_worker", "circuit_open"))
            == 0
        )
        assert s.orch.context_pool.workers[0].breaker.state == CircuitBreaker.CLOSED


async def test_a_refusing_context_worker_is_retried_on_another_before_falling_back() -> None:
    async with stack(contexts=2) as s, aiohttp.ClientSession() as session:
        await s.proxies[0].set_mode("status:503")
        for _ in range(2):  # round robin: the refusing worker comes first at least once
            status, _ = await chat(session, s.url)
            assert status == 200
        page = await metrics(session, s.url)
        refusals = s.proxies[0].seen["post"]
        assert refusals >= 1 and page['fastcore_orchestrator_retries_total{leg="context"}'] == refusals
        assert fallbacks(page, "refused") == 0
        await s.proxies[1].set_mode("status:503")
        assert (await chat(session, s.url))[0] == 200
        assert fallbacks(await metrics(session, s.url), "refused") == 1


# -- the context leg's deadline and the breakers -----------------------------------------------------------


async def test_a_frozen_context_worker_costs_one_context_timeout_then_its_breaker_is_open() -> None:
    async with stack(context_timeout_s=0.3, context_timeout_per_1k_tokens_s=0.0,
                     circuit_breaker_open_s=60.0) as s, aiohttp.ClientSession() as session:  # fmt: skip
        proxy = s.proxies[0]
        await proxy.set_mode("freeze")
        # request_timeout_s is 180 s: only the context deadline ends this one
        status, _ = await chat(session, s.url)
        assert status == 200
        worker = s.orch.context_pool.workers[0]
        assert worker.breaker.state == CircuitBreaker.OPEN and worker.healthy
        posts = proxy.seen["post"]
        await same_as_reference(session, s)  # served at once: no leg goes to the frozen worker
        assert proxy.seen["post"] == posts
        page = await metrics(session, s.url)
        assert fallbacks(page, "timeout") == 1 and fallbacks(page, "circuit_open") == 2
        url = worker.url
        assert page[f'fastcore_orchestrator_worker_circuit_state{{pool="context",url="{url}"}}'] == 2
        assert page['fastcore_orchestrator_circuit_opened_total{pool="context"}'] == 1
        await proxy.set_mode("pass")  # thawed: the request it held reaches the worker and is cancelled
        assert await eventually(lambda: s.kv_left() == 0)


def test_the_context_deadline_grows_with_the_prompt_and_stays_below_request_timeout_s() -> None:
    config = build_config({"context_servers": {"urls": ["a:1"]}, "generation_servers": {"urls": ["b:1"]},
                           "context_timeout_s": 2.0, "context_timeout_per_1k_tokens_s": 0.5,
                           "request_timeout_s": 10.0}, environ={})  # fmt: skip
    orch = Orchestrator(config)
    assert orch.context_timeout(0) == 2.0
    assert orch.context_timeout(4 * 4000) == 4.0  # 4,000 estimated tokens: 2 s more
    assert orch.context_timeout(4 * 1_000_000) == 10.0


async def test_breaker_half_open_probe_reopens_on_failure_and_closes_on_success() -> None:
    async with (
        stack(circuit_breaker_failures=2, circuit_breaker_open_s=0.2) as s,
        aiohttp.ClientSession() as session,
    ):
        proxy = s.proxies[0]
        worker = s.orch.context_pool.workers[0]
        await proxy.set_mode("status:500")
        for _ in range(2):
            assert (await chat(session, s.url))[0] == 200
        assert worker.breaker.state == CircuitBreaker.OPEN and proxy.seen["post"] == 2
        assert (await chat(session, s.url))[0] == 200
        assert proxy.seen["post"] == 2  # open: not tried
        # Half-open: the next request is the probe; it fails, the breaker opens again for longer.
        assert await eventually(lambda: worker.breaker.allows(time.monotonic()))
        assert (await chat(session, s.url))[0] == 200
        assert proxy.seen["post"] == 3 and worker.breaker.state == CircuitBreaker.OPEN
        assert worker.breaker.open_for == 0.4
        await proxy.set_mode("pass")
        assert await eventually(lambda: worker.breaker.allows(time.monotonic()))
        await same_as_reference(session, s)
        assert proxy.seen["post"] == 5 and worker.breaker.state == CircuitBreaker.CLOSED
        page = await metrics(session, s.url)
        assert page['fastcore_orchestrator_circuit_opened_total{pool="context"}'] == 2
        assert page['fastcore_orchestrator_requests_by_path_total{path="disaggregated"}'] == 2


async def test_a_frozen_generation_worker_costs_a_stream_its_first_byte_deadline_then_another_worker() -> (
    None
):
    async with (
        stack(proxied=False, frozen_generation=True, generation_first_byte_timeout_s=1.0,
              context_timeout_per_1k_tokens_s=0.0) as s,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session,
    ):  # fmt: skip
        frozen = s.proxies[0]
        frozen_worker = s.orch.generation_pool.workers[0]
        assert frozen_worker.url == frozen.url
        await same_as_reference(session, s)  # both workers once (the first KV fetch imports torch)
        posts = frozen.seen["post"]
        await frozen.set_mode("freeze")
        # request_timeout_s is 180 s: only the first-byte deadline moves this stream on
        status, got = await chat(session, s.url, True, stream_options={"include_usage": True})
        assert status == 200 and got["usage"]["completion_tokens"] == BODY["max_tokens"], got
        assert frozen.seen["post"] == posts + 1 and frozen_worker.breaker.state == CircuitBreaker.OPEN
        page = await metrics(session, s.url)
        assert page['fastcore_orchestrator_retries_total{leg="generation"}'] == 1
        await same_as_reference(session, s)  # the breaker is open: straight to the other worker
        assert frozen.seen["post"] == posts + 1
        await frozen.set_mode("pass")
        assert await eventually(lambda: s.kv_left() == 0)


# -- aborts free both workers' KV ---------------------------------------------------------------------------


async def leave_after(url: str, seconds: float, stream: bool = True) -> None:
    async with aiohttp.ClientSession() as session:
        try:
            async with session.post(url + "/v1/chat/completions", json={**BODY, "max_tokens": 1000, "stream": stream},
                                    timeout=aiohttp.ClientTimeout(total=seconds)) as resp:  # fmt: skip
                await resp.read()
        except asyncio.TimeoutError:
            pass


async def test_a_client_hang_up_frees_both_workers_in_every_phase() -> None:
    # Phase 1: during the context leg (a slow prefill on the context worker).
    async with stack(proxied=False, context_engine={"prefill_latency_s": 5.0}) as s:
        ctx = s.context[0].engine
        await leave_after(s.url, 0.3)
        assert ctx.running == 0 or await eventually(lambda: ctx.running == 0)
        assert await eventually(lambda: s.kv_left() == 0)
    # Phase 2: mid-stream on the generation worker (a slow decode), the context KV fetched already.
    async with stack(proxied=False, generation_engine={"token_latency_s": 0.02}) as s:
        gen = s.generation.engine
        task = asyncio.ensure_future(leave_after(s.url, 5.0))
        assert await eventually(lambda: gen.running == 1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert await eventually(lambda: s.kv_left() == 0)
        assert s.context[0].metrics.handoff.get(event="served") == 1


async def test_a_cancel_after_a_hand_over_before_its_task_ran_frees_the_worker_and_the_exchange(
    request_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The callback path hands a refused attempt to the leg runner in a task; a client that leaves
    before that task's first step cancels a task that never runs a line of its coroutine: the
    exchange itself lets the worker go, resets the attempt, releases what the leg may have parked and
    counts the 499 (before, the worker's in-flight count and the orchestrator's stayed up)."""
    if request_path != "callbacks":
        pytest.skip("the callback path's hand-over")
    from server.orchestrator import app as app_module
    from server.orchestrator.exchange import Exchange

    cancelled: list[asyncio.Task[None]] = []

    class CancelledAtHandOver(Exchange):
        __slots__ = ()

        def _hand_over(self, resp: Any, error: BaseException | None) -> None:
            super()._hand_over(resp, error)
            assert self.task is not None and self.work is not None
            cancelled.append(self.task)
            self.cancel()  # as connection_lost would, in the same loop turn

    monkeypatch.setattr(app_module, "Exchange", CancelledAtHandOver)
    async with stack() as s:
        await s.proxies[0].set_mode("status:503")
        async with aiohttp.ClientSession() as session:
            with pytest.raises(aiohttp.ClientError):
                await chat(session, s.url)
            page = await metrics(session, s.url)
        assert len(cancelled) == 1 and await eventually(lambda: cancelled[0].done())
        assert cancelled[0].cancelled()
        for pool in s.orch.pools:
            for worker in pool.workers:
                assert worker.in_flight == 0 and worker.in_flight_tokens == 0 and not worker.breaker.probing
        assert s.orch.in_flight == 0 and not s.orch._serving
        assert page['fastcore_orchestrator_requests_total{route="chat",status="499"}'] == 1


async def test_a_hang_up_while_the_context_answer_is_in_flight_releases_its_kv_by_request_id() -> None:
    """The context worker answered and parked the KV, the answer has not reached the orchestrator
    when the client leaves: the KV's id was never read, so it is released by disagg_request_id
    (else it stays parked until its TTL)."""
    async with stack() as s:
        await s.proxies[0].set_mode("hold")
        ctx = s.context[0].engine
        task = asyncio.ensure_future(leave_after(s.url, 30.0))
        assert await eventually(lambda: ctx.parked_count == 1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert await eventually(lambda: s.kv_left() == 0)
        assert s.context[0].metrics.handoff.get(event="released") == 1


async def test_an_abandoned_upstream_response_resets_its_connection() -> None:
    """A response given up before its end closes with a reset, not a FIN: the worker's server need
    not probe a half-close before it aborts the sequence."""
    from server.http import UpstreamPool

    seen: asyncio.Future[bytes | str] = asyncio.get_running_loop().create_future()

    async def worker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(2)  # the body, b"{}"
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        writer.write(b"5\r\ndata:\r\n")
        await writer.drain()
        try:
            seen.set_result(await reader.read(100))  # b"": a FIN
        except ConnectionResetError:
            seen.set_result("reset")

    server = await asyncio.start_server(worker, "127.0.0.1", 0)
    pool = UpstreamPool(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
    try:
        resp = await pool.request(b"POST", b"/v1/completions", (b"{}",))
        resp.release()  # the client left mid-stream
        assert await asyncio.wait_for(seen, 10) == "reset"
    finally:
        pool.close()
        server.close()


async def test_a_failed_kv_fetch_leaves_no_kv_parked_on_the_context_worker() -> None:
    async with stack() as s, aiohttp.ClientSession() as session:
        for fault in ("kv_refuse", "kv_timeout", "kv_truncate"):
            await s.proxies[0].set_mode(fault)
            await same_as_reference(session, s)  # recomputed on the generation worker: the same answers
            assert await eventually(lambda: s.kv_left() == 0), fault
        assert s.context[0].metrics.handoff.get(event="released") >= 4  # refused, timed out: released


async def test_a_failed_generation_leg_releases_the_context_kv() -> None:
    async with stack(proxied=False) as s, aiohttp.ClientSession() as session:
        gen_proxy = await FaultProxy(s.orch.generation_pool.workers[0].url, "status:500").start()
        try:
            s.orch.generation_pool.workers[0].url = gen_proxy.url
            status, got = await chat(session, s.url)
            assert status == 502 and got["error"]["code"] == "generation_leg_failed"
            assert await eventually(lambda: s.kv_left() == 0)
            assert s.context[0].metrics.handoff.get(event="released") == 1
        finally:
            await gen_proxy.stop()


# -- drain ---------------------------------------------------------------------------------------------


async def test_orchestrator_drain_finishes_in_flight_then_cancels_and_frees_kv() -> None:
    async with stack(proxied=False, generation_engine={"token_latency_s": 0.01}) as s:
        kept = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
        async with aiohttp.ClientSession() as session, kept:
            async with kept.get(s.url + "/health") as health:  # an idle keep-alive connection from now on
                assert health.status == 200
            body = {**BODY, "max_tokens": 40, "stream": True}
            async with session.post(s.url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                drain = asyncio.ensure_future(s.orch.drain(30.0))
                assert await eventually(lambda: s.orch.draining)
                # The listener is closed; a request on a kept connection is refused, and closes it.
                async with kept.post(s.url + "/v1/chat/completions", json=BODY) as refused:
                    assert (
                        refused.status == 503 and (await refused.json())["error"]["code"] == "shutting_down"
                    )
                text = await resp.text()
            assert text.rstrip().endswith("data: [DONE]")  # the request in flight finished
            assert await drain == 0
    async with stack(proxied=False, generation_engine={"token_latency_s": 0.05}) as s:
        task = asyncio.ensure_future(leave_after(s.url, 30.0))
        assert await eventually(lambda: s.generation.engine.running == 1)
        assert await s.orch.drain(0.1) == 1  # past the deadline: cancelled
        await asyncio.gather(task, return_exceptions=True)
        assert await eventually(lambda: s.kv_left() == 0)


async def test_worker_drain_refuses_new_requests_and_keeps_serving_kv() -> None:
    server, app, url = await start_app("both", token_latency_s=0.01)
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(
                url + "/v1/chat/completions", json={**BODY, "max_tokens": 30, "stream": True}
            ) as r:
                drained = asyncio.ensure_future(app.drain(30.0))
                async with session.get(url + "/health") as health:
                    assert health.status == 503
                async with session.post(url + "/v1/chat/completions", json=BODY) as refused:
                    assert refused.status == 503 and refused.headers["Retry-After"] == "1"
                    assert (await refused.json())["error"]["code"] == "draining"
                assert (await r.text()).rstrip().endswith("data: [DONE]")
            assert await drained is True
    finally:
        await server.cleanup()


# -- SIGTERM on real processes ----------------------------------------------------------------------------


def spawn(argv: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "server.cli", *argv], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip


def worker_process(role: str, *extra: str) -> tuple[subprocess.Popen[str], str]:
    proc = spawn(
        ["worker", "--model", "synthetic", "--prompt-tokens", "0", "--role", role, "--port", "0", *extra]
    )
    assert proc.stderr is not None
    for line in proc.stderr:
        found = re.search(r"listening on (http://\S+)", line)
        if found:
            return proc, found.group(1)
    raise AssertionError(f"worker exited with {proc.wait()}")


def stop(procs: list[subprocess.Popen[str]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


async def wait_status(session: aiohttp.ClientSession, url: str, status: int) -> bool:
    async def ok() -> bool:
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=1)) as resp:
                return resp.status == status
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if await ok():
            return True
        await asyncio.sleep(0.05)
    return False


@pytest.mark.slow
async def test_sigterm_drains_the_orchestrator_and_a_worker() -> None:
    ctx, ctx_url = worker_process("context")
    gen, gen_url = worker_process("generation", "--token-latency-ms", "20")
    procs = [ctx, gen]
    try:
        port = free_port()
        orch = spawn(["orchestrator", "--port", str(port), "--context-urls", ctx_url, "--generation-urls", gen_url,
                      "--health-check-interval-s", "0.1", "--log-level", "WARNING"])  # fmt: skip
        procs.append(orch)
        url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as session:
            assert await wait_status(session, url + "/health", 200)
            body = {**BODY, "max_tokens": 40, "stream": True}
            # The orchestrator: a stream in flight when SIGTERM comes ends whole; the process exits 0.
            async with session.post(url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                await resp.content.readline()
                orch.send_signal(signal.SIGTERM)
                text = await resp.text()
            assert text.rstrip().endswith("data: [DONE]") and text.count("data: ") >= 40
            assert orch.wait(30) == 0
            # A worker: SIGTERM fails its /health and refuses new requests, while its stream ends whole.
            async with session.post(gen_url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                await resp.content.readline()
                gen.send_signal(signal.SIGTERM)
                assert await wait_status(session, gen_url + "/health", 503)
                async with session.post(gen_url + "/v1/chat/completions", json=BODY) as refused:
                    assert refused.status == 503
                text = await resp.text()
            assert text.rstrip().endswith("data: [DONE]")
            assert gen.wait(30) == 0
    finally:
        stop(procs)
