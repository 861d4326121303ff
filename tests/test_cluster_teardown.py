"""The cluster code's stops end, and a stop's own cancel is raised, not swallowed.

A watcher whose probe finds etcd gone quiet (SIGSTOPped: a partition, not a dead process, so the
watch does not break and only the probe notices) restarts its watch loop; a stop at any loop pass
of that restart must end with every task it cancelled ended. The probe used to stop the loop with
``task.cancel(); with suppress(CancelledError): await task``, where a cancel of the probe itself is
handed to the loop it awaits and comes back as the loop's CancelledError: the probe swallowed its
own cancel, started a new loop and went on probing, and ``ClusterWatcher.stop`` awaited it forever.
The stops themselves (watcher, registration, embedded registry) waited the same way: cancelled
while they waited (a caller's bound), they went on instead of raising (server/tasks.py).
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import free_port, need_etcd

from server.cluster import ClusterSettings, ClusterWatcher, WorkerRecord, WorkerRegistration
from server.cluster.embedded import EmbeddedRegistry
from server.cluster.local_etcd import LocalEtcd

#: loop passes from the probe's restart of the watch loop to the stop: past the cancelled loop's end
#: (its watches' connections closed: a few passes) and the new loop's start
PASSES = 16
#: a stop that has not ended by then never will (each ends within a few loop passes)
HANG_S = 5.0
#: the probe's period: its two misses in a row (each a 0.5 s status timeout) take about 1.2 s
HEARTBEAT_S = 0.1


@pytest.fixture(scope="module")
def etcd() -> Iterator[LocalEtcd]:
    """This module's own etcd: the probe test stops it (SIGSTOP) for a while."""
    need_etcd()
    server = LocalEtcd(free_port(), free_port()).start()
    yield server
    server.stop()


def settings(etcd: LocalEtcd, name: str) -> ClusterSettings:
    return ClusterSettings(cluster_uri=etcd.uri, cluster_name=name, heartbeat_interval_s=HEARTBEAT_S,
                           inactive_timeout_s=2.0)  # fmt: skip


def record(worker_id: str) -> WorkerRecord:
    return WorkerRecord(worker_id, "context", "tiny", "http://127.0.0.1:9", {"role": "context"})


async def _passes(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def _stop_at(watcher: ClusterWatcher, passes: int) -> str | None:
    """Stop ``watcher`` ``passes`` loop passes after its probe dropped the connection (and, in the
    same step, cancelled the watch loop to restart it); what went wrong, or None."""
    while watcher.connected:  # every pass: the probe's step is the one that clears it
        await asyncio.sleep(0)
    await _passes(passes)
    stopping = asyncio.ensure_future(watcher.stop())
    await asyncio.wait([stopping], timeout=HANG_S)
    tasks = [t for t in (watcher._probe, watcher._task) if t is not None]
    running = [t for t in tasks if not t.done()]
    for task in running:  # (so that a failing case does not leave it probing)
        task.cancel()
    if not stopping.done():
        stopping.cancel()
        return f"stop still waiting {HANG_S} s after a stop {passes} passes into the probe's restart"
    if running:
        return f"a task ignored its cancel {passes} passes into the probe's restart: {running}"
    stopping.result()
    return None


async def test_a_watcher_stopped_at_any_pass_of_its_probes_restart_ends(etcd: LocalEtcd) -> None:
    s = settings(etcd, "probe-restart")
    watchers = [ClusterWatcher(s, lambda records: None) for _ in range(PASSES)]
    for watcher in watchers:
        await watcher.start()
    assert all(w.connected for w in watchers)
    stops = [asyncio.ensure_future(_stop_at(w, passes)) for passes, w in enumerate(watchers)]
    assert etcd.proc is not None
    etcd.proc.send_signal(signal.SIGSTOP)  # etcd answers nothing; its sockets stay open
    try:
        failures = await asyncio.gather(*stops)
    finally:
        etcd.proc.send_signal(signal.SIGCONT)
    assert not [f for f in failures if f is not None]


async def _cancel_while_it_waits(stop: Any) -> asyncio.Future[None]:
    stopping = asyncio.ensure_future(stop())
    await asyncio.sleep(0)  # the stop has cancelled its tasks and waits for them to end
    stopping.cancel()
    await asyncio.wait([stopping], timeout=HANG_S)
    return stopping


async def test_a_watcher_stop_cancelled_while_it_waits_is_cancelled(etcd: LocalEtcd) -> None:
    watcher = ClusterWatcher(settings(etcd, "stop-cancel"), lambda records: None)
    await watcher.start()
    assert watcher.connected
    tasks = [watcher._probe, watcher._task]
    stopping = await _cancel_while_it_waits(watcher.stop)
    assert stopping.cancelled()
    await asyncio.wait(tasks, timeout=HANG_S)
    assert all(t is not None and t.cancelled() for t in tasks)
    assert watcher.session is not None and watcher.session.closed  # its own session closed all the same


async def test_a_registration_stop_cancelled_while_it_waits_is_cancelled(etcd: LocalEtcd) -> None:
    reg = WorkerRegistration(settings(etcd, "reg-cancel"), record("w"))
    assert await reg.start()
    task = reg._task
    stopping = await _cancel_while_it_waits(reg.stop)
    assert stopping.cancelled()
    assert task is not None and task.done()
    assert reg.session is not None and reg.session.closed


async def test_an_embedded_registry_stop_cancelled_while_it_waits_is_cancelled() -> None:
    registry = EmbeddedRegistry(ClusterSettings(cluster_uri="http://127.0.0.1:9", cluster_name="x"))
    await registry.start()
    task = registry._expiry
    stopping = await _cancel_while_it_waits(registry.stop)
    assert stopping.cancelled()
    assert task is not None and task.cancelled()
