"""The small endpoints trtllm-serve's processes have beside the completions, in its shapes, for
workers and orchestrators alike (docs/protocol.md, "Talking to trtllm-serve").

- ``GET /version``: ``{"version": "<fastcore's>"}`` (trtllm-serve answers its own version there);
- ``GET /perf_metrics``: ``[]``. trtllm-serve's are per-request timing entries, kept only with
  ``perf_metrics_max_requests`` above 0 (its default 0 answers ``[]`` too); none are collected here;
- ``GET /steady_clock_offset``: ``{"receive_ts", "transmit_ts"}`` in seconds of this process's
  monotonic clock; ``POST /steady_clock_offset`` with ``{"offset": seconds}`` (a trtllm-serve
  orchestrator measures the offset NTP-style and sends it): kept and answered 200, used by nothing
  here (no per-request timestamps are reported);
- ``GET /prometheus/metrics``: the ``/metrics`` page, under ``/metrics``' access rule;
- workers: ``POST /kv_cache_events`` (server/worker/kv_events.py), under the same access rule: the
  block hashes of what a worker caches are an oracle of other clients' prompts, as the prefix-cache
  counters of ``/metrics`` were;
- orchestrators: ``GET /cluster_info`` (trtllm-serve's DisaggClusterManager shape), under the same
  access rule: it names every worker's address, as ``/metrics`` did before it was closed.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from typing import Any

import fastcore
from server.metrics import CONTENT_TYPE

_GET, _POST, _HEAD = b"GET", b"POST", b"HEAD"
#: path -> the methods it takes
ROUTES: dict[bytes, tuple[bytes, ...]] = {
    b"/version": (_GET, _HEAD),
    b"/perf_metrics": (_GET, _HEAD),
    b"/steady_clock_offset": (_GET, _POST),
    b"/prometheus/metrics": (_GET, _HEAD),
}
WORKER_ROUTES = {**ROUTES, b"/kv_cache_events": (_POST,)}
ORCHESTRATOR_ROUTES = {**ROUTES, b"/cluster_info": (_GET, _HEAD)}
#: the largest POST /steady_clock_offset body read
_MAX_OFFSET_BODY = 256
#: under /metrics' access rule: the page itself, the KV events (an oracle of prompts) and the
#: cluster's worker addresses (what /metrics was closed for naming); trtllm-serve's are open
_GUARDED = frozenset({b"/prometheus/metrics", b"/kv_cache_events", b"/cluster_info"})


class TrtllmEndpoints:
    """``routes``: WORKER_ROUTES or ORCHESTRATOR_ROUTES; ``render``: the /metrics page; ``access``:
    its :class:`~server.metrics_access.MetricsAccess`; ``kv_events`` (workers): a page of the
    waiting KV events as JSON (bounded: the rest wait for the next poll) and how many wait after
    it (the ``X-Fastcore-Events-Waiting`` header); ``cluster_info`` (orchestrators): its answer."""

    def __init__(
        self,
        routes: dict[bytes, tuple[bytes, ...]],
        render: Callable[[], bytes],
        access: Any,
        *,
        kv_events: Callable[[], tuple[bytes, int]] | None = None,
        cluster_info: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.routes = routes
        self.render = render
        self.access = access
        self.kv_events = kv_events
        self.cluster_info = cluster_info
        #: what a trtllm-serve orchestrator last said our clock is off by (seconds)
        self.steady_clock_offset = 0.0
        self._version = json.dumps({"version": fastcore.__version__}).encode()

    def handles(self, path: bytes) -> bool:
        return path in self.routes

    def handle(self, request: Any, out: Any) -> None:
        path, method = request.path, request.method
        allowed = self.routes[path]
        if method not in allowed:
            names = ", ".join(m.decode() for m in allowed)
            out.send_error(405, f"{path.decode()} takes {names}", headers=b"Allow: %s\r\n" % names.encode())
            return
        if path in _GUARDED:
            refused = self.access.refusal(request.header(b"authorization"), out.peer)
            if refused is not None:
                out.send_error(
                    refused.status, refused.message, code=refused.code, headers=refused.header_lines()
                )
                return
        if path == b"/version":
            out.send(200, self._version)
        elif path == b"/perf_metrics":
            out.send(200, b"[]")
        elif path == b"/prometheus/metrics":
            out.send(200, self.render(), CONTENT_TYPE.encode())
        elif path == b"/kv_cache_events":
            assert self.kv_events is not None
            page, waiting = self.kv_events()
            out.send(200, page, headers=b"X-Fastcore-Events-Waiting: %d\r\n" % waiting)
        elif path == b"/cluster_info":
            assert self.cluster_info is not None
            out.send(200, json.dumps(self.cluster_info()).encode())
        elif method == _POST:
            self._set_offset(request.body, out)
        else:
            now = time.monotonic()
            out.send(200, json.dumps({"receive_ts": now, "transmit_ts": time.monotonic()}).encode())

    def _set_offset(self, body: bytes, out: Any) -> None:
        offset = None
        if len(body) <= _MAX_OFFSET_BODY:
            try:
                obj = json.loads(body)
            except (ValueError, RecursionError):
                obj = None
            value = obj.get("offset") if isinstance(obj, dict) else None
            if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                offset = float(value)
        if offset is None:
            out.send_error(
                400, 'POST /steady_clock_offset takes {"offset": <seconds, a finite number>}', param="offset"
            )
            return
        self.steady_clock_offset = offset
        out.send(200, b"")


__all__ = ["ORCHESTRATOR_ROUTES", "ROUTES", "WORKER_ROUTES", "TrtllmEndpoints"]
