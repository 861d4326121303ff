"""Routers: which worker of a pool takes a request (config ``<pool>.router.type``, trtllm-serve's names).

- ``round_robin``: in turn.
- ``least_loaded`` (trtllm-serve's ``load_balancing``): fewest requests in flight, ties in turn.
- ``conversation``: a conversation's requests stick to one worker, by consistent hashing.
- ``kv_cache_aware``: the worker expected to hold the longest cached prefix of the prompt,
  balanced against load.

A router gets the healthy candidates and, when it says ``needs_key``, the request's
:class:`RequestKey` (computed once per request, from the raw body, only when a pool's router needs
one: round_robin and least_loaded requests pay nothing). ``forget(worker)`` drops what a router
knows of a worker; the pool and the health checker call it when the worker leaves the pool, turns
unhealthy or comes back (it may have restarted with an empty cache). ``sync(workers)`` gives the
router the pool's member list whenever it changes.

Bad input never raises here: a body whose span cannot be found, a ``conversation_id`` that is an
object: the request has no key of that kind and is routed to the least loaded worker.
"""

from __future__ import annotations

import bisect
import collections
import hashlib
import itertools
import json
import math
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any, Protocol, TypeVar, cast

import fastcore
from fastcore import JSONSpanError
from fastcore import protocol as wire
from server.cache_keys import CACHE_SALT, salt_key_at

from .estimates import BytesPerToken


class RoutedWorker(Protocol):
    """What a router reads of a worker (server/orchestrator/pools.py's ``Worker`` is one): its URL,
    the legs and estimated prompt tokens it has in flight, the KV capacity its ``/server_info``
    says. Routers key their state by the worker object itself (hashed by identity)."""

    @property
    def url(self) -> str: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def in_flight_tokens(self) -> int: ...

    @property
    def kv_capacity_tokens(self) -> int | None: ...


#: a router hands back one of the candidates it was given, as the caller's type
_W = TypeVar("_W", bound=RoutedWorker)

#: trtllm-serve's conversation: the body's ``conversation_params.conversation_id`` (canonical), else
#: the first non-empty of its headers (its conversation_id.py CONVERSATION_ID_HEADERS), in order
CONVERSATION_PARAMS = wire.CONVERSATION_PARAMS
CONVERSATION_FIELD = wire.CONVERSATION_ID
TRTLLM_CONVERSATION_HEADERS = (b"x-session-id", b"x-correlation-id", b"x-session-affinity",
                               b"x-multi-turn-session-id")  # fmt: skip
#: ours, older: a top-level ``conversation_id`` (moved into conversation_params before the legs:
#: trtllm-serve's workers forbid unknown fields) and this header, read after trtllm-serve's
CONVERSATION_HEADER = b"x-conversation-id"
CONVERSATION_HEADERS = (*TRTLLM_CONVERSATION_HEADERS, CONVERSATION_HEADER)
#: JSON bytes per prompt token where a figure must be fixed at startup (``tokens_per_block`` as
#: chunk bytes, timeouts, rate limits); every routing figure uses the learned one (estimates.py)
BYTES_PER_TOKEN = 4
#: kv_cache_aware in a large pool: loads read per request (a moving window of candidates), and the
#: most workers asked for their prefix (the holders of the deepest chunk held)
LOAD_SAMPLE = 32
MAX_ASKED = 32
#: routes this recent (the last RECENT_ROUTES of a pool) survive a resync of their worker's view:
#: a snapshot taken while they were on their way does not hold them yet
RECENT_S = 5.0
RECENT_ROUTES = 1024
#: kv_cache_aware: a tier-2 chunk's credit against a device chunk's where the worker publishes no
#: rates (Dynamo's KV router credits a host-tier hit at 0.75 of a device hit)
TIER_WEIGHT = 0.75
_NO_TIER2: tuple[None, None, None] = (None, None, None)
#: ids longer than this are not conversation ids (hashing megabytes per request is not routing)
MAX_CONVERSATION_ID_BYTES = 1024

_NESTED = (CONVERSATION_PARAMS, CONVERSATION_FIELD)
_CHAT_PATHS = (_NESTED, (CONVERSATION_FIELD,), (wire.MESSAGES,), (CACHE_SALT,))
_COMPLETION_PATHS = (_NESTED, (CONVERSATION_FIELD,), (wire.PROMPT,), (CACHE_SALT,))
_MOVE_PATHS = ((CONVERSATION_FIELD,), (CONVERSATION_PARAMS,))
_QUOTE, _MINUS, _COMMA = ord('"'), ord("-"), ord(",")
_SPACE = b" \t\r\n"


class RequestKey:
    """What the routers read of one request: its conversation id and its prompt span's chunk hashes.

    ``conversation``: the id's bytes (a string's decoded UTF-8, an integer's digits), or None.
    ``span``: the ``messages`` (chat) or ``prompt`` (completions) value's byte span, or None.
    Hashes are computed on first use per chunk size and kept (both pools may ask), each XORed with
    ``salt`` (the ``cache_salt``'s key, server/cache_keys.py; 0 without one): different salts
    share no key, as they share no cached block.
    ``hit_chunks``: set by the kv_cache_aware router to the expected hit on the worker it chose
    (``hit_tier2_chunks``: of it, in the worker's tier 2).
    """

    __slots__ = ("_hashes", "body", "conversation", "hit_chunks", "hit_tier2_chunks", "salt", "span")

    def __init__(
        self, body: bytes, conversation: bytes | None, span: tuple[int, int] | None, salt: int = 0
    ) -> None:
        self.body = body
        self.conversation = conversation
        self.span = span
        self.salt = salt
        self.hit_chunks = 0
        #: of them, those expected in the worker's second tier
        self.hit_tier2_chunks = 0
        self._hashes: tuple[int, list[int]] | None = None

    @property
    def prompt_bytes(self) -> int:
        return 0 if self.span is None else self.span[1] - self.span[0]

    def hashes(self, chunk: int) -> list[int]:
        """The chained hashes of the span's full ``chunk``-byte chunks ([] without a span)."""
        if self.span is None:
            return []
        cached = self._hashes
        if cached is not None and cached[0] == chunk:
            return cached[1]
        hashes = fastcore.chunk_hashes(self.body, self.span[0], self.span[1], chunk)
        if self.salt:
            salt = self.salt
            hashes = [h ^ salt for h in hashes]
        self._hashes = (chunk, hashes)
        return hashes


def _conversation_of(body: bytes, span: tuple[int, int] | None) -> bytes | None:
    """A string's UTF-8 or an integer's digits; None for anything else (object, float, null...)."""
    if span is None:
        return None
    start, end = span
    if end - start > MAX_CONVERSATION_ID_BYTES + 2:
        return None
    first = body[start]
    if first == _QUOTE:
        raw = body[start + 1 : end - 1]
        if b"\\" not in raw:
            return raw or None
        try:
            value = json.loads(body[start:end])
        except ValueError:
            return None
        return value.encode("utf-8", "surrogatepass") or None
    raw = body[start:end]
    digits = raw[1:] if first == _MINUS else raw
    if digits.isdigit():  # an integer: no fraction, no exponent
        return raw
    return None


def conversation_header(request: Any) -> bytes | None:
    """The first non-empty conversation header of ``request`` (trtllm-serve's four, then ours)."""
    for name in CONVERSATION_HEADERS:
        value = request.header(name)
        if value is not None and value.strip():
            return value
    return None


def request_key(body: bytes, chat: bool, header: bytes | None) -> RequestKey:
    """The routing key of a client body (already validated by the relay): one non-validating scan
    finds the conversation id (``conversation_params.conversation_id``, else a top-level
    ``conversation_id``, else ``header``) and the prompt span. Never raises on a body's content."""
    try:
        nested, conversation, prompt, salt = fastcore.find_spans(
            body, _CHAT_PATHS if chat else _COMPLETION_PATHS, validate=False
        )
    except JSONSpanError:  # e.g. a repeated conversation_id: no key, least loaded
        nested = conversation = prompt = salt = None
    cid = _conversation_of(body, nested)
    if cid is None:
        cid = _conversation_of(body, conversation)
    if cid is None and header:
        header = header.strip()
        if 0 < len(header) <= MAX_CONVERSATION_ID_BYTES:
            cid = header
    return RequestKey(body, cid, prompt, salt_key_at(body, salt) if salt is not None else 0)


def conversation_to_params(body: bytes) -> bytes:
    """``body`` with a top-level ``conversation_id`` (ours) moved to trtllm-serve's
    ``conversation_params: {"conversation_id": ...}``, so that no leg carries a field trtllm-serve's
    workers forbid: dropped when ``conversation_params`` is there already (it is canonical) or the
    value is no id (a string or an integer). ``body`` itself when it has none: one non-validating
    compiled scan of the top level (~5 µs at 160 KiB; a bytes search for the name took 86 µs)."""
    try:
        top, params = fastcore.find_spans(body, _MOVE_PATHS, validate=False)
    except JSONSpanError:
        return body  # a repeated member: the relay's own validation words the 400
    if top is None:
        return body
    start, end = top
    # the member's key: the last quote pair before the colon (the decoded name has no quote in it)
    colon = body.rindex(b":", 0, start)
    key_start = body.rindex(b'"', 0, body.rindex(b'"', 0, colon))
    view = memoryview(body)  # one copy of the body in all, made by the join
    if params is None and _conversation_of(body, top) is not None:
        value = bytes(view[start:end])
        if value[:1] != b'"':  # an integer id: trtllm-serve's conversation_id is a string
            value = b'"' + value + b'"'
        member = b'"conversation_params":{"conversation_id":' + value + b"}"
        return b"".join((view[:key_start], member, view[end:]))
    before = key_start - 1
    while before >= 0 and body[before] in _SPACE:
        before -= 1
    if body[before] == _COMMA:
        cut = (before, end)
    else:  # the first member: take the comma after it
        after = end
        while after < len(body) and body[after] in _SPACE:
            after += 1
        cut = (key_start, after + 1 if after < len(body) and body[after] == _COMMA else end)
    return b"".join((view[: cut[0]], view[cut[1] :]))


def _point(data: bytes) -> int:
    """A stable 64-bit point on the ring (never Python's salted ``hash()``)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class Router:
    name = ""
    #: this router reads a RequestKey (Pool.choose gets one only then)
    needs_key = False
    #: the key's kinds it reads: "conversation", "prefix"
    key_kinds: frozenset[str] = frozenset()
    #: the pool's learned prompt bytes per token (seeded by its workers' /server_info, taught by
    #: the context answers' usage: server/orchestrator/estimates.py)
    estimate: BytesPerToken

    def choose(self, candidates: list[_W], key: RequestKey | None = None) -> _W:
        raise NotImplementedError

    def sync(self, workers: Sequence[RoutedWorker]) -> None:
        """The pool's members changed (all of them, healthy or not)."""

    def forget(self, worker: RoutedWorker) -> None:
        """``worker`` left, turned unhealthy or came back: drop what is known of it."""


class RoundRobinRouter(Router):
    name = "round_robin"

    def __init__(self) -> None:
        self.estimate = BytesPerToken()
        self._next = 0

    def choose(self, candidates: list[_W], key: RequestKey | None = None) -> _W:
        worker = candidates[self._next % len(candidates)]
        self._next += 1
        return worker


class LeastLoadedRouter(Router):
    """Fewest in-flight requests; ties go round robin so idle workers share load.

    ``use_tokens`` (trtllm-serve's ``load_balancing`` argument): fewest in-flight prompt tokens
    instead, a request weighing its body's bytes / the pool's learned bytes per token (no parse), so one 40k-token
    prompt counts as much as forty 1k-token ones; ties by requests, then in turn."""

    name = "least_loaded"
    ARGS = frozenset({"use_tokens"})

    def __init__(self, args: dict[str, Any] | None = None) -> None:
        self.estimate = BytesPerToken()
        self._tiebreak = 0
        use = (args or {}).get("use_tokens", False)
        if not isinstance(use, bool):
            raise ValueError(f"use_tokens must be true or false, got {use!r}")
        self.use_tokens = use

    def choose(self, candidates: list[_W], key: RequestKey | None = None) -> _W:
        if self.use_tokens:
            least_tokens = min(w.in_flight_tokens for w in candidates)
            candidates = [w for w in candidates if w.in_flight_tokens == least_tokens]
        least = min(w.in_flight for w in candidates)
        tied = [w for w in candidates if w.in_flight == least]
        worker = tied[self._tiebreak % len(tied)]
        self._tiebreak += 1
        return worker


def _held_prefix(hashes: list[int], held: Collection[int]) -> int:
    """How many leading ``hashes`` are in ``held``, given that ``hashes[0]`` is (binary search: a
    chain's holders are prefix-closed, so membership only ever turns off along it)."""
    lo, hi = 1, len(hashes)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if hashes[mid - 1] in held:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _int_arg(args: dict[str, Any], name: str, default: int, low: int, high: int | None = None) -> int:
    value = args.get(name, default)
    if type(value) is not int or value < low or (high is not None and value > high):
        bound = f"an integer in [{low}, {high}]" if high is not None else f"an integer >= {low}"
        raise ValueError(f"{name} must be {bound}, got {value!r}")
    return value


def _float_arg(args: dict[str, Any], name: str, default: float, low: float) -> float:
    value = args.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= low:
        raise ValueError(f"{name} must be a number >= {low:g}, got {value!r}")
    return float(value)


def _chunk_from_tokens(args: dict[str, Any], default_bytes: int) -> int:
    """``chunk_bytes``, or trtllm-serve's ``tokens_per_block`` as bytes (x ``BYTES_PER_TOKEN``: our
    chunks are of the raw JSON, not of token ids); not both."""
    from fastcore._hash_py import CHUNK_MAX

    if "tokens_per_block" in args:
        if "chunk_bytes" in args:
            raise ValueError("tokens_per_block: give it or chunk_bytes, not both (one chunk size)")
        high = CHUNK_MAX // BYTES_PER_TOKEN
        tokens = _int_arg(args, "tokens_per_block", 32, 8, high)
        if tokens % 8:
            raise ValueError(f"tokens_per_block must be a multiple of 8 (chunks of {BYTES_PER_TOKEN} x it bytes, "
                             f"a multiple of 32), got {tokens}")  # fmt: skip
        return tokens * BYTES_PER_TOKEN
    chunk = _int_arg(args, "chunk_bytes", default_bytes, 32, CHUNK_MAX)
    if chunk % 32:
        raise ValueError(f"chunk_bytes must be a multiple of 32, got {chunk}")
    return chunk


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
        self.virtual_nodes = _int_arg(args, "virtual_nodes", 100, 1, 10_000)
        self.load_factor = _float_arg(args, "load_factor", 1.25, 0.0)
        if 0 < self.load_factor < 1:
            raise ValueError(f"load_factor must be 0 (no bound) or >= 1, got {self.load_factor:g}")
        # trtllm-serve's implicit matching: a request without an id whose prompt shares at least
        # match_threshold of its chunks with what a worker was sent goes to that worker (off: None)
        self.match_threshold: float | None = None
        if "match_threshold" in args:
            threshold = _float_arg(args, "match_threshold", 0.75, 0.0)
            if not 0 < threshold <= 1:
                raise ValueError(f"match_threshold must be in (0, 1], got {threshold:g}")
            self.match_threshold = threshold
            self.key_kinds = frozenset({"conversation", "prefix"})
        self.chunk_bytes = _chunk_from_tokens(args, 128 * BYTES_PER_TOKEN)  # trtllm's 128 tokens
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

    def owner(self, conversation: bytes, healthy: dict[str, _W], capacity: float = math.inf) -> _W | None:
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

    def choose(self, candidates: list[_W], key: RequestKey | None = None) -> _W:
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

    def _implicit(self, candidates: list[_W], key: RequestKey, chunks: int) -> _W | None:
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


class _PrefixIndex:
    """One worker's approximate cache: chunk hash -> recency, bounded to ``limit`` entries.

    Within a request the prefix's hashes get the higher recency, so eviction drops the tails of
    chains first and what stays of a chain is (nearly always) a prefix of it, as in a prefix cache.
    Eviction is amortized: past 5/4 of the bound, the oldest are dropped down to the bound.
    """

    __slots__ = ("entries", "limit", "tier2", "tier2_limit")

    def __init__(self, limit: int, tier2_limit: int = 0) -> None:
        self.limit = limit
        self.entries: dict[int, int] = {}
        #: the entries in the worker's second tier (the rest are on its device)
        self.tier2: set[int] = set()
        #: an approximate index's tier 2 (its eviction spills there, ``tier2_limit`` entries LRU)
        self.tier2_limit = tier2_limit

    def tier2_count(self, hashes: list[int], held: int) -> int:
        """How many of the first ``held`` hashes are in tier 2."""
        tier2 = self.tier2
        return sum(1 for h in hashes[:held] if h in tier2) if tier2 else 0

    def longest_prefix(self, hashes: list[int]) -> int:
        """How many leading hashes this worker holds (binary search: chains are prefix-closed)."""
        entries = self.entries
        if not entries or not hashes or hashes[0] not in entries:
            return 0
        return _held_prefix(hashes, entries)

    def add(self, hashes: list[int], clock: int) -> list[int]:
        """Hold ``hashes`` on the device (the prefix most recent); the hashes evicted to stay in
        bound. With a ``tier2_limit`` the least recent past ``limit`` are in tier 2 instead."""
        n = len(hashes)
        entries, tier2, limit = self.entries, self.tier2, self.limit
        entries.update(zip(hashes, range(clock + n, clock, -1)))
        if tier2:
            tier2.difference_update(hashes)
        total = limit + self.tier2_limit
        if len(entries) - len(tier2) <= limit + (limit >> 2) and len(entries) <= total + (total >> 2):
            return []
        ranked = sorted(entries.items(), key=lambda item: item[1], reverse=True)
        self.entries = dict(ranked[:total])
        if self.tier2_limit:
            self.tier2 = {h for h, _ in ranked[limit:total]}
        elif tier2:
            self.tier2 = {h for h in tier2 if h in self.entries}
        return [h for h, _ in ranked[total:]]


class KvCacheAwareRouter(Router):
    """The worker with the longest expected prefix hit, balanced against load.

    Keys: :func:`fastcore.chunk_hashes` of the prompt span's raw bytes (``messages`` on chat,
    ``prompt`` on completions), in ``chunk_bytes`` chunks. Each worker has a bounded index of the
    hashes routed to it (:class:`_PrefixIndex`): ``max_cached_tokens`` tokens' worth, or the
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
    ARGS = frozenset(
        {"chunk_bytes", "tokens_per_block", "max_cached_tokens", "max_index_tokens", "load_weight",
         "max_load_ratio", "tier_weight"}
    )  # fmt: skip

    def __init__(self, args: dict[str, Any] | None = None) -> None:
        args = args or {}
        self.estimate = BytesPerToken()
        self.chunk_bytes = _chunk_from_tokens(args, 512)
        self.max_cached_tokens = _int_arg(args, "max_cached_tokens", 262_144, 1)
        #: the orchestrator's own bound on any worker's index (~100 bytes per chunk entry)
        self.max_index_tokens = _int_arg(args, "max_index_tokens", 1 << 20, 1)
        self.load_weight = _float_arg(args, "load_weight", 1024.0, 0.0)
        self.max_load_ratio = _float_arg(args, "max_load_ratio", 1.5, 1.0)
        #: a tier-2 chunk's credit against a device chunk's: the args' (every worker), else each
        #: worker's measured one (:meth:`tier_rates`), else TIER_WEIGHT
        self.tier_weight: float | None = None
        if "tier_weight" in args:
            self.tier_weight = _float_arg(args, "tier_weight", TIER_WEIGHT, 0.0)
            if self.tier_weight > 1:
                raise ValueError(f"tier_weight must be in [0, 1], got {self.tier_weight:g}")
        self._tier_weights: dict[RoutedWorker, float] = {}
        self._fallback = LeastLoadedRouter()
        self._indexes: dict[RoutedWorker, _PrefixIndex] = {}
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

    def index(self, worker: RoutedWorker) -> _PrefixIndex:
        index = self._indexes.get(worker)
        if index is None:
            index = self._indexes[worker] = _PrefixIndex(self._limit(worker), self._tier2_limit(worker))
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

    def choose(self, candidates: list[_W], key: RequestKey | None = None) -> _W:
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
                    worker, best_score, best_load, hit = cast(_W, holder), score, load, held
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

    def _window(self, candidates: list[_W]) -> list[_W]:
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
        deepest = holders[hashes[_held_prefix(hashes, holders) - 1]]
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


#: config router kind -> its router: the one list of the routers built (the config's router types and
#: the CLI's choices are read from it, server/orchestrator/config.py ROUTER_TYPES)
ROUTERS: dict[str, Callable[..., Router]] = {
    "round_robin": lambda args=None: RoundRobinRouter(),
    "least_loaded": LeastLoadedRouter,
    "conversation": ConversationRouter,
    "kv_cache_aware": KvCacheAwareRouter,
}
#: config router kind -> the args it takes
ROUTER_ARGS: dict[str, frozenset[str]] = {
    kind: getattr(new, "ARGS", frozenset()) for kind, new in ROUTERS.items()
}


def make_router(kind: str, args: dict[str, Any] | None = None) -> Router:
    """The router ``kind`` with ``args`` (``ValueError`` naming a bad argument's value)."""
    return ROUTERS[kind](args or {})
