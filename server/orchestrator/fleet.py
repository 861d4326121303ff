"""One host's orchestrator processes as one fleet (``--workers N``): admission slots, per-tenant
token buckets and circuit breakers shared through one mapping.

The parent (cli.py) makes the mapping before it starts its children (:meth:`Mapping.create`: a file
in ``/dev/shm``, mode 0600, removed when the parent stops) and hands each child its path and an
index; every child maps it (:meth:`Mapping.attach`) and works on its 64-bit words through
:data:`Core`: the compiled twin (``_fleet.pyx``, GCC atomics, no lock) unless it is not built or
``FASTCORE_NO_EXTENSIONS=1``, else :class:`PureCore` (the reference: the same layout and arithmetic
under one ``lockf`` lock, which the kernel drops with a process that dies holding it).

What is shared, and how exactly (docs/configuration.md, "Several processes on one host"):

- **Slots** (``admission.max_inflight``): each process counts its own in its word; a slot is taken by
  adding one to it and reading the sum, given back when the sum is over the limit. The fleet never
  holds more than ``max_inflight`` (exact); two processes racing for the last slot may both give it
  back (a spurious wait, not one too many). Each process keeps its own queue (its fair share by
  tenant, its priorities, ``max_queue``, ``max_queue_wait_s``); its waiters take slots that its own
  completions give back at once and look for slots the others gave back every
  :data:`POLL_S`: the order across processes is approximately, not exactly, first come first served.
  A process that dies: the parent, which watches its children, zeroes its count
  (:meth:`Mapping.clear`) within its watch interval (0.2 s).
- **Token buckets** (``rate_limits``): one per (tenant, limit) in a fixed table (tenants hashed to
  entries, open addressing), each one word: the bucket's theoretical arrival time in monotonic ns
  (GCRA, the token bucket's one-number form: a level of ``capacity - (tat - now) * rate``), changed by
  compare-exchange. Exact across the fleet: N processes admit what one would.
- **Breakers**: a worker's breaker that opens in one process publishes its end (monotonic ns) in a
  second table at that process's next exchange (every :data:`BREAKER_SYNC_S`); every other process
  copies an end later than its own into its breaker at its next, so within two exchanges the worker
  gets no new leg from any of them until that end, then one half-open probe from each that still
  has it open; a process whose own probe succeeds withdraws the end it knew. An exchange with
  nothing new (no end published or withdrawn, no breaker, health or member change here) is two
  loads.

``/metrics`` needs nothing of this: each process's counts are its own and the page sums them
(server/metrics.py's multiprocess mode), so ``admission_inflight`` is the fleet's once.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import importlib
import logging
import mmap
import os
import tempfile
import time
from types import ModuleType
from typing import TYPE_CHECKING, Any

from fastcore import NO_EXTENSIONS
from server.tasks import stop_tasks

from .pools import _ROUTABLE_EPOCH

if TYPE_CHECKING:
    from .pools import Pool

log = logging.getLogger("fastcore.orchestrator")

#: the mapping's first word
MAGIC = 0x31_54_45_45_4C_46_43_46  # "FCFLEET1", little-endian
HEADER_WORDS = 8
#: header words: the magic, the process count, the bucket and breaker table sizes, the breakers'
#: generation (bumped by each change of a published end) (_fleet.pyx's enum)
W_MAGIC, W_PROCS, W_BUCKETS, W_BREAKERS, W_GENERATION = 0, 1, 2, 3, 4
#: what the tests pin the compiled twin's enum to
LAYOUT = {
    "HEADER_WORDS": HEADER_WORDS,
    "W_PROCS": W_PROCS,
    "W_BUCKETS": W_BUCKETS,
    "W_BREAKERS": W_BREAKERS,
    "W_GENERATION": W_GENERATION,
}
#: (tenant, limit) buckets and breakers the tables hold (a full table: that bucket stays per process)
BUCKET_ENTRIES = 4096
BREAKER_ENTRIES = 1024
BUCKETS, BREAKERS = 0, 1
#: seconds between a waiting process's looks for a slot another process gave back
POLL_S = 0.002
#: seconds between a process's breaker exchanges (each two loads when nothing changed): another
#: process's open breaker is honoured here within two of them
BREAKER_SYNC_S = 0.01
#: a token bucket holds one minute's worth (admission.py's TokenBucket)
MINUTE_NS = 60_000_000_000


class Mapping:
    """The shared file, mapped: ``procs`` slot counts and the two keyed tables, 64-bit words."""

    def __init__(self, path: str, fd: int, buffer: mmap.mmap) -> None:
        self.path = path
        self.fd = fd
        self.buffer = buffer
        words = memoryview(buffer).cast("q")
        #: the tables' sizes (entries), as the header says
        self.buckets, self.breakers = words[W_BUCKETS], words[W_BREAKERS]
        words.release()

    @staticmethod
    def size(procs: int, buckets: int = BUCKET_ENTRIES, breakers: int = BREAKER_ENTRIES) -> int:
        return 8 * (HEADER_WORDS + procs + 2 * buckets + 2 * breakers)

    @classmethod
    def create(cls, procs: int, buckets: int = BUCKET_ENTRIES, breakers: int = BREAKER_ENTRIES) -> Mapping:
        """A fresh zeroed mapping (every bucket full, no breaker open, no slot held) in ``/dev/shm``
        where there is one (memory, not a disk), else the temp directory."""
        where = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        fd, path = tempfile.mkstemp(prefix="fastcore-fleet-", dir=where)
        os.ftruncate(fd, cls.size(procs, buckets, breakers))
        buffer = mmap.mmap(fd, cls.size(procs, buckets, breakers))
        words = memoryview(buffer).cast("q")
        words[W_PROCS], words[W_BUCKETS], words[W_BREAKERS] = procs, buckets, breakers
        words[W_MAGIC] = MAGIC
        words.release()
        return cls(path, fd, buffer)

    @classmethod
    def attach(cls, path: str) -> Mapping:
        fd = os.open(path, os.O_RDWR)
        try:
            buffer = mmap.mmap(fd, 0)
            words = memoryview(buffer).cast("q")
            try:
                magic, procs, buckets, breakers = words[0], words[1], words[2], words[3]
            finally:
                words.release()
            if magic != MAGIC or len(buffer) != cls.size(procs, buckets, breakers):
                buffer.close()
                raise ValueError(f"{path} is not a fastcore fleet mapping")
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, buffer)

    def clear(self, index: int) -> int:
        """The parent's release of a dead child's slots (its count zeroed); the count it held."""
        core = Core(self, index)
        return int(core.clear(index))

    def close(self) -> None:
        try:
            self.buffer.close()
        except BufferError:  # a core's view still holds it: the process is ending anyway
            pass
        os.close(self.fd)

    def remove(self) -> None:
        self.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class PureCore:
    """The reference twin of ``_fleet.Core``: each operation reads and writes the words under one
    ``lockf`` lock of the whole file (the kernel drops it with a process that dies holding it)."""

    def __init__(self, mapping: Mapping, index: int) -> None:
        self.mapping = mapping
        self.fd = mapping.fd
        self.words = memoryview(mapping.buffer).cast("q")
        self.procs = self.words[W_PROCS]
        self.buckets = self.words[W_BUCKETS]
        self.breakers = self.words[W_BREAKERS]
        self.index = self._proc(index)

    def _proc(self, index: int) -> int:
        if not 0 <= index < self.procs:
            raise ValueError(f"process index {index} out of 0..{self.procs - 1}")
        return index

    def _lock(self) -> None:
        fcntl.lockf(self.fd, fcntl.LOCK_EX)

    def _unlock(self) -> None:
        fcntl.lockf(self.fd, fcntl.LOCK_UN)

    def acquire(self, limit: int) -> bool:
        words, own = self.words, HEADER_WORDS + self.index
        self._lock()
        try:
            words[own] += 1
            if sum(words[HEADER_WORDS : HEADER_WORDS + self.procs]) <= limit:
                return True
            words[own] -= 1
            return False
        finally:
            self._unlock()

    def release(self) -> None:
        self._lock()
        try:
            self.words[HEADER_WORDS + self.index] -= 1
        finally:
            self._unlock()

    def held(self, index: int) -> int:
        return self.words[HEADER_WORDS + self._proc(index)]

    def total(self) -> int:
        return sum(self.words[HEADER_WORDS : HEADER_WORDS + self.procs])

    def clear(self, index: int) -> int:
        word = HEADER_WORDS + self._proc(index)
        self._lock()
        try:
            held, self.words[word] = self.words[word], 0
            return held
        finally:
            self._unlock()

    def _base(self, table: int) -> tuple[int, int]:
        if table == BUCKETS:
            return HEADER_WORDS + self.procs, self.buckets
        return HEADER_WORDS + self.procs + 2 * self.buckets, self.breakers

    def _value(self, table: int, entry: int) -> int:
        base, size = self._base(table)
        if not 0 <= entry < size:
            raise ValueError(f"entry {entry} out of 0..{size - 1}")
        return base + 2 * entry + 1

    def entry(self, table: int, key: int) -> int:
        if key == 0:
            raise ValueError("key 0 marks a free entry")
        base, size = self._base(table)
        words = self.words
        self._lock()
        try:
            for i in range(size):
                slot = ((key % (1 << 64)) + i) % (1 << 64) % size  # the compiled twin's unsigned sum
                seen = words[base + 2 * slot]
                if seen == 0:
                    words[base + 2 * slot] = key
                    return slot
                if seen == key:
                    return slot
            return -1
        finally:
            self._unlock()

    def take(self, entry: int, now: int, cost: int, burst: int) -> int:
        word = self._value(BUCKETS, entry)
        self._lock()
        try:
            base = max(self.words[word], now)
            if base + cost - now > burst:
                return base + cost - burst - now
            self.words[word] = base + cost
            return 0
        finally:
            self._unlock()

    def correct(self, entry: int, now: int, more: int) -> None:
        word = self._value(BUCKETS, entry)
        self._lock()
        try:
            self.words[word] = max(now, max(self.words[word], now) + more)
        finally:
            self._unlock()

    def generation(self) -> int:
        return self.words[W_GENERATION]

    def until(self, entry: int) -> int:
        return self.words[self._value(BREAKERS, entry)]

    def publish(self, entry: int, until: int) -> None:
        word = self._value(BREAKERS, entry)
        self._lock()
        try:
            if self.words[word] < until:
                self.words[word] = until
                self.words[W_GENERATION] += 1
        finally:
            self._unlock()

    def withdraw(self, entry: int, seen: int) -> bool:
        word = self._value(BREAKERS, entry)
        self._lock()
        try:
            if self.words[word] != seen:
                return False
            self.words[word] = 0
            self.words[W_GENERATION] += 1
            return True
        finally:
            self._unlock()


def _load() -> ModuleType | None:
    if not NO_EXTENSIONS:
        try:
            return importlib.import_module("._fleet", __package__)
        except ImportError:
            pass
    return None


#: the compiled module, or None (PureCore is used), chosen as twins.py chooses _tally
compiled = _load()
#: the twin every process of a fleet uses
Core: Any = PureCore if compiled is None else compiled.Core
backend = "python" if compiled is None else "cython"


def key_of(*parts: str) -> int:
    """A table key every process computes alike (``hash()`` of a str is salted per process): a
    signed 64-bit blake2b of the parts, never 0 (a free entry)."""
    digest = hashlib.blake2b("\0".join(parts).encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True) or 1


class SharedBucket:
    """admission.py's TokenBucket over the fleet's entry: ``per_minute`` units a minute, up to a
    minute's worth at once, starting full; :meth:`take` checks and takes in one step."""

    __slots__ = ("capacity", "core", "entry", "fleet", "unit_ns")

    def __init__(self, fleet: Fleet, entry: int, per_minute: float) -> None:
        self.fleet = fleet
        self.core = fleet.core
        self.entry = entry
        self.capacity = per_minute
        #: ns of refill one unit costs
        self.unit_ns = MINUTE_NS / per_minute

    def take(self, cost: float) -> float:
        """Seconds until ``cost`` units are there (0.0: taken now)."""
        ns = round(min(cost, self.capacity) * self.unit_ns)
        wait = self.core.take(self.entry, self.fleet.clock(), ns, MINUTE_NS)
        return wait / 1e9

    def correct(self, more: float) -> None:
        """``more`` units used beyond what was taken (a refund when negative, up to full)."""
        self.core.correct(self.entry, self.fleet.clock(), round(more * self.unit_ns))

    def resize(self, per_minute: float) -> None:
        """A new size (several hosts' share, fleet_cluster.py): the level scales with it."""
        self.capacity = per_minute
        self.unit_ns = MINUTE_NS / per_minute


class Fleet:
    """This process's part of the fleet: its :data:`Core` on the mapping, and what it shares."""

    def __init__(self, mapping: Mapping, index: int) -> None:
        self.mapping = mapping
        self.index = index
        self.core = Core(mapping, index)
        #: monotonic ns: CLOCK_MONOTONIC, one clock for every process of the host
        self.clock = time.monotonic_ns
        self._breakers: dict[tuple[str, str], list[int]] = {}
        self._sync: asyncio.Task[None] | None = None
        #: what the last exchange saw: the published ends' generation, the pools' epoch, their member lists
        self._seen: tuple[int, int, list[Any]] | None = None
        #: the tables found full (each said once)
        self._full: set[int] = set()

    @classmethod
    def attach(cls, path: str, index: int) -> Fleet:
        return cls(Mapping.attach(path), index)

    # -- admission ----------------------------------------------------------------------------

    def bucket(self, tenant: str, limit: str, per_minute: float) -> SharedBucket | None:
        """The fleet's bucket of ``tenant``'s ``limit``; None when the table is full (then that
        tenant's limit is kept per process, as without a fleet, and a warning says so once)."""
        entry = self.core.entry(BUCKETS, key_of("bucket", tenant, limit))
        if entry < 0:
            if BUCKETS not in self._full:
                self._full.add(BUCKETS)
                log.warning(
                    "fleet: the rate-limit table is full (%d buckets): tenant %s's %s is per process",
                    self.mapping.buckets,
                    tenant,
                    limit,
                )
            return None
        return SharedBucket(self, entry, per_minute)

    def join(self, orchestrator: Any) -> None:
        """``orchestrator`` (app.py's, before it serves) takes its slots and rate limits from the
        fleet and shares its pools' breakers until :meth:`stop`."""
        if orchestrator.admission is not None:
            orchestrator.admission.share(self)
        self.start(orchestrator.pools)

    # -- breakers -----------------------------------------------------------------------------

    def start(self, pools: list[Pool]) -> None:
        """Share ``pools``' breakers until :meth:`stop` (a task on the running loop)."""
        self._sync = asyncio.ensure_future(self._keep_breakers(pools))

    async def stop(self) -> None:
        task, self._sync = self._sync, None
        await stop_tasks([task])

    async def _keep_breakers(self, pools: list[Pool]) -> None:
        while True:
            self.sync_breakers(pools)
            await asyncio.sleep(BREAKER_SYNC_S)

    def sync_breakers(self, pools: list[Pool]) -> None:
        """One exchange: breakers this process opened since the last one published, a later end
        published by another copied into this process's breaker, an end withdrawn by a probe here
        that succeeded. Skipped (two loads) while no published end, no breaker or health of this
        process (pools' epoch) and no pool's member list changed since the last."""
        seen = (self.core.generation(), _ROUTABLE_EPOCH[0], [pool.workers for pool in pools])
        last = self._seen
        if (
            last is not None
            and last[:2] == seen[:2]
            and len(last[2]) == len(seen[2])
            and all(a is b for a, b in zip(last[2], seen[2]))
        ):
            return
        self._seen = seen
        now = self.clock()
        records, self._breakers = self._breakers, {}
        for pool in pools:
            for worker in pool.workers:
                self._sync_breaker(records, pool.name, worker.url, worker.breaker, now)

    def _sync_breaker(
        self, records: dict[tuple[str, str], list[int]], pool: str, url: str, breaker: Any, now: int
    ) -> None:
        """One worker's exchange; its record kept for the next (those of workers gone are dropped)."""
        record = records.get((pool, url))
        if record is None:
            entry = self.core.entry(BREAKERS, key_of("breaker", pool, url))
            if entry < 0 and BREAKERS not in self._full:
                self._full.add(BREAKERS)
                log.warning(
                    "fleet: the breaker table is full (%d workers): %s's breaker is per process",
                    self.mapping.breakers,
                    url,
                )
            # [entry, the breaker's opened count seen, the end known here, its state seen]
            record = [entry, breaker.opened, 0, breaker.state]
        self._breakers[(pool, url)] = record
        entry = record[0]
        if entry < 0:
            return  # a full table: this worker's breaker stays this process's own
        core, state = self.core, breaker.state
        if breaker.opened != record[1]:
            record[1] = breaker.opened
            if state == breaker.OPEN:
                end = round((breaker.opened_at + breaker.open_for) * 1e9)
                core.publish(entry, end)
                record[2] = max(record[2], end)
        published = core.until(entry)
        if (
            published > now
            and published != record[2]
            and not (state == breaker.HALF_OPEN and breaker.probing)
        ):
            mine = round((breaker.opened_at + breaker.open_for) * 1e9) if state == breaker.OPEN else 0
            if published > mine:  # another's breaker is open past this one's: honoured here
                breaker.opened_at = now / 1e9
                breaker.open_for = (published - now) / 1e9
                breaker.probing = False
                breaker.state = breaker.OPEN
                state = breaker.OPEN
            record[2] = published
        elif state == breaker.CLOSED and record[3] != breaker.CLOSED and published and published == record[2]:
            core.withdraw(entry, published)  # this process's probe succeeded
        record[3] = state


__all__ = ["BREAKERS", "BUCKETS", "Core", "Fleet", "Mapping", "PureCore", "SharedBucket", "key_of"]
