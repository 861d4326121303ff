"""The worker's Prometheus metrics (``GET /metrics``): requests, the engine's queue and KV cache,
the prefix cache, the KV hand-off, admission, latency, and the HTTP server's connections."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from server.http import HTTPServer
from server.metrics import Registry, Scraped, http_server_families, scraped_families

from .engine_api import Engine


class WorkerMetrics:
    def __init__(
        self, engine: Engine, waiting: Callable[[], int], server: Callable[[], HTTPServer | None]
    ) -> None:
        """``waiting``: how many requests wait for KV room now; ``server``: the HTTP server, once
        it listens."""
        r = self.registry = Registry()
        self.requests = r.counter(
            "fastcore_worker_requests_total", "Requests by route and HTTP status", ("route", "status")
        )
        self._load_families(r, engine)
        self.prompt_tokens = r.counter("fastcore_worker_prompt_tokens_total", "Prompt tokens admitted")
        self._prefix_families(r, engine)
        tier2 = getattr(getattr(engine, "cache", None), "tier2", None)
        if tier2 is not None:  # the torch engine's second KV tier (server/worker/kv_tier2.py)
            self._tier2_families(r, tier2)
        self.generated_tokens = r.counter(
            "fastcore_worker_generated_tokens_total", "Completion tokens returned"
        )
        self.handoff = r.counter(
            "fastcore_worker_kv_handoff_total",
            "KV hand-off events. Context side: parked, served, expired, abandoned (the fetcher hung up "
            "mid-download), cancelled (a context leg's client left before its answer: its KV freed at "
            "once, parked or not), released (DELETE by an orchestrator that gave up on the leg), "
            "evicted (parked KV freed for the parked bound or to admit a request; with a second KV tier "
            "its registered blocks let go to the cache first, read back by the export), lost (such an "
            "export that could not read them all back: 404, the generation leg prefills). "
            "Generation side: fetched, recomputed",
            ("event",),
        )
        self.fetch_failures = r.counter(
            "fastcore_worker_kv_fetch_failures_total",
            "KV fetches that failed or were not tried, by reason",
            ("reason",),
        )
        self.rejected = r.counter(
            "fastcore_worker_rejected_total", "Requests refused with 503, by reason", ("reason",)
        )
        self.waited = r.counter(
            "fastcore_worker_admission_waits_total", "Requests that waited for KV room before admission"
        ).labels()
        r.gauge("fastcore_worker_waiting_for_kv", "Requests waiting for KV room now", callback=waiting)
        self.ttft = r.histogram(
            "fastcore_worker_time_to_first_token_seconds", "Arrival to first token", ("route",)
        )
        self.latency = r.histogram("fastcore_worker_request_seconds", "Arrival to last token", ("route",))
        self._server_families(r, server)

    @staticmethod
    def _load_families(r: Registry, engine: Engine) -> None:
        """The engine's queue, batch, KV cache use, parked KV and decode rate."""
        scraped_families(r, lambda: engine, _LOAD)

    @staticmethod
    def _prefix_families(r: Registry, engine: Engine) -> None:
        """The prefix cache's hits, computed prefill, cached tokens and evictions."""
        scraped_families(r, lambda: engine, _PREFIX)

    @staticmethod
    def _server_families(r: Registry, server: Callable[[], HTTPServer | None]) -> None:
        """The HTTP server's connections and refusals (0 until it listens)."""
        scraped_families(r, server, http_server_families("fastcore_worker"))

    @staticmethod
    def _tier2_families(r: Registry, tier2: Any) -> None:
        """The second KV tier's: what it holds, its block moves, the rates its loads are weighed by."""
        scraped_families(r, lambda: tier2, _TIER2)


#: the engine's families read at each scrape: (kind, name, help, what of the engine)
_LOAD: list[Scraped] = [
    ("gauge", "fastcore_worker_queue_depth", "Requests admitted and waiting for their prefill", "queue_depth"),
    ("gauge", "fastcore_worker_running_sequences", "Sequences in the decode batch", "running"),
    ("gauge", "fastcore_worker_kv_used_tokens", "KV cache tokens reserved (running, waiting, parked)", "kv_used_tokens"),
    ("gauge", "fastcore_worker_kv_capacity_tokens", "KV cache size in tokens", "kv_capacity_tokens"),
    ("gauge", "fastcore_worker_kv_usage_ratio", "Fraction of the KV cache in use",
     lambda engine: engine.kv_used_tokens / max(1, engine.kv_capacity_tokens)),
    ("gauge", "fastcore_worker_kv_parked", "Context legs' KV waiting for a generation worker", "parked_count"),
    ("gauge", "fastcore_worker_kv_parked_tokens", "KV cache tokens held by parked entries", "parked_tokens"),
    ("gauge", "fastcore_worker_decode_tokens_per_second", "Decode tokens per second over the last 5 s",
     "tokens_per_second"),
]  # fmt: skip

_PREFIX: list[Scraped] = [
    ("counter", "fastcore_worker_prefix_cache_hit_tokens_total",
     "Prompt tokens whose KV came from the prefix cache (not computed)", "prefix_hit_tokens"),
    ("counter", "fastcore_worker_prefill_computed_tokens_total",
     "Prompt (and replayed) tokens prefilled: computed, not from the cache or a KV hand-off",
     "prefill_computed_tokens"),
    ("gauge", "fastcore_worker_prefix_cache_tokens", "Tokens in registered full blocks (held or evictable)",
     "prefix_cached_tokens"),
    ("counter", "fastcore_worker_prefix_cache_evicted_blocks_total", "Cached blocks evicted to make room",
     "prefix_evicted_blocks"),
]  # fmt: skip

#: the second KV tier's (server/worker/kv_tier2.py): what it holds, each block move it counts (as
#: <move>_blocks_total), the rates its loads are weighed by
_TIER2: list[Scraped] = [
    ("gauge", "fastcore_worker_kv_tier2_tokens", "Tokens held in the second KV tier",
     lambda tier2: tier2.held_blocks * tier2.block_size),
    ("gauge", "fastcore_worker_kv_tier2_capacity_tokens", "The second KV tier's size in tokens", "capacity_tokens"),
    *[
        ("counter", f"fastcore_worker_kv_tier2_{move}_blocks_total", f"KV blocks {what}", f"{move}_blocks_total")
        for move, what in (
            ("spilled", "evicted from the device into tier 2"),
            ("loaded", "loaded back from it"),
            ("dropped", "dropped from it, least recently spilled first"),
            ("failed", "whose load failed (a missing or corrupt file: recomputed)"),
            ("exported", "read from it by a parked entry's KV export (left there)"),
            ("export_failed", "an export could not read (gone, a file missing or corrupt)"),
        )
    ],
    ("gauge", "fastcore_worker_kv_tier2_load_tokens_per_second", "Tier-2 loads' measured rate",
     "rates.load_tokens_per_s"),
    ("gauge", "fastcore_worker_kv_tier2_prefill_tokens_per_second", "Prefill's measured rate, loads weighed against",
     "rates.prefill_tokens_per_s"),
]  # fmt: skip
