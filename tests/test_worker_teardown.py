"""A worker's stops raise their own cancel: the KV hand-off's stop, cancelled while it waits for its
expiry task (a caller's bound, ``asyncio.wait_for``), is cancelled, not taken for the cancel of the
task it waits for and swallowed with it (server/tasks.py)."""

from __future__ import annotations

import asyncio

from server.worker.app import WorkerApp, WorkerSettings
from server.worker.synthetic import SyntheticEngine

#: a stop that has not ended by then never will (each ends within a few loop passes)
HANG_S = 5.0


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
