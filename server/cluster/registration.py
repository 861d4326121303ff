"""A worker's membership of a cluster: registered while it runs, gone when it stops.

etcd: the record is put under a lease of ``inactive_timeout_s`` that a
heartbeat renews every ``heartbeat_interval_s``; a clean stop revokes the lease
(etcd deletes the key at once), a crash lets it expire. When etcd cannot be
reached the worker keeps trying; when its lease is gone (etcd was down longer
than the TTL) it registers again under a new one.

http:// (an orchestrator's embedded registry): every heartbeat is a PUT of
the record; a clean stop is a DELETE.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math

import aiohttp

from server.auth import SIGNATURE_HEADER

from .embedded import REGISTRY_PATH, sign_registry
from .etcd import TRANSIENT_ERRORS, EtcdClient, EtcdError
from .records import ClusterSettings, WorkerRecord

log = logging.getLogger("fastcore.cluster")

_TRANSIENT = TRANSIENT_ERRORS


class WorkerRegistration:
    def __init__(
        self,
        settings: ClusterSettings,
        record: WorkerRecord,
        *,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        self.settings = settings
        self.record = record
        self._own_session = session is None
        self.session = session
        self.registered = False
        self._ever = False
        #: times it (re-)registered after the first
        self.reregistrations = 0
        self._lease: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._first = asyncio.Event()
        self._etcd: EtcdClient | None = None

    @property
    def key(self) -> str:
        return self.settings.key(self.record.worker_id)

    async def start(self, *, wait_s: float = 5.0) -> bool:
        """Start keeping the registration; waits up to ``wait_s`` for the first one (True if made)."""
        if self.session is None:
            self.session = aiohttp.ClientSession()
        if self.settings.etcd:
            self._etcd = EtcdClient(self.settings.etcd_endpoints(), self.session,
                                    timeout_s=min(2.0, self.settings.heartbeat_interval_s * 2))  # fmt: skip
        self._task = asyncio.get_running_loop().create_task(self._run())
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._first.wait(), wait_s)
        if not self.registered:
            log.warning("cluster: not registered yet at %s; still trying", self.settings.cluster_uri)
        return self.registered

    async def stop(self) -> None:
        """Deregister (revoke the lease / DELETE), then stop heartbeating."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.registered:
            try:
                await asyncio.wait_for(self._deregister(), 2.0)
                log.info("cluster: worker %s deregistered", self.record.worker_id)
            except _TRANSIENT as exc:  # a timeout is one of them
                log.warning("cluster: could not deregister (%r); the registration expires in %gs",
                            exc, self.settings.inactive_timeout_s)  # fmt: skip
        self.registered = False
        if self._own_session and self.session is not None:
            await self.session.close()

    # -- the loop --------------------------------------------------------------------

    async def _run(self) -> None:
        backoff = 0.1
        while True:
            try:
                await self._register()
                if not self.registered:
                    log.info("cluster: %s worker %s registered at %s (%s)", self.record.role,
                             self.record.worker_id, self.settings.cluster_uri, self.record.url)  # fmt: skip
                    if self._ever:
                        self.reregistrations += 1
                self.registered = self._ever = True
                self._first.set()
                backoff = 0.1
                while await self._heartbeat():
                    pass
                log.warning(
                    "cluster: the registration of %s is gone: registering again", self.record.worker_id
                )
                self.registered = False
            except _TRANSIENT as exc:
                if self.registered or not self._first.is_set():
                    log.warning(
                        "cluster: registry %s unreachable (%r); retrying", self.settings.cluster_uri, exc
                    )
                self.registered = False
                self._first.set()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.settings.heartbeat_interval_s)

    async def _register(self) -> None:
        if self._etcd is not None:
            lease, _ = await self._etcd.grant(max(2, math.ceil(self.settings.inactive_timeout_s)))
            await self._etcd.put(self.key, self.record.to_json(), lease=lease)
            self._lease = lease
        else:
            await self._put()

    async def _heartbeat(self) -> bool:
        """One heartbeat after a sleep; False when the registration is gone."""
        await asyncio.sleep(self.settings.heartbeat_interval_s)
        if self._etcd is not None:
            assert self._lease is not None
            return await self._etcd.keepalive(self._lease) > 0
        await self._put()
        return True

    async def _deregister(self) -> None:
        if self._etcd is not None:
            if self._lease is not None:
                await self._etcd.revoke(self._lease)
            return
        url = REGISTRY_PATH.decode() + "/" + self.record.worker_id
        await self._http("DELETE", url, b"", ok=(200, 404))

    # -- http:// -----------------------------------------------------------------------

    async def _put(self) -> None:
        body = json.dumps(
            {"worker": json.loads(self.record.to_json()), "ttl_s": self.settings.inactive_timeout_s}
        ).encode()
        await self._http("PUT", REGISTRY_PATH.decode() + "/" + self.record.worker_id, body)

    async def _http(self, method: str, url: str, body: bytes, *, ok: tuple[int, ...] = (200,)) -> None:
        assert self.session is not None
        headers = {"Content-Type": "application/json"}
        if self.settings.secret is not None:
            headers[SIGNATURE_HEADER] = sign_registry(self.settings.secret, method, url, body)
        timeout = aiohttp.ClientTimeout(total=min(5.0, self.settings.inactive_timeout_s))
        async with self.session.request(
            method, self.settings.cluster_uri + url, data=body, headers=headers, timeout=timeout
        ) as resp:
            raw = await resp.read()
            if resp.status not in ok:
                raise EtcdError(
                    f"registry {self.settings.cluster_uri}: {method} HTTP {resp.status}: {raw[:300]!r}"
                )


__all__ = ["WorkerRegistration"]
