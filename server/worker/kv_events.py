"""trtllm-serve's KV cache events (``POST /kv_cache_events``), from a worker's prefix cache.

trtllm-serve's ``kv_cache_aware`` router polls each worker's ``POST /kv_cache_events`` and keeps a
set of the block hashes each one holds (its ``router.py`` ``KvCacheAwareServerState``). The answer
is a JSON list of events as its ``KVCacheEventSerializer`` writes them, oldest first, each returned
once::

    {"event_id": N, "data": {"type": "created", "num_blocks_per_cache_level": [blocks]}, "window_size": W}
    {"event_id": N, "data": {"type": "stored", "parent_hash": H | null,
                             "blocks": [{"type": "stored_block", "block_hash": H, "tokens": [],
                                         "cache_level": 0, "priority": 0}, ...]}, "window_size": W}
    {"event_id": N, "data": {"type": "removed", "block_hashes": [H, ...]}, "window_size": W}

A block hash is the first 8 bytes of our chained BLAKE2b-128 block key as a signed little-endian
int64 (trtllm-serve's are int64 too). ``tokens`` is empty: the router reads only the hashes, and
token ids would hand every poller the prompts themselves. The log records nothing until the first
poll (a worker nobody polls pays nothing); the first answer starts with ``created``.

Bounded in bytes, not only in events (a dict per block made one poll's log of 1,000 long prompts
720 MiB): an event keeps its hashes packed, 8 bytes each, and is at most :data:`MAX_EVENT_BLOCKS`
blocks (a longer one is split, each piece chained to the one before); past :data:`MAX_LOG_BYTES`
(or :data:`MAX_EVENTS`) the oldest are dropped (``dropped``), as trtllm-serve's bounded event
buffer drops them. A poll takes the oldest events up to :data:`MAX_ANSWER_BYTES` of JSON (at
least one), so an answer, and the loop's time building it, is bounded; the rest wait for the next
poll. Appends come from the engine thread, polls from the event loop: one lock orders them (an
append evicts from the same end a poll takes from).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import sys
import threading
from array import array
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar
from urllib.parse import parse_qs

from fastcore import protocol as wire
from server.cache_keys import prompt_keys
from server.errors import HTTPError

#: events waiting for a poll (trtllm-serve's kv_cache_config.event_buffer_max_size plays this part)
MAX_EVENTS = 4096
#: a log's bytes (its own accounting: packed hashes or keys plus :data:`EVENT_BYTES` an event);
#: past it the oldest events go. 8 MiB: a million block hashes, 16 turns of a 1M-token cache
MAX_LOG_BYTES = 8 << 20
#: one answer's JSON, at most (a single event larger than it still goes alone: it is bounded by
#: :data:`MAX_EVENT_BLOCKS` / :data:`MAX_EVENT_KEYS`); about 10 ms of the loop to build
MAX_ANSWER_BYTES = 1 << 20
#: blocks in one trtllm-serve event (~100 KB of JSON); a longer store or removal is split
MAX_EVENT_BLOCKS = 1024
#: accounted per event beside its packed hashes: the tuple, its ints, the bytes object's header
EVENT_BYTES = 160

_STORED, _REMOVED, _CREATED = 0, 1, 2
_BLOCK = '{"type":"stored_block","block_hash":%d,"tokens":[],"cache_level":0,"priority":0}'
#: the JSON of one stored block (the longest int64) and of one removed hash, a comma each
_BLOCK_JSON = len(_BLOCK) - 2 + 20 + 1
_HASH_JSON = 20 + 1
#: an event's JSON around its hashes, at most (ids, type, parent hash, window size)
_EVENT_JSON = 160


def block_hash(digest: bytes) -> int:
    """Our 16-byte block key as trtllm-serve's int64 block hash."""
    return int.from_bytes(digest[:8], "little", signed=True)


def _pack(digests: list[bytes]) -> bytes:
    """The digests' block hashes, 8 bytes each (each digest's first 8: a little-endian int64)."""
    return b"".join([d[:8] for d in digests])


def _unpack(packed: bytes) -> array[int]:
    hashes = array("q")
    hashes.frombytes(packed)
    if sys.byteorder == "big":
        hashes.byteswap()
    return hashes


#: an event of either log: its last member is what it holds, packed (8 bytes a hash or key)
_Event = TypeVar("_Event", bound=tuple[Any, ...])


class _PackedEvents(Generic[_Event]):
    """What both logs keep alike: their events, oldest first, each holding its hashes or keys
    packed; ``bytes``, their accounting (:data:`EVENT_BYTES` an event beside its packed bytes),
    kept under ``max_bytes``, and at most ``max_events`` of them: past either the oldest go
    (``dropped``). An answer's JSON is at most ``answer_bytes`` (or one event)."""

    def __init__(self, block_size: int, max_events: int, max_bytes: int, answer_bytes: int) -> None:
        self.block_size = block_size
        self.max_events = max_events
        self.max_bytes = max_bytes
        self.answer_bytes = answer_bytes
        self._events: deque[_Event] = deque()
        self.bytes = 0
        #: events dropped unread (the log was full)
        self.dropped = 0

    def _keep(self, event: _Event) -> None:
        events = self._events
        events.append(event)
        self.bytes += EVENT_BYTES + len(event[-1])
        while events and (len(events) > self.max_events or self.bytes > self.max_bytes):
            self.bytes -= EVENT_BYTES + len(events.popleft()[-1])
            self.dropped += 1


class KvEventLog(_PackedEvents[tuple[int, int, int | None, bytes]]):
    """trtllm-serve's event buffer of one cache. An event: (event_id, kind, the parent hash or, for
    created, the block count, packed hashes)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_events: int = MAX_EVENTS,
        max_bytes: int = MAX_LOG_BYTES,
        answer_bytes: int = MAX_ANSWER_BYTES,
    ) -> None:
        super().__init__(block_size, max_events, max_bytes, answer_bytes)
        self.num_blocks = num_blocks
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._append(_CREATED, num_blocks, b"")

    @property
    def waiting(self) -> int:
        return len(self._events)

    def _append(self, kind: int, parent: int | None, packed: bytes) -> None:
        with self._lock:
            self._keep((next(self._ids), kind, parent, packed))

    def stored(self, parent: bytes, digests: list[bytes]) -> None:
        """``digests``: blocks now held, in chain order; ``parent``: the block before the first (b"": none)."""
        for start in range(0, len(digests), MAX_EVENT_BLOCKS):
            before = digests[start - 1] if start else parent
            self._append(
                _STORED,
                block_hash(before) if before else None,
                _pack(digests[start : start + MAX_EVENT_BLOCKS]),
            )

    def removed(self, digests: list[bytes]) -> None:
        for start in range(0, len(digests), MAX_EVENT_BLOCKS):
            self._append(_REMOVED, None, _pack(digests[start : start + MAX_EVENT_BLOCKS]))

    def page(self) -> bytes:
        """The oldest waiting events, as one JSON list of at most ``answer_bytes`` (or one event);
        each is returned once. The JSON is built outside the lock, from the events taken."""
        taken: list[tuple[int, int, int | None, bytes]] = []
        with self._lock:
            events, size = self._events, 2
            while events:
                _, kind, _, packed = events[0]
                cost = _EVENT_JSON + len(packed) // 8 * (_BLOCK_JSON if kind == _STORED else _HASH_JSON)
                if taken and size + cost > self.answer_bytes:
                    break
                taken.append(events.popleft())
                self.bytes -= EVENT_BYTES + len(packed)
                size += cost
        return ("[" + ",".join([self._json(*event) for event in taken]) + "]").encode()

    def _json(self, event_id: int, kind: int, parent: int | None, packed: bytes) -> str:
        if kind == _STORED:
            blocks = ",".join([_BLOCK % h for h in _unpack(packed)])
            before = "null" if parent is None else parent
            data = f'{{"type":"stored","parent_hash":{before},"blocks":[{blocks}]}}'
        elif kind == _REMOVED:
            data = f'{{"type":"removed","block_hashes":[{",".join(map(str, _unpack(packed)))}]}}'
        else:
            data = f'{{"type":"created","num_blocks_per_cache_level":[{parent}]}}'
        return f'{{"event_id":{event_id},"data":{data},"window_size":{self.block_size}}}'

    def drain(self) -> list[dict[str, Any]]:
        """Every waiting event, oldest first (page after page); each is returned once."""
        out: list[dict[str, Any]] = []
        while page := json.loads(self.page()):
            out.extend(page)
        return out


def events_of(cache: Any, block_size: int, num_blocks: int) -> KvEventLog:
    """``cache``'s event log, started (recording from now) on the first call."""
    log = getattr(cache, "events", None)
    if log is None:
        log = cache.events = KvEventLog(num_blocks, block_size)
    return log


#: the keys in one of our events (~86 KB of JSON); a longer store or removal is split
MAX_EVENT_KEYS = 4096
#: keys held at once (a resync lists them all: ~21 bytes of JSON each); past it new keys are not
#: published (the orchestrator then estimates them, as without events)
MAX_HELD_KEYS = 1 << 18
#: keys mapped to one block: a block covers block_size ids of a chunk's bytes, but a request's
#: JSON may pad its prompt span (whitespace between messages) so that thousands of chunks end in one
#: block, each a key held as long as that block
MAX_KEYS_PER_BLOCK = 64
#: an answer's JSON around its events (instance, chunk_bytes, seq, more), at most
_ANSWER_JSON = 160
#: one of our events' JSON around its keys, at most
_CHUNK_EVENT_JSON = 40
#: a resync's keys are written this many at a time, the loop free between
_RESYNC_PIECE = 1 << 15


class ChunkEventLog(_PackedEvents[tuple[int, str, int, bytes]]):
    """This worker's cache in the orchestrator's key space (server/cache_keys.py), as a stream every
    orchestrator may follow (``GET /cache_events``, docs/protocol.md).

    A request's prompt keys (one per ``chunk_bytes`` chunk of its raw ``messages`` / ``prompt``
    bytes, salted) are mapped to the token block covering each chunk's end (in proportion: chunk
    ``i`` ends at byte ``(i + 1) x chunk_bytes`` of ``span_bytes``, so at token
    ``ceil(that x ids / span_bytes)``); a key is held while that block is (at most
    :data:`MAX_KEYS_PER_BLOCK` a block, ``max_held_keys`` in all). Events: ``stored`` keys (their
    blocks were computed or imported), ``moved`` keys with a ``tier`` (2: their blocks spilled to
    the worker's second tier; 1: loaded back) and ``removed`` keys (their blocks were evicted), each
    numbered by ``seq``, kept packed (8 bytes a key) under ``max_bytes`` and ``max_events``: a
    follower that asks after an older ``seq``, or names another ``instance`` (this process
    restarted), gets a resync (every held key) instead. An answer holds the events after the
    follower's ``seq`` up to ``answer_bytes`` of JSON (``more``: the rest follow). ``chunk_bytes``
    is the worker's (``--cache-events-chunk-bytes``); the log records nothing before its first follower.
    An event: (seq, "stored", "removed" or "moved", the tier (0: none said, device), the keys packed
    as uint64).
    """

    def __init__(
        self,
        instance: str,
        chunk_bytes: int,
        block_size: int,
        max_events: int = MAX_EVENTS,
        max_bytes: int = MAX_LOG_BYTES,
        answer_bytes: int = MAX_ANSWER_BYTES,
        max_held_keys: int = MAX_HELD_KEYS,
    ) -> None:
        super().__init__(block_size, max_events, max_bytes, answer_bytes)
        self.instance = instance
        self.chunk_bytes = chunk_bytes
        self.max_held_keys = max_held_keys
        self.seq = 0
        #: key -> the block digest it is mapped to; block digest -> its keys
        self.held: dict[int, bytes] = {}
        self._by_block: dict[bytes, list[int]] = {}
        #: the blocks in tier 2 now (moved there from the device; a resync lists their keys apart)
        self.tier2_blocks: set[bytes] = set()
        #: a tier's rates, as /server_info says them (kv_tier2_load_tokens_per_s,
        #: prefill_tokens_per_s): a resync carries them to the router's tier weight
        self.tier_rates: dict[str, float] = {}
        #: request id -> (its prompt keys, its prompt span's bytes), until its blocks are stored
        self.pending: dict[str, tuple[list[int], int]] = {}
        self._changed: asyncio.Event | None = None

    def track(self, request_id: str, body: bytes, chat: bool) -> None:
        """Keep a request's prompt keys until its blocks are stored (:meth:`stored`; the handler
        drops them when the request ends, whatever happened)."""
        keys, span_bytes = prompt_keys(body, chat, self.chunk_bytes)
        if keys:
            self.pending[request_id] = (keys, span_bytes)

    def _append(self, kind: str, keys: list[int], tier: int = 0) -> None:
        for start in range(0, len(keys), MAX_EVENT_KEYS):
            self.seq += 1
            self._keep((self.seq, kind, tier, array("Q", keys[start : start + MAX_EVENT_KEYS]).tobytes()))
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def stored(self, request_id: str, digests: list[bytes], ids: int) -> None:
        """The request's full blocks (``digests``, chain order) are held now; ``ids`` its prompt length."""
        pending = self.pending.pop(request_id, None)
        if pending is None or not digests or ids <= 0:
            return
        keys, span_bytes = pending
        held, by_block, block_size, chunk = self.held, self._by_block, self.block_size, self.chunk_bytes
        new = []
        for i, key in enumerate(keys):
            end_token = -(-(i + 1) * chunk * ids // span_bytes)
            block = (end_token - 1) // block_size
            if block >= len(digests) or len(held) >= self.max_held_keys:
                break
            if key in held:
                continue
            digest = digests[block]
            mapped = by_block.setdefault(digest, [])
            if len(mapped) >= MAX_KEYS_PER_BLOCK:
                continue
            held[key] = digest
            mapped.append(key)
            new.append(key)
        if new:
            self._append("stored", new)

    def moved(self, digests: list[bytes], tier: int) -> None:
        """These blocks moved to ``tier`` (2: spilled from the device to tier 2; 1: loaded back)."""
        moved, tier2 = [], self.tier2_blocks
        for digest in digests:
            keys = self._by_block.get(digest)
            if tier == 2:
                tier2.add(digest)
            else:
                tier2.discard(digest)
            if keys:
                moved.extend(keys)
        if moved:
            self._append("moved", moved, tier)

    def evicted(self, digests: list[bytes], tier: int = 0) -> None:
        """These blocks left the cache (``tier`` 2: evicted from tier 2; 0: from wherever they
        were): the keys mapped to them are gone."""
        gone = []
        for digest in digests:
            self.tier2_blocks.discard(digest)
            keys = self._by_block.pop(digest, None)
            if keys:
                for key in keys:
                    self.held.pop(key, None)
                gone.extend(keys)
        if gone:
            self._append("removed", gone, tier)

    def _resync(self, tiers: bool) -> dict[str, Any]:
        answer: dict[str, Any] = {
            "instance": self.instance,
            "chunk_bytes": self.chunk_bytes,
            "seq": self.seq,
            "resync": True,
        }
        if tiers and self.tier_rates:
            answer["tier_rates"] = self.tier_rates
        tier2 = self.tier2_blocks
        if not tier2:
            answer["held"] = list(self.held)
            return answer
        # held: the device's keys; held_tier2: tier 2's (a follower that reads no tier: not listed)
        answer["held"] = [k for k, d in self.held.items() if d not in tier2]
        if tiers:
            answer["held_tier2"] = [k for k, d in self.held.items() if d in tier2]
        return answer

    def answer(self, after: int, instance: str | None, tiers: bool = False) -> dict[str, Any]:
        """The events after ``after`` up to ``answer_bytes`` of JSON (``more``: not all of them), or a
        resync (``held``: every key) when they cannot be given. ``tiers``: the follower reads the
        tier events (``tiers=1``); to one that does not, a move to tier 2 is a removal and a move
        back a store, as it read them before tiers (backward compatible)."""
        events = self._events
        oldest = events[0][0] if events else self.seq + 1
        if instance != self.instance or after > self.seq or after < oldest - 1:
            return self._resync(tiers)
        out: list[dict[str, Any]] = []
        size, more = _ANSWER_JSON, False
        for seq, kind, tier, packed in itertools.islice(events, after + 1 - oldest, None):  # seqs run on
            size += _CHUNK_EVENT_JSON + len(packed) // 8 * 21
            if out and size > self.answer_bytes:
                more = True
                break
            keys = array("Q")
            keys.frombytes(packed)
            if not tiers and kind == "moved":
                kind, tier = ("removed" if tier == 2 else "stored"), 0
            event: dict[str, Any] = {"seq": seq, kind: keys.tolist()}
            if tier and tiers:
                event["tier"] = tier
            out.append(event)
        answer = {"instance": self.instance, "chunk_bytes": self.chunk_bytes, "seq": self.seq, "events": out}
        if more:
            answer["more"] = True
        return answer

    async def wait(self, after: int, timeout: float) -> None:
        """Until an event after ``after`` exists (or ``timeout`` seconds)."""
        if after != self.seq or timeout <= 0:
            return
        if self._changed is None:
            self._changed = asyncio.Event()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)


async def encode_answer(answer: dict[str, Any]) -> bytes:
    """An answer of :meth:`ChunkEventLog.answer` as compact JSON; a resync's keys (up to
    :data:`MAX_HELD_KEYS`, megabytes of text) written :data:`_RESYNC_PIECE` at a time, the loop
    free between (the keys are a snapshot: later events follow from its ``seq``)."""
    if "held" not in answer:
        return json.dumps(answer, separators=(",", ":")).encode()
    lists = ("held", "held_tier2")
    head = json.dumps({k: v for k, v in answer.items() if k not in lists}, separators=(",", ":"))
    parts = [head[:-1]]
    for name in lists:
        held = answer.get(name)
        if held is None:
            continue
        parts.append(f',"{name}":[')
        for start in range(0, len(held), _RESYNC_PIECE):
            if start:
                parts.append(",")
                await asyncio.sleep(0)
            parts.append(",".join(map(str, held[start : start + _RESYNC_PIECE])))
        parts.append("]")
    parts.append("}")
    return "".join(parts).encode()


#: the longest a follower's ``wait`` holds a poll open
MAX_WAIT_S = 30.0


def _query_value(params: dict[str, list[str]], name: str, parse: Callable[[str], Any], default: Any) -> Any:
    values = params.get(name)
    if not values:
        return default
    try:
        return parse(values[-1])
    except ValueError:
        raise HTTPError(
            400, f"GET /cache_events: {name} must be {parse.__name__}, got {values[-1][:40]!r}", param=name
        ) from None


async def follow_cache_events(cache: Any, instance: str, query: bytes, chunk_bytes: int) -> bytes:
    """``GET /cache_events?after=<seq>&instance=<id>&chunk_bytes=<n>&wait=<s>``: the events after
    ``after`` (a resync when they are gone or ``instance`` is not this process's), held up to
    ``wait`` seconds (at most 30) until there is one, as JSON. ``chunk_bytes`` is the worker's
    (``--cache-events-chunk-bytes``): a caller's other size is a 400 naming both, and changes
    nothing (the first caller's chose the log's size for every caller before)."""
    if cache is None or not hasattr(cache, "chunks"):
        raise HTTPError(
            404,
            "GET /cache_events: this worker's engine publishes no cache events "
            "(an orchestrator keeps its own estimate of this worker's cache)",
        )
    params = parse_qs(query.decode("latin-1"), keep_blank_values=True)
    after = _query_value(params, "after", int, 0)
    asked = _query_value(params, "chunk_bytes", int, chunk_bytes)
    wait = _query_value(params, "wait", float, 0.0)
    tiers = _query_value(params, "tiers", int, 0)
    if after < 0:
        raise HTTPError(400, f"GET /cache_events: after must be >= 0, got {after}", param="after")
    if tiers not in (0, 1):
        raise HTTPError(400, f"GET /cache_events: tiers must be 0 or 1, got {tiers}", param="tiers")
    if asked != chunk_bytes:
        raise HTTPError(
            400,
            f"GET /cache_events: chunk_bytes is this worker's {chunk_bytes} "
            f"(--cache-events-chunk-bytes; a kv_cache_aware router's chunk_bytes must be it), "
            f"got {asked}",
            param="chunk_bytes",
        )
    if not 0 <= wait <= MAX_WAIT_S:  # NaN too
        raise HTTPError(
            400, f"GET /cache_events: wait must be in [0, {MAX_WAIT_S:g}] seconds, got {wait}", param="wait"
        )
    log = cache.chunks
    if log is None:
        log = cache.chunks = ChunkEventLog(instance, chunk_bytes, cache.block_size)
    if getattr(cache, "tier2_tokens", 0):  # at each ask: the torch worker's rates are measured
        log.tier_rates = {
            wire.INFO_KV_TIER2_LOAD_TOKENS_PER_S: cache.load_tokens_per_s,
            wire.INFO_PREFILL_TOKENS_PER_S: cache.prefill_tokens_per_s,
        }
    names = params.get("instance")
    if names and names[-1] == instance:
        await log.wait(after, wait)
    return await encode_answer(log.answer(after, names[-1] if names else None, tiers == 1))


__all__ = [
    "MAX_ANSWER_BYTES",
    "MAX_EVENTS",
    "MAX_EVENT_BLOCKS",
    "MAX_EVENT_KEYS",
    "MAX_LOG_BYTES",
    "ChunkEventLog",
    "KvEventLog",
    "block_hash",
    "encode_answer",
    "events_of",
    "follow_cache_events",
]
