"""``fastcore-serve orchestrator --workers 2`` as one fleet, live (server/orchestrator/fleet.py): one
``max_inflight`` for both processes, and ``/metrics`` (whichever process answers) the fleet's figures
once. Real processes and sockets on 127.0.0.1; nothing asserts a duration (waits are polls for a
state, bounded so that a broken build fails instead of hanging)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from helpers import eventually, free_port

from server.worker.app import WorkerApp, WorkerSettings
from server.worker.synthetic import SyntheticEngine

#: a stream that runs until its client leaves: a slot held for as long as the test needs
ENDLESS = {
    "model": "synthetic",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 4000,
    "stream": True,
}


async def start_worker(role: str) -> tuple[Any, str]:
    app = WorkerApp(
        SyntheticEngine(0, token_latency_s=0.01), WorkerSettings(role=role, model_name="synthetic")
    )
    server, port = await app.start("127.0.0.1", 0)
    return server, f"http://127.0.0.1:{port}"


def sample(page: str, name: str) -> float:
    """The sum of ``name``'s series on a page (one per tenant, or one)."""
    rows = [row for row in page.splitlines() if row.startswith((name + " ", name + "{"))]
    return sum(float(row.rsplit(" ", 1)[1]) for row in rows)


@pytest.mark.slow
async def test_max_inflight_8_holds_8_across_workers_2(tmp_path: Path) -> None:
    """20 streams on 20 connections (the kernel spreads them over both processes): 8 in the workers,
    12 queued, on the one page; before the fleet each process held 8 (16)."""
    log = tmp_path / "stderr"
    ctx, ctx_url = await start_worker("context")
    gen, gen_url = await start_worker("generation")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "server.cli", "orchestrator", "--port", str(port), "--context-urls", ctx_url,
         "--generation-urls", gen_url, "--health-check-interval-s", "0.1", "--workers", "2",
         "--max-inflight", "8", "--max-queue", "100", "--max-queue-wait-s", "120"],
        stderr=log.open("w"), env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    started: list[int] = []

    async def stream(i: int) -> None:
        while True:  # a 503: that process's health round has not seen the workers up yet (a loaded machine)
            async with aiohttp.ClientSession() as session:
                async with session.post(url + "/v1/chat/completions", json=ENDLESS) as resp:
                    if resp.status == 503:
                        await asyncio.sleep(0.1)
                        continue
                    assert resp.status == 200, await resp.text()
                    started.append(i)
                    async for _ in resp.content:
                        pass
                    return

    async def page() -> str:
        async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as resp:
            return await resp.text() if resp.status == 200 else ""

    tasks: list[asyncio.Task[None]] = []
    try:
        assert await eventually(lambda: log.read_text().count("listening on") == 2, timeout=60)
        tasks = [asyncio.ensure_future(stream(i)) for i in range(20)]
        seen = {"inflight": -1.0, "queued": -1.0}

        async def fleet_figures() -> bool:
            text = await page()
            seen["inflight"] = sample(text, "fastcore_orchestrator_admission_inflight")
            seen["queued"] = sample(text, "fastcore_orchestrator_tenant_queued")
            return seen == {"inflight": 8.0, "queued": 12.0}

        for _ in range(600):  # each look takes a scrape: bounded at about a minute
            if await fleet_figures():
                break
            await asyncio.sleep(0.1)
        failed = [t.exception() for t in tasks if t.done() and not t.cancelled()]
        assert seen == {"inflight": 8.0, "queued": 12.0}, (seen, failed, log.read_text()[-2000:])
        assert await eventually(lambda: len(started) == 8, timeout=60)
        for task in tasks[:10]:  # ten leave: their slots go to waiters, in either process
            task.cancel()
        ok = await eventually(lambda: len([i for i in started if i >= 10]) == 8, timeout=30)
        await fleet_figures()
        assert ok, (started, seen, [t.done() for t in tasks], log.read_text()[-3000:])
        assert await eventually(lambda: sum(t.done() for t in tasks) == 10, timeout=60)
        seen.update(inflight=-1.0, queued=-1.0)
        for _ in range(600):
            if seen == {"inflight": 8.0, "queued": 2.0}:
                break
            await fleet_figures()
            await asyncio.sleep(0.1)
        assert seen == {"inflight": 8.0, "queued": 2.0}, seen
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        proc.terminate()
        proc.wait(timeout=60)
        await ctx.cleanup()
        await gen.cleanup()
    assert proc.returncode == 0, log.read_text()[-2000:]


@pytest.mark.slow
async def test_a_tenant_limit_holds_for_workers_2_as_a_whole(tmp_path: Path) -> None:
    """requests_per_minute 120, 300 requests at once on 300 connections (both processes take some):
    the fleet admits the bucket's 120 plus what it refilled meanwhile (2 a second), not 120 per
    process; the rest are 429 requests_per_minute."""
    config = tmp_path / "orchestrator.yaml"
    config.write_text("admission:\n  rate_limits:\n    '*': {requests_per_minute: 120}\n")
    log = tmp_path / "stderr"
    ctx, ctx_url = await start_worker("context")
    gen, gen_url = await start_worker("generation")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "server.cli", "orchestrator", "-c", str(config), "--port", str(port),
         "--context-urls", ctx_url, "--generation-urls", gen_url, "--health-check-interval-s", "0.1",
         "--workers", "2"],
        stderr=log.open("w"), env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    body = {"model": "synthetic", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    statuses: list[int] = []

    async def one(gate: asyncio.Semaphore) -> None:
        async with gate, aiohttp.ClientSession() as session:
            while True:
                async with session.post(url + "/v1/chat/completions", json=body) as resp:
                    await resp.read()
                    if resp.status != 503:  # before that process's first health round saw the workers
                        statuses.append(resp.status)
                        return
                await asyncio.sleep(0.1)

    try:
        assert await eventually(lambda: log.read_text().count("listening on") == 2, timeout=60)
        gate = asyncio.Semaphore(20)
        start = time.monotonic()
        await asyncio.gather(*(one(gate) for _ in range(300)))
        elapsed = time.monotonic() - start
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        await ctx.cleanup()
        await gen.cleanup()
    admitted = statuses.count(200)
    assert statuses.count(429) == 300 - admitted, sorted(set(statuses))
    assert 120 <= admitted <= 120 + 2 * elapsed + 1, (admitted, elapsed)


@pytest.mark.slow
async def test_a_breaker_opened_in_one_process_keeps_the_other_away(tmp_path: Path) -> None:
    """Two context workers, one answering 500 to every leg; its breaker opens on one failure and
    stays open a minute. Once one process has sent it a leg (its breaker open), 60 more requests on
    60 connections (both processes take some) send it nothing: the other process honours that
    breaker (without the fleet its own round robin would send it every other context leg)."""
    broken_legs = 0

    async def broken(request: web.Request) -> web.Response:
        nonlocal broken_legs
        broken_legs += 1
        return web.json_response({"error": {"message": "broken", "type": "internal_error"}}, status=500)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/{tail:.*}", broken)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    broken_url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    config = tmp_path / "orchestrator.yaml"
    config.write_text(
        "circuit_breaker_failures: 1\ncircuit_breaker_open_s: 60\ncircuit_breaker_panic_threshold: 0\n"
    )
    log = tmp_path / "stderr"
    ctx, ctx_url = await start_worker("context")
    gen, gen_url = await start_worker("generation")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "server.cli", "orchestrator", "-c", str(config), "--port", str(port),
         "--context-urls", f"{ctx_url},{broken_url}", "--generation-urls", gen_url,
         "--health-check-interval-s", "0.1", "--workers", "2", "--context-router", "round_robin"],
        stderr=log.open("w"), env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    body = {"model": "synthetic", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}

    async def request() -> int:
        async with aiohttp.ClientSession() as session:  # a new connection: either process
            async with session.post(url + "/v1/chat/completions", json=body) as resp:
                await resp.read()
                return resp.status

    try:
        assert await eventually(lambda: log.read_text().count("listening on") == 2, timeout=60)
        for _ in range(200):
            if broken_legs:
                break
            await request()
        assert broken_legs == 1, log.read_text()[-2000:]
        await asyncio.sleep(2.0)  # the other process's next exchange (every 10 ms) has honoured it
        statuses = [await request() for _ in range(60)]
        assert broken_legs == 1 and statuses.count(200) == 60, (broken_legs, statuses)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        await ctx.cleanup()
        await gen.cleanup()
        await runner.cleanup()
