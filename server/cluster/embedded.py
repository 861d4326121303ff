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
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs

from server.auth import SIGNATURE_HEADER, Verifier, sign_pieces

from .records import MAX_RECORD_BYTES, MAX_WORKERS, ClusterSettings, RecordError, WorkerRecord

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
        #: worker_id -> (record, monotonic expiry)
        self._records: dict[str, tuple[WorkerRecord, float]] = {}
        self.version = 0
        self._changed = asyncio.Event()
        self._subscribers: list[Callable[[dict[str, WorkerRecord]], None]] = []
        self._expiry: asyncio.Task[None] | None = None

    # -- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        self._expiry = asyncio.get_running_loop().create_task(self._expire_loop())

    async def stop(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._expiry
        self._changed.set()  # long polls answer now

    def subscribe(self, callback: Callable[[dict[str, WorkerRecord]], None]) -> None:
        self._subscribers.append(callback)

    def snapshot(self) -> dict[str, WorkerRecord]:
        return {worker_id: record for worker_id, (record, _) in self._records.items()}

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
            gone = [worker_id for worker_id, (_, until) in self._records.items() if until <= now]
            for worker_id in gone:
                record, _ = self._records.pop(worker_id)
                log.warning("cluster: worker %s at %s missed its heartbeats: gone", worker_id, record.url)
            if gone:
                self._bump()

    # -- HTTP ------------------------------------------------------------------------

    def handles(self, path: bytes) -> bool:
        return path == REGISTRY_PATH or path.startswith(REGISTRY_PATH + b"/")

    async def handle(self, request: Any, out: Any) -> None:
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
            if self._records.pop(worker_id, None) is None:
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
            out.send_error(413, f"cluster registry: a registration takes at most {_MAX_PUT_BYTES} bytes "
                           f"(its record at most {MAX_RECORD_BYTES})")  # fmt: skip
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
            out.send_error(400, f"cluster registry: the path names worker {worker_id[:200]!r}, the record "
                           f"{record.worker_id!r}", param="worker_id", code="bad_registration")  # fmt: skip
            return
        known = self._records.get(worker_id)
        if known is None and len(self._records) >= self.max_workers:
            out.send_error(503, f"cluster registry: full ({self.max_workers} workers)", code="registry_full",
                           headers=b"Retry-After: 5\r\n")  # fmt: skip
            return
        ttl = min(float(ttl), self.settings.inactive_timeout_s)
        self._records[worker_id] = (record, time.monotonic() + ttl)
        if known is None or known[0] != record:
            log.info("cluster: %s worker %s registered at %s", record.role, worker_id, record.url)
            self._bump()
        out.send(200, json.dumps({"ttl_s": ttl, "version": self.version}).encode())

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
                for worker_id, (record, _) in self._records.items()
            )
            cached = self._listing = (
                self.version,
                b'{"version":%d,"workers":{%s}}' % (self.version, workers),
            )
        return cached[1]


__all__ = ["LONG_POLL_S", "REGISTRY_PATH", "UNSIGNED_FLAG", "EmbeddedRegistry", "sign_registry"]
