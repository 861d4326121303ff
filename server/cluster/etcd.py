"""A small etcd v3 client over etcd's JSON gateway (``/v3/...`` on the client port), with aiohttp.

Only what discovery needs: leases (grant, keep-alive, revoke), put, delete, a
prefix range and a prefix watch. Keys and values travel base64-encoded and
int64s as strings, as the gateway does. With several endpoints
(``etcd://a:2379,b:2379``) a request that cannot reach one tries the next.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp

#: the most bytes one watch message may take before the stream is dropped (and resynced)
MAX_WATCH_MESSAGE = 16 << 20
#: keys per request of a paged full read (etcd's values reach 1.5 MiB by default: 16 bound a page)
RANGE_PAGE = 16


class EtcdUnavailable(Exception):
    """No endpoint answered."""


class EtcdError(Exception):
    """An endpoint answered with an error (or something that is not the gateway's JSON)."""


class EtcdCompacted(EtcdError):
    """The watch's start revision was compacted away: read everything again."""


#: what a call to the store (etcd, or an embedded registry) may raise when it is away, restarting or
#: answering junk: the registration and the watcher retry on these, and let anything else surface
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    EtcdUnavailable,
    EtcdError,
    aiohttp.ClientError,
    asyncio.TimeoutError,
    OSError,
    ValueError,
    KeyError,
)


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def prefix_end(prefix: bytes) -> bytes:
    """The range_end that makes a range or watch cover every key starting with ``prefix``."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


@dataclass(frozen=True)
class Event:
    kind: str  # "PUT" or "DELETE"
    key: bytes
    value: bytes


class EtcdClient:
    def __init__(
        self, endpoints: list[str], session: aiohttp.ClientSession, *, timeout_s: float = 2.0
    ) -> None:
        if not endpoints:
            raise ValueError("no etcd endpoint")
        self.endpoints = endpoints
        self.session = session
        self.timeout_s = timeout_s
        self._current = 0

    # -- transport ---------------------------------------------------------------

    async def _post(
        self, path: str, body: dict[str, Any], *, timeout_s: float | None = None
    ) -> dict[str, Any]:
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s)
        last: BaseException | None = None
        for step in range(len(self.endpoints)):
            index = (self._current + step) % len(self.endpoints)
            url = self.endpoints[index] + path
            try:
                async with self.session.post(url, json=body, timeout=timeout) as resp:
                    raw = await resp.read()
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                last = exc
                continue
            self._current = index
            try:
                answer = json.loads(raw)
            except ValueError:
                raise EtcdError(f"etcd {url}: HTTP {resp.status}, not JSON: {raw[:200]!r}") from None
            if resp.status != 200 or not isinstance(answer, dict):
                message = answer.get("message") if isinstance(answer, dict) else None
                raise EtcdError(f"etcd {url}: HTTP {resp.status}: {message or raw[:200]!r}")
            return answer
        raise EtcdUnavailable(f"no etcd endpoint answered ({', '.join(self.endpoints)}): {last!r}")

    # -- leases ------------------------------------------------------------------

    async def grant(self, ttl_s: int) -> tuple[str, int]:
        """A new lease: its id and the TTL etcd granted (it may raise a TTL below its minimum)."""
        answer = await self._post("/v3/lease/grant", {"TTL": str(ttl_s)})
        if answer.get("error"):
            raise EtcdError(f"lease grant refused: {answer['error']}")
        return str(answer["ID"]), int(answer.get("TTL", ttl_s))

    async def keepalive(self, lease: str) -> int:
        """Renew ``lease``: its TTL, 0 when it is gone (expired or revoked)."""
        answer = await self._post("/v3/lease/keepalive", {"ID": lease})
        result = answer.get("result")
        if not isinstance(result, dict):
            raise EtcdError(f"lease keep-alive: {answer.get('error') or answer}")
        return int(result.get("TTL", 0))

    async def revoke(self, lease: str) -> None:
        """End ``lease`` now: etcd deletes every key attached to it."""
        await self._post("/v3/lease/revoke", {"ID": lease})

    # -- keys --------------------------------------------------------------------

    async def put(self, key: str, value: bytes, *, lease: str | None = None) -> int:
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease is not None:
            body["lease"] = lease
        answer = await self._post("/v3/kv/put", body)
        return int(answer["header"]["revision"])

    async def delete(self, key: str) -> None:
        await self._post("/v3/kv/deleterange", {"key": _b64(key)})

    async def range_prefix_pages(
        self, prefix: str, page: int = RANGE_PAGE
    ) -> AsyncIterator[tuple[list[tuple[bytes, bytes]], int]]:
        """Every key under ``prefix`` with its value, ``page`` keys a request, all at the revision of
        the first (one consistent snapshot); yields (kvs, revision) per page. Paged so that a prefix
        full of large values costs one page of memory at a time, not the whole prefix."""
        raw = prefix.encode()
        body: dict[str, Any] = {"key": _b64(raw), "range_end": _b64(prefix_end(raw)), "limit": str(page)}
        while True:
            answer = await self._post("/v3/kv/range", body)
            revision = int(answer["header"]["revision"])
            kvs = [
                (base64.b64decode(kv["key"]), base64.b64decode(kv.get("value", "")))
                for kv in answer.get("kvs", ())
            ]
            yield kvs, revision
            if not answer.get("more") or not kvs:
                return
            body["key"] = _b64(kvs[-1][0] + b"\0")  # the next key after the last one read
            body["revision"] = str(revision)

    async def status(self, *, timeout_s: float | None = None) -> None:
        """Raises unless some endpoint answers."""
        await self._post("/v3/maintenance/status", {}, timeout_s=timeout_s)

    # -- watch ---------------------------------------------------------------------

    async def watch_prefix(self, prefix: str, start_revision: int) -> AsyncIterator[list[Event]]:
        """The changes under ``prefix`` from ``start_revision`` on, one list per message.

        Ends (returns) when etcd closes the stream; raises :class:`EtcdCompacted` when
        the revision is gone, and whatever the connection raises when it breaks.
        """
        raw = prefix.encode()
        body = {
            "create_request": {
                "key": _b64(raw),
                "range_end": _b64(prefix_end(raw)),
                "start_revision": str(start_revision),
            }
        }
        url = self.endpoints[self._current] + "/v3/watch"
        timeout = aiohttp.ClientTimeout(total=None, connect=self.timeout_s, sock_connect=self.timeout_s)
        async with self.session.post(url, json=body, timeout=timeout) as resp:
            if resp.status != 200:
                raise EtcdError(f"etcd {url}: watch: HTTP {resp.status}: {(await resp.read())[:200]!r}")
            buffer = b""
            async for chunk in resp.content.iter_any():
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if line.strip():
                        events = _watch_events(line)
                        if events:
                            yield events
                if len(buffer) > MAX_WATCH_MESSAGE:
                    raise EtcdError(f"etcd {url}: a watch message above {MAX_WATCH_MESSAGE} bytes")


def _watch_events(line: bytes) -> list[Event]:
    try:
        message = json.loads(line)
    except ValueError:
        raise EtcdError(f"etcd watch: not JSON: {line[:200]!r}") from None
    if not isinstance(message, dict):
        raise EtcdError(f"etcd watch: not an object: {line[:200]!r}")
    if "error" in message:
        raise EtcdError(f"etcd watch: {message['error']}")
    result = message.get("result") or {}
    if int(result.get("compact_revision", 0) or 0) > 0:
        raise EtcdCompacted(f"etcd watch: revision compacted (now {result['compact_revision']})")
    if result.get("canceled"):
        raise EtcdError(f"etcd watch canceled: {result.get('cancel_reason', '')}")
    return [
        Event(
            ev.get("type", "PUT"),
            base64.b64decode(ev["kv"]["key"]),
            base64.b64decode(ev["kv"].get("value", "")),
        )
        for ev in result.get("events", ())
    ]


__all__ = [
    "TRANSIENT_ERRORS",
    "EtcdClient",
    "EtcdCompacted",
    "EtcdError",
    "EtcdUnavailable",
    "Event",
    "prefix_end",
]
