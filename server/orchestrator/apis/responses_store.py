"""Stored responses for ``store`` / ``previous_response_id`` and ``GET``/``DELETE /v1/responses/{id}``.

In memory, bounded per tenant (entries, bytes, time to live): a tenant's entries are its own, so
one never reads (nor evicts) another's. The oldest entries go first when a bound is reached. A
restart forgets them all: a client going on from a forgotten id gets a 400 naming it and resends
its conversation.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import parse_qsl

import msgspec

from server.errors import HTTPError


class StoreLimits(Protocol):
    """``responses_store`` in the config (config.ResponsesStoreConfig): each tenant's bounds."""

    max_entries: int
    max_bytes: int
    ttl_s: float


@dataclass
class Stored:
    response: dict[str, Any]
    #: the conversation up to and with this response's answer, in chat messages (instructions left out)
    history: list[dict[str, Any]]
    size: int
    expires: float
    #: its request's input as OpenAI's items (GET /v1/responses/{id}/input_items)
    input_items: list[dict[str, Any]] = field(default_factory=list)


class ResponseStore:
    def __init__(self, limits: StoreLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.clock = clock
        self._tenants: dict[str, OrderedDict[str, Stored]] = {}
        self._bytes: dict[str, int] = {}

    def put(
        self,
        tenant: str,
        response: dict[str, Any],
        history: list[dict[str, Any]],
        input_items: list[dict[str, Any]] | None = None,
    ) -> bool:
        """Keeps a response (False: larger than the tenant's whole byte bound, not kept)."""
        items = input_items or []
        size = sum(len(msgspec.json.encode(part)) for part in (response, history, items))
        if size > self.limits.max_bytes:
            return False
        entries = self._tenants.setdefault(tenant, OrderedDict())
        self._expire(tenant, self.clock())  # what expired frees its bytes now, not when a bound is met
        self._drop(tenant, response["id"])
        entries[response["id"]] = Stored(response, history, size, self.clock() + self.limits.ttl_s, items)
        self._bytes[tenant] = self._bytes.get(tenant, 0) + size
        while len(entries) > self.limits.max_entries or self._bytes[tenant] > self.limits.max_bytes:
            self._drop(tenant, next(iter(entries)))
        return True

    def get(self, tenant: str, response_id: str) -> Stored | None:
        entries = self._tenants.get(tenant)
        stored = entries.get(response_id) if entries is not None else None
        if stored is not None and stored.expires <= self.clock():
            self._drop(tenant, response_id)
            return None
        return stored

    def delete(self, tenant: str, response_id: str) -> bool:
        return self.get(tenant, response_id) is not None and self._drop(tenant, response_id)

    def _drop(self, tenant: str, response_id: str) -> bool:
        stored = self._tenants[tenant].pop(response_id, None)
        if stored is None:
            return False
        self._bytes[tenant] -= stored.size
        return True

    def sweep(self) -> None:
        """Forgets what expired, every tenant's."""
        now = self.clock()
        for tenant in self._tenants:
            self._expire(tenant, now)

    def _expire(self, tenant: str, now: float) -> None:
        # oldest first: entries keep their insertion order, and every entry lives ttl_s
        entries = self._tenants[tenant]
        while entries and next(iter(entries.values())).expires <= now:
            self._drop(tenant, next(iter(entries)))


def previous_history(store: ResponseStore | None, tenant: str, response_id: str) -> list[dict[str, Any]]:
    """The conversation a ``previous_response_id`` goes on from: a 400 naming the id when the store
    is off or holds no such response for this tenant."""
    if store is None:
        raise HTTPError(
            400,
            "'previous_response_id' needs stored responses, and this deployment stores none "
            "(responses_store is off): send the whole conversation in 'input'.",
            param="previous_response_id",
            code="invalid_request_error",
        )
    stored = store.get(tenant, response_id)
    if stored is None:
        raise HTTPError(
            400,
            f"Previous response with id '{response_id}' not found.",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    return stored.history


def refuse_store(store: ResponseStore | None, asked: bool | None) -> None:
    """``store: true`` asked of a deployment that stores nothing is refused (left out, it is off)."""
    if asked and store is None:
        raise HTTPError(
            400,
            "'store' is off on this deployment (responses_store is not configured): "
            "send store: false, or leave it out.",
            param="store",
            code="invalid_request_error",
        )


def stored_or_404(store: ResponseStore | None, tenant: str, response_id: str) -> Stored:
    stored = store.get(tenant, response_id) if store is not None else None
    if stored is None:
        raise HTTPError(404, f"Response with id '{response_id}' not found.", param="response_id")
    return stored


def deleted(response_id: str) -> dict[str, Any]:
    return {"id": response_id, "object": "response.deleted", "deleted": True}


def input_items_page(stored: Stored, query: bytes) -> dict[str, Any]:
    """A page of a stored response's input items, as OpenAI's list (its SDK's cursor page): ``order``
    (``desc``, newest first, by default; ``asc``), ``after`` (an item id: the items past it in that
    order), ``limit`` (1-100, 20 by default); ``has_more`` with ``first_id`` / ``last_id``. A bad
    parameter is a 400 naming it; ``include`` and others are accepted (nothing to add)."""
    params = dict(parse_qsl(query.decode("utf-8", "replace"), keep_blank_values=True))
    order = params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise HTTPError(
            400, f"Invalid 'order': expected 'asc' or 'desc' (got {order[:40]!r}).", param="order"
        )
    limit_text = params.get("limit", "20")
    limit = int(limit_text) if limit_text.isdigit() and len(limit_text) < 4 else -1
    if not 1 <= limit <= 100:
        raise HTTPError(
            400,
            f"Invalid 'limit': expected an integer from 1 to 100 (got {limit_text[:40]!r}).",
            param="limit",
        )
    items = stored.input_items if order == "asc" else stored.input_items[::-1]
    after = params.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise HTTPError(400, f"No input item with id {after[:80]!r} in this response.", param="after")
        items = items[ids.index(after) + 1 :]
    data = items[:limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(items) > limit,
    }
