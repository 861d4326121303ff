"""Admission by KV room: a request takes its KV before it runs, or waits for room (bounded in time
and in waiters) before its 503; parked KV gives way first."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from typing import TYPE_CHECKING

from fastcore import protocol as wire
from server.errors import HTTPError

from .engine_api import Engine, EngineRequest, KVCacheFull

if TYPE_CHECKING:
    from .metrics import WorkerMetrics
    from .settings import WorkerSettings

#: parked entries younger than this are evicted only by a request about to be refused
PARKED_GRACE_S = 1.0
#: how often requests waiting for KV room look again (frees happen on the engine thread too)
ADMISSION_POLL_S = 0.01


class Admission:
    """One worker's admission: the requests waiting for KV room, woken in arrival order."""

    def __init__(self, engine: Engine, settings: WorkerSettings, metrics: WorkerMetrics) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        #: requests waiting for KV room, woken in arrival order (:meth:`reserve`)
        self.waiting: collections.deque[asyncio.Future[None]] = collections.deque()
        self._wake_timer: asyncio.TimerHandle | None = None

    async def reserve(self, engine_req: EngineRequest) -> None:
        """Take the request's KV. When it does not fit: parked entries, oldest first, give way;
        then the request waits for room (bounded in time and in waiters) before its 503.

        Requests whose clients left hold their KV until the engine drops them
        (before its next step), and a burst of admissions holds it until its
        prefills run: a short wait turns those moments into latency instead of
        errors. A waiting request holds no KV; its client leaving ends the
        wait (the task is cancelled). Arrivals queue behind those already
        waiting.
        """
        engine = self.engine
        settings = self.settings
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        why = "requests are already waiting for KV"
        while True:
            if deadline is not None or not self.waiting:
                try:
                    engine.reserve(engine_req)
                    return
                except KVCacheFull as exc:
                    if not exc.ever_fits:
                        raise HTTPError(
                            400, f"the request is too large for this worker: {exc}", param=wire.MAX_TOKENS
                        ) from None
                    # A parked entry is the cheapest KV to lose: its generation leg
                    # recomputes the prefill. One parked just now is likely about to
                    # be fetched: while the request may still wait, only older ones go.
                    waiting_left = settings.admission_wait_s > 0 and (
                        deadline is None or loop.time() < deadline
                    )
                    before = time.monotonic() - PARKED_GRACE_S if waiting_left else None
                    evicted = engine.evict_parked(1, before) if engine.parked_tokens > 0 else 0
                    if evicted:
                        self.metrics.handoff.inc(evicted, event="evicted")
                        continue
                    why = str(exc)
            now = loop.time()
            if deadline is None:
                full = len(self.waiting) >= settings.max_waiting
                deadline = now if full else now + settings.admission_wait_s
                if not full:
                    self.metrics.waited.inc()
            if now >= deadline:
                self.metrics.rejected.inc(reason="kv_full")
                raise HTTPError(
                    503,
                    f"the worker is full: {why}",
                    code="worker_full",
                    headers={"Retry-After": str(settings.retry_after_s)},
                )
            await self._wait_for_kv(deadline - now)

    async def _wait_for_kv(self, timeout: float) -> None:
        """Until KV may have been freed (looked at every ADMISSION_POLL_S), or ``timeout``."""
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self.waiting.append(waiter)
        if self._wake_timer is None:
            self._wake_timer = loop.call_later(ADMISSION_POLL_S, self._wake_waiters)
        try:
            # asyncio.wait, not wait_for: before 3.12 wait_for returns a waiter woken in the loop pass
            # of a cancel (the client left) and drops the cancel: the request ran for nobody
            await asyncio.wait([waiter], timeout=timeout)
        finally:
            with contextlib.suppress(ValueError):
                self.waiting.remove(waiter)

    def _wake_waiters(self) -> None:
        # Frees happen on the engine thread too (finished sequences): a short
        # poll while anyone waits is simpler than a cross-thread signal per free.
        self._wake_timer = None
        # Each woken request leaves the queue itself when it runs, so one
        # arriving meanwhile still queues behind it.
        for waiter in self.waiting:
            if not waiter.done():
                waiter.set_result(None)
