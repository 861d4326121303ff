"""The torch engine's second KV tier (issue 40): full blocks evicted from the paged cache go to host
memory (``--kv-tier2-tokens``), or to files under a directory (``--kv-tier2-path``), instead of
being dropped; a later prompt whose prefix is there loads them back rather than prefilling them.

**Bounded.** The tier holds at most ``capacity_tokens // block_size`` blocks, least recently
spilled first out: the memory store is one tensor of that many blocks made up front (pinned host
memory under CUDA, so a copy runs beside the compute), the file store at most that many files
(a dropped block's file is deleted before a new one is written: the writer takes both in order).

**Off the step.** An eviction happens under the cache's lock wherever a reservation takes room
(the event loop); it only queues the spill (:meth:`KVTier2.spill`). The engine thread runs the
queue between steps (:meth:`KVTier2.flush`), before it admits a request: every write to the
paged cache comes from a request admitted after the flush that follows its blocks' taking, so a
block's old K/V is read before anyone overwrites it. The copies of one flush are batched (one
gather for all spilled blocks); under CUDA they are ``non_blocking`` copies into pinned memory on
the compute stream (ordered with the writes, the CPU not waiting); the file store hands its
writes to a thread of its own, at most :data:`MAX_WRITES_IN_FLIGHT` blocks waiting (past it a
spill is dropped, as without a tier), and a block is served only once its file is written; a
load's files are read by a reader thread from the moment the load is decided (the reservation),
so under load the reading overlaps the engine's running step and the flush takes what was read.

**Load or recompute.** A prefix hit in the tier (the chained hash *and* the ids compared, as on
the device) is taken only when loading is faster than prefilling those tokens, both measured on
this worker::

    load_s    = tokens x bytes_per_token / copy_bytes_per_s
    prefill_s = tokens / prefill_tokens_per_s
    load when load_s < prefill_s    (i.e. load_tokens_per_s > prefill_tokens_per_s)

Each rate is bytes (tokens) over seconds, both decaying sums (:data:`RATE_DECAY`), so a long step
weighs by its length: ``copy_bytes_per_s`` over the tier's copies (the memory store's spills and
loads, the file store's loads; a calibration copy at start before any), ``prefill_tokens_per_s``
over the engine's prefill steps of at least a block (prefill-only steps that sampled, so the
device had finished; mixed steps less the measured decode-only time). Before a
prefill is measured a load is taken (nothing can be in the tier before a prefill anyway). A load
that fails (a file missing, cut short or corrupt: its checksum) is a miss: the request's cached
prefix ends before that block and prefill computes the rest (:meth:`PagedKVCache.settle`).
While loading is slower than prefill, evicted blocks are dropped as without a tier but for one in
:data:`SLOW_TIER_SAMPLE`, whose copy keeps the load rate measured.

**Events.** A spilled block's keys ``moved`` to tier 2, a loaded one's back to tier 1 (once it is
registered on the device again), a block dropped from the tier or whose load failed ``removed``
with tier 2 (server/worker/kv_events.py's ChunkEventLog; trtllm-serve's events say the device).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

#: blocks a file store's writer may have waiting; past it a spill is dropped (the step never waits)
MAX_WRITES_IN_FLIGHT = 256
#: how much of a rate's decaying sums each new measurement replaces (~20 measurements of memory)
RATE_DECAY = 0.05
#: while loading is slower than prefill, one eviction in this many still spills (the copies keep
#: the load rate measured); the others are dropped, as without a tier: no copy for nothing
SLOW_TIER_SAMPLE = 16
#: a spill file: magic, the block's chained hash (16), the payload's length, its BLAKE2b-128
_MAGIC = b"FCKV2\0\0\0"
_HEADER = struct.Struct("<8s16sQ16s")
_SUFFIX = ".kv"


@dataclass(eq=False)
class _Entry:
    """A block in the tier: its chained hash, its ids' bytes, where it is (a memory slot or a file)."""

    digest: bytes
    chunk: bytes
    slot: int
    #: its K/V is in the store (a spill copied or written it): only then may a hit take it
    ready: bool = False
    #: dropped from the tier (LRU) or taken for a load: a pending spill of it is skipped
    gone: bool = False
    #: the file store's file (a fresh name per spill: an older one may still wait for deletion)
    path: Path | None = None


@dataclass(eq=False)
class LoadJob:
    """One request's blocks loaded back: (entry, destination block) in chain order."""

    parent: bytes
    moves: list[tuple[_Entry, int]] = field(default_factory=list)
    #: the file store's read of the blocks, started when the load was decided (None: read at the flush)
    reading: Future[list[torch.Tensor]] | None = None


class _DecayingRate:
    """Amount over seconds, both decaying sums: a long step weighs by its length (an average of
    per-step rates would let a 2-token step's fixed overhead say the prefill is 20x slower)."""

    __slots__ = ("amount", "seconds")

    def __init__(self) -> None:
        self.amount = self.seconds = 0.0

    def add(self, amount: float, seconds: float) -> None:
        if amount > 0 and seconds > 0.0:
            keep = 1.0 - RATE_DECAY if self.seconds else 0.0
            self.amount = self.amount * keep + amount
            self.seconds = self.seconds * keep + seconds

    @property
    def per_second(self) -> float:
        return self.amount / self.seconds if self.seconds else 0.0


class Rates:
    """Measured load and prefill rates and the load-or-recompute decision."""

    def __init__(self, bytes_per_token: int) -> None:
        self.bytes_per_token = bytes_per_token
        self._copy = _DecayingRate()
        self._prefill = _DecayingRate()

    def observe_copy(self, nbytes: int, seconds: float) -> None:
        self._copy.add(nbytes, seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        self._prefill.add(tokens, seconds)

    @property
    def copy_bytes_per_s(self) -> float:
        return self._copy.per_second

    @property
    def prefill_tokens_per_s(self) -> float:
        return self._prefill.per_second

    @property
    def load_tokens_per_s(self) -> float:
        return self.copy_bytes_per_s / self.bytes_per_token

    def worth_loading(self, tokens: int) -> bool:
        """Loading ``tokens`` beats prefilling them (the module docstring's formula)."""
        if self.prefill_tokens_per_s <= 0.0 or self.copy_bytes_per_s <= 0.0:
            return True  # nothing measured yet: a copy is the cheaper guess
        load_s = tokens * self.bytes_per_token / self.copy_bytes_per_s
        return load_s < tokens / self.prefill_tokens_per_s


class KVTier2:
    """The tier of one :class:`~server.worker.kv_cache.PagedKVCache` (which calls it under its lock,
    except :meth:`flush`, the engine thread's, and :meth:`close`)."""

    def __init__(self, cache: Any, capacity_tokens: int, path: str | os.PathLike[str] | None = None) -> None:
        if capacity_tokens < 0:
            raise ValueError(f"--kv-tier2-tokens must be >= 0, got {capacity_tokens}")
        self.cache = cache
        self.block_size: int = cache.block_size
        self.capacity_blocks = capacity_tokens // self.block_size
        self.capacity_tokens = self.capacity_blocks * self.block_size
        self.device: torch.device = cache.device
        #: one block's K and V: [2, layers, block_size, kv_heads, head_dim]
        self.block_shape = (2, cache.num_layers, self.block_size, cache.kv_heads, cache.head_dim)
        elem = torch.empty((), dtype=cache.dtype).element_size()
        self.block_bytes = elem * 2 * cache.num_layers * self.block_size * cache.kv_heads * cache.head_dim
        self.rates = Rates(self.block_bytes // self.block_size)
        #: chained hash -> entry, least recently spilled first
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._free_slots = list(range(self.capacity_blocks - 1, -1, -1))
        #: spills and loads in the order they were decided, run by the next flush
        self._ops: list[tuple[_Entry, int] | LoadJob] = []
        self._evictions = 0
        self.store: _MemoryStore | _FileStore = (
            _FileStore(Path(path), self) if path else _MemoryStore(self, self.capacity_blocks)
        )
        # Statistics: blocks spilled, loaded, dropped (LRU), loads failed; read by a parked entry's
        # export (left in the tier), and such reads failed (the export with them).
        self.exported_blocks_total = 0
        self.export_failed_blocks_total = 0
        self.spilled_blocks_total = 0
        self.loaded_blocks_total = 0
        self.dropped_blocks_total = 0
        self.failed_blocks_total = 0
        self.store.calibrate()

    @property
    def held_blocks(self) -> int:
        return len(self._entries)

    # -------------------------------------------------------------- under the cache's lock

    def spill(self, block: int, digest: bytes, chunk: bytes) -> tuple[bool, list[bytes]]:
        """Queue an evicted block's copy into the tier: (kept, the digests dropped for room)."""
        if not self.capacity_blocks or not self.store.accepts():
            return False, []
        self._evictions += 1
        if self._evictions % SLOW_TIER_SAMPLE and not self.rates.worth_loading(self.block_size):
            return False, []
        dropped = []
        old = self._entries.pop(digest, None)
        if old is not None:  # the same block spilled again (a copy computed twice): the new one stays
            self._release(old)
        while not self._free_slots:
            _, entry = self._entries.popitem(last=False)
            self._release(entry)
            dropped.append(entry.digest)
            self.dropped_blocks_total += 1
        entry = _Entry(digest, chunk, self._free_slots.pop())
        self._entries[digest] = entry
        self._ops.append((entry, block))
        self.spilled_blocks_total += 1
        return True, dropped

    def _release(self, entry: _Entry) -> None:
        entry.gone = True
        self._free_slots.append(entry.slot)
        self.store.discard(entry)

    def match(self, wanted: list[tuple[bytes, bytes]]) -> list[_Entry]:
        """The leading blocks of ``wanted`` ((hash, ids) in chain order) the tier holds, ready."""
        run = []
        for digest, chunk in wanted:
            entry = self._entries.get(digest)
            if entry is None or not entry.ready or entry.chunk != chunk:
                break
            run.append(entry)
        return run

    def take(self, run: list[_Entry], job: LoadJob) -> None:
        """These entries leave the tier for ``job``'s load, queued now (its moves filled in under
        the same hold of the lock): a spill queued after it may reuse their slots."""
        for entry in run:
            del self._entries[entry.digest]
            entry.gone = True
            self._free_slots.append(entry.slot)
        self._ops.append(job)
        job.reading = self.store.prefetch(run)

    def export_hold(self, digest: bytes, chunk: bytes) -> torch.Tensor | tuple[bytes, Path] | None:
        """Under the cache's lock: a parked entry's block for its export (kv_cache.read_parked), left
        in the tier: the memory store's copy made now (its slot is reused once the block is dropped,
        which needs the lock), the file store's (hash, file) to read off the lock with
        :meth:`export_read` (a file deleted meanwhile is a failed read, never another block's: each
        spill has a name of its own, and a read checks the hash and the checksum). None: not here."""
        entry = self._entries.get(digest)
        if entry is None or not entry.ready or entry.chunk != chunk:
            return None
        if isinstance(self.store, _FileStore):
            return None if entry.path is None else (digest, entry.path)
        return self.store.read([entry])[0]

    def export_read(self, held: torch.Tensor | tuple[bytes, Path]) -> torch.Tensor | None:
        """A block :meth:`export_hold` held: ``[2, layers, block_size, kv_heads, head_dim]``, or None
        where its file is missing, cut short or corrupt."""
        if isinstance(held, torch.Tensor):
            return held
        digest, path = held
        return _read_block(path, digest, self.block_shape, self.cache.dtype)

    # -------------------------------------------------------------- the engine thread

    def flush(self) -> None:
        """Run the queued spills and loads: first, in queue order, each load's read of the tier
        and each spill's copy of its device blocks (consecutive spills in one batch), then the
        loads' writes into their device blocks. A load's slots are read before a later spill
        may reuse them, and a block that one reservation both evicted (spilled) and took for a
        load is copied out before the load overwrites it."""
        cache = self.cache
        with cache._lock:
            ops, self._ops = self._ops, []
        spills: list[tuple[_Entry, int]] = []
        staged: list[tuple[LoadJob, list[torch.Tensor]]] = []
        for op in ops:
            if isinstance(op, LoadJob):
                self._spill_now(spills)
                spills = []
                if op.reading is None:  # the memory store: the load's copy out of the tier, timed
                    began = self.store.start()
                    data = self.store.read([e for e, _ in op.moves])
                    self.store.timed(len(data) * self.block_bytes, began)
                else:  # the file store: read (and timed) by its reader
                    data = op.reading.result()
                staged.append((op, [d.to(self.device) for d in data]))
            else:
                spills.append(op)
        self._spill_now(spills)
        for job, data in staged:
            self._load_now(job, data)
        self.store.settle_timings()

    def _gather(self, blocks: list[int]) -> torch.Tensor:
        """``[n, 2, layers, block_size, kv_heads, head_dim]``: these device blocks' K/V (a copy)."""
        cache = self.cache
        idx = cache.slots(blocks, 0, len(blocks) * self.block_size)
        kv = torch.stack((cache.k.index_select(1, idx), cache.v.index_select(1, idx)))
        n = len(blocks)
        return kv.view(2, kv.shape[1], n, self.block_size, *kv.shape[3:]).permute(2, 0, 1, 3, 4, 5)

    def _spill_now(self, spills: list[tuple[_Entry, int]]) -> None:
        spills = [(e, b) for e, b in spills if not e.gone]
        if spills:
            self.store.write([e for e, _ in spills], self._gather([b for _, b in spills]))

    def _load_now(self, job: LoadJob, data: list[torch.Tensor]) -> None:
        """``data``: the job's blocks read from the tier (copies), up to the first that failed."""
        cache = self.cache
        good = len(data)
        if good:
            blocks = [b for _, b in job.moves[:good]]
            kv = torch.stack(data)  # [n, 2, layers, bs, heads, dim] on the device
            idx = cache.slots(blocks, 0, good * self.block_size)
            flat = kv.permute(1, 2, 0, 3, 4, 5).reshape(2, kv.shape[2], -1, *kv.shape[4:])
            cache.k.index_copy_(1, idx, flat[0])
            cache.v.index_copy_(1, idx, flat[1])
        cache.loaded(job, good)
        self.loaded_blocks_total += good
        self.failed_blocks_total += len(job.moves) - good

    def close(self) -> None:
        self.store.close()


class _MemoryStore:
    """The tier in host memory: one tensor of ``slots`` blocks (pinned under CUDA)."""

    def __init__(self, tier: KVTier2, slots: int) -> None:
        self.tier = tier
        cuda = tier.device.type == "cuda"
        # made up front: the tier never takes more memory than its flag says (empty: a slot is
        # read only once a spill wrote it)
        self.data = torch.empty((max(slots, 1), *tier.block_shape), dtype=tier.cache.dtype, pin_memory=cuda)
        self.cuda = cuda
        #: CUDA copies not yet timed: (start event, end event, bytes)
        self._timings: list[tuple[Any, Any, int]] = []

    def accepts(self) -> bool:
        return True

    def discard(self, entry: _Entry) -> None:
        pass

    def prefetch(self, entries: list[_Entry]) -> None:
        return None  # read at the flush: a copy in memory

    def write(self, entries: list[_Entry], kv: torch.Tensor) -> None:
        began = self.start()
        if self.cuda:
            for i, entry in enumerate(entries):  # into pinned memory, the CPU not waiting
                self.data[entry.slot].copy_(kv[i], non_blocking=True)
        else:
            self.data.index_copy_(0, torch.tensor([e.slot for e in entries]), kv)
        self.timed(len(entries) * self.tier.block_bytes, began)
        for entry in entries:
            entry.ready = True

    def read(self, entries: list[_Entry]) -> list[torch.Tensor]:
        """Copies on the device (from pinned memory under CUDA: async, ordered on the stream
        before a later spill into the same slots; on the CPU a copy at once)."""
        device = self.tier.device
        return [self.data[e.slot].to(device, non_blocking=self.cuda, copy=True) for e in entries]

    def start(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def timed(self, nbytes: int, began: Any) -> None:
        if not self.cuda:
            self.tier.rates.observe_copy(nbytes, time.perf_counter() - began)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._timings.append((began, end, nbytes))

    def settle_timings(self) -> None:
        """CUDA copies that finished: their times (never waiting for one)."""
        pending = []
        for began, end, nbytes in self._timings:
            if end.query():
                self.tier.rates.observe_copy(nbytes, began.elapsed_time(end) / 1000.0)
            else:
                pending.append((began, end, nbytes))
        self._timings = pending[-64:]

    def calibrate(self) -> None:
        """A first copy rate: a few blocks to the store and back, timed (the device waited for)."""
        tier = self.tier
        n = min(4, self.data.shape[0])
        probe = torch.zeros((n, *tier.block_shape), dtype=self.data.dtype, device=tier.device)
        if self.cuda:
            torch.cuda.synchronize()
        began = time.perf_counter()
        self.data[:n].copy_(probe, non_blocking=self.cuda)
        probe.copy_(self.data[:n], non_blocking=self.cuda)
        if self.cuda:
            torch.cuda.synchronize()
        tier.rates.observe_copy(2 * n * tier.block_bytes, time.perf_counter() - began)

    def close(self) -> None:
        pass


class _FileStore:
    """The tier as files under a directory, one a block, written by a thread of its own.

    A file is ``_HEADER`` (magic, the block's hash, the payload's length and BLAKE2b-128) then the
    raw K/V; a read checks all four, so a file cut short, corrupt or another block's is a miss.
    The directory's earlier spill files are deleted at start: a restart empties the tier."""

    def __init__(self, root: Path, tier: KVTier2) -> None:
        self.root = root
        self.tier = tier
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("*" + _SUFFIX):
            with contextlib.suppress(OSError):
                stale.unlink()
        self._names = itertools.count()
        self._queue: queue.SimpleQueue[tuple[str, Any] | None] = queue.SimpleQueue()
        self._in_flight = 0
        self._in_flight_lock = threading.Lock()
        self._thread = threading.Thread(target=self._writer, name="fastcore-kv-tier2", daemon=True)
        self._thread.start()
        #: reads a load's files as soon as it is decided (under the cache's lock, on the event loop),
        #: so that under load the reading overlaps the engine's running step, not its next one
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="fastcore-kv-tier2-read")

    def accepts(self) -> bool:
        return self._in_flight < MAX_WRITES_IN_FLIGHT

    def discard(self, entry: _Entry) -> None:
        """Under the cache's lock: the entry's file goes (queued: after any write of it)."""
        path, entry.path = entry.path, None
        if path is not None:
            self._queue.put(("unlink", path))

    def _count(self, n: int) -> None:
        with self._in_flight_lock:
            self._in_flight += n

    def write(self, entries: list[_Entry], kv: torch.Tensor) -> None:
        host = kv.to("cpu", non_blocking=kv.is_cuda)
        event = None
        if kv.is_cuda:
            event = torch.cuda.Event()
            event.record()
        live = []
        with self.tier.cache._lock:  # an entry dropped meanwhile is not written
            for i, entry in enumerate(entries):
                if not entry.gone:
                    entry.path = self.root / f"{next(self._names)}{_SUFFIX}"
                    live.append((i, entry, entry.path))
        self._count(len(live))
        self._queue.put(("write", (host, event, live)))

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Until the writes and deletions queued so far are done (a test's view; close's drain)."""
        done = threading.Event()
        self._queue.put(("barrier", done))
        return done.wait(timeout)

    def _writer(self) -> None:
        while (item := self._queue.get()) is not None:
            kind, arg = item
            if kind == "barrier":
                arg.set()
                continue
            if kind == "unlink":
                with contextlib.suppress(OSError):
                    arg.unlink()
                continue
            host, event, live = arg
            if event is not None:
                event.synchronize()
            for i, entry, path in live:
                try:
                    _write_block(path, entry.digest, host[i])
                    entry.ready = not entry.gone
                except OSError as exc:
                    log.warning("kv tier 2: writing %s failed: %s", path, exc)
                finally:
                    self._count(-1)

    def prefetch(self, entries: list[_Entry]) -> Future[list[torch.Tensor]]:
        """Under the cache's lock: the entries' files read on the reader thread (each then deleted)."""
        paths = []
        for entry in entries:
            paths.append((entry.digest, entry.path))
            entry.path = None  # the read deletes it, read or not
        return self._reader.submit(self._read, paths)

    def read(self, entries: list[_Entry]) -> list[torch.Tensor]:
        raise AssertionError("the file store's loads are prefetched")  # pragma: no cover

    def _read(self, paths: list[tuple[bytes, Path | None]]) -> list[torch.Tensor]:
        """The blocks' K/V up to the first that cannot be read (missing, short, corrupt), timed."""
        out: list[torch.Tensor] = []
        tier = self.tier
        began = time.perf_counter()
        failed = False
        for digest, path in paths:
            block = None
            if path is not None:
                if not failed:  # after a failure the rest are not read (their files still go)
                    block = _read_block(path, digest, tier.block_shape, tier.cache.dtype)
                self._queue.put(("unlink", path))
            failed = failed or block is None
            if block is not None:
                out.append(block)
        tier.rates.observe_copy(len(out) * tier.block_bytes, time.perf_counter() - began)
        return out

    def start(self) -> None:
        return None

    def timed(self, nbytes: int, began: None) -> None:
        pass  # a load is timed by its reader (the files' reading is its cost)

    def settle_timings(self) -> None:
        pass

    def calibrate(self) -> None:
        """A first load rate: a block written, then read back (and checked) a few times, timed."""
        tier = self.tier
        probe = torch.zeros(tier.block_shape, dtype=tier.cache.dtype)
        path = self.root / f"calibrate{_SUFFIX}"
        _write_block(path, b"\0" * 16, probe)
        began = time.perf_counter()
        for _ in range(4):
            _read_block(path, b"\0" * 16, tier.block_shape, tier.cache.dtype)
        tier.rates.observe_copy(4 * tier.block_bytes, time.perf_counter() - began)
        with contextlib.suppress(OSError):
            path.unlink()

    def close(self) -> None:
        self._reader.shutdown(wait=True)
        self._queue.put(None)
        self._thread.join(timeout=10)


def _write_block(path: Path, digest: bytes, kv: torch.Tensor) -> None:
    payload = kv.contiguous().view(torch.uint8).numpy().tobytes()
    check = hashlib.blake2b(payload, digest_size=16).digest()
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(_HEADER.pack(_MAGIC, digest, len(payload), check))
        f.write(payload)
    os.replace(tmp, path)  # a reader sees a whole file or none


def _read_block(path: Path, digest: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    if len(raw) < _HEADER.size:
        return None
    magic, stored, length, check = _HEADER.unpack_from(raw)
    payload = memoryview(raw)[_HEADER.size :]
    if magic != _MAGIC or stored != digest or length != len(payload):
        return None
    if hashlib.blake2b(payload, digest_size=16).digest() != check:
        return None
    try:
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).reshape(shape)
    except RuntimeError:  # a length that does not fit this cache's block (another model's file)
        return None


__all__ = ["MAX_WRITES_IN_FLIGHT", "KVTier2", "LoadJob", "Rates"]
