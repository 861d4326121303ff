"""Workers found through a cluster store (config ``disagg_cluster``; the store side is server/cluster).

The orchestrator watches the cluster's prefix (etcd) or keeps the registry itself
(``cluster_uri: http://`` naming this orchestrator's own address; another
orchestrator on that URI is watched over HTTP). Every change of the registered
set goes through :meth:`Discovery.apply`:

- a worker's role puts it in the context pool, the generation pool, or both
  (role ``both``); its URL becomes a pool member and is health-checked at once,
  so it takes traffic as soon as its ``/health`` passes (well within a second);
- a worker serving another model than the deployment's (config ``model``, else
  the first worker discovered) is refused, with one log line per worker; a
  trtllm-serve record names no model, so it is not checked;
- a worker whose record names another protocol than the deployment's ``worker_protocol`` is
  refused the same way (a record that names none speaks trtllm's: fastcore's and trtllm-serve's
  workers; a vLLM or SGLang worker is registered naming its own, by ``fastcore-serve register``);
- a worker whose registration is gone (clean shutdown, or its lease expired)
  leaves the pool; its requests in flight finish, new ones go elsewhere;
- statically configured ``urls`` stay whatever discovery says.

While the store is unreachable the last known set keeps serving (the watcher
keeps it); ``/metrics`` says so (``fastcore_orchestrator_cluster_connected``).
``/health`` is 503 until ``minimal_instances`` of each pool are healthy.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from server.cluster import ClusterSettings, ClusterWatcher, EmbeddedRegistry, WorkerRecord
from server.cluster.embedded import UNSIGNED_FLAG
from server.cluster.records import DEFAULT_PROTOCOL

from .pools import Pool, Worker

if TYPE_CHECKING:
    import aiohttp

    from .config import DisaggClusterConfig

log = logging.getLogger("fastcore.orchestrator")

#: which pools a registered role joins
ROLE_POOLS = {"context": ("context",), "generation": ("generation",), "both": ("context", "generation")}
_LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "0.0.0.0", "::", ""})


def cluster_settings(config: DisaggClusterConfig, secret: bytes | None = None) -> ClusterSettings:
    return ClusterSettings(
        cluster_uri=config.cluster_uri,
        cluster_name=config.cluster_name,
        heartbeat_interval_s=config.heartbeat_interval_sec,
        inactive_timeout_s=config.inactive_timeout_sec,
        secret=secret,
        key_prefixes=tuple(dict.fromkeys(config.key_prefixes)),
        api_key=config.api_key.encode() if config.api_key else None,
    )


def hosts_registry(cluster_uri: str, hostname: str, port: int) -> bool:
    """Whether ``cluster_uri`` (http://) names this orchestrator's own listening address."""
    if not cluster_uri.startswith("http://"):
        return False
    where = urlsplit(cluster_uri)
    if where.port != port:
        return False
    host = (where.hostname or "").lower()
    return host == hostname.lower() or (host in _LOCAL_HOSTS and hostname.lower() in _LOCAL_HOSTS)


class Discovery:
    def __init__(
        self,
        config: DisaggClusterConfig,
        pools: dict[str, Pool],
        *,
        model: str | None,
        hostname: str,
        protocol: str = DEFAULT_PROTOCOL,
        port: int,
        check_now: Callable[[Pool, Worker], None],
        on_removed: Callable[[Pool, Worker], None],
        secret: bytes | None = None,
    ) -> None:
        self.config = config
        self.settings = cluster_settings(config, secret)
        self.pools = pools
        self.model = model
        #: the deployment's worker protocol: a record naming another is refused
        self.protocol = protocol
        self.check_now = check_now
        self.on_removed = on_removed
        #: worker_id -> why it was refused (logged once)
        self.refused: dict[str, str] = {}
        #: worker_id -> record of the registered workers the pools took
        self.accepted: dict[str, WorkerRecord] = {}
        self.embedded: EmbeddedRegistry | None = None
        self.watcher: ClusterWatcher | None = None
        if hosts_registry(config.cluster_uri, hostname, port):
            self.embedded = EmbeddedRegistry(
                self.settings, allow_unsigned_loopback=config.allow_unsigned_loopback_registration
            )
            if secret is None and not config.api_key and not config.allow_unsigned_loopback_registration:
                log.warning(
                    "cluster: no shared secret: the registry at %s refuses every registration (set "
                    "FASTCORE_SHARED_SECRET here and on the workers, or disagg_cluster.%s: true)",
                    config.cluster_uri,
                    UNSIGNED_FLAG,
                )

    # -- lifecycle -------------------------------------------------------------

    async def start(self, session: aiohttp.ClientSession | None = None) -> None:
        if self.embedded is not None:
            await self.embedded.start()
            self.embedded.subscribe(self.apply)
            self.apply(self.embedded.snapshot())
            log.info(
                "cluster %r: keeping the worker registry at %s",
                self.settings.cluster_name,
                self.settings.cluster_uri,
            )
            return
        self.watcher = ClusterWatcher(self.settings, self.apply, session=session)
        await self.watcher.start()
        log.info("cluster %r: watching %s", self.settings.cluster_name, self.settings.cluster_uri)

    async def stop(self) -> None:
        if self.watcher is not None:
            await self.watcher.stop()
        if self.embedded is not None:
            await self.embedded.stop()

    # -- state -----------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """Whether the registry is reachable now (the embedded one always is)."""
        return self.watcher.connected if self.watcher is not None else True

    @property
    def resyncs(self) -> int:
        return self.watcher.resyncs if self.watcher is not None else 0

    def handles(self, path: bytes) -> bool:
        return self.embedded is not None and self.embedded.handles(path)

    async def handle(self, request: Any, out: Any) -> None:
        assert self.embedded is not None
        await self.embedded.handle(request, out)

    def missing(self) -> list[str]:
        """The pools short of ``minimal_instances`` healthy workers, as "<pool> (n of m)"."""
        short = []
        for name, pool in self.pools.items():
            need, have = self.config.minimal(name), pool.healthy_count()
            if have < need:
                short.append(f"{name} ({have} of {need} healthy)")
        return short

    # -- changes ---------------------------------------------------------------

    def _accepted(self, record: WorkerRecord) -> bool:
        why = None
        if record.role not in ROLE_POOLS:
            why = f"role {record.role!r} is none of {', '.join(ROLE_POOLS)}"
        elif record.protocol != self.protocol:
            why = f"it speaks worker protocol {record.protocol!r}, this deployment {self.protocol!r}"
        elif not record.model:
            pass  # trtllm-serve's records name no model: it cannot be checked here
        elif self.model is None:
            self.model = record.model
            log.info("cluster: serving model %r (the first worker discovered, %s)", record.model, record.url)
        elif record.model != self.model:
            why = f"it serves model {record.model!r}, this deployment {self.model!r}"
        if why is None:
            self.refused.pop(record.worker_id, None)
            return True
        if self.refused.get(record.worker_id) != why:
            self.refused[record.worker_id] = why
            log.warning("cluster: worker %s at %s refused: %s", record.worker_id, record.url, why)
        return False

    def cluster_info(self) -> dict[str, Any]:
        """trtllm-serve's ``/cluster_info`` (its DisaggClusterManager.cluster_info): the registered
        workers each pool took, as its WorkerInfo (role 0 context, 1 generation; a ``both`` worker
        is in both lists), and ``minimal_instances``."""
        lists: dict[str, list[dict[str, Any]]] = {"context_servers": [], "generation_servers": []}
        for record in self.accepted.values():
            where = urlsplit(record.url)
            for number, pool in enumerate(("context", "generation")):
                if pool in ROLE_POOLS[record.role]:
                    lists[f"{pool}_servers"].append(
                        {
                            "worker_id": record.worker_id,
                            "host": where.hostname,
                            "port": where.port,
                            "role": number,
                        }
                    )
        minimal = {f"{name}_servers": self.config.minimal(name) for name in ("context", "generation")}
        return {"current_workers": lists, "minimal_instances": minimal}

    def apply(self, records: dict[str, WorkerRecord]) -> None:
        """Make the pools' discovered workers those of ``records`` (called on every change)."""
        wanted: dict[str, set[str]] = {name: set() for name in self.pools}
        self.accepted = {}
        for record in records.values():
            if self._accepted(record):
                self.accepted[record.worker_id] = record
                for name in ROLE_POOLS[record.role]:
                    if name in wanted:
                        wanted[name].add(record.url.rstrip("/"))
        for gone_id in set(self.refused) - set(records):
            del self.refused[gone_id]
        for name, pool in self.pools.items():
            added, removed = pool.sync_discovered(wanted[name])
            for worker in added:
                log.info("cluster: %s worker %s joined", name, worker.url)
                self.check_now(pool, worker)
            for worker in removed:
                log.info("cluster: %s worker %s left", name, worker.url)
                self.on_removed(pool, worker)

    def count(self, pool: str) -> int:
        return len(self.pools[pool].discovered)


def schedule_check(checker: Any, background: set[asyncio.Task[None]]) -> Callable[[Pool, Worker], None]:
    """A ``check_now`` that runs one health check of the new worker in the background."""

    def check_now(pool: Pool, worker: Worker) -> None:
        task = asyncio.get_running_loop().create_task(checker().check_worker(pool, worker))
        background.add(task)
        task.add_done_callback(background.discard)

    return check_now
