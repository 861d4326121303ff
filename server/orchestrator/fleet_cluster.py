"""Orchestrators on several hosts sharing one etcd (config ``fleet_cluster``): each registers under a
lease, divides each tenant's rate and ``max_inflight`` by the live count, and publishes the breakers
it opens (docs/configuration.md, "Several hosts").

The approach of Envoy's local rate limit with a shard count: no request waits on etcd. A watch of
``/fastcore/<name>/fleet/`` keeps the members and the published breakers; each change of the
members rewrites what admission reads (:meth:`Admission.divide`: the buckets' sizes, the slots), so
admission's path is the same with or without the cluster.

- **Members**: ``members/<id>`` -> ``{"group": ...}`` under this orchestrator's lease (TTL
  ``lease_ttl_s``, renewed every third of it). A group is one host's ``--workers N`` processes (they
  share one mapping, fleet.py) or one process alone; a group's share is its members over all.
- **Breakers**: a worker's breaker that opens here is put at ``breakers/<hash>`` ->
  ``{"pool", "url", "open_s", "until"}`` under a lease of its open period; the others open theirs for
  what is left of it (``until``, wall-clock; their own half-open probe after it), and a probe that
  succeeds here deletes the key. Breakers are looked at every :data:`BREAKER_POLL_S` (nothing when no breaker or
  health changed: the pools' epoch).
- **etcd unreachable**: the last share and breakers stay, one warning says so; the loop retries and,
  when etcd answers, registers again if its lease expired and reads everything anew.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import time
import uuid
from collections import Counter
from typing import TYPE_CHECKING

import aiohttp

from server.cluster.etcd import TRANSIENT_ERRORS, EtcdClient, EtcdError, Event
from server.cluster.records import KEY_ROOT, ClusterSettings
from server.cluster.watcher import until_one_fails
from server.tasks import stop_tasks

from .pools import _ROUTABLE_EPOCH

if TYPE_CHECKING:
    from .admission import Admission
    from .config import FleetClusterConfig
    from .pools import Pool

log = logging.getLogger("fastcore.orchestrator")

#: seconds between looks at this orchestrator's breakers (one epoch compare when nothing changed)
BREAKER_POLL_S = 0.05
MEMBERS, BREAKERS = "members/", "breakers/"
#: the shortest lease etcd grants reliably (its minimum TTL is about 1.5 s with default timings)
MIN_LEASE_S = 2


def divide(groups: dict[str, str], own: str, max_inflight: int) -> tuple[float, int]:
    """This group's part of the fleet: (its fraction of each rate, its slots). ``groups``: member id
    -> its group. Slots: each group ``max_inflight * size // total``, the remainder one each to the
    first groups by name, never below 1."""
    sizes = Counter(groups.values())
    total = sum(sizes.values())
    if own not in sizes:
        sizes[own], total = 1, total + 1
    names = sorted(sizes)
    parts = {name: max_inflight * sizes[name] // total for name in names}
    for name in names[: max_inflight - sum(parts.values())]:
        parts[name] += 1
    return sizes[own] / total, max(1, parts[own])


def breaker_key(pool: str, url: str) -> str:
    return hashlib.blake2b(f"{pool}\0{url}".encode("utf-8", "surrogatepass"), digest_size=12).hexdigest()


class FleetCluster:
    """This orchestrator's membership of the fleet (``start`` before it serves, ``stop`` at its end)."""

    def __init__(
        self,
        config: FleetClusterConfig,
        *,
        admission: Admission | None,
        pools: list[Pool],
        group: str | None = None,
    ) -> None:
        self.config = config
        settings = ClusterSettings(
            config.cluster_uri, config.cluster_name, config.lease_ttl_s / 3, config.lease_ttl_s
        )
        self.endpoints = settings.etcd_endpoints()
        self.prefix = f"{KEY_ROOT}/{config.cluster_name or 'default'}/fleet/"
        self.id = uuid.uuid4().hex
        #: this orchestrator's group: one host's --workers N processes, or itself alone
        self.group = group or self.id
        self.admission = admission
        self.max_inflight = admission.max_inflight if admission is not None else 0
        self.pools = pools
        #: member id -> its group, as etcd said last (this one counted even before it registered)
        self.members: dict[str, str] = {}
        #: (fraction of each rate, slots) applied last
        self.share = (1.0, self.max_inflight)
        self.connected = False
        self.lease: str | None = None
        #: breaker key -> (pool, url) of the ends known (published here or heard of)
        self.published: dict[str, tuple[str, str]] = {}
        #: (pool, url) -> [its breaker's opened count, its state] at the last look
        self._breakers: dict[tuple[str, str], list[int]] = {}
        self._epoch = -1
        self._session: aiohttp.ClientSession | None = None
        self._etcd: EtcdClient | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._synced = asyncio.Event()

    @property
    def member_count(self) -> int:
        """The live members as the watch says, this one counted even before etcd showed it (as the
        share is divided: :meth:`_divide`)."""
        members = self.members
        return len(members) + (self.id not in members)

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self, *, wait_s: float = 2.0) -> None:
        """Register and read the members (up to ``wait_s``: serving starts regardless, with a whole
        share until etcd answers)."""
        self._session = aiohttp.ClientSession()
        self._etcd = EtcdClient(
            self.endpoints, self._session, timeout_s=max(0.5, self.config.lease_ttl_s / 3)
        )
        self.sync_breakers()  # the breakers' state now: what opens from here on is published
        self._tasks = [
            asyncio.ensure_future(self._run()),
            asyncio.ensure_future(self._keep_breakers()),
        ]
        try:
            await asyncio.wait_for(self._synced.wait(), wait_s)
        except asyncio.TimeoutError:
            log.warning(
                "fleet cluster: %s unreachable at start: this orchestrator takes a whole share "
                "until it answers",
                self.config.cluster_uri,
            )

    async def stop(self) -> None:
        """Leave: the lease revoked (the others re-divide at once); else it expires with its TTL."""
        tasks, self._tasks = self._tasks, []
        try:
            await stop_tasks(tasks)
            if self.lease is not None and self._etcd is not None:
                try:
                    await asyncio.wait_for(self._etcd.revoke(self.lease), 2.0)
                except TRANSIENT_ERRORS as exc:
                    log.warning(
                        "fleet cluster: could not leave (%r): this orchestrator counts until its "
                        "lease expires (%d s)",
                        exc,
                        self.config.lease_ttl_s,
                    )
                self.lease = None
        finally:
            if self._session is not None:
                await self._session.close()
                self._session = None

    # -- membership -----------------------------------------------------------------------------

    async def _run(self) -> None:
        """Register, read, watch and renew; on any failure keep the last share and retry."""
        assert self._etcd is not None
        backoff = 0.05
        while True:
            try:
                await self._register()
                revision = await self._read_all()
                if not self.connected:
                    log.info(
                        "fleet cluster: %s reachable: %d orchestrator(s)",
                        self.config.cluster_uri,
                        len(self.members),
                    )
                self.connected = True
                self._synced.set()
                backoff = 0.05
                await until_one_fails([self._follow(revision + 1), self._renew()])
            except TRANSIENT_ERRORS as exc:
                self._lost(exc)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.config.lease_ttl_s / 3)

    def _lost(self, exc: BaseException) -> None:
        if self.connected:  # said once per outage
            fraction, slots = self.share
            log.warning(
                "fleet cluster: %s unreachable (%r): keeping this orchestrator's last share "
                "(%.3g of each rate, %d slots of max_inflight)",
                self.config.cluster_uri,
                exc,
                fraction,
                slots,
            )
        self.connected = False

    async def _register(self) -> None:
        assert self._etcd is not None
        if self.lease is not None and await self._etcd.keepalive(self.lease) > 0:
            return  # the lease outlived the outage: still a member
        lease, _ = await self._etcd.grant(max(MIN_LEASE_S, self.config.lease_ttl_s))
        value = json.dumps({"group": self.group}).encode()
        await self._etcd.put(self.prefix + MEMBERS + self.id, value, lease=lease)
        self.lease = lease

    async def _renew(self) -> None:
        assert self._etcd is not None and self.lease is not None
        while True:
            await asyncio.sleep(self.config.lease_ttl_s / 3)
            if await self._etcd.keepalive(self.lease) <= 0:
                self.lease = None
                raise EtcdError("this orchestrator's lease expired: registering again")

    async def _read_all(self) -> int:
        assert self._etcd is not None
        members: dict[str, str] = {}
        revision = 0
        async for kvs, page_revision in self._etcd.range_prefix_pages(self.prefix):
            revision = page_revision
            for key, value in kvs:
                self._entry(Event("PUT", key, value), members, now=time.monotonic())
        self.members = members
        self._divide()
        return revision

    async def _follow(self, revision: int) -> None:
        assert self._etcd is not None
        async for events in self._etcd.watch_prefix(self.prefix, revision):
            members = dict(self.members)
            now = time.monotonic()
            for event in events:
                self._entry(event, members, now=now)
            if members != self.members:
                self.members = members
                self._divide()
        raise EtcdError("the fleet's watch ended")

    def _entry(self, event: Event, members: dict[str, str], *, now: float) -> None:
        """One key of the fleet's prefix: a member joining or leaving, a breaker published."""
        key = event.key.decode("utf-8", "replace")[len(self.prefix) :]
        kind, _, name = key.partition("/")
        if f"{kind}/" == MEMBERS:
            if event.kind == "DELETE":
                members.pop(name, None)
                return
            try:
                group = json.loads(event.value)["group"]
            except (ValueError, KeyError, TypeError):
                group = None
            if isinstance(group, str) and group:
                members[name] = group
        elif f"{kind}/" == BREAKERS:
            if event.kind == "DELETE":
                self.published.pop(name, None)
            else:
                self._honour(name, event.value, now)

    def _divide(self) -> None:
        """This orchestrator's share from the members now, handed to admission when it changed."""
        members = dict(self.members)
        members[self.id] = self.group
        share = divide(members, self.group, self.max_inflight)
        if share == self.share:
            return
        self.share = share
        log.info(
            "fleet cluster: %d orchestrator(s): this one takes %.3g of each rate and %d of max_inflight %d",
            len(members),
            share[0],
            share[1],
            self.max_inflight,
        )
        if self.admission is not None:
            self.admission.divide(*share)

    # -- breakers -------------------------------------------------------------------------------

    async def _keep_breakers(self) -> None:
        while True:
            await asyncio.sleep(BREAKER_POLL_S)
            opened, closed = self.sync_breakers()
            for pool, url, open_s in opened:
                await self._publish(pool, url, open_s)
            for key, where in list(self.published.items()):
                if where in closed:
                    await self._withdraw(key)

    def sync_breakers(self) -> tuple[list[tuple[str, str, float]], set[tuple[str, str]]]:
        """The breakers opened here since the last look, as (pool, url, seconds left open), and the
        (pool, url) of those closed since (a probe here succeeded). Nothing when no breaker or
        health changed (the pools' epoch: one compare)."""
        if _ROUTABLE_EPOCH[0] == self._epoch:
            return [], set()
        self._epoch = _ROUTABLE_EPOCH[0]
        now = time.monotonic()
        opened, closed = [], set()
        seen, self._breakers = self._breakers, {}
        for pool in self.pools:
            for worker in pool.workers:
                breaker, where = worker.breaker, (pool.name, worker.url)
                record = seen.get(where)
                if record is not None:
                    if breaker.opened != record[0] and breaker.state == breaker.OPEN:
                        left = breaker.opened_at + breaker.open_for - now
                        if left > 0:
                            opened.append((pool.name, worker.url, left))
                    elif breaker.state == breaker.CLOSED != record[1]:
                        closed.add(where)
                self._breakers[where] = [breaker.opened, breaker.state]
        return opened, closed

    async def _publish(self, pool: str, url: str, open_s: float) -> None:
        assert self._etcd is not None
        key = breaker_key(pool, url)
        # the end in wall-clock time too: one who reads the key later (a resync, a join) honours
        # what is left of it, not a whole period from then (the hosts' clocks within NTP's error)
        item = {"pool": pool, "url": url, "open_s": open_s, "until": time.time() + open_s, "by": self.id}
        value = json.dumps(item).encode()
        try:
            lease, _ = await self._etcd.grant(max(MIN_LEASE_S, math.ceil(open_s)))
            await self._etcd.put(self.prefix + BREAKERS + key, value, lease=lease)
            self.published[key] = (pool, url)
        except TRANSIENT_ERRORS as exc:
            self._lost(exc)  # the others find this worker failing themselves

    async def _withdraw(self, key: str) -> None:
        assert self._etcd is not None
        self.published.pop(key, None)
        try:
            await self._etcd.delete(self.prefix + BREAKERS + key)
        except TRANSIENT_ERRORS as exc:
            self._lost(exc)  # the key expires with its lease

    def _honour(self, key: str, raw: bytes, now: float) -> None:
        """Another orchestrator's open breaker: this one's opened for what is left of it, unless
        this one is open longer already or its own probe is under way."""
        try:
            item = json.loads(raw)
            pool, url, open_s, by = item["pool"], item["url"], float(item["open_s"]), item["by"]
            open_s = min(open_s, float(item["until"]) - time.time())
        except (ValueError, KeyError, TypeError):
            return
        if not (isinstance(pool, str) and isinstance(url, str)) or not 0 < open_s < 86400:
            return
        self.published[key] = (pool, url)
        if by == self.id:
            return
        for candidate in self.pools:
            if candidate.name != pool:
                continue
            for worker in candidate.workers:
                breaker = worker.breaker
                if worker.url != url or (breaker.state == breaker.HALF_OPEN and breaker.probing):
                    continue
                if breaker.state == breaker.OPEN and breaker.opened_at + breaker.open_for >= now + open_s:
                    continue
                breaker.opened_at, breaker.open_for, breaker.probing = now, open_s, False
                breaker.state = breaker.OPEN
                record = self._breakers.get((pool, url))
                if record is not None:  # its close is noticed even if no look saw it open
                    record[1] = breaker.OPEN


__all__ = ["BREAKER_POLL_S", "FleetCluster", "breaker_key", "divide"]
