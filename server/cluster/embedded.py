"""The registry an orchestrator keeps itself (``cluster_uri: http://<its own address>``).

For one host with no etcd. Workers speak to it over plain HTTP on the
orchestrator's port:

- ``PUT /cluster/v1/workers/<worker_id>`` with ``{"worker": <record>, "ttl_s": <s>}``:
  registers, and each repeat is a heartbeat; the worker is gone ``ttl_s``
  after its last one (``ttl_s`` capped by ``inactive_timeout_sec``);
- ``DELETE /cluster/v1/workers/<worker_id>``: a clean shutdown;
- ``GET /cluster/v1/workers[?after=<version>]``: ``{"version": N, "workers": {id: record}}``;
  with ``after`` equal to the current version it waits (up to 20 s) for a change.

With a shared secret (``FASTCORE_SHARED_SECRET``) every request carries
``X-Fastcore-Signature`` over ``METHOD SP URL LF BODY`` (:func:`sign_registry`).
Without one the registry refuses every request (403): a registration names
where the orchestrator sends prompts, so an unsigned one would let any local
process take a share of them. ``allow_unsigned_loopback_registration`` opts
into the unsigned mode, loopback peers only, for a single-user host.

It holds at most ``max_workers`` records of at most ``MAX_RECORD_BYTES`` each,
and a GET answers one listing serialized once per change (many pollers share
its bytes).

Beside it, the same store answers trtllm-serve's HTTP cluster storage API
(its ``cluster_storage.py``; a trtllm-serve worker given ``cluster_uri:
http://<this orchestrator>`` registers through it): ``POST /set`` (a
StorageItem: key, value, ttl, overwrite_if_exists), ``GET /get?key=``,
``GET /expire?key=&ttl=``, ``GET /get_prefix?key_prefix=&keys_only=``,
``DELETE /delete?key=``, each ``{"result": ...}``, 400 when the result is
empty. Behind ``Authorization: Bearer <key>`` (``api_key``, else the shared
secret); without either, the same loopback-only opt-in as above. Only worker
records under this cluster's prefixes are stored (each checked by
:func:`parse_entry`, as etcd's are), a ttl is capped by
``inactive_timeout_sec`` (none: that), and the same ``max_workers`` bound
holds for both APIs together.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs

from server.auth import SIGNATURE_HEADER, Verifier, sign_pieces
from server.tasks import stop_tasks

from .records import MAX_RECORD_BYTES, MAX_WORKERS, ClusterSettings, RecordError, WorkerRecord, parse_entry

log = logging.getLogger("fastcore.cluster")

REGISTRY_PATH = b"/cluster/v1/workers"
#: the longest a GET waits for a change
LONG_POLL_S = 20.0
_SIGNATURE = SIGNATURE_HEADER.lower().encode()
_LOOPBACK = ("127.", "::1", "::ffff:127.")
#: a PUT body: the record and {"worker": ..., "ttl_s": ...} around it
_MAX_PUT_BYTES = MAX_RECORD_BYTES + 256
#: the config key that opts into unsigned registrations from loopback peers
UNSIGNED_FLAG = "allow_unsigned_loopback_registration"
#: trtllm-serve's HTTP cluster storage routes (cluster_storage.py add_routes) and their methods
TRTLLM_STORE_ROUTES = {
    b"/set": b"POST",
    b"/get": b"GET",
    b"/expire": b"GET",
    b"/get_prefix": b"GET",
    b"/delete": b"DELETE",
}
#: a /set body: the StorageItem around a value that is a record as a JSON string (escaped: x2)
_MAX_SET_BYTES = 2 * MAX_RECORD_BYTES + 1024


def sign_registry(secret: bytes, method: str, url: str, body: bytes = b"") -> str:
    """The signature header value of one registry request."""
    return sign_pieces(secret, (method.encode(), b" ", url.encode(), b"\n", body))


class EmbeddedRegistry:
    def __init__(
        self,
        settings: ClusterSettings,
        *,
        max_workers: int = MAX_WORKERS,
        allow_unsigned_loopback: bool = False,
    ) -> None:
        self.settings = settings
        self.max_workers = max_workers
        self.verifier = Verifier(settings.secret) if settings.secret is not None else None
        self.allow_unsigned_loopback = allow_unsigned_loopback
        #: (version, the GET answer's bytes): serialized once per change, shared by every GET
        self._listing: tuple[int, bytes] | None = None
        #: store key -> (record, the value as stored, monotonic expiry); our PUTs are kept under
        #: our prefix, trtllm-serve's /set under the key it names
        self._entries: dict[str, tuple[WorkerRecord, str, float]] = {}
        self.version = 0
        self._changed = asyncio.Event()
        self._subscribers: list[Callable[[dict[str, WorkerRecord]], None]] = []
        self._expiry: asyncio.Task[None] | None = None

    # -- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._expiry = loop.create_task(self._expire_loop(), name="fastcore-registry-expiry")

    async def stop(self) -> None:
        try:
            await stop_tasks([self._expiry])
        finally:
            self._changed.set()  # long polls answer now

    def subscribe(self, callback: Callable[[dict[str, WorkerRecord]], None]) -> None:
        self._subscribers.append(callback)

    def snapshot(self) -> dict[str, WorkerRecord]:
        return {record.worker_id: record for record, _, _ in self._entries.values()}

    def _own_key(self, worker_id: str) -> str:
        return self.settings.prefix_of("fastcore") + worker_id

    def _bump(self) -> None:
        self.version += 1
        self._changed.set()
        self._changed = asyncio.Event()
        snapshot = self.snapshot()
        for callback in self._subscribers:
            callback(snapshot)

    async def _expire_loop(self) -> None:
        period = max(0.05, min(0.5, self.settings.inactive_timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            gone = [key for key, (_, _, until) in self._entries.items() if until <= now]
            for key in gone:
                record, _, _ = self._entries.pop(key)
                log.warning(
                    "cluster: worker %s at %s missed its heartbeats: gone", record.worker_id, record.url
                )
            if gone:
                self._bump()

    # -- HTTP ------------------------------------------------------------------------

    def handles(self, path: bytes) -> bool:
        return path == REGISTRY_PATH or path.startswith(REGISTRY_PATH + b"/") or path in TRTLLM_STORE_ROUTES

    @staticmethod
    def routes() -> list[str]:
        """What :meth:`handles` takes, as its orchestrator's 404 lists it."""
        store = [f"{method.decode()} {path.decode()}" for path, method in TRTLLM_STORE_ROUTES.items()]
        return [f"{REGISTRY_PATH.decode()}[/...]", *store]

    async def handle(self, request: Any, out: Any) -> None:
        if request.path in TRTLLM_STORE_ROUTES:
            self._trtllm_store(request, out)
            return
        refused = self._refused(request, out)
        if refused is not None:
            out.send_error(403, f"cluster registry: {refused}", code="registry_refused")
            return
        path, method = request.path, request.method
        if path == REGISTRY_PATH:
            if method != b"GET":
                out.send_error(405, f"{path.decode()} takes GET", headers=b"Allow: GET\r\n")
                return
            await self._list(request, out)
            return
        worker_id = path[len(REGISTRY_PATH) + 1 :].decode("utf-8", "replace")
        if method == b"PUT":
            self._put(worker_id, request, out)
        elif method == b"DELETE":
            if self._entries.pop(self._own_key(worker_id), None) is None:
                out.send_error(404, f"cluster registry: no worker {worker_id[:200]!r}", code="unknown_worker")
                return
            log.info("cluster: worker %s deregistered", worker_id)
            self._bump()
            out.send(200, b'{"deleted": true}')
        else:
            out.send_error(405, "a registry entry takes PUT or DELETE", headers=b"Allow: PUT, DELETE\r\n")

    def _refused(self, request: Any, out: Any) -> str | None:
        if self.verifier is None:
            if not self.allow_unsigned_loopback:
                return (
                    "no shared secret is set, so registrations are refused (set FASTCORE_SHARED_SECRET on "
                    f"the orchestrator and the workers, or disagg_cluster.{UNSIGNED_FLAG}: true to let any "
                    "process on this host register)"
                )
            peer = out.peer
            host = peer[0] if isinstance(peer, tuple) and peer else ""
            if not str(host).startswith(_LOOPBACK):
                return (
                    "without a shared secret only this host may register workers "
                    "(set FASTCORE_SHARED_SECRET on the orchestrator and the workers)"
                )
            return None
        pieces = (request.method, b" ", request.url, b"\n", request.body)
        reason = self.verifier.check(pieces, request.header(_SIGNATURE))
        return None if reason is None else f"{SIGNATURE_HEADER} {reason}"

    def _put(self, worker_id: str, request: Any, out: Any) -> None:
        if len(request.body) > _MAX_PUT_BYTES:
            out.send_error(
                413,
                f"cluster registry: a registration takes at most {_MAX_PUT_BYTES} bytes "
                f"(its record at most {MAX_RECORD_BYTES})",
            )
            return
        try:
            try:
                obj = json.loads(request.body)
            except json.JSONDecodeError as exc:
                raise RecordError(f"a registration must be JSON: {exc.msg} at byte {exc.pos}") from None
            if not isinstance(obj, dict):
                raise RecordError('a registration is {"worker": <record>, "ttl_s": <seconds>}')
            record = WorkerRecord.from_obj(obj.get("worker"))
            ttl = obj.get("ttl_s", self.settings.inactive_timeout_s)
            if type(ttl) not in (int, float) or not 0 < ttl <= 3600:
                raise RecordError("registration field 'ttl_s' must be a number of seconds in (0, 3600]")
            if len(record.to_json()) > MAX_RECORD_BYTES:  # what the store and its followers hold
                raise RecordError(f"the worker record takes at most {MAX_RECORD_BYTES} bytes as JSON")
        except (ValueError, RecursionError) as exc:  # RecordError is a ValueError
            out.send_error(400, f"cluster registry: {exc}", code="bad_registration")
            return
        if record.worker_id != worker_id:
            out.send_error(
                400,
                f"cluster registry: the path names worker {worker_id[:200]!r}, the record "
                f"{record.worker_id!r}",
                param="worker_id",
                code="bad_registration",
            )
            return
        key = self._own_key(worker_id)
        known = self._entries.get(key)
        if known is None and len(self._entries) >= self.max_workers:
            out.send_error(
                503,
                f"cluster registry: full ({self.max_workers} workers)",
                code="registry_full",
                headers=b"Retry-After: 5\r\n",
            )
            return
        ttl = min(float(ttl), self.settings.inactive_timeout_s)
        self._entries[key] = (record, record.to_json().decode(), time.monotonic() + ttl)
        if known is None or known[0] != record:
            # debug: the worker says it registered, the orchestrator's discovery that it joined
            log.debug("cluster registry: %s worker %s recorded at %s", record.role, worker_id, record.url)
            self._bump()
        out.send(200, json.dumps({"ttl_s": ttl, "version": self.version}).encode())

    # -- trtllm-serve's HTTP cluster storage ---------------------------------------------

    def _bearer_refused(self, request: Any, out: Any) -> str | None:
        key = self.settings.bearer_key
        if key is None:
            return self._refused(request, out)  # the loopback-only opt-in, or refused
        given = request.header(b"authorization") or b""
        scheme, _, token = given.partition(b" ")
        if scheme.lower() != b"bearer" or not token:
            return "Authorization: Bearer <key> required (disagg_cluster.api_key, else the shared secret)"
        if not hmac.compare_digest(token.strip(), key):
            return "Invalid API key"
        return None

    def _trtllm_store(self, request: Any, out: Any) -> None:
        path, method = request.path, request.method
        want = TRTLLM_STORE_ROUTES[path]
        if method != want:
            out.send_error(405, f"{path.decode()} takes {want.decode()}", headers=b"Allow: %s\r\n" % want)
            return
        refused = self._bearer_refused(request, out)
        if refused is not None:
            out.send_error(403, f"cluster storage: {refused}", code="registry_refused")
            return
        query = parse_qs(request.query.decode("latin-1"), keep_blank_values=True)
        try:
            if path == b"/set":
                result: Any = self._store_set(request.body)
            elif path == b"/get_prefix":
                keys_only = _flag(query, "keys_only")
                prefix = _param(query, "key_prefix")
                result = {
                    k: ("" if keys_only else v)
                    for k, (_, v, _) in self._entries.items()
                    if k.startswith(prefix)
                }
            else:
                key = _param(query, "key")
                if path == b"/get":
                    entry = self._entries.get(key)
                    result = None if entry is None else entry[1]
                elif path == b"/expire":
                    result = self._store_expire(key, _param(query, "ttl"))
                else:
                    result = self._store_delete(key)
        except _Full:
            out.send_error(
                503,
                f"cluster storage: full ({self.max_workers} workers)",
                code="registry_full",
                headers=b"Retry-After: 5\r\n",
            )
            return
        except _BadParam as exc:
            out.send_error(400, f"cluster storage: {exc.message}", param=exc.param, code="bad_registration")
            return
        # trtllm-serve's jsonify: {"result": ...}, 400 when the result is empty (False, None, {})
        out.send(200 if result else 400, json.dumps({"result": result}).encode())

    def _store_set(self, body: bytes) -> bool:
        if len(body) > _MAX_SET_BYTES:
            raise _BadParam("body", f"a /set body takes at most {_MAX_SET_BYTES} bytes")
        try:
            item = json.loads(body)
        except (ValueError, RecursionError) as exc:
            raise _BadParam("body", f"a StorageItem must be JSON: {exc}") from None
        if not isinstance(item, dict):
            raise _BadParam("body", "a StorageItem is a JSON object: key, value, ttl, overwrite_if_exists")
        key, value, ttl = item.get("key"), item.get("value", ""), item.get("ttl", -1)
        overwrite = item.get("overwrite_if_exists", False)
        if not isinstance(key, str) or not key:
            raise _BadParam("key", "StorageItem field 'key' must be a non-empty string")
        if not isinstance(value, str):
            raise _BadParam("value", "StorageItem field 'value' must be a string")
        if type(ttl) is not int and ttl is not None:
            raise _BadParam("ttl", "StorageItem field 'ttl' must be an integer number of seconds")
        if not isinstance(overwrite, bool) and overwrite is not None:
            raise _BadParam(
                "overwrite_if_exists", "StorageItem field 'overwrite_if_exists' must be true or false"
            )
        prefix = next((p for p in self.settings.prefixes if key.startswith(p)), None)
        if prefix is None:
            raise _BadParam(
                "key", f"this store keeps worker records only, under {' or '.join(self.settings.prefixes)}"
            )
        try:  # surrogatepass: a lone surrogate from the JSON makes bytes parse_entry refuses, not a 500
            _, record = parse_entry(
                prefix, key.encode("utf-8", "surrogatepass"), value.encode("utf-8", "surrogatepass")
            )
        except RecordError as exc:
            raise _BadParam("value", f"{key[:200]}: {exc}") from None
        known = self._entries.get(key)
        if known is not None and not overwrite:
            return False
        if known is None and len(self._entries) >= self.max_workers:
            raise _Full
        # a ttl <= 0 is trtllm-serve's "never expires": here every record expires (bounded memory)
        limit = self.settings.inactive_timeout_s
        ttl_s = float(min(ttl, limit)) if ttl is not None and ttl > 0 else limit  # min first: 10**400
        self._entries[key] = (record, value, time.monotonic() + ttl_s)
        if known is None or known[0] != record:
            log.info(
                "cluster: %s worker %s registered at %s (trtllm-serve's storage API)",
                record.role,
                record.worker_id,
                record.url,
            )
            self._bump()
        return True

    def _store_expire(self, key: str, ttl_text: str) -> bool:
        try:
            ttl = int(ttl_text)
        except ValueError:
            raise _BadParam(
                "ttl", f"'ttl' must be an integer number of seconds, got {ttl_text[:50]!r}"
            ) from None
        entry = self._entries.get(key)
        if entry is None or ttl <= 0:  # trtllm-serve's etcd storage: a ttl <= 0 is refused
            return False
        record, value, _ = entry
        self._entries[key] = (
            record,
            value,
            time.monotonic() + float(min(ttl, self.settings.inactive_timeout_s)),
        )
        return True

    def _store_delete(self, key: str) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        log.info("cluster: worker %s deregistered", entry[0].worker_id)
        self._bump()
        return True

    async def _list(self, request: Any, out: Any) -> None:
        query = parse_qs(request.query.decode("latin-1"))
        after = query.get("after", [""])[0]
        if after:
            if not after.isdigit():
                out.send_error(400, "cluster registry: 'after' must be a version number", param="after")
                return
            if int(after) == self.version:
                changed = self._changed
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(changed.wait(), LONG_POLL_S)
        if out.closed:
            return
        out.send(200, self.listing())

    def listing(self) -> bytes:
        """``{"version": N, "workers": {id: record}}``, serialized once per version."""
        cached = self._listing
        if cached is None or cached[0] != self.version:
            workers = b",".join(
                json.dumps(worker_id).encode() + b":" + record.to_json()
                for worker_id, record in self.snapshot().items()
            )
            cached = self._listing = (
                self.version,
                b'{"version":%d,"workers":{%s}}' % (self.version, workers),
            )
        return cached[1]


class _Full(Exception):
    """The store holds max_workers records already."""


class _BadParam(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param, self.message = param, message


def _param(query: dict[str, list[str]], name: str) -> str:
    values = query.get(name)
    if not values:
        raise _BadParam(name, f"query parameter {name!r} is required")
    return values[0]


def _flag(query: dict[str, list[str]], name: str) -> bool:
    """A FastAPI bool query parameter: 1/0, true/false, yes/no, on/off (absent: false)."""
    text = query.get(name, ["0"])[0].lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise _BadParam(name, f"{name!r} must be a boolean (0/1, true/false), got {text[:20]!r}")


__all__ = [
    "LONG_POLL_S",
    "REGISTRY_PATH",
    "TRTLLM_STORE_ROUTES",
    "UNSIGNED_FLAG",
    "EmbeddedRegistry",
    "sign_registry",
]
