"""The orchestrator's teardown ends: every background task it cancels ends, and its stops end.

A cache-events follower (server/orchestrator/cache_view.py) is stopped at every loop pass of its
poll, from before its first request, through its connect, to its long poll held by the worker and
its retry sleep, against stand-in workers on 127.0.0.1 (port 0) that answer a resync, answer
something that is not one (a retry), hold the poll, or reset it. Each stop must end with every task
it cancelled ended (CI once hung in ``server.cleanup()`` on a follower whose cancel was lost: a
connect ending in the same loop pass as the cancel made ``asyncio.wait_for`` return the connection
and drop the cancel, and the follower went on polling once a second).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

import aiohttp
import pytest
from helpers import StandInServer, eventually

from server.http import UpstreamError, UpstreamPool
from server.orchestrator.cache_view import CacheView
from server.orchestrator.pools import HealthChecker, Pool
from server.tasks import stop_tasks

#: loop passes from a view's start to the stop: past the follower's connect (about ten passes on
#: asyncio's loop) and its first request, into the poll it waits on (the stand-in's answer or silence)
PASSES = 40
#: a stop that has not ended by then never will (each ends within a few loop passes)
HANG_S = 5.0

RESYNC = b'{"instance": "i", "seq": 0, "resync": true, "held": []}'


def _answer(body: bytes) -> bytes:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    return head % len(body) + body


class Worker(StandInServer):
    """A worker's ``GET /cache_events``: answered ``how`` (resync, not_events, silent, reset)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.accepted = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        while True:
            await reader.readuntil(b"\r\n\r\n")
            if self.how == "reset":
                writer.transport.abort()
                return
            if self.how == "silent":  # a long poll with nothing to tell
                await asyncio.sleep(3600)
            writer.write(_answer(RESYNC if self.how == "resync" else b'{"ok": true}'))
            await writer.drain()


async def _passes(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


@pytest.mark.parametrize("how", ["resync", "not_events", "silent", "reset"])
async def test_a_follower_stopped_at_any_pass_of_its_poll_ends(how: str) -> None:
    async with Worker(how) as worker:
        for passes in range(PASSES):
            pool = Pool("context", [worker.url], "kv_cache_aware")
            pool.workers[0].healthy = True  # (the health checker's verdict: not under test here)
            view = CacheView([pool], None)
            view.start()
            await _passes(passes)
            tasks = [t for _, t in view._followers.values()]
            stopping = asyncio.ensure_future(view.stop())
            await asyncio.wait([stopping], timeout=HANG_S)
            running = [t for t in tasks if not t.done()]
            for task in running:  # (so that a failing case does not leave them polling)
                task.cancel()
            assert stopping.done(), f"stop still waiting {HANG_S} s after a stop {passes} passes in"
            assert not running, f"a follower ignored its cancel {passes} passes in"
            stopping.result()
            assert all(t.cancelled() for t in tasks)
        assert worker.accepted > 0  # the sweep reached the worker


async def test_a_request_cancelled_at_any_pass_of_its_connect_is_cancelled() -> None:
    """:meth:`UpstreamPool.request` cancelled while it connects raises the cancel whenever it comes,
    and a connection that opened meanwhile is closed, not left open."""
    async with Worker("resync") as worker:
        for passes in range(PASSES):
            pool = UpstreamPool(worker.url)
            task = asyncio.ensure_future(pool.request(b"GET", b"/cache_events", max_body=1 << 20))
            await _passes(passes)
            if task.done():  # answered before the cancel: nothing left to test at this pass
                task.result().release()
                pool.close()
                continue
            task.cancel()
            await asyncio.wait([task], timeout=HANG_S)
            assert task.cancelled(), f"a cancel {passes} passes in was lost: {task}"
            assert not pool.open and not pool.idle
            assert await eventually(lambda: not worker.tasks), f"a connection left open {passes} passes in"
        assert worker.accepted > 0  # the sweep reached the worker


async def test_a_connect_past_its_timeout_is_an_unsent_error() -> None:
    """The connect's bound (the same wait as the cancel above): past it, an UpstreamError whose
    request was never sent, and nothing left open."""
    with socket.socket() as listener, socket.socket() as filler:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)  # never accepts
        port = listener.getsockname()[1]
        filler.connect(("127.0.0.1", port))  # fills its accept queue: the next SYN is dropped
        pool = UpstreamPool(f"http://127.0.0.1:{port}", connect_timeout_s=0.2)
        with pytest.raises(UpstreamError, match=r"connect timed out after 0\.2 s") as raised:
            await pool.request(b"GET", b"/")
        assert not raised.value.sent and not pool.open


async def test_a_stop_cancelled_while_it_waits_is_cancelled() -> None:
    """A stop's caller may bound it (``asyncio.wait_for``): the stop's own cancel is raised, not
    taken for the cancel of a task it waits for."""
    async with Worker("silent") as worker:
        pool = Pool("context", [worker.url], "kv_cache_aware")
        pool.workers[0].healthy = True
        view = CacheView([pool], None)
        view.start()
        await _passes(PASSES)  # the follower waits on its long poll
        tasks = [t for _, t in view._followers.values()]
        assert tasks
        stopping = asyncio.ensure_future(view.stop())
        await asyncio.sleep(0)  # the stop has cancelled its tasks and waits for them to end
        stopping.cancel()
        await asyncio.wait([stopping], timeout=HANG_S)
        assert stopping.cancelled()
        await asyncio.wait(tasks, timeout=HANG_S)
        assert all(t.cancelled() for t in tasks)
        assert not view._followers  # its connections closed all the same


async def test_a_task_that_ignores_its_cancel_is_left_named_not_waited_for(caplog: Any) -> None:
    """The stops' one wait (``stop_tasks``): bounded, and what outlived it named in the log."""
    ignoring = True

    async def stubborn() -> None:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if not ignoring:
                    raise  # (the bug this bound survives, until the test ends)

    loop = asyncio.get_running_loop()
    task = loop.create_task(stubborn(), name="stubborn")
    quick = loop.create_task(asyncio.sleep(3600))
    await asyncio.sleep(0)
    try:
        with caplog.at_level(logging.ERROR, logger="fastcore.tasks"):
            await asyncio.wait_for(stop_tasks([task, None, quick], within=0.1), HANG_S)
        assert quick.cancelled() and not task.done()
        assert "stubborn" in caplog.text and "ignored its cancel" in caplog.text
    finally:
        ignoring = False
        task.cancel()
        await asyncio.wait([task], timeout=HANG_S)


async def test_a_health_checker_stop_cancelled_while_it_waits_is_cancelled() -> None:
    async with Worker("silent") as worker:  # its /health check waits on
        pool = Pool("context", [worker.url], "round_robin")
        async with aiohttp.ClientSession() as session:
            health = HealthChecker([pool], session, interval=3600.0, timeout=3600.0)
            health.start()
            assert await eventually(lambda: worker.accepted)
            task = health._task
            assert task is not None
            stopping = asyncio.ensure_future(health.stop())
            await asyncio.sleep(0)  # the stop has cancelled the checker and waits for it to end
            stopping.cancel()
            await asyncio.wait([stopping], timeout=HANG_S)
            assert stopping.cancelled()
            await asyncio.wait([task], timeout=HANG_S)
            assert task.cancelled()
