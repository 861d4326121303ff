"""``conversation``: a conversation's requests stick to one worker, by consistent hashing with
bounded loads (and trtllm-serve's implicit matching of a prompt without an id)."""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Sequence
from typing import Any

from ..estimates import BytesPerToken
from .base import BYTES_PER_TOKEN, RoutedWorker, Router, W, chunk_from_tokens, float_arg, int_arg
from .keys import RequestKey
from .kv_cache_aware import KvCacheAwareRouter
from .least_loaded import LeastLoadedRouter


def _point(data: bytes) -> int:
    """A stable 64-bit point on the ring (never Python's salted ``hash()``)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class ConversationRouter(Router):
    """One conversation, one worker: consistent hashing of the conversation id, with bounded loads.

    The ring holds ``virtual_nodes`` points per member worker (blake2b of ``"<url>#<i>"``); a
    request's id (its body's ``conversation_id``, else the ``X-Conversation-Id`` header) hashes to a
    point (blake2b of its bytes) and goes to the first healthy worker clockwise from it. A joining
    worker takes about 1/N of the conversations; an unhealthy or departed one's conversations move
    to their next worker on the ring while every other conversation stays. A request without an
    id goes to the least loaded worker.

    Bounded loads (Mirrokni, Thorup, Zadimoghaddam, "Consistent Hashing with Bounded Loads", 2018):
    a worker already holding ``ceil(load_factor x (in flight + 1) / healthy workers)`` requests is
    skipped for the next one clockwise, so one id (or a few hot ones: the client chooses them) can
    pin at most about ``load_factor`` x its share on a worker; the others take the overflow, and
    the conversation goes home again once its worker is below the bound. ``load_factor: 0``: no
    bound (an id always goes to its worker, whatever its load).
    """

    name = "conversation"
    needs_key = True
    key_kinds = frozenset({"conversation"})
    ARGS = frozenset({"virtual_nodes", "load_factor", "match_threshold", "tokens_per_block", "chunk_bytes"})

    def __init__(self, args: dict[str, Any] | None = None) -> None:
        args = args or {}
        self.virtual_nodes = int_arg(args, "virtual_nodes", 100, 1, 10_000)
        self.load_factor = float_arg(args, "load_factor", 1.25, 0.0)
        if 0 < self.load_factor < 1:
            raise ValueError(f"load_factor must be 0 (no bound) or >= 1, got {self.load_factor:g}")
        # trtllm-serve's implicit matching: a request without an id whose prompt shares at least
        # match_threshold of its chunks with what a worker was sent goes to that worker (off: None)
        self.match_threshold: float | None = None
        if "match_threshold" in args:
            threshold = float_arg(args, "match_threshold", 0.75, 0.0)
            if not 0 < threshold <= 1:
                raise ValueError(f"match_threshold must be in (0, 1], got {threshold:g}")
            self.match_threshold = threshold
            self.key_kinds = frozenset({"conversation", "prefix"})
        self.chunk_bytes = chunk_from_tokens(args, 128 * BYTES_PER_TOKEN)  # trtllm's 128 tokens
        #: the implicit matching's per-worker index (KvCacheAwareRouter's, at its default bound)
        self._prefixes = (
            KvCacheAwareRouter({"chunk_bytes": self.chunk_bytes}) if self.match_threshold else None
        )
        self.estimate = self._prefixes.estimate if self._prefixes is not None else BytesPerToken()
        self._fallback = LeastLoadedRouter()
        self._points: list[int] = []
        self._urls: list[str] = []
        self._members: frozenset[str] = frozenset()

    def forget(self, worker: RoutedWorker) -> None:
        if self._prefixes is not None:
            self._prefixes.forget(worker)

    def sync(self, workers: Sequence[RoutedWorker]) -> None:
        if self._prefixes is not None:
            self._prefixes.sync(workers)
        members = frozenset(w.url for w in workers)
        if members == self._members:
            return
        ring = sorted(
            (_point(f"{url}#{i}".encode()), url) for url in members for i in range(self.virtual_nodes)
        )
        self._points = [p for p, _ in ring]
        self._urls = [u for _, u in ring]
        self._members = members

    def owner(self, conversation: bytes, healthy: dict[str, W], capacity: float = math.inf) -> W | None:
        """The first worker of ``healthy`` (url -> worker) clockwise from the id's point with fewer
        than ``capacity`` requests in flight."""
        points, urls = self._points, self._urls
        n = len(points)
        if not n:
            return None
        start = bisect.bisect_left(points, _point(conversation))
        for i in range(n):
            worker = healthy.get(urls[(start + i) % n])
            if worker is not None and worker.in_flight < capacity:
                return worker
        return None

    def capacity(self, candidates: Sequence[RoutedWorker]) -> float:
        """The most requests a worker may hold before the ring skips it (inf: no bound)."""
        if not self.load_factor:
            return math.inf
        total = sum(w.in_flight for w in candidates)
        return math.ceil(self.load_factor * (total + 1) / len(candidates))

    def choose(self, candidates: list[W], key: RequestKey | None = None) -> W:
        if key is not None and key.conversation is not None:
            # Some candidate is always below the capacity (load_factor >= 1): the walk finds one.
            capacity = self.capacity(candidates)
            worker = self.owner(key.conversation, {w.url: w for w in candidates}, capacity)
            if worker is not None:
                return worker
        if self._prefixes is None or key is None:
            return self._fallback.choose(candidates)
        hashes = key.hashes(self.chunk_bytes)
        worker = self._implicit(candidates, key, len(hashes)) if hashes else None
        if worker is None:
            worker = self._fallback.choose(candidates)
        if hashes:
            self._prefixes.routed(worker, hashes)
        return worker

    def _implicit(self, candidates: list[W], key: RequestKey, chunks: int) -> W | None:
        """The worker sent the longest run of the request's ``chunks`` leading chunks, if that run
        is at least ``match_threshold`` of them and the worker is below the bounded-load capacity."""
        assert self._prefixes is not None and self.match_threshold is not None
        capacity = self.capacity(candidates)
        best, best_hit = None, 0
        for worker in candidates:
            hit = self._prefixes.expected_hit(worker, key)
            if hit > best_hit and worker.in_flight < capacity:
                best, best_hit = worker, hit
        if best is not None and best_hit >= self.match_threshold * chunks:
            return best
        return None
