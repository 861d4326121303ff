"""trtllm-serve's cluster side, for tests: its worker registration, its storage clients and server,
and its orchestrator's view of the workers, each as strict as trtllm-serve's own.

What it follows (NVIDIA/TensorRT-LLM, read through the project's code index, written here, not
copied):

- ``tensorrt_llm/serve/disagg_auto_scaling.py``: ``WorkerInfo`` (a dataclass of ``worker_id``,
  ``host``, ``port``, ``role``: ``WorkerInfo(**json.loads(value))``, so a record with any other
  field fails there), the key ``/trtllm-disagg/<cluster_name>/workers/<worker_id>``, the worker id
  ``<ROLE>-<host>:<port>-<ms>-<pid>-<nnn>``, ``DisaggClusterWorker`` (``set`` with
  ``ttl=inactive_timeout_sec``, ``expire`` every ``heartbeat_interval_sec``, a failed ``expire``
  registers again, ``delete`` on a clean stop), ``DisaggClusterManager`` (``get_prefix`` of the
  worker prefix, workers kept by their full key, ``ServerRole(role)``: 0 context, 1 generation).
- ``tensorrt_llm/serve/cluster_storage.py``: ``StorageItem``, ``HttpClusterStorageServer``'s
  routes (``POST /set``, ``GET /get``, ``GET /expire``, ``GET /get_prefix``, ``DELETE /delete``,
  each ``{"result": ...}`` with 400 when the result is empty; ``Authorization: Bearer`` when it
  has an ``api_key``: 403 otherwise) and ``HttpClusterStorageClient`` (``set`` posts the
  StorageItem, ``expire``/``get``/``get_prefix`` are GETs with query parameters, a non-200 answer is
  a failure); ``Etcd3ClusterStorage`` (one lease per key, ``set`` puts under it, ``expire``
  refreshes it, ``get_prefix`` reads the range). The etcd transport here is fastcore's JSON-gateway
  client (trtllm-serve uses the etcd3 gRPC package): the keys, values and leases are the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hmac
import json
import os
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp
from aiohttp import web
from helpers import read_prefix
from pydantic import BaseModel, ValidationError

from server.cluster.etcd import EtcdClient


class ServerRole(enum.IntEnum):
    CONTEXT = 0
    GENERATION = 1
    MM_ENCODER = 2


@dataclass
class WorkerInfo:
    worker_id: str
    host: str = ""
    port: int = 0
    role: ServerRole = ServerRole.CONTEXT


class StorageItem(BaseModel):
    key: str
    value: str | None = ""
    expire_time: int | None = -1
    ttl: int | None = -1
    overwrite_if_exists: bool | None = False


def worker_key_prefix(cluster_name: str) -> str:
    return f"/trtllm-disagg/{cluster_name}/workers"


def worker_key(cluster_name: str, worker_id: str) -> str:
    return f"{worker_key_prefix(cluster_name)}/{worker_id}"


def trtllm_worker_id(role: ServerRole, host: str, port: int) -> str:
    return f"{role.name}-{host}:{port}-{int(time.time() * 1000)}-{os.getpid()}-{random.randint(0, 1000):03}"


# -- storage clients ----------------------------------------------------------------------------


class HttpStorageClient:
    """trtllm-serve's HttpClusterStorageClient: None/False on any non-200 answer."""

    def __init__(self, cluster_uri: str, api_key: str = "") -> None:
        self.uri = cluster_uri.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5), headers=headers)
        #: every (method, path, status) sent, oldest first
        self.calls: list[tuple[str, str, int]] = []

    async def close(self) -> None:
        await self.session.close()

    async def _get(self, endpoint: str, ignore_result: bool = False, **params: Any) -> Any:
        async with self.session.get(f"{self.uri}/{endpoint}", params=params) as resp:
            self.calls.append(("GET", endpoint, resp.status))
            if resp.status == 200:
                body = await resp.json()
                return True if ignore_result else body.get("result")
            return False if ignore_result else None

    async def set(self, key: str, value: str, overwrite_if_exists: bool = False, ttl: int = -1) -> bool:
        item = StorageItem(key=key, value=value, overwrite_if_exists=overwrite_if_exists, ttl=ttl)
        async with self.session.post(f"{self.uri}/set", json=item.model_dump()) as resp:
            self.calls.append(("POST", "set", resp.status))
            return resp.status == 200

    async def expire(self, key: str, ttl: int) -> bool:
        return await self._get("expire", ignore_result=True, key=key, ttl=str(ttl))

    async def get(self, key: str) -> Any:
        return await self._get("get", key=key)

    async def get_prefix(self, key_prefix: str, keys_only: bool = False) -> Any:
        return await self._get("get_prefix", key_prefix=key_prefix, keys_only=int(keys_only))

    async def delete(self, key: str) -> bool:
        async with self.session.delete(f"{self.uri}/delete", params={"key": key}) as resp:
            self.calls.append(("DELETE", "delete", resp.status))
            return resp.status == 200


class EtcdStorage:
    """trtllm-serve's Etcd3ClusterStorage: one lease per key."""

    def __init__(self, cluster_uri: str) -> None:
        hosts = cluster_uri.removeprefix("etcd://").split(",")
        self.session = aiohttp.ClientSession()
        self.client = EtcdClient([f"http://{h}" for h in hosts], self.session)
        self.leases: dict[str, str] = {}

    async def close(self) -> None:
        await self.session.close()

    async def _lease(self, key: str, ttl: int) -> str | None:
        if ttl <= 0:
            return None
        if key not in self.leases:
            self.leases[key], _ = await self.client.grant(ttl)
        return self.leases[key]

    async def set(self, key: str, value: str, overwrite_if_exists: bool = False, ttl: int = -1) -> bool:
        await self.client.put(key, value.encode(), lease=await self._lease(key, ttl))
        return True

    async def expire(self, key: str, ttl: int) -> bool:
        lease = await self._lease(key, ttl)
        return lease is not None and await self.client.keepalive(lease) > 0

    async def get_prefix(self, key_prefix: str, keys_only: bool = False) -> dict[str, str]:
        kvs, _ = await read_prefix(self.client, key_prefix)
        return {k.decode(): "" if keys_only else v.decode() for k, v in kvs}

    async def delete(self, key: str) -> bool:
        await self.client.delete(key)
        return True


# -- the worker's registration and the orchestrator's view --------------------------------------


class ClusterWorker:
    """trtllm-serve's DisaggClusterWorker: register, heartbeat by ``expire``, deregister."""

    def __init__(self, role: ServerRole, host: str, port: int, storage: Any, *, cluster_name: str,
                 heartbeat_s: float, inactive_timeout_s: int) -> None:  # fmt: skip
        self.info = WorkerInfo(trtllm_worker_id(role, host, port), host, port, role)
        self.storage = storage
        self.key = worker_key(cluster_name, self.info.worker_id)
        self.heartbeat_s, self.ttl = heartbeat_s, inactive_timeout_s
        self.reregistrations = 0
        self._task: asyncio.Task[None] | None = None

    async def register(self) -> bool:
        ok = await self.storage.set(self.key, json.dumps(asdict(self.info)), ttl=self.ttl)
        if ok and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._heartbeat())
        return ok

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            if not await self.storage.expire(self.key, self.ttl):
                self.reregistrations += 1
                await self.storage.set(self.key, json.dumps(asdict(self.info)), ttl=self.ttl)

    async def stop_heartbeats(self) -> None:
        """A worker that hangs: its key expires after ``inactive_timeout_s``."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def deregister(self) -> bool:
        await self.stop_heartbeats()
        return await self.storage.delete(self.key)


class ClusterManager:
    """trtllm-serve's DisaggClusterManager's view: workers by their full key, parsed strictly."""

    def __init__(self, storage: Any, cluster_name: str) -> None:
        self.storage = storage
        self.prefix = worker_key_prefix(cluster_name)
        #: values it could not parse (trtllm-serve logs "Failed to parse set event" and skips them)
        self.unparsed: list[str] = []

    async def workers(self) -> dict[str, WorkerInfo]:
        found: dict[str, WorkerInfo] = {}
        for key, value in (await self.storage.get_prefix(self.prefix, keys_only=False) or {}).items():
            try:
                info = WorkerInfo(**json.loads(value))  # any field beside its four: TypeError
                info.role = ServerRole(info.role)
            except (TypeError, ValueError) as exc:
                self.unparsed.append(f"{key}: {exc}")
                continue
            found[key] = info
        return found


# -- the storage server a trtllm-serve orchestrator hosts ---------------------------------------


class HttpStorageServer:
    """trtllm-serve's HttpClusterStorageServer on its own port (as a trtllm-serve orchestrator
    mounts it): ``.items`` key -> (value, monotonic expiry or -1)."""

    def __init__(self, api_key: str = "") -> None:
        self.api_key = api_key
        self.items: dict[str, tuple[str, float]] = {}
        self.runner: web.AppRunner | None = None
        self.port = 0
        app = web.Application()
        app.router.add_post("/set", self._set)
        app.router.add_get("/get", self._get)
        app.router.add_get("/expire", self._expire)
        app.router.add_get("/get_prefix", self._get_prefix)
        app.router.add_delete("/delete", self._delete)
        self.app = app

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> HttpStorageServer:
        self.runner = web.AppRunner(self.app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = int(self.runner.addresses[0][1])
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    def _denied(self, request: web.Request) -> web.Response | None:
        if not self.api_key:
            return None
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            return web.json_response({"detail": "Not authenticated"}, status=403)
        if not hmac.compare_digest(token, self.api_key):
            return web.json_response({"detail": "Invalid API key"}, status=403)
        return None

    @staticmethod
    def _result(result: Any) -> web.Response:
        return web.json_response({"result": result}, status=200 if result else 400)

    def _live(self, key: str) -> str | None:
        item = self.items.get(key)
        if item is None:
            return None
        if item[1] >= 0 and item[1] <= time.monotonic():
            del self.items[key]
            return None
        return item[0]

    async def _set(self, request: web.Request) -> web.Response:
        denied = self._denied(request)
        if denied is not None:
            return denied
        try:
            item = StorageItem.model_validate(await request.json())
        except (ValidationError, ValueError) as exc:
            return web.json_response({"detail": str(exc)}, status=422)
        if self._live(item.key) is not None and not item.overwrite_if_exists:
            return self._result(False)
        expiry = time.monotonic() + item.ttl if item.ttl and item.ttl > 0 else -1.0
        self.items[item.key] = (item.value or "", expiry)
        return self._result(True)

    async def _get(self, request: web.Request) -> web.Response:
        return self._denied(request) or self._result(self._live(request.query["key"]))

    async def _expire(self, request: web.Request) -> web.Response:
        denied = self._denied(request)
        if denied is not None:
            return denied
        key = request.query["key"]
        if self._live(key) is None:
            return self._result(False)
        self.items[key] = (self.items[key][0], time.monotonic() + int(request.query["ttl"]))
        return self._result(True)

    async def _get_prefix(self, request: web.Request) -> web.Response:
        denied = self._denied(request)
        if denied is not None:
            return denied
        prefix, keys_only = request.query["key_prefix"], request.query.get("keys_only", "0") in ("1", "true")
        found = {k: "" if keys_only else v for k in list(self.items) if k.startswith(prefix)
                 for v in [self._live(k)] if v is not None}  # fmt: skip
        return self._result(found)

    async def _delete(self, request: web.Request) -> web.Response:
        denied = self._denied(request)
        if denied is not None:
            return denied
        return self._result(self.items.pop(request.query["key"], None) is not None)
