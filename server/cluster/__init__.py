"""Cluster membership: workers register in a store, orchestrators watch it (config ``disagg_cluster``).

- :mod:`.records`: settings, the worker record and the key layout;
- :mod:`.etcd`: etcd v3 through its JSON gateway (aiohttp);
- :mod:`.registration`: a worker's lease and heartbeats (etcd or an embedded registry);
- :mod:`.watcher`: an orchestrator's full read + watch, resync after an outage;
- :mod:`.embedded`: the registry an orchestrator keeps itself (``cluster_uri: http://``).
"""

from .embedded import REGISTRY_PATH, EmbeddedRegistry, sign_registry
from .records import ClusterSettings, RecordError, WorkerRecord, new_worker_id
from .registration import WorkerRegistration
from .watcher import ClusterWatcher

__all__ = [
    "REGISTRY_PATH",
    "ClusterSettings",
    "ClusterWatcher",
    "EmbeddedRegistry",
    "RecordError",
    "WorkerRecord",
    "WorkerRegistration",
    "new_worker_id",
    "sign_registry",
]
