"""What a cluster holds: its settings, one record per worker, and the key layout.

A worker registers one JSON object (:class:`WorkerRecord`) under
``/fastcore/<cluster_name>/workers/<worker_id>`` (etcd; the embedded registry
keeps the same records in memory). Other tools may register workers the same
way: docs/protocol.md, "Cluster discovery", is the contract.

trtllm-serve's workers register ``{"worker_id", "host", "port", "role"}`` (role
0 = context, 1 = generation: its ``ServerRole``) under
``/trtllm-disagg/<cluster_name>/workers/<worker_id>`` (its
``disagg_auto_scaling.py``). Orchestrators read both layouts under both
prefixes (``key_prefixes``), and a record may carry trtllm-serve's fields and
ours at once; a worker writes one layout (``record_format``).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import secrets
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit

#: roles a worker may register with (server.worker.app.ROLES)
ROLES = ("context", "generation", "both")
#: the worker protocols a record may name (server.orchestrator.protocols.PROTOCOLS' names); a record that
#: names none speaks trtllm's (fastcore's workers and trtllm-serve's: what every record meant before)
PROTOCOLS = ("trtllm", "vllm", "sglang")
DEFAULT_PROTOCOL = "trtllm"
#: the record's member naming it
PROTOCOL_FIELD = "protocol"
#: the most bytes one record may take (a value in etcd, a PUT body in the embedded registry). A real
#: record is ~700 bytes (its capabilities are the worker's /server_info, ~540); 4 KiB leaves room
#: for long model names and new fields while bounding what one registration can make us hold.
MAX_RECORD_BYTES = 4 << 10
#: the most records an orchestrator keeps (the embedded registry's bound, the watcher's too): with
#: MAX_RECORD_BYTES this bounds a registry's memory (~1024 x ~20 KB parsed, docs/protocol.md)
MAX_WORKERS = 1024
#: a record's capabilities: at most this many members (nested ones counted), nested at most one level
MAX_CAPABILITIES = 64
#: the key prefix of every fastcore cluster
KEY_ROOT = "/fastcore"
#: the key prefix of every trtllm-serve cluster (its get_worker_key_prefix)
TRTLLM_KEY_ROOT = "/trtllm-disagg"
#: record layouts / key prefixes: ours and trtllm-serve's
LAYOUTS: tuple[Literal["fastcore", "trtllm"], ...] = ("fastcore", "trtllm")
#: the cluster's timings unless configured (ClusterSettings', the worker's flags', the orchestrator's
#: disagg_cluster keys'): seconds between a worker's heartbeats, seconds of silence before it is gone
HEARTBEAT_INTERVAL_S = 5.0
INACTIVE_TIMEOUT_S = 10.0
#: trtllm-serve's ServerRole values a worker may register with -> our roles (2+: encoders, ...)
TRTLLM_ROLES = {0: "context", 1: "generation"}
_TRTLLM_ROLE_NAMES = {0: "CONTEXT", 1: "GENERATION", 2: "MM_ENCODER", 3: "VISUAL_GEN", 4: "EMBEDDING"}
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
    heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S
    #: seconds without a heartbeat after which a worker is gone (its lease's TTL)
    inactive_timeout_s: float = INACTIVE_TIMEOUT_S
    #: with a shared secret, the embedded registry's requests are signed (server.auth)
    secret: bytes | None = field(default=None, repr=False)
    #: the key prefixes an orchestrator reads (LAYOUTS): ours, trtllm-serve's, or both
    key_prefixes: tuple[str, ...] = LAYOUTS
    #: the layout a worker registers in: "fastcore" (its record, our prefix) or "trtllm"
    #: (trtllm-serve's four fields under its prefix, its HTTP storage API on http://)
    record_format: str = "fastcore"
    #: trtllm-serve's HTTP cluster storage bearer key (``Authorization: Bearer``); None: the secret
    api_key: bytes | None = field(default=None, repr=False)

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
        if not self.key_prefixes or set(self.key_prefixes) - set(LAYOUTS):
            raise RecordError(
                f"key_prefixes: one or more of {', '.join(LAYOUTS)}, got {list(self.key_prefixes)}"
            )
        if self.record_format not in LAYOUTS:
            raise RecordError(
                f"record_format must be one of {', '.join(LAYOUTS)}, got {self.record_format!r}"
            )

    @property
    def etcd(self) -> bool:
        return self.cluster_uri.startswith("etcd://")

    def etcd_endpoints(self) -> list[str]:
        """The etcd members as http:// base URLs (its JSON gateway)."""
        hosts = self.cluster_uri.removeprefix("etcd://").strip("/").split(",")
        return [f"http://{h.strip()}" for h in hosts if h.strip()]

    def prefix_of(self, layout: str) -> str:
        """The key prefix of this cluster's workers in ``layout`` (ends in '/'). trtllm-serve's takes
        the name as it is ('/trtllm-disagg//workers/' when empty), ours says 'default'."""
        if layout == "trtllm":
            return f"{TRTLLM_KEY_ROOT}/{self.cluster_name}/workers/"
        return f"{KEY_ROOT}/{self.cluster_name or 'default'}/workers/"

    @property
    def prefix(self) -> str:
        """The key prefix this worker registers under (its ``record_format``'s)."""
        return self.prefix_of(self.record_format)

    @property
    def prefixes(self) -> list[str]:
        """The key prefixes an orchestrator reads (``key_prefixes``)."""
        return [self.prefix_of(layout) for layout in self.key_prefixes]

    def key(self, worker_id: str) -> str:
        return self.prefix + worker_id

    @property
    def bearer_key(self) -> bytes | None:
        """trtllm-serve's HTTP storage key: ``api_key``, else the shared secret."""
        return self.api_key if self.api_key is not None else self.secret


def new_worker_id(role: str, port: int, layout: str = "fastcore", host: str = "") -> str:
    """A worker's id: unique per process start (a restarted worker is a new member).

    ``layout="trtllm"``: trtllm-serve's shape, ``<ROLE>-<host>:<port>-<ms>-<pid>-<nnn>``."""
    if layout == "trtllm":
        where = re.sub(r"[^A-Za-z0-9._:-]", "-", host)[:64] or "host"
        return (
            f"{role.upper()}-{where}:{port}-{int(time.time() * 1000)}-{os.getpid()}-"
            f"{secrets.randbelow(1000):03}"
        )
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:64] or "host"
    return f"{role}-{host}-{port}-{secrets.token_hex(4)}"


def check_worker_url(url: str) -> str:
    """``url`` (``http://HOST:PORT``) if an orchestrator may send traffic there, else a RecordError.

    A registration names where prompts go, so only what a worker really is passes: plain http (the
    workers serve no TLS), a host and an explicit port, no path, query, fragment or userinfo, no
    IPv6 zone id, no link-local (169.254/16 holds cloud metadata services; fe80::/10), unspecified
    (0.0.0.0, ::) or multicast address, and no IPv4 spelling a resolver would read but a reader
    would not (``2852039166``, ``0xa9.0xfe.1``: inet_aton forms). A DNS name is taken as named: what
    it resolves to is not checked here (docs/protocol.md, "Cluster discovery").
    """

    def bad(why: str) -> RecordError:
        return RecordError(f"worker record field 'url' must be http://HOST:PORT ({why}), got {url[:300]!r}")

    if not url.isascii() or any(c.isspace() or ord(c) < 0x21 for c in url):
        raise bad("ASCII, no spaces or control characters")
    try:
        where = urlsplit(url)
    except ValueError as exc:  # "Invalid IPv6 URL": an unbalanced bracket (a plain ValueError, not ours)
        raise bad(str(exc)) from None
    if where.scheme != "http":
        raise bad("plain http: workers serve no TLS")
    if "@" in where.netloc:
        raise bad("no userinfo")
    if where.path or where.query or where.fragment or url.endswith(("?", "#")):
        raise bad("no path, query or fragment")
    host = where.hostname
    if not host:
        raise bad("a host")
    try:
        port = where.port
    except ValueError as exc:
        raise bad(str(exc)) from None
    if port is None or port == 0:
        raise bad("an explicit port in 1-65535")
    if "%" in host:
        raise bad("no IPv6 zone id")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    if address is None:
        if where.netloc.startswith("["):
            raise bad("a bracketed host must be an IPv6 address")
        try:
            socket.inet_aton(host)
        except OSError:
            pass
        else:  # a resolver reads it as an IPv4 address that is not written as one
            raise bad("an IPv4 address as four decimal numbers")
        if not _HOSTNAME.fullmatch(host):
            raise bad("a DNS name of letters, digits, '-', '_' and '.'")
        return url
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if address.is_link_local or address.is_unspecified or address.is_multicast:
        raise bad("not a link-local, unspecified or multicast address")
    return url


_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOSTNAME = re.compile(rf"(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*\.?")


def _check_capabilities(capabilities: object) -> dict[str, Any]:
    """A flat object of scalars (one level of nesting), at most MAX_CAPABILITIES members in all."""
    if not isinstance(capabilities, dict):
        raise RecordError("worker record field 'capabilities' must be an object")
    count = 0
    for value in capabilities.values():
        count += 1
        if isinstance(value, dict):
            count += len(value)
            if any(isinstance(v, dict | list) for v in value.values()):
                raise RecordError("worker record field 'capabilities' nests objects at most one level deep")
        elif isinstance(value, list):
            raise RecordError("worker record field 'capabilities' holds scalars and objects of scalars")
    if count > MAX_CAPABILITIES:
        raise RecordError(
            f"worker record field 'capabilities' has {count} members, at most {MAX_CAPABILITIES}"
        )
    return capabilities


def _string(obj: dict[str, Any], name: str, limit: int = 512) -> str:
    value = obj.get(name)
    if not isinstance(value, str) or not value or len(value) > limit:
        raise RecordError(
            f"worker record field {name!r} must be a non-empty string of at most {limit} characters"
        )
    return value


def _host_port_url(obj: dict[str, Any]) -> str:
    """trtllm-serve's ``host`` and ``port`` as ``http://HOST:PORT`` (IPv6 bracketed), checked."""
    host, port = obj.get("host"), obj.get("port")
    if not isinstance(host, str) or not host or len(host) > 253:
        raise RecordError("worker record field 'host' must be a non-empty string of at most 253 characters")
    if type(port) is not int or not 0 < port < 65536:
        raise RecordError(f"worker record field 'port' must be an integer in 1-65535, got {port!r}"[:200])
    if ":" in host or "[" in host or "]" in host:  # only an IPv6 address, written bare, has these
        try:
            ipaddress.IPv6Address(host.split("%", 1)[0])
        except ValueError:
            raise RecordError(
                f"worker record field 'host' {host[:100]!r}: a name, an IPv4 address or a bare "
                "IPv6 address (no brackets, no port)"
            ) from None
        return check_worker_url(f"http://[{host}]:{port}")
    return check_worker_url(f"http://{host}:{port}")


@dataclass(frozen=True)
class WorkerRecord:
    """One registered worker: who it is, what it serves and where.

    ``layout`` is how it was (or will be) written: ``fastcore`` (``role`` a name, ``url``, ``model``,
    ``capabilities``) or ``trtllm`` (trtllm-serve's ``host``, ``port`` and ``role`` as its
    ServerRole number; ``model`` "" when the record names none: unknown, not checked). ``protocol``:
    what its legs speak (:data:`PROTOCOLS`; written only when not trtllm's, which a record that names
    none speaks), so that an orchestrator takes only the workers of its ``worker_protocol``.
    """

    worker_id: str
    role: str
    model: str
    #: where the orchestrator reaches it: http://HOST:PORT (no path)
    url: str
    #: its /server_info (what a context leg may ask of it, auth, KV capacity, ...)
    capabilities: dict[str, Any] = field(default_factory=dict)
    layout: str = "fastcore"
    protocol: str = DEFAULT_PROTOCOL

    def to_json(self) -> bytes:
        if self.layout == "trtllm":
            # trtllm-serve reads WorkerInfo(**value): exactly these four unless we add ours
            where = urlsplit(self.url)
            number = {name: n for n, name in TRTLLM_ROLES.items()}.get(self.role)
            if number is None:
                raise RecordError(
                    f"trtllm-serve's records have one role, CONTEXT or GENERATION, not {self.role!r}"
                )
            obj: dict[str, Any] = {
                "worker_id": self.worker_id,
                "host": where.hostname,
                "port": where.port,
                "role": number,
            }
            if self.model:
                obj["model"] = self.model
            if self.capabilities:
                obj["capabilities"] = self.capabilities
        else:
            obj = {
                "worker_id": self.worker_id,
                "role": self.role,
                "model": self.model,
                "url": self.url,
                "capabilities": self.capabilities,
            }
        if self.protocol != DEFAULT_PROTOCOL:
            obj[PROTOCOL_FIELD] = self.protocol
        return json.dumps(obj, separators=(",", ":")).encode()

    @classmethod
    def from_obj(cls, obj: object) -> WorkerRecord:
        """Either layout, or both in one record (trtllm-serve's fields plus ours): a numeric
        ``role`` is trtllm-serve's ServerRole; ``host`` + ``port`` stand for ``url`` (both given:
        they must agree)."""
        if not isinstance(obj, dict):
            raise RecordError("a worker record must be a JSON object")
        worker_id = _string(obj, "worker_id", 200)
        if not _WORKER_ID.fullmatch(worker_id):
            raise RecordError("worker record field 'worker_id' takes letters, digits and . _ : - only")
        role = obj.get("role")
        layout = "fastcore"
        if type(role) is int:
            if role not in TRTLLM_ROLES:
                name = _TRTLLM_ROLE_NAMES.get(role, "unknown")
                raise RecordError(
                    f"worker record field 'role' {role} (trtllm-serve's {name}): only 0 "
                    "(CONTEXT) and 1 (GENERATION) serve here"
                )
            role, layout = TRTLLM_ROLES[role], "trtllm"
        else:
            role = _string(obj, "role")
            if role not in ROLES:
                raise RecordError(
                    f"worker record field 'role' must be one of {', '.join(ROLES)} "
                    f"(or trtllm-serve's 0, 1), got {role!r}"
                )
        if "host" in obj or "port" in obj:
            url = _host_port_url(obj)
            if "url" in obj and check_worker_url(_string(obj, "url", 300).rstrip("/")) != url:
                raise RecordError(f"worker record fields 'url' and 'host'/'port' disagree ({url})")
        else:
            url = check_worker_url(_string(obj, "url", 300).rstrip("/"))
        capabilities = _check_capabilities(obj.get("capabilities", {}))
        model = _string(obj, "model") if layout == "fastcore" or "model" in obj else ""
        protocol = obj.get(PROTOCOL_FIELD, DEFAULT_PROTOCOL)
        if protocol not in PROTOCOLS:
            raise RecordError(
                f"worker record field {PROTOCOL_FIELD!r} must be one of {', '.join(PROTOCOLS)} "
                f"(none: trtllm), got {protocol!r}"[:300]
            )
        return cls(worker_id, role, model, url, capabilities, layout, protocol)

    @classmethod
    def from_json(cls, raw: bytes | str) -> WorkerRecord:
        if len(raw) > MAX_RECORD_BYTES:
            raise RecordError(f"a worker record takes at most {MAX_RECORD_BYTES} bytes, got {len(raw)}")
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise RecordError(f"a worker record must be JSON: {exc}") from None
        return cls.from_obj(obj)


def parse_entry(prefix: str, key: bytes, value: bytes) -> tuple[str, WorkerRecord]:
    """One store entry (key, value) under ``prefix``: its worker id and record, else a RecordError.

    The key must be UTF-8, end in a valid worker id, and name the same worker as its record (a
    record under another worker's key would take that worker's place). The one place a store entry
    is read: either layout under either prefix (:meth:`WorkerRecord.from_obj`).
    """
    try:
        text = key.decode()
    except UnicodeDecodeError:
        raise RecordError("the key is not UTF-8") from None
    worker_id = text[len(prefix) :] if text.startswith(prefix) else ""
    if not _WORKER_ID.fullmatch(worker_id):
        raise RecordError("the key does not end in a worker id (letters, digits and . _ : -)")
    record = WorkerRecord.from_json(value)
    if record.worker_id != worker_id:
        raise RecordError(f"the record's worker_id {record.worker_id!r} is not its key's {worker_id!r}")
    return worker_id, record


__all__ = [
    "KEY_ROOT",
    "LAYOUTS",
    "MAX_RECORD_BYTES",
    "MAX_WORKERS",
    "PROTOCOLS",
    "ROLES",
    "TRTLLM_KEY_ROOT",
    "TRTLLM_ROLES",
    "ClusterSettings",
    "RecordError",
    "WorkerRecord",
    "check_worker_url",
    "new_worker_id",
    "parse_entry",
]
