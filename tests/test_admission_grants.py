"""What a client may claim of the admission queue, and what it is charged (server/orchestrator/admission.py):
``priority`` only as the operator grants it (``admission.client_priority``, a key's ``priority=`` range),
prompt tokens charged as the workers count them, a request that can never fit refused, and queued
requests that leave taken out of their tenant's heap.

In process, on the admission object itself, and on real sockets on 127.0.0.1 (synthetic workers);
each request is sent once the one before it is queued (arrival order known, never raced).
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from helpers import eventually

from server.metrics import Registry
from server.orchestrator.admission import Admission
from server.orchestrator.config import AdmissionConfig
from server.orchestrator.tenants import Tenant

eventually_long = functools.partial(eventually, timeout=20.0)


def admission(**config: Any) -> Admission:
    return Admission(AdmissionConfig(**config), Registry(), retry_after_s=1)


# -- queued requests that leave (issue 36, 8) ---------------------------------------------------------


async def test_queued_requests_that_leave_do_not_pile_up_in_their_tenants_heap() -> None:
    """A tenant that keeps one request waiting while others join and leave: the heap holds the ones
    still waiting and at most as many left ones (compacted when those are over half of it), not one
    entry per request that ever waited."""
    queue = admission(max_inflight=1)
    tenant = Tenant("t")
    await queue.slot(tenant, b"{}").__aenter__()  # the one slot, held
    stayer = asyncio.create_task(queue.slot(tenant, b"{}").__aenter__())
    assert await eventually_long(lambda: queue.queued == 1)
    for _ in range(2000):
        leaver = asyncio.create_task(queue.slot(tenant, b"{}").__aenter__())
        await asyncio.sleep(0)  # queued
        assert queue.queued == 2
        leaver.cancel()
        await asyncio.gather(leaver, return_exceptions=True)
        assert queue.queued == 1
    heap = queue._tenants["t"].heap
    assert len(heap) <= 4, len(heap)
    queue.release()  # the stayer gets the slot
    await stayer
    assert queue.queued == 0 and queue.inflight == 1
    queue.release()
    assert queue.inflight == 0 and not heap
