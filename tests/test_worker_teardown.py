"""A worker's stops raise their own cancel: the KV hand-off's stop, cancelled while it waits for its
expiry task (a caller's bound, ``asyncio.wait_for``), is cancelled, not taken for the cancel of the
task it waits for and swallowed with it (server/tasks.py)."""

from __future__ import annotations

import asyncio
import json
import socket
import struct

from helpers import eventually

from server.worker.app import WorkerApp, WorkerSettings
from server.worker.synthetic import SyntheticEngine

#: a stop that has not ended by then never will (each ends within a few loop passes)
HANG_S = 5.0
#: a model name that makes each streamed event about 2 KB: a client that reads nothing fills fast
LONG_MODEL = "synthetic-" + "x" * 2000


async def test_a_kv_handoff_stop_cancelled_while_it_waits_is_cancelled() -> None:
    kv = WorkerApp(SyntheticEngine(0), WorkerSettings(role="context", model_name="synthetic")).kv
    kv.start()
    task = kv.expiry_task
    await asyncio.sleep(0)  # the expiry loop waits for its next round
    stopping = asyncio.ensure_future(kv.stop())
    await asyncio.sleep(0)  # the stop has cancelled the expiry task and waits for it to end
    stopping.cancel()
    await asyncio.wait([stopping], timeout=HANG_S)
    assert stopping.cancelled()
    assert task is not None and task.cancelled()
    assert kv.session is not None and kv.session.closed  # its session closed all the same


async def test_a_stream_whose_client_leaves_while_it_waits_to_drain_ends() -> None:
    """A client that stopped reading, then left: its handler, waiting for the write buffer to drain,
    is cancelled and the sequence freed, not run to max_tokens for nobody. The connection's loss
    wakes the drain and cancels the handler in one step; ``asyncio.wait_for`` (before 3.12) then
    returned the drain, that ended in the loop pass of the cancel, and dropped the cancel: the
    stream went on (the connection gone, every write a no-op) until the context's end."""
    engine = SyntheticEngine(64, token_latency_s=0.001)
    server, port = await WorkerApp(engine, WorkerSettings(model_name=LONG_MODEL)).start("127.0.0.1", 0)
    sock = socket.socket()
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # never read: the worker's writes pause
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        body = json.dumps({"model": LONG_MODEL, "prompt": "hi", "stream": True, "ignore_eos": True}).encode()
        sock.send(b"POST /v1/completions HTTP/1.1\r\nHost: w\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
        assert await eventually(lambda: any(c.write_paused for c in server.connections))
        (conn,) = server.connections
        task = conn.task
        assert isinstance(task, asyncio.Task)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # a reset: the client is gone
        await asyncio.wait([task], timeout=HANG_S)
        running = not task.done()
        if running:
            task.cancel()  # (so that a failing case does not stream on)
        assert not running, "the handler of a client that left streams on"
        assert task.cancelled()
        assert await eventually(lambda: engine.running == 0, HANG_S)  # its sequence freed
    finally:
        sock.close()
        await server.cleanup()


async def test_a_request_cancelled_at_any_pass_of_its_wake_for_kv_is_cancelled() -> None:
    """A request waiting for KV (admission) whose client leaves in the loop passes where the wake-up
    (a poll of the free KV) lands: the cancel is raised. ``asyncio.wait_for`` returned the wake-up
    and dropped the cancel, and the request was admitted and generated for nobody (its connection
    gone, the only cancel it would get spent)."""
    admission = WorkerApp(SyntheticEngine(0), WorkerSettings(model_name="synthetic")).admission
    reached = 0
    for passes in range(6):
        waiting = asyncio.ensure_future(admission._wait_for_kv(3600.0))
        await asyncio.sleep(0)  # it waits for KV
        assert admission._wake_timer is not None
        admission._wake_timer.cancel()
        admission._wake_waiters()  # the poll's timer, now
        for _ in range(passes):
            await asyncio.sleep(0)
        if waiting.done():  # woken before the cancel: nothing left to test at this pass
            continue
        reached += 1
        waiting.cancel()
        await asyncio.wait([waiting], timeout=HANG_S)
        assert waiting.cancelled(), f"a cancel {passes} passes after the wake-up was lost"
        assert not admission.waiting
    assert reached >= 2  # the sweep met the wake-up's passes
