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

import itertools
from collections import deque
from typing import Any

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
        self._append({"type": "stored", "parent_hash": block_hash(parent) if parent else None, "blocks": blocks})

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


__all__ = ["MAX_EVENTS", "KvEventLog", "block_hash", "events_of"]
