"""``kv_cache_aware``: the worker expected to hold the longest cached prefix of the prompt,
balanced against load; its index follows each worker's own cache events where it publishes them."""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Iterable, Sequence
from typing import Any, cast

from ..estimates import BytesPerToken
from .base import BYTES_PER_TOKEN, RoutedWorker, Router, W, chunk_from_tokens, float_arg, int_arg
from .keys import RequestKey
from .least_loaded import LeastLoadedRouter
from .prefix_index import PrefixIndex, held_prefix

#: loads read per request in a large pool (a moving window of candidates), and the most workers
#: asked for their prefix (the holders of the deepest chunk held)
LOAD_SAMPLE = 32
MAX_ASKED = 32
#: routes this recent (the last RECENT_ROUTES of a pool) survive a resync of their worker's view:
#: a snapshot taken while they were on their way does not hold them yet
RECENT_S = 5.0
RECENT_ROUTES = 1024
#: a tier-2 chunk's credit against a device chunk's where the worker publishes no rates (Dynamo's
#: KV router credits a host-tier hit at 0.75 of a device hit)
TIER_WEIGHT = 0.75
_NO_TIER2: tuple[None, None, None] = (None, None, None)


class KvCacheAwareRouter(Router):
    """The worker with the longest expected prefix hit, balanced against load.

    Keys: :func:`fastcore.chunk_hashes` of the prompt span's raw bytes (``messages`` on chat,
    ``prompt`` on completions), in ``chunk_bytes`` chunks. Each worker has a bounded index of the
    hashes routed to it (:class:`PrefixIndex`): ``max_cached_tokens`` tokens' worth, or the
    worker's own ``kv_capacity_tokens`` (``/server_info``) when it says, at the pool's learned bytes
    per token (:class:`~server.orchestrator.estimates.BytesPerToken`, ``self.estimate``), and never
    more than ``max_index_tokens`` tokens' worth: a worker's word is not trusted with the
    orchestrator's memory (one reporting 4.5e9 tokens grew its index without bound). After routing,
    the request's hashes go into the chosen worker's index (it will cache them). A worker's index
    is cleared when it leaves the pool, turns unhealthy or comes back.

    An inverted index (chunk hash -> the workers holding it) makes a request's cost independent of
    the fleet's indexes: only the workers holding the prompt's first chunk are asked for their
    longest prefix; every other candidate's hit is 0, and the best of those is the least loaded.

    Score of a candidate: ``hit_tokens - load_weight * (in_flight - mean_in_flight)``, where
    ``hit_tokens`` = (device hit chunks + ``tier_weight`` x tier-2 hit chunks) x ``chunk_bytes`` /
    bytes per token (a worker's second tier, from its cache events; ``tier_weight``: the router's
    arg, else measured from the worker's load and prefill rates, else 0.75) and the mean is over the
    candidates; a worker with more than ``max_load_ratio`` x the mean in flight (and at least one
    more than the mean) gets no credit for its hit, so a hot prefix cannot pile every request onto
    one worker. The highest score wins; ties go to the fewest in flight, then in turn. A request
    without a span (or shorter than one chunk) goes to the least loaded worker.
    """

    name = "kv_cache_aware"
    needs_key = True
    key_kinds = frozenset({"prefix"})
    predicts_hits = True
    follows_cache_events = True
    ARGS = frozenset(
        {"chunk_bytes", "tokens_per_block", "max_cached_tokens", "max_index_tokens", "load_weight",
         "max_load_ratio", "tier_weight"}
    )  # fmt: skip

    def __init__(self, args: dict[str, Any] | None = None) -> None:
        args = args or {}
        self.estimate = BytesPerToken()
        self.chunk_bytes = chunk_from_tokens(args, 512)
        self.max_cached_tokens = int_arg(args, "max_cached_tokens", 262_144, 1)
        #: the orchestrator's own bound on any worker's index (~100 bytes per chunk entry)
        self.max_index_tokens = int_arg(args, "max_index_tokens", 1 << 20, 1)
        self.load_weight = float_arg(args, "load_weight", 1024.0, 0.0)
        self.max_load_ratio = float_arg(args, "max_load_ratio", 1.5, 1.0)
        #: a tier-2 chunk's credit against a device chunk's: the args' (every worker), else each
        #: worker's measured one (:meth:`tier_rates`), else TIER_WEIGHT
        self.tier_weight: float | None = None
        if "tier_weight" in args:
            self.tier_weight = float_arg(args, "tier_weight", TIER_WEIGHT, 0.0)
            if self.tier_weight > 1:
                raise ValueError(f"tier_weight must be in [0, 1], got {self.tier_weight:g}")
        self._tier_weights: dict[RoutedWorker, float] = {}
        self._fallback = LeastLoadedRouter()
        self._indexes: dict[RoutedWorker, PrefixIndex] = {}
        #: chunk hash -> the workers whose index holds it (the inverse of ``_indexes``)
        self._holders: dict[int, set[RoutedWorker]] = {}
        #: workers whose cache events this orchestrator follows (server/orchestrator/cache_view.py),
        #: and of them those whose events carried keys: their evictions come as events, so their
        #: index is bounded by max_index_tokens only (a worker that publishes nothing it is sent,
        #: e.g. generation legs without the prompt's text, keeps the estimate's bound)
        self.followed: set[RoutedWorker] = set()
        self.exact: set[RoutedWorker] = set()
        #: the last routes (time, worker, hashes), put back after a resync of their worker's view
        self._recent: collections.deque[tuple[float, RoutedWorker, list[int]]] = collections.deque(
            maxlen=RECENT_ROUTES
        )
        self._candidates: Sequence[RoutedWorker] | None = None
        self._candidate_set: set[RoutedWorker] = set()
        self._next_window = 0
        self._clock = 0
        self._tiebreak = 0
        #: chunks routed with a key, and of them those expected to hit (/metrics)
        self.routed_chunks = 0
        self.hit_chunks = 0
        #: context answers: hit tokens predicted (from ``key.hit_chunks``), achieved (the worker's
        #: ``cached_tokens``) and the sum of |predicted - achieved| (/metrics)
        self.predicted_tokens = 0
        self.achieved_tokens = 0
        self.error_tokens = 0
        #: hit tokens by tier: predicted when routed (device, tier 2), achieved as answered (/metrics)
        self.predicted_tier_tokens = [0, 0]
        self.achieved_tier_tokens = [0, 0]

    def _limit(self, worker: RoutedWorker) -> int:
        if worker in self.exact:
            return max(1, self.max_index_tokens * BYTES_PER_TOKEN // self.chunk_bytes)
        tokens = min(worker.kv_capacity_tokens or self.max_cached_tokens, self.max_index_tokens)
        return max(1, int(tokens * self.estimate.value) // self.chunk_bytes)

    def _tier2_limit(self, worker: RoutedWorker) -> int:
        """An approximate index's tier 2: the worker's /server_info ``kv_tier2_capacity_tokens``
        (0: none, or its events say where each key is), within ``max_index_tokens``."""
        tokens = getattr(worker, "kv_tier2", _NO_TIER2)[0]
        if not tokens or worker in self.exact:
            return 0
        return int(min(tokens, self.max_index_tokens) * self.estimate.value) // self.chunk_bytes

    def index(self, worker: RoutedWorker) -> PrefixIndex:
        index = self._indexes.get(worker)
        if index is None:
            index = self._indexes[worker] = PrefixIndex(self._limit(worker), self._tier2_limit(worker))
        return index

    def tier_rates(
        self, worker: RoutedWorker, load_tokens_per_s: object, prefill_tokens_per_s: object
    ) -> None:
        """``worker``'s tier 2 loads at ``load_tokens_per_s`` and prefills at ``prefill_tokens_per_s``
        (its /server_info's figures): a tier-2 hit saves ``1 - prefill / load`` of a device hit's
        time (0.75 where loading is 4x faster: Dynamo's host-tier weight), nothing where loading
        is slower than recomputing (the worker does not take it: SGLang's trap)."""
        rates = (load_tokens_per_s, prefill_tokens_per_s)
        if all(isinstance(r, int | float) and not isinstance(r, bool) and r > 0 for r in rates):
            load, prefill = cast(tuple[float, float], rates)
            self._tier_weights[worker] = max(0.0, 1.0 - prefill / load)
        else:
            self._tier_weights.pop(worker, None)

    def tier_weight_of(self, worker: RoutedWorker) -> float:
        """The args' weight, else the rates of the worker's cache events, else of its /server_info
        (``kv_tier2``: pools.py's Worker), else TIER_WEIGHT."""
        if self.tier_weight is not None:
            return self.tier_weight
        weight = self._tier_weights.get(worker)
        if weight is not None:
            return weight
        _, load, prefill = getattr(worker, "kv_tier2", _NO_TIER2)
        return max(0.0, 1.0 - prefill / load) if load and prefill else TIER_WEIGHT

    def forget(self, worker: RoutedWorker) -> None:
        self.followed.discard(worker)  # its stream resyncs (and says its rates again)
        self.exact.discard(worker)
        self._tier_weights.pop(worker, None)
        index = self._indexes.pop(worker, None)
        if index is not None:
            self._unhold(worker, index.entries)

    def _unhold(self, worker: RoutedWorker, hashes: Iterable[int]) -> None:
        holders = self._holders
        for h in hashes:
            held = holders.get(h)
            if held is not None:
                held.discard(worker)
                if not held:
                    del holders[h]

    def sync(self, workers: Sequence[RoutedWorker]) -> None:
        members = set(workers)
        for worker in [w for w in self._indexes if w not in members]:
            self.forget(worker)

    def expected_hit(self, worker: RoutedWorker, key: RequestKey) -> int:
        """Chunks of ``key``'s prompt that ``worker`` is expected to hold."""
        index = self._indexes.get(worker)
        return 0 if index is None else index.longest_prefix(key.hashes(self.chunk_bytes))

    def hit_tokens(self, chunks: int) -> int:
        """The prompt tokens ``chunks`` hit chunks are estimated to hold."""
        return self.estimate.tokens(chunks * self.chunk_bytes)

    def choose(self, candidates: list[W], key: RequestKey | None = None) -> W:
        hashes = key.hashes(self.chunk_bytes) if key is not None else []
        if not hashes:
            if key is not None:
                key.hit_chunks = 0
            return self._fallback.choose(candidates)
        assert key is not None
        # A large fleet's loads are read in a window of LOAD_SAMPLE candidates that moves on each
        # request (the power of d choices: Mitzenmacher, 2001), and the workers asked for their
        # prefix are the holders of the prompt's deepest held chunk: no pass over the fleet.
        window = self._window(candidates)
        mean = sum(w.in_flight for w in window) / len(window)
        hot = max(mean * self.max_load_ratio, mean + 1)
        per_chunk = self.chunk_bytes / self.estimate.value
        load_weight = self.load_weight
        # Without a hit, the least loaded candidate scores best (ties in turn, as the fallback).
        worker = self._fallback.choose(window)
        best_score, best_load, hit = -load_weight * (worker.in_flight - mean), worker.in_flight, 0
        hit_tier2 = 0
        holders = self._holders.get(hashes[0])
        if holders:
            indexes = self._indexes
            if candidates is not self._candidates:  # Pool.choose's cached list: its set is kept too
                self._candidates, self._candidate_set = candidates, set(candidates)
            if len(holders) > MAX_ASKED:
                holders = self._deepest_holders(hashes)
            for holder in holders:
                if holder not in self._candidate_set:
                    continue
                load = holder.in_flight
                index = indexes[holder]
                held = index.longest_prefix(hashes)
                # a tier-2 chunk is worth tier_weight of a device chunk (its load is not free)
                in_tier2 = index.tier2_count(hashes, held) if index.tier2 else 0
                credit = held - in_tier2 * (1.0 - self.tier_weight_of(holder)) if in_tier2 else held
                score = (credit * per_chunk if load <= hot else 0.0) - load_weight * (load - mean)
                if score > best_score or (score == best_score and load < best_load):
                    # a holder in the candidate set is one of the candidates, as the caller typed them
                    worker, best_score, best_load, hit = cast(W, holder), score, load, held
                    hit_tier2 = in_tier2
        if hit_tier2 and not self.tier_weight_of(worker):
            hit -= hit_tier2  # not loaded: recomputed (at best, the device's chunks before them hit)
            hit_tier2 = 0
        key.hit_chunks = hit
        key.hit_tier2_chunks = hit_tier2
        if hit:
            tiers = self.predicted_tier_tokens
            tiers[0] += self.hit_tokens(hit - hit_tier2)
            tiers[1] += self.hit_tokens(hit_tier2)
        self.routed_chunks += len(hashes)
        self.hit_chunks += hit
        self._add(worker, hashes, hit)
        self._remember(worker, hashes)
        return worker

    def _window(self, candidates: list[W]) -> list[W]:
        n = len(candidates)
        if n <= LOAD_SAMPLE:
            return candidates
        start = self._next_window % n
        self._next_window = start + LOAD_SAMPLE
        window = candidates[start : start + LOAD_SAMPLE]
        return window if len(window) == LOAD_SAMPLE else window + candidates[: LOAD_SAMPLE - len(window)]

    def _deepest_holders(self, hashes: list[int]) -> set[RoutedWorker]:
        """The workers holding the deepest of ``hashes`` that any worker holds (binary search:
        holder sets shrink along a chain), when too many hold its first chunk to ask them all."""
        holders = self._holders
        deepest = holders[hashes[held_prefix(hashes, holders) - 1]]
        if len(deepest) <= MAX_ASKED:
            return deepest
        return set(itertools.islice(deepest, MAX_ASKED))

    def routed(self, worker: RoutedWorker, hashes: list[int]) -> None:
        """``worker`` took a request with these chunks: it will cache them."""
        index = self._indexes.get(worker)
        self._add(worker, hashes, 0 if index is None else index.longest_prefix(hashes))
        self._remember(worker, hashes)

    def _remember(self, worker: RoutedWorker, hashes: list[int]) -> None:
        """Keep the last routes (of every worker: its first snapshot may come after them): a
        worker's events may not say them yet when its view resyncs."""
        self._recent.append((time.monotonic(), worker, hashes))

    def _add(self, worker: RoutedWorker, hashes: list[int], held: int) -> None:
        """Index ``hashes`` on ``worker``, whose index holds the first ``held`` of them already."""
        index = self.index(worker)
        index.limit = self._limit(worker)  # the bytes per token may have been learned since
        index.tier2_limit = self._tier2_limit(worker)
        holders = self._holders
        for h in hashes[held:]:
            found = holders.get(h)
            if found is None:
                holders[h] = {worker}
            else:
                found.add(worker)
        evicted = index.add(hashes, self._clock)
        self._clock += len(hashes)
        if evicted:
            self._unhold(worker, evicted)

    # -- the exact view: a worker's own cache events (server/orchestrator/cache_view.py) ---------------

    def stored(self, worker: RoutedWorker, keys: list[int], tier: int = 1) -> None:
        """``worker`` says it holds ``keys`` now (in chain order: the first most recent), in ``tier``."""
        if keys:
            self.exact.add(worker)
            index = self._indexes.get(worker)
            self._add(worker, keys, 0 if index is None else index.longest_prefix(keys))
            if tier == 2:
                self.index(worker).tier2.update(keys)

    def moved(self, worker: RoutedWorker, keys: list[int], tier: int) -> None:
        """``worker`` says ``keys`` moved to ``tier`` (2: spilled from its device; 1: loaded back)."""
        index = self._indexes.get(worker)
        if index is None:
            return
        held = [k for k in keys if k in index.entries]
        if tier == 2:
            index.tier2.update(held)
        else:
            index.tier2.difference_update(held)

    def removed(self, worker: RoutedWorker, keys: list[int]) -> None:
        """``worker`` says it evicted ``keys`` (from whichever tier)."""
        index = self._indexes.get(worker)
        if index is not None:
            entries, tier2 = index.entries, index.tier2
            for key in keys:
                entries.pop(key, None)
            if tier2:
                tier2.difference_update(keys)
            self._unhold(worker, keys)

    def resync(self, worker: RoutedWorker, keys: list[int], tier2: list[int] | None = None) -> None:
        """``worker`` holds exactly ``keys`` on its device and ``tier2`` in its second tier (a
        snapshot; its stream goes on from here)."""
        self.forget(worker)
        self.followed.add(worker)
        if tier2:
            self.stored(worker, tier2, 2)
        self.stored(worker, keys)
        # what was routed there just before: the worker may not have stored it when it answered
        since = time.monotonic() - RECENT_S
        for at, routed_to, hashes in list(self._recent):
            if routed_to is worker and at >= since:
                self._add(worker, hashes, self.index(worker).longest_prefix(hashes))

    def account(self, hit_chunks: int, prompt_tokens: int, cached_tokens: int, tier2_tokens: int = 0) -> None:
        """A context answer of the worker this router chose: predicted versus achieved hit tokens
        (``tier2_tokens``: of ``cached_tokens``, those its second tier served)."""
        predicted = min(self.hit_tokens(hit_chunks), prompt_tokens)
        self.predicted_tokens += predicted
        self.achieved_tokens += cached_tokens
        self.error_tokens += abs(predicted - cached_tokens)
        tier2_tokens = min(tier2_tokens, cached_tokens)
        self.achieved_tier_tokens[0] += cached_tokens - tier2_tokens
        self.achieved_tier_tokens[1] += tier2_tokens
