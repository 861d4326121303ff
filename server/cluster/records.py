"""What a cluster holds: its settings, one record per worker, and the key layout.

A worker registers one JSON object (:class:`WorkerRecord`) under
``/fastcore/<cluster_name>/workers/<worker_id>`` (etcd; the embedded registry
keeps the same records in memory). Other tools may register workers the same
way: docs/protocol.md, "Cluster discovery", is the contract.
"""

from __future__ import annotations

import json
import re
import secrets
import socket
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

#: roles a worker may register with (server.worker.app.ROLES)
ROLES = ("context", "generation", "both")
#: the most bytes one record may take (a value in etcd, a PUT body in the embedded registry)
MAX_RECORD_BYTES = 64 << 10
#: the key prefix of every fastcore cluster
KEY_ROOT = "/fastcore"
_NAME = re.compile(r"[A-Za-z0-9._-]{0,128}")
_WORKER_ID = re.compile(r"[A-Za-z0-9._:-]{1,200}")


class RecordError(ValueError):
    """A record or setting that cannot be used; the message names the field."""


@dataclass(frozen=True)
class ClusterSettings:
    """Where the cluster is and how often its members speak (config ``disagg_cluster``)."""

    #: etcd://HOST:PORT[,HOST:PORT...] or http://HOST:PORT (an orchestrator's embedded registry)
    cluster_uri: str
    cluster_name: str = ""
    #: seconds between a worker's heartbeats (lease keep-alives)
    heartbeat_interval_s: float = 5.0
    #: seconds without a heartbeat after which a worker is gone (its lease's TTL)
    inactive_timeout_s: float = 10.0
    #: with a shared secret, the embedded registry's requests are signed (server.auth)
    secret: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        scheme, sep, rest = self.cluster_uri.partition("://")
        if not sep or scheme not in ("etcd", "http") or not rest.strip("/"):
            raise RecordError(
                f"cluster_uri must be etcd://HOST:PORT or http://HOST:PORT, got {self.cluster_uri!r}"
            )
        if not _NAME.fullmatch(self.cluster_name):
            raise RecordError(
                f"cluster_name {self.cluster_name!r}: at most 128 of letters, digits, '.', '_' and '-'"
            )
        if not self.heartbeat_interval_s > 0 or not self.inactive_timeout_s > 0:
            raise RecordError("heartbeat_interval_sec and inactive_timeout_sec must be > 0")
        if self.heartbeat_interval_s >= self.inactive_timeout_s:
            raise RecordError(
                f"heartbeat_interval_sec ({self.heartbeat_interval_s:g}) must be below inactive_timeout_sec "
                f"({self.inactive_timeout_s:g}): a worker would expire between two heartbeats"
            )

    @property
    def etcd(self) -> bool:
        return self.cluster_uri.startswith("etcd://")

    def etcd_endpoints(self) -> list[str]:
        """The etcd members as http:// base URLs (its JSON gateway)."""
        hosts = self.cluster_uri.removeprefix("etcd://").strip("/").split(",")
        return [f"http://{h.strip()}" for h in hosts if h.strip()]

    @property
    def prefix(self) -> str:
        """The key prefix of this cluster's workers (ends in '/')."""
        return f"{KEY_ROOT}/{self.cluster_name or 'default'}/workers/"

    def key(self, worker_id: str) -> str:
        return self.prefix + worker_id


def new_worker_id(role: str, port: int) -> str:
    """A worker's id: unique per process start (a restarted worker is a new member)."""
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:64] or "host"
    return f"{role}-{host}-{port}-{secrets.token_hex(4)}"


def _string(obj: dict[str, Any], name: str, limit: int = 2048) -> str:
    value = obj.get(name)
    if not isinstance(value, str) or not value or len(value) > limit:
        raise RecordError(
            f"worker record field {name!r} must be a non-empty string of at most {limit} characters"
        )
    return value


@dataclass(frozen=True)
class WorkerRecord:
    """One registered worker: who it is, what it serves and where."""

    worker_id: str
    role: str
    model: str
    #: where the orchestrator reaches it: http://HOST:PORT (no path)
    url: str
    #: its /server_info (what a context leg may ask of it, auth, KV capacity, ...)
    capabilities: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "worker_id": self.worker_id,
                "role": self.role,
                "model": self.model,
                "url": self.url,
                "capabilities": self.capabilities,
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_obj(cls, obj: object) -> WorkerRecord:
        if not isinstance(obj, dict):
            raise RecordError("a worker record must be a JSON object")
        worker_id = _string(obj, "worker_id", 200)
        if not _WORKER_ID.fullmatch(worker_id):
            raise RecordError("worker record field 'worker_id' takes letters, digits and . _ : - only")
        role = _string(obj, "role")
        if role not in ROLES:
            raise RecordError(f"worker record field 'role' must be one of {', '.join(ROLES)}, got {role!r}")
        url = _string(obj, "url").rstrip("/")
        where = urlsplit(url)
        if where.scheme not in ("http", "https") or not where.hostname or where.path or where.query:
            raise RecordError(f"worker record field 'url' must be http(s)://HOST:PORT, got {url!r}")
        try:
            where.port  # noqa: B018 - raises on a bad port
        except ValueError as exc:
            raise RecordError(f"worker record field 'url': {exc}") from None
        capabilities = obj.get("capabilities", {})
        if not isinstance(capabilities, dict):
            raise RecordError("worker record field 'capabilities' must be an object")
        return cls(worker_id, role, _string(obj, "model"), url, capabilities)

    @classmethod
    def from_json(cls, raw: bytes | str) -> WorkerRecord:
        if len(raw) > MAX_RECORD_BYTES:
            raise RecordError(f"a worker record takes at most {MAX_RECORD_BYTES} bytes, got {len(raw)}")
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise RecordError(f"a worker record must be JSON: {exc}") from None
        return cls.from_obj(obj)


__all__ = [
    "KEY_ROOT",
    "MAX_RECORD_BYTES",
    "ROLES",
    "ClusterSettings",
    "RecordError",
    "WorkerRecord",
    "new_worker_id",
]
