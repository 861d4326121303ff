"""The orchestrator's view of a cluster: every registered worker, kept current.

etcd: a full read of the prefix, then a watch from the revision after it;
every change calls ``on_change`` with the whole set. A probe every
``heartbeat_interval_s`` notices an etcd that stopped answering (a dead
process breaks the watch at once, a partition does not). While etcd is
unreachable the last known set stays (``connected`` is False); when it answers
again the watcher reads everything again (``resyncs``) and watches from there.

http:// naming another orchestrator's embedded registry: long polls of
``GET /cluster/v1/workers?after=<version>``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable

import aiohttp

from server.auth import SIGNATURE_HEADER

from .embedded import LONG_POLL_S, REGISTRY_PATH, sign_registry
from .etcd import TRANSIENT_ERRORS, EtcdClient, EtcdError
from .records import ClusterSettings, RecordError, WorkerRecord

log = logging.getLogger("fastcore.cluster")

_TRANSIENT = TRANSIENT_ERRORS


class ClusterWatcher:
    def __init__(
        self,
        settings: ClusterSettings,
        on_change: Callable[[dict[str, WorkerRecord]], None],
        *,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        self.settings = settings
        self.on_change = on_change
        self._own_session = session is None
        self.session = session
        self.connected = False
        #: full reads after the first one (one per reconnection)
        self.resyncs = 0
        self.workers: dict[str, WorkerRecord] = {}
        #: key -> why its value was unusable (logged once)
        self._bad: dict[str, str] = {}
        self._task: asyncio.Task[None] | None = None
        self._probe: asyncio.Task[None] | None = None
        self._synced = asyncio.Event()
        self._etcd: EtcdClient | None = None
        self._watch: asyncio.Task[None] | None = None

    async def start(self, *, wait_s: float = 2.0) -> None:
        """Start watching; waits up to ``wait_s`` for the first full read (serving starts regardless)."""
        if self.session is None:
            self.session = aiohttp.ClientSession()
        loop = asyncio.get_running_loop()
        if self.settings.etcd:
            self._etcd = EtcdClient(self.settings.etcd_endpoints(), self.session,
                                    timeout_s=max(0.5, min(2.0, self.settings.heartbeat_interval_s)))  # fmt: skip
            self._task = loop.create_task(self._run_etcd())
            self._probe = loop.create_task(self._probe_etcd())
        else:
            self._task = loop.create_task(self._run_http())
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._synced.wait(), wait_s)
        if not self.connected:
            log.warning(
                "cluster: %s unreachable at start; no worker discovered yet", self.settings.cluster_uri
            )

    async def stop(self) -> None:
        for task in (self._probe, self._task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._own_session and self.session is not None:
            await self.session.close()

    # -- applying what the store says ------------------------------------------------

    def _record(self, key: str, value: bytes) -> WorkerRecord | None:
        try:
            record = WorkerRecord.from_json(value)
        except RecordError as exc:
            if self._bad.get(key) != str(exc):
                self._bad[key] = str(exc)
                log.warning("cluster: ignoring %s: %s", key, exc)
            return None
        self._bad.pop(key, None)
        return record

    def _replace(self, records: dict[str, WorkerRecord]) -> None:
        if not self.connected:
            if self._synced.is_set():
                self.resyncs += 1
            log.info(
                "cluster: %s reachable: %d worker(s) registered", self.settings.cluster_uri, len(records)
            )
        self.connected = True
        self.workers = records
        self._synced.set()
        self.on_change(dict(records))

    def _lost(self, exc: BaseException) -> None:
        if self.connected:
            log.warning("cluster: %s unreachable (%r): serving the last known %d worker(s)",
                        self.settings.cluster_uri, exc, len(self.workers))  # fmt: skip
        self.connected = False

    # -- etcd --------------------------------------------------------------------------

    async def _run_etcd(self) -> None:
        assert self._etcd is not None
        prefix = self.settings.prefix
        backoff = 0.05
        while True:
            try:
                kvs, revision = await self._etcd.range_prefix(prefix)
                records = {}
                for key, value in kvs:
                    record = self._record(key.decode("utf-8", "replace"), value)
                    if record is not None:
                        records[key.decode()[len(prefix) :]] = record
                self._replace(records)
                backoff = 0.05
                await self._follow(prefix, revision + 1)
                raise EtcdError("the watch stream ended")
            except _TRANSIENT as exc:
                self._lost(exc)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.settings.heartbeat_interval_s)

    async def _follow(self, prefix: str, revision: int) -> None:
        assert self._etcd is not None
        async for events in self._etcd.watch_prefix(prefix, revision):
            changed = False
            for event in events:
                key = event.key.decode("utf-8", "replace")
                worker_id = key[len(prefix) :]
                if event.kind == "DELETE":
                    self._bad.pop(key, None)
                    changed |= self.workers.pop(worker_id, None) is not None
                    continue
                record = self._record(key, event.value)
                if record is None:
                    changed |= self.workers.pop(worker_id, None) is not None
                elif self.workers.get(worker_id) != record:
                    self.workers[worker_id] = record
                    changed = True
            if changed:
                self.on_change(dict(self.workers))

    async def _probe_etcd(self) -> None:
        """Breaks the watch when etcd stops answering, so that its return is a resync."""
        assert self._etcd is not None
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval_s)
            if not self.connected:
                continue
            try:
                await self._etcd.status()
            except _TRANSIENT as exc:
                self._lost(exc)
                if self._task is not None:  # restart the loop: it reads everything when etcd is back
                    self._task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await self._task
                    self._task = asyncio.get_running_loop().create_task(self._run_etcd())

    # -- http:// -------------------------------------------------------------------------

    async def _run_http(self) -> None:
        assert self.session is not None
        version: int | None = None
        backoff = 0.05
        while True:
            url = REGISTRY_PATH.decode() + ("" if version is None else f"?after={version}")
            headers = {}
            if self.settings.secret is not None:
                headers[SIGNATURE_HEADER] = sign_registry(self.settings.secret, "GET", url)
            try:
                timeout = aiohttp.ClientTimeout(total=LONG_POLL_S + 5)
                async with self.session.get(
                    self.settings.cluster_uri + url, headers=headers, timeout=timeout
                ) as r:
                    raw = await r.read()
                    if r.status != 200:
                        raise EtcdError(
                            f"registry {self.settings.cluster_uri}: HTTP {r.status}: {raw[:300]!r}"
                        )
                answer = json.loads(raw)
                records = {}
                for worker_id, obj in answer["workers"].items():
                    record = self._record(str(worker_id), json.dumps(obj).encode())
                    if record is not None:
                        records[str(worker_id)] = record
                new_version = int(answer["version"])
                if version is None or new_version != version or not self.connected:
                    self._replace(records)
                version = new_version
                backoff = 0.05
                continue
            except _TRANSIENT as exc:
                self._lost(exc)
                version = None
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.settings.heartbeat_interval_s)


__all__ = ["ClusterWatcher"]
