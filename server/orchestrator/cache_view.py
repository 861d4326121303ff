"""An exact view of each worker's prefix cache: its own events, in the orchestrator's key space.

A fastcore worker publishes what its prefix cache holds as keys of the orchestrator's
kv_cache_aware index (server/cache_keys.py: chunk hashes of the raw prompt bytes, salted) on
``GET /cache_events`` (server/worker/kv_events.py): ``stored`` and ``removed`` keys numbered by a
sequence, held open up to ``wait`` seconds until there is one (a long poll). Every orchestrator
follows every worker of its kv_cache_aware pools, so each one's index holds what the worker
caches, whoever routed the request there (with several orchestrators, each saw only its own
requests before), and evictions are the worker's own, not a guess at its size.

A follower asks for the events after the last ``seq`` it applied, naming the worker's
``instance``. The worker answers a resync (every key it holds) when those events are gone (more
than its buffer happened since), when the instance is not its own (it restarted), or when the
follower names none: the router's index of the worker is then replaced by the snapshot. A gap in
the sequence, a malformed answer, or an index the router dropped meanwhile (the worker turned
unhealthy) asks for a resync too. A follower asks for the tiers (``tiers=1``): ``stored`` events
may say a ``tier`` (none: the device), ``moved`` events say the tier keys moved to, and a resync
lists tier 2's keys apart (``held_tier2``) with the worker's load and prefill rates, from which
the router weighs a tier-2 hit. An answer holds a bounded page of the events; while the
worker's ``seq`` is past the last one applied, the next poll goes at once. A worker that answers
400 (its chunk size is not this router's ``chunk_bytes``) or 404 (trtllm-serve's: no events in our
key space) keeps the approximate index, asked again every
:data:`UNSUPPORTED_RETRY_S`. The events endpoint is under /metrics' access rule: the orchestrator
sends its metrics token, if it has one, as a bearer token.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any
from urllib.parse import urlencode

from fastcore import protocol as wire
from server.http.client import Deadlines, UpstreamError, UpstreamPool, UpstreamTimeout
from server.tasks import stop_tasks

from .pools import Pool, Worker
from .routing import CacheEventFollower, can_follow_cache_events

__all__ = ["CacheView"]

log = logging.getLogger("fastcore.orchestrator")

#: how long a poll is held open by the worker when nothing happens
WAIT_S = 10.0
#: after a failed poll (refused, reset, a 5xx)
RETRY_S = 1.0
#: after an answer, the next poll waits this long: events batch into one answer (a poll per event
#: cost each orchestrator an HTTP round trip per worker per request; routing adds its own request's
#: keys at once, so the delay only ages what other orchestrators sent and what the worker evicted)
BATCH_S = 0.05
#: a worker that publishes no events is asked again this much later (it may have been replaced)
UNSUPPORTED_RETRY_S = 60.0
#: the largest answer read (a resync lists every key held: ~25 bytes each)
MAX_ANSWER_BYTES = 64 << 20
#: how often the followers are matched to the pools' members
RECONCILE_S = 1.0
_KEY_END = 1 << 64


def _keys(value: object) -> list[int] | None:
    if not isinstance(value, list):
        return None
    for key in value:
        if type(key) is not int or not 0 <= key < _KEY_END:
            return None
    return value


class _Follower:
    """One worker's stream: the last applied ``seq`` and the worker's ``instance``."""

    def __init__(self, view: CacheView, router: CacheEventFollower, worker: Worker) -> None:
        self.view = view
        self.router = router
        self.worker = worker
        self.instance: str | None = None
        self.seq = 0
        #: one keep-alive connection of the lean HTTP client (an aiohttp poll cost ~1 ms of CPU),
        #: made on the first poll
        self.upstream: UpstreamPool | None = None

    def close(self) -> None:
        if self.upstream is not None:
            self.upstream.close()

    async def run(self) -> None:
        while True:
            delay = await self.poll_once()
            if delay:
                await asyncio.sleep(delay)

    async def poll_once(self) -> float:
        """One poll; the seconds to wait before the next."""
        worker, router = self.worker, self.router
        if not worker.healthy:
            return RETRY_S
        params: dict[str, str] = {
            "after": str(self.seq),
            "chunk_bytes": str(router.chunk_bytes),
            "wait": str(self.view.wait_s),
            "tiers": "1",
        }
        if self.instance is not None and worker in router.followed:
            params["instance"] = self.instance
        else:
            params["after"] = "0"  # no instance: the answer is a resync
        path = b"/cache_events?" + urlencode(params).encode()
        if self.upstream is None:
            self.upstream = UpstreamPool(worker.url, max_idle=1, deadlines=self.view.deadlines)
        try:
            resp = await self.upstream.request(
                b"GET",
                path,
                headers=self.view.headers,
                timeout=self.view.wait_s + 10.0,
                max_body=MAX_ANSWER_BYTES,
            )
        except (UpstreamError, UpstreamTimeout):
            return RETRY_S
        try:
            status, body = resp.status, await resp.read()
        except (UpstreamError, UpstreamTimeout):
            return RETRY_S
        finally:
            resp.release()
        # 400: the worker's chunk size is not this router's (its --cache-events-chunk-bytes)
        if status in (400, 401, 403, 404, 405, 409):
            if status != 404:
                log.warning(
                    "%s: GET /cache_events answered %d (%s); routing on an estimate of its cache",
                    worker.url,
                    status,
                    body[:200].decode("utf-8", "replace"),
                )
            return UNSUPPORTED_RETRY_S
        if status != 200:
            return RETRY_S
        try:
            answer = json.loads(body)
        except ValueError:
            answer = None
        before = self.seq
        if not self.apply(answer):
            self.instance = None  # resync next
            return RETRY_S
        # a page of a longer run of events (the worker bounds an answer): the next one at once,
        # only after progress (an answer that applies nothing and says more cannot make us spin)
        return 0.0 if before < self.seq < answer["seq"] else self.view.batch_s

    def apply(self, answer: Any) -> bool:
        """Apply one answer to the router; False when it cannot be (a resync is needed)."""
        if not isinstance(answer, dict):
            return False
        instance, seq = answer.get("instance"), answer.get("seq")
        if not isinstance(instance, str) or type(seq) is not int:
            return False
        router, worker = self.router, self.worker
        if answer.get("resync") is True:
            held = _keys(answer.get("held"))
            tier2 = _keys(answer.get("held_tier2", []))
            if held is None or tier2 is None:
                return False
            router.resync(worker, held, tier2)
            rates = answer.get("tier_rates")
            if isinstance(rates, dict):
                router.tier_rates(
                    worker,
                    rates.get(wire.INFO_KV_TIER2_LOAD_TOKENS_PER_S),
                    rates.get(wire.INFO_PREFILL_TOKENS_PER_S),
                )
            self.instance, self.seq = instance, seq
            self.view.resyncs += 1
            return True
        events = answer.get("events")
        if instance != self.instance or not isinstance(events, list) or worker not in router.followed:
            return False
        for event in events:
            if not isinstance(event, dict) or event.get("seq") != self.seq + 1:
                return False  # a gap: what happened between is unknown
            stored, removed, moved = event.get("stored"), event.get("removed"), event.get("moved")
            keys = _keys(stored if stored is not None else moved if moved is not None else removed)
            tier = event.get("tier", 1)  # an event without a tier: the device's
            if keys is None or tier not in (1, 2) or type(tier) is not int:
                return False
            if stored is not None:
                router.stored(worker, keys, tier)
            elif moved is not None:
                router.moved(worker, keys, tier)
            else:
                router.removed(worker, keys)
            self.seq += 1
            self.view.events += 1
        return True


class CacheView:
    """Follows the cache events of every worker of the kv_cache_aware ``pools``."""

    def __init__(
        self,
        pools: list[Pool],
        token: bytes | None,
        wait_s: float = WAIT_S,
        *,
        deadlines: Deadlines | None = None,
    ) -> None:
        self.pools = [p for p in pools if p.router.follows_cache_events]
        #: the followers' connections' deadline sweeper (the orchestrator's, shared by its upstreams)
        self.deadlines = deadlines if deadlines is not None else Deadlines()
        self.headers = b"Authorization: Bearer %s\r\n" % token if token else b""
        self.wait_s = wait_s
        self.batch_s = BATCH_S
        self._followers: dict[tuple[int, Worker], tuple[_Follower, asyncio.Task[None]]] = {}
        self._task: asyncio.Task[None] | None = None
        #: events applied and resyncs taken (tests, debugging)
        self.events = 0
        self.resyncs = 0

    def reconcile(self) -> None:
        """A follower for each member of each pool; none for workers that left."""
        wanted: dict[tuple[int, Worker], CacheEventFollower] = {}
        for pool in self.pools:
            router = pool.router
            assert can_follow_cache_events(router)
            for worker in pool.workers:
                wanted[id(pool), worker] = router
        for slot in [s for s in self._followers if s not in wanted]:
            follower, task = self._followers.pop(slot)
            task.cancel()
            follower.close()
        loop = asyncio.get_running_loop()
        for slot, follows in wanted.items():
            if slot not in self._followers:
                follower = _Follower(self, follows, slot[1])
                self._followers[slot] = (
                    follower,
                    loop.create_task(follower.run(), name="fastcore-cache-events"),
                )

    async def _run(self) -> None:
        while True:
            self.reconcile()
            await asyncio.sleep(RECONCILE_S)

    def start(self) -> None:
        if self.pools:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="fastcore-cache-view")

    async def stop(self) -> None:
        try:
            await stop_tasks([self._task, *(task for _, task in self._followers.values())])
        finally:  # (a stop cancelled meanwhile closes the followers' connections all the same)
            for follower, _ in self._followers.values():
                follower.close()
            self._followers.clear()
            self._task = None
