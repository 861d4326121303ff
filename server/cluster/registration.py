"""A worker's membership of a cluster: registered while it runs, gone when it stops.

etcd: the record is put under a lease of ``inactive_timeout_s`` that a
heartbeat renews every ``heartbeat_interval_s``; a clean stop revokes the lease
(etcd deletes the key at once), a crash lets it expire. When etcd cannot be
reached the worker keeps trying; when its lease is gone (etcd was down longer
than the TTL) it registers again under a new one.

http:// (an orchestrator's embedded registry): every heartbeat is a PUT of
the record; a clean stop is a DELETE.

``record_format: trtllm``: trtllm-serve's record under its prefix, so a
trtllm-serve orchestrator discovers this worker. etcd: as above (trtllm-serve
also keeps one lease per key and refreshes it). http://: trtllm-serve's storage
API, as its ``HttpClusterStorageClient`` and ``DisaggClusterWorker`` use it:
``POST /set`` with the record and ``ttl``, ``GET /expire`` per heartbeat (a 400:
the key is gone, register again), ``DELETE /delete`` on a clean stop, with
``Authorization: Bearer <key>`` when a key is set (never over plain HTTP to a
host that is not loopback, trtllm-serve's own rule).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from urllib.parse import urlencode, urlsplit

import aiohttp

from server.auth import SIGNATURE_HEADER
from server.tasks import stop_tasks

from .embedded import REGISTRY_PATH, sign_registry
from .etcd import TRANSIENT_ERRORS, EtcdClient, EtcdError
from .records import ClusterSettings, RecordError, WorkerRecord

_LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})

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
        self.trtllm = settings.record_format == "trtllm"
        if self.trtllm != (record.layout == "trtllm"):
            raise RecordError(f"record_format {settings.record_format} needs a record of that layout")
        if self.trtllm:
            record.to_json()  # a role trtllm-serve has (no "both"), else the RecordError says so
            host = (urlsplit(settings.cluster_uri).hostname or "").lower()
            if not settings.etcd and settings.bearer_key is not None and host not in _LOOPBACK_HOSTS:
                raise RecordError(
                    f"cluster_uri {settings.cluster_uri}: trtllm-serve's storage API takes its bearer key "
                    "over plain HTTP from loopback only (its HttpClusterStorageClient refuses this too)"
                )
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
            self._etcd = EtcdClient(
                self.settings.etcd_endpoints(),
                self.session,
                timeout_s=min(2.0, self.settings.heartbeat_interval_s * 2),
            )
        self._task = asyncio.get_running_loop().create_task(self._run(), name="fastcore-cluster-registration")
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._first.wait(), wait_s)
        if not self.registered:
            log.warning("cluster: not registered yet at %s; still trying", self.settings.cluster_uri)
        return self.registered

    async def stop(self) -> None:
        """Stop heartbeating, then deregister (revoke the lease / DELETE). A stop cancelled meanwhile
        raises its cancel (and closes its session): the registration then expires with its TTL."""
        try:
            await stop_tasks([self._task])
            if self.registered:
                try:
                    await asyncio.wait_for(self._deregister(), 2.0)
                    log.info("cluster: worker %s deregistered", self.record.worker_id)
                except _TRANSIENT as exc:  # a timeout is one of them
                    log.warning(
                        "cluster: could not deregister (%r); the registration expires in %gs",
                        exc,
                        self.settings.inactive_timeout_s,
                    )
            self.registered = False
        finally:
            if self._own_session and self.session is not None:
                await self.session.close()

    # -- the loop --------------------------------------------------------------------

    async def _run(self) -> None:
        backoff = 0.1
        while True:
            try:
                await self._register()
                if not self.registered:
                    log.info(
                        "cluster: %s worker %s registered at %s (%s)",
                        self.record.role,
                        self.record.worker_id,
                        self.settings.cluster_uri,
                        self.record.url,
                    )
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
        if self._etcd is None and self.trtllm:
            item = {
                "key": self.key,
                "value": self.record.to_json().decode(),
                "overwrite_if_exists": True,
                "ttl": max(1, math.ceil(self.settings.inactive_timeout_s)),
            }
            await self._http("POST", "/set", json.dumps(item).encode())
        elif self._etcd is not None:
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
        if self.trtllm:  # trtllm-serve's heartbeat: 400 when the key is gone
            ttl = max(1, math.ceil(self.settings.inactive_timeout_s))
            return (
                await self._http("GET", f"/expire?{_query(key=self.key, ttl=ttl)}", b"", ok=(200, 400)) == 200
            )
        await self._put()
        return True

    async def _deregister(self) -> None:
        if self._etcd is not None:
            if self._lease is not None:
                await self._etcd.revoke(self._lease)
            return
        if self.trtllm:
            await self._http("DELETE", f"/delete?{_query(key=self.key)}", b"", ok=(200, 400))
            return
        url = REGISTRY_PATH.decode() + "/" + self.record.worker_id
        await self._http("DELETE", url, b"", ok=(200, 404))

    # -- http:// -----------------------------------------------------------------------

    async def _put(self) -> None:
        body = json.dumps(
            {"worker": json.loads(self.record.to_json()), "ttl_s": self.settings.inactive_timeout_s}
        ).encode()
        await self._http("PUT", REGISTRY_PATH.decode() + "/" + self.record.worker_id, body)

    async def _http(self, method: str, url: str, body: bytes, *, ok: tuple[int, ...] = (200,)) -> int:
        assert self.session is not None
        headers = {"Content-Type": "application/json"}
        if self.trtllm:
            if self.settings.bearer_key is not None:
                headers["Authorization"] = "Bearer " + self.settings.bearer_key.decode(
                    "utf-8", "surrogateescape"
                )
        elif self.settings.secret is not None:
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
            return resp.status


def _query(**params: object) -> str:
    return urlencode(params)


__all__ = ["WorkerRegistration"]
