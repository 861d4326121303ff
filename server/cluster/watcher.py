"""The orchestrator's view of a cluster: every registered worker, kept current.

etcd: a full read of each key prefix (``key_prefixes``: ours and
trtllm-serve's), then a watch of each from the revision after the reads;
every change calls ``on_change`` with the whole set. A probe every
``heartbeat_interval_s`` notices an etcd that stopped answering (a dead
process breaks the watch at once, a partition does not). While etcd is
unreachable the last known set stays (``connected`` is False); when it answers
again the watcher reads everything again (``resyncs``) and watches from there.

http:// naming another orchestrator's embedded registry: long polls of
``GET /cluster/v1/workers?after=<version>``; naming a trtllm-serve
orchestrator (no such path: 404), its HTTP cluster storage's
``GET /get_prefix`` of each key prefix every ``heartbeat_interval_s``.

A store full of junk costs bounded memory and log lines and never blocks a
sync: an entry whose key or record is unusable (not UTF-8, a record under
another worker's key, too big, ...) is skipped and counted (``ignored``), past
``MAX_WORKERS`` records the rest are skipped too, a full read logs one summary
line, and the watch's warnings are rate-limited (:class:`Complaints`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any
from urllib.parse import urlencode

import aiohttp

from server.auth import SIGNATURE_HEADER
from server.tasks import stop_tasks

from .embedded import LONG_POLL_S, REGISTRY_PATH, sign_registry
from .etcd import TRANSIENT_ERRORS, EtcdClient, EtcdError
from .records import MAX_RECORD_BYTES, MAX_WORKERS, ClusterSettings, RecordError, WorkerRecord, parse_entry

log = logging.getLogger("fastcore.cluster")

_TRANSIENT = TRANSIENT_ERRORS
#: the most bytes an embedded registry's listing may take (MAX_WORKERS records and their ids)
MAX_LISTING_BYTES = MAX_WORKERS * (MAX_RECORD_BYTES + 256) + 64
#: failed etcd status probes in a row (one a heartbeat) that mean etcd is gone, not slow
PROBE_MISSES = 2
#: the watch loop's task name (in the log of a stop that found it ignoring its cancel)
_WATCH_TASK = "fastcore-cluster-watch"


class Complaints:
    """Warnings about unusable store entries, at most ``burst`` per ``period_s``; the rest are
    counted and summarized in one line when the next period begins. Memory: a few counters."""

    def __init__(self, period_s: float = 60.0, burst: int = 5) -> None:
        self.period_s, self.burst = period_s, burst
        #: every complaint ever made (logged or not)
        self.total = 0
        self._window = -period_s
        self._logged = self._suppressed = 0

    def __call__(self, key: str, why: str) -> None:
        self.total += 1
        now = time.monotonic()
        if now - self._window >= self.period_s:
            if self._suppressed:
                log.warning(
                    "cluster: %d more unusable entries ignored in the last %gs (not logged one by one)",
                    self._suppressed,
                    self.period_s,
                )
            self._window, self._logged, self._suppressed = now, 0, 0
        if self._logged < self.burst:
            self._logged += 1
            log.warning("cluster: ignoring %s: %s", key[:300], why)
        else:
            self._suppressed += 1


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
        #: worker id -> the key prefix its record is under (etcd: one watch per prefix)
        self._origin: dict[str, str] = {}
        #: store entries skipped (unusable, or past MAX_WORKERS), counted on every read and event
        self.ignored = 0
        self.complaints = Complaints()
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
            self._etcd = EtcdClient(
                self.settings.etcd_endpoints(),
                self.session,
                timeout_s=max(0.5, min(2.0, self.settings.heartbeat_interval_s)),
            )
            self._task = loop.create_task(self._run_etcd(), name=_WATCH_TASK)
            self._probe = loop.create_task(self._probe_etcd(), name="fastcore-cluster-probe")
        else:
            self._task = loop.create_task(self._run_http(), name=_WATCH_TASK)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._synced.wait(), wait_s)
        if not self.connected:
            log.warning(
                "cluster: %s unreachable at start; no worker discovered yet", self.settings.cluster_uri
            )

    async def stop(self) -> None:
        try:
            await stop_tasks([self._probe, self._task])
        finally:  # (a stop cancelled meanwhile closes its session all the same)
            if self._own_session and self.session is not None:
                await self.session.close()

    # -- applying what the store says ------------------------------------------------

    def _read_all(
        self,
        entries: list[tuple[bytes, bytes]],
        prefix: str,
        records: dict[str, WorkerRecord],
        skipped: dict[str, int],
        origin: dict[str, str] | None = None,
    ) -> None:
        """Add the usable ones of ``entries`` to ``records`` (``origin``: worker id -> ``prefix``);
        count the others by reason in ``skipped``."""
        for key, value in entries:
            try:
                worker_id, record = parse_entry(prefix, key, value)
            except RecordError as exc:
                reason = str(exc).split(":", 1)[0].split(", got", 1)[0][:120]  # grouped: no sizes
                skipped[reason] = skipped.get(reason, 0) + 1
                continue
            if len(records) >= MAX_WORKERS and worker_id not in records:
                over = f"past the {MAX_WORKERS}-worker bound"
                skipped[over] = skipped.get(over, 0) + 1
                continue
            records[worker_id] = record
            if origin is not None:
                origin[worker_id] = prefix

    def _summarize(self, skipped: dict[str, int]) -> None:
        if not skipped:
            return
        count = sum(skipped.values())
        self.ignored += count
        reasons = "; ".join(f"{n} x {why}" for why, n in sorted(skipped.items(), key=lambda kv: -kv[1])[:5])
        log.warning(
            "cluster: %s: %d unusable entries ignored (%s)", self.settings.cluster_uri, count, reasons
        )

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
            log.warning(
                "cluster: %s unreachable (%r): serving the last known %d worker(s)",
                self.settings.cluster_uri,
                exc,
                len(self.workers),
            )
        self.connected = False

    # -- etcd --------------------------------------------------------------------------

    async def _run_etcd(self) -> None:
        assert self._etcd is not None
        prefixes = self.settings.prefixes
        backoff = 0.05
        while True:
            try:
                records: dict[str, WorkerRecord] = {}
                origin: dict[str, str] = {}
                skipped: dict[str, int] = {}
                revisions: dict[str, int] = {}
                for prefix in prefixes:  # one bound over all of them: MAX_WORKERS in all
                    async for kvs, page_revision in self._etcd.range_prefix_pages(prefix):
                        self._read_all(kvs, prefix, records, skipped, origin)
                        revisions[prefix] = page_revision  # one prefix's pages share a revision
                self._summarize(skipped)
                self._origin = origin
                self._replace(records)
                backoff = 0.05
                # one watch per prefix, each from the revision after its own read (a later one would
                # miss what changed under an earlier prefix meanwhile); any of them ending is a resync
                await until_one_fails([self._follow(p, revisions[p] + 1) for p in prefixes])
            except _TRANSIENT as exc:
                self._lost(exc)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.settings.heartbeat_interval_s)

    async def _follow(self, prefix: str, revision: int) -> None:
        assert self._etcd is not None
        async for events in self._etcd.watch_prefix(prefix, revision):
            changed = False
            for event in events:
                worker_id = event.key.decode("utf-8", "replace")[len(prefix) :]
                if event.kind == "DELETE":
                    changed |= self._drop(worker_id, prefix)
                    continue
                try:
                    worker_id, record = parse_entry(prefix, event.key, event.value)
                except RecordError as exc:
                    self.ignored += 1
                    self.complaints(event.key.decode("utf-8", "replace"), str(exc))
                    changed |= self._drop(worker_id, prefix)
                    continue
                if len(self.workers) >= MAX_WORKERS and worker_id not in self.workers:
                    self.ignored += 1
                    self.complaints(worker_id, f"past the {MAX_WORKERS}-worker bound")
                elif self.workers.get(worker_id) != record:
                    self.workers[worker_id] = record
                    self._origin[worker_id] = prefix
                    changed = True
            if changed:
                self.on_change(dict(self.workers))
        raise EtcdError(f"the watch of {prefix} ended")

    def _drop(self, worker_id: str, prefix: str) -> bool:
        """Forget ``worker_id`` if its record came from ``prefix`` (the same id under the other
        prefix is another entry); True if it was known."""
        if self._origin.get(worker_id, prefix) != prefix:
            return False
        self._origin.pop(worker_id, None)
        return self.workers.pop(worker_id, None) is not None

    async def _probe_etcd(self) -> None:
        """Breaks the watch when etcd stops answering, so that its return is a resync."""
        assert self._etcd is not None
        misses = 0
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval_s)
            if not self.connected:
                misses = 0
                continue
            try:
                await self._etcd.status()
                misses = 0
            except _TRANSIENT as exc:
                # One slow answer on a busy host is no outage (a dead etcd breaks the watch at once):
                # only PROBE_MISSES in a row drop the connection and cost a full resync.
                misses += 1
                if misses < PROBE_MISSES:
                    continue
                misses = 0
                self._lost(exc)
                if self._task is not None:  # restart the loop: it reads everything when etcd is back
                    # stop_tasks, not suppress(CancelledError) around await: a stop cancelling this
                    # probe meanwhile would have its cancel swallowed, and the probe go on
                    await stop_tasks([self._task])
                    self._task = asyncio.get_running_loop().create_task(self._run_etcd(), name=_WATCH_TASK)

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
                    raw = await r.content.read(MAX_LISTING_BYTES + 1)
                    if len(raw) > MAX_LISTING_BYTES:
                        raise EtcdError(
                            f"registry {self.settings.cluster_uri}: a listing above {MAX_LISTING_BYTES} bytes"
                        )
                    status = r.status
                if status == 404 and version is None:
                    # no registry of ours there: a trtllm-serve orchestrator's HTTP cluster storage
                    log.info(
                        "cluster: %s has no %s: reading it as trtllm-serve's HTTP cluster storage",
                        self.settings.cluster_uri,
                        REGISTRY_PATH.decode(),
                    )
                    await self._run_trtllm_store()
                if status != 200:
                    raise EtcdError(f"registry {self.settings.cluster_uri}: HTTP {status}: {raw[:300]!r}")
                answer = json.loads(raw)
                records: dict[str, WorkerRecord] = {}
                skipped: dict[str, int] = {}
                entries = [
                    (str(worker_id).encode(), json.dumps(obj).encode())
                    for worker_id, obj in answer["workers"].items()
                ]
                self._read_all(entries, "", records, skipped)
                del entries
                new_version = int(answer["version"])
                if version is None or new_version != version or not self.connected:
                    self._summarize(skipped)
                    self._replace(records)
                version = new_version
                backoff = 0.05
                continue
            except _TRANSIENT as exc:
                self._lost(exc)
                version = None
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.settings.heartbeat_interval_s)

    # -- trtllm-serve's HTTP cluster storage ------------------------------------------------

    async def _run_trtllm_store(self) -> None:
        """Follow a trtllm-serve orchestrator's HTTP storage: ``GET /get_prefix`` of each key prefix
        every ``heartbeat_interval_s`` (its API has no watch). Never returns."""
        backoff = 0.05
        while True:
            try:
                records: dict[str, WorkerRecord] = {}
                skipped: dict[str, int] = {}
                for prefix in self.settings.prefixes:
                    self._read_all(await self._get_prefix(prefix), prefix, records, skipped)
                if records != self.workers or not self.connected:
                    self._summarize(skipped)
                    self._replace(records)
                backoff = 0.05
                await asyncio.sleep(self.settings.heartbeat_interval_s)
            except _TRANSIENT as exc:
                self._lost(exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.settings.heartbeat_interval_s)

    async def _get_prefix(self, prefix: str) -> list[tuple[bytes, bytes]]:
        assert self.session is not None
        uri = self.settings.cluster_uri
        headers = {}
        if self.settings.api_key is not None:  # its own key only: the shared secret is never sent here
            headers["Authorization"] = "Bearer " + self.settings.api_key.decode("utf-8", "surrogateescape")
        timeout = aiohttp.ClientTimeout(total=max(1.0, min(5.0, self.settings.heartbeat_interval_s * 2)))
        query = urlencode({"key_prefix": prefix, "keys_only": 0})
        async with self.session.get(f"{uri}/get_prefix?{query}", headers=headers, timeout=timeout) as r:
            raw = await r.content.read(MAX_LISTING_BYTES + 1)
            status = r.status
        if len(raw) > MAX_LISTING_BYTES:
            raise EtcdError(f"cluster storage {uri}: a listing above {MAX_LISTING_BYTES} bytes")
        try:
            result = json.loads(raw).get("result") if status in (200, 400) else None
        except (ValueError, AttributeError):
            result = None
        # {"result": {}} with a 400 is its "nothing under that prefix"; any other answer is a failure
        if status == 400 and result in ({}, None) and raw.lstrip().startswith(b"{"):
            return []
        if status != 200 or not isinstance(result, dict):
            raise EtcdError(f"cluster storage {uri}: GET /get_prefix HTTP {status}: {raw[:300]!r}")
        return [
            (
                str(k).encode("utf-8", "surrogatepass"),
                v.encode("utf-8", "surrogatepass") if isinstance(v, str) else b"",
            )
            for k, v in result.items()
        ]


async def until_one_fails(coros: list[Coroutine[Any, Any, None]]) -> None:
    """Run ``coros`` together until one ends (each raises when it does: a watch that ended); cancel
    the others and raise its exception. asyncio.wait, not a TaskGroup: Python 3.10 is supported."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for task in done:
        exc = None if task.cancelled() else task.exception()
        if exc is not None:
            raise exc
    raise EtcdError("a watch ended")


__all__ = ["ClusterWatcher"]
