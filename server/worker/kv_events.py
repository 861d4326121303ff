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
poll (a worker nobody polls pays nothing); the first answer starts with ``created``. At most
``max_events`` wait; past that the oldest are dropped (``dropped``), as trtllm-serve's bounded
event buffer drops them. Appends come from the engine thread, drains from the event loop: a deque's
append and popleft are atomic.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import deque
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs

from fastcore._hash_py import CHUNK_MAX
from server.cache_keys import prompt_keys
from server.errors import HTTPError

#: events waiting for a poll (trtllm-serve's kv_cache_config.event_buffer_max_size plays this part)
MAX_EVENTS = 4096


def block_hash(digest: bytes) -> int:
    """Our 16-byte block key as trtllm-serve's int64 block hash."""
    return int.from_bytes(digest[:8], "little", signed=True)


class KvEventLog:
    def __init__(self, num_blocks: int, block_size: int, max_events: int = MAX_EVENTS) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._events: deque[dict[str, Any]] = deque(maxlen=max_events)
        self._ids = itertools.count()
        #: events dropped unread (the buffer was full)
        self.dropped = 0
        self._append({"type": "created", "num_blocks_per_cache_level": [num_blocks]})

    def _append(self, data: dict[str, Any]) -> None:
        events = self._events
        if len(events) == events.maxlen:
            self.dropped += 1
        events.append({"event_id": next(self._ids), "data": data, "window_size": self.block_size})

    def stored(self, parent: bytes, digests: list[bytes]) -> None:
        """``digests``: blocks now held, in chain order; ``parent``: the block before the first (b"": none)."""
        if not digests:
            return
        blocks = [{"type": "stored_block", "block_hash": block_hash(d), "tokens": [], "cache_level": 0,
                   "priority": 0} for d in digests]  # fmt: skip
        self._append(
            {"type": "stored", "parent_hash": block_hash(parent) if parent else None, "blocks": blocks}
        )

    def removed(self, digests: list[bytes]) -> None:
        if digests:
            self._append({"type": "removed", "block_hashes": [block_hash(d) for d in digests]})

    def drain(self) -> list[dict[str, Any]]:
        """Every waiting event, oldest first; each is returned once."""
        out = []
        events = self._events
        while events:
            out.append(events.popleft())
        return out


def events_of(cache: Any, block_size: int, num_blocks: int) -> KvEventLog:
    """``cache``'s event log, started (recording from now) on the first call."""
    log = getattr(cache, "events", None)
    if log is None:
        log = cache.events = KvEventLog(num_blocks, block_size)
    return log


class ChunkEventLog:
    """This worker's cache in the orchestrator's key space (server/cache_keys.py), as a stream every
    orchestrator may follow (``GET /cache_events``, docs/protocol.md).

    A request's prompt keys (one per ``chunk_bytes`` chunk of its raw ``messages`` / ``prompt``
    bytes, salted) are mapped to the token block covering each chunk's end (in proportion: chunk
    ``i`` ends at byte ``(i + 1) x chunk_bytes`` of ``span_bytes``, so at token
    ``ceil(that x ids / span_bytes)``); a key is held while that block is. Events: ``stored`` keys
    (their blocks were computed or imported) and ``removed`` keys (their blocks were evicted), each
    numbered by ``seq``. The last ``max_events`` are kept: a follower that asks after an older
    ``seq``, or names another ``instance`` (this process restarted), gets a resync (every held key)
    instead. The first follower's ``chunk_bytes`` is the log's; it records nothing before.
    """

    def __init__(
        self, instance: str, chunk_bytes: int, block_size: int, max_events: int = MAX_EVENTS
    ) -> None:
        self.instance = instance
        self.chunk_bytes = chunk_bytes
        self.block_size = block_size
        self.seq = 0
        self._events: deque[tuple[int, str, list[int]]] = deque(maxlen=max_events)
        #: key -> the block digest it is mapped to; block digest -> its keys
        self.held: dict[int, bytes] = {}
        self._by_block: dict[bytes, list[int]] = {}
        #: request id -> (its prompt keys, its prompt span's bytes), until its blocks are stored
        self.pending: dict[str, tuple[list[int], int]] = {}
        self._changed: asyncio.Event | None = None

    def track(self, request_id: str, body: bytes, chat: bool) -> None:
        """Keep a request's prompt keys until its blocks are stored (:meth:`stored`; the handler
        drops them when the request ends, whatever happened)."""
        keys, span_bytes = prompt_keys(body, chat, self.chunk_bytes)
        if keys:
            self.pending[request_id] = (keys, span_bytes)

    def _append(self, kind: str, keys: list[int]) -> None:
        self.seq += 1
        self._events.append((self.seq, kind, keys))
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
            if block >= len(digests):
                break
            if key in held:
                continue
            digest = digests[block]
            held[key] = digest
            by_block.setdefault(digest, []).append(key)
            new.append(key)
        if new:
            self._append("stored", new)

    def evicted(self, digests: list[bytes]) -> None:
        """These blocks left the cache: the keys mapped to them are gone."""
        gone = []
        for digest in digests:
            keys = self._by_block.pop(digest, None)
            if keys:
                for key in keys:
                    self.held.pop(key, None)
                gone.extend(keys)
        if gone:
            self._append("removed", gone)

    def answer(self, after: int, instance: str | None) -> dict[str, Any]:
        """Events after ``after``, or a resync (``held``: every key) when they cannot be given."""
        events = self._events
        oldest = events[0][0] if events else self.seq + 1
        if instance != self.instance or after > self.seq or after < oldest - 1:
            return {"instance": self.instance, "chunk_bytes": self.chunk_bytes, "seq": self.seq,
                    "resync": True, "held": list(self.held)}  # fmt: skip
        out = [{"seq": seq, kind: keys} for seq, kind, keys in events if seq > after]
        return {"instance": self.instance, "chunk_bytes": self.chunk_bytes, "seq": self.seq, "events": out}

    async def wait(self, after: int, timeout: float) -> None:
        """Until an event after ``after`` exists (or ``timeout`` seconds)."""
        if after != self.seq or timeout <= 0:
            return
        if self._changed is None:
            self._changed = asyncio.Event()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)


#: the longest a follower's ``wait`` holds a poll open
MAX_WAIT_S = 30.0


def _query_value(params: dict[str, list[str]], name: str, parse: Callable[[str], Any], default: Any) -> Any:
    values = params.get(name)
    if not values:
        return default
    try:
        return parse(values[-1])
    except ValueError:
        raise HTTPError(400, f"GET /cache_events: {name} must be {parse.__name__}, got {values[-1][:40]!r}",
                        param=name) from None  # fmt: skip


async def follow_cache_events(cache: Any, instance: str, query: bytes) -> dict[str, Any]:
    """``GET /cache_events?after=<seq>&instance=<id>&chunk_bytes=<n>&wait=<s>``: the events after
    ``after`` (a resync when they are gone or ``instance`` is not this process's), held up to
    ``wait`` seconds (at most 30) until there is one. The first follower's ``chunk_bytes`` starts
    the log; another size is a 409 (every orchestrator of a deployment routes with one)."""
    if cache is None or not hasattr(cache, "chunks"):
        raise HTTPError(404, "GET /cache_events: this worker's engine publishes no cache events "
                             "(an orchestrator keeps its own estimate of this worker's cache)")  # fmt: skip
    params = parse_qs(query.decode("latin-1"), keep_blank_values=True)
    after = _query_value(params, "after", int, 0)
    chunk_bytes = _query_value(params, "chunk_bytes", int, 512)
    wait = _query_value(params, "wait", float, 0.0)
    if after < 0:
        raise HTTPError(400, f"GET /cache_events: after must be >= 0, got {after}", param="after")
    if chunk_bytes < 32 or chunk_bytes % 32 or chunk_bytes > CHUNK_MAX:
        raise HTTPError(400, f"GET /cache_events: chunk_bytes must be a multiple of 32 in [32, {CHUNK_MAX}], "
                             f"got {chunk_bytes}", param="chunk_bytes")  # fmt: skip
    if not 0 <= wait <= MAX_WAIT_S:  # NaN too
        raise HTTPError(400, f"GET /cache_events: wait must be in [0, {MAX_WAIT_S:g}] seconds, got {wait}",
                        param="wait")  # fmt: skip
    log = cache.chunks
    if log is None:
        log = cache.chunks = ChunkEventLog(instance, chunk_bytes, cache.block_size)
    elif log.chunk_bytes != chunk_bytes:
        raise HTTPError(409, f"GET /cache_events: this worker's log is in chunks of {log.chunk_bytes} bytes "
                             f"(its first follower's), not {chunk_bytes}", param="chunk_bytes")  # fmt: skip
    names = params.get("instance")
    if names and names[-1] == instance:
        await log.wait(after, wait)
    return log.answer(after, names[-1] if names else None)


__all__ = ["MAX_EVENTS", "ChunkEventLog", "KvEventLog", "block_hash", "events_of", "follow_cache_events"]
