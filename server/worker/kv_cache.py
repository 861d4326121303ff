"""Paged KV cache: a pool of fixed-size blocks per layer, and the attention backends over it.

Each sequence owns a list of blocks (its block table); token ``p`` of a
sequence lives in slot ``table[p // block_size] * block_size + p % block_size``
of the flat ``[num_blocks * block_size, kv_heads, head_dim]`` view. The pool's
size is the worker's KV token budget: requests reserve
``ceil((prompt + max_tokens) / block_size)`` blocks on admission, so a request
that was admitted never runs out of cache, and one that does not fit is
refused up front (503) instead of failing midway.

Prefix caching (``prefix_caching=True``): a full block whose KV is computed is
registered under a chained hash of its token ids (block ``i``'s hash covers
blocks ``0..i``) together with the ids themselves. A new sequence starts from
its longest registered full-block prefix (:meth:`PagedKVCache.allocate_prefix`):
those blocks are shared (reference-counted, read only: a sequence writes only
positions past its cached prefix, into blocks of its own) and only the rest is
prefilled. A hit needs the hash *and* the ids to match, so a hash collision can
never hand a sequence another prefix's KV. A block whose last user frees it
stays cached, least recently used first out, until an allocation needs room.

What the prefix cache holds is published twice, once a poller or follower asks
(server/worker/kv_events.py): trtllm-serve's block events (``events``) and the
orchestrators' key space (``chunks``, ``GET /cache_events``): a request's
prompt keys are stored once its prompt's full blocks are registered (the
engine names the request: ``register(..., owner=...)``) and removed with the
block they map to when it is evicted. The key log lives on the event loop;
the engine thread hands it its updates through :attr:`PagedKVCache.post` (the
loop's ``call_soon_threadsafe``, set when the first follower made the log),
under the cache's lock, so stores and evictions reach it in the cache's order.

A second tier (:meth:`PagedKVCache.attach_tier2`, server/worker/kv_tier2.py): an evicted block's
K/V is copied there instead of dropped, and a prefix that continues in the tier is loaded back
into fresh blocks (:meth:`PagedKVCache.allocate_prefix_tiers`) when that beats recomputing it.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from fastcore import protocol as wire

from .decode_attention import DENSE_DECODE_BYTES, DecodeAttention
from .dense_prefix import DensePrefix
from .engine_api import KVCacheFull, ParkedKV, ParkedKVLost, chain_block_hashes
from .kv_events import ChunkEventLog, KvEventLog
from .kv_tier2 import KVTier2, LoadJob
from .model import AttentionBackend, ModelConfig


class PagedKVCache:
    def __init__(
        self,
        config: ModelConfig,
        num_tokens: int,
        *,
        block_size: int = 16,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        prefix_caching: bool = False,
    ) -> None:
        self.block_size = block_size
        self.num_blocks = max(1, num_tokens // block_size)
        self.num_layers = config.num_hidden_layers
        self.kv_heads = config.kv_heads
        self.head_dim = config.dim_per_head
        self.device = torch.device(device)
        self.dtype = dtype
        shape = (self.num_layers, self.num_blocks * block_size, self.kv_heads, self.head_dim)
        self.k = torch.zeros(shape, device=self.device, dtype=dtype)
        self.v = torch.zeros(shape, device=self.device, dtype=dtype)
        self._free = list(range(self.num_blocks - 1, -1, -1))
        #: the chunked prompt's K/V kept dense between its chunks (PrefillAttention's goes_on)
        self.dense_prefix: DensePrefix | None = None
        # Taken by the event loop (admission, hand-off) and the engine thread (frees).
        self._lock = threading.Lock()
        self.prefix_caching = prefix_caching
        #: users of each block (0: free, or cached and evictable)
        self._refs = [0] * self.num_blocks
        #: registered full blocks: chained hash -> block, and block -> (hash, its token ids' bytes)
        self._by_hash: dict[bytes, int] = {}
        self._cached: dict[int, tuple[bytes, bytes]] = {}
        #: cached blocks nobody uses, least recently used first: reused by a hit, or evicted for room
        self._evictable: OrderedDict[int, None] = OrderedDict()
        # Statistics (/metrics): prompt tokens served from the cache, and cached blocks evicted.
        self.hit_tokens_total = 0
        self.evicted_blocks_total = 0
        #: trtllm-serve's KV cache events (server/worker/kv_events.py), once someone polls them
        self.events: KvEventLog | None = None
        self._chunks: ChunkEventLog | None = None
        #: runs a key-log update on the log's loop, in order (see the module docstring)
        self.post: Callable[..., Any] = _call_now
        #: the second tier (server/worker/kv_tier2.py; :meth:`attach_tier2`): evicted blocks go there
        self.tier2: KVTier2 | None = None
        #: blocks a tier-2 load will fill at the next flush, and blocks whose load failed
        self._loading: dict[int, LoadJob] = {}
        self._failed: set[int] = set()

    def attach_tier2(self, tokens: int, path: str | None = None) -> None:
        """``--kv-tier2-tokens`` / ``--kv-tier2-path``: evicted full blocks go to a second tier
        (ValueError naming the flag where it cannot: less than a block, no prefix caching)."""
        if tokens < self.block_size:
            raise ValueError(f"--kv-tier2-tokens must hold a block ({self.block_size} tokens), got {tokens}")
        if not self.prefix_caching:
            raise ValueError("--kv-tier2-tokens needs --prefix-caching: the tier keeps evicted cached blocks")
        self.tier2 = KVTier2(self, tokens, path)

    @property
    def tier2_tokens(self) -> int:
        return self.tier2.capacity_tokens if self.tier2 is not None else 0

    @property
    def load_tokens_per_s(self) -> float:
        return self.tier2.rates.load_tokens_per_s if self.tier2 is not None else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.tier2.rates.prefill_tokens_per_s if self.tier2 is not None else 0.0

    @property
    def kv_tiers_info(self) -> dict[str, Any]:
        """/server_info's tier figures (docs/protocol.md): tier 2's size, its measured load rate and
        the prefill rate it is weighed against (nothing without a tier)."""
        if self.tier2 is None:
            return {}
        info: dict[str, Any] = {wire.INFO_KV_TIER2_CAPACITY_TOKENS: self.tier2_tokens}
        rates = {
            wire.INFO_KV_TIER2_LOAD_TOKENS_PER_S: self.load_tokens_per_s,
            wire.INFO_PREFILL_TOKENS_PER_S: self.prefill_tokens_per_s,
        }
        info.update((k, round(v, 1)) for k, v in rates.items() if v > 0)
        return info

    def prefill_timed(self, plan: list[Any], seconds: float) -> None:
        """The engine ran ``plan``'s (state, tokens) prefill chunks in ``seconds`` (tier 2's prefill
        rate). Under CUDA only a step that sampled a first token is timed: the device had finished;
        a step of less than a block says more about a step's overhead than about prefill: not timed."""
        tokens = sum(take for _, take in plan)
        if self.tier2 is None or tokens < self.block_size:
            return
        state = plan[-1][0]
        if self.device.type == "cpu" or state.req.cached_len >= state.total:
            self.tier2.rates.observe_prefill(tokens, seconds)

    @property
    def chunks(self) -> ChunkEventLog | None:
        """The orchestrators' key space (``GET /cache_events``), once one follows it."""
        return self._chunks

    @chunks.setter
    def chunks(self, log: ChunkEventLog | None) -> None:
        # Set on the event loop (the first follower): its updates are made there from now on.
        try:
            self.post = _OnLoop(asyncio.get_running_loop())
        except RuntimeError:  # no loop (a test's direct use): updates run where they are made
            self.post = _call_now
        self._chunks = log

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def used_blocks(self) -> int:
        """Blocks some sequence (or parked entry) holds; cached blocks nobody holds are not used."""
        return self.num_blocks - len(self._free) - len(self._evictable)

    @property
    def used_tokens(self) -> int:
        return self.used_blocks * self.block_size

    @property
    def cached_blocks(self) -> int:
        """Registered full blocks (held or evictable)."""
        return len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _check_fits(self, need: int, available: int) -> None:
        if need > self.num_blocks:
            raise KVCacheFull(
                f"needs {need * self.block_size} KV tokens; this worker's whole KV cache holds {self.capacity_tokens}",
                ever_fits=False,
            )
        if need > available:
            raise KVCacheFull(
                f"needs {need * self.block_size} KV tokens, {available * self.block_size} free "
                f"of {self.capacity_tokens}"
            )

    def _take(self, count: int) -> list[int]:
        """``count`` blocks nobody holds: free ones first, then the least recently used cached ones
        (their registration dropped). Caller holds the lock and checked there is room."""
        blocks = []
        for _ in range(count):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._evictable.popitem(last=False)
                digest, chunk = self._cached.pop(block)
                del self._by_hash[digest]
                self.evicted_blocks_total += 1
                if self.events is not None:
                    self.events.removed([digest])
                kept, dropped = self.tier2.spill(block, digest, chunk) if self.tier2 else (False, [])
                if self._chunks is not None:
                    if kept:  # in tier 2 now
                        self.post(self._chunks.moved, [digest], 2)
                    else:
                        self.post(self._chunks.evicted, [digest])
                    if dropped:
                        self.post(self._chunks.evicted, dropped, 2)
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def allocate(self, num_tokens: int) -> list[int]:
        need = self.blocks_for(num_tokens)
        with self._lock:
            self._check_fits(need, len(self._free) + len(self._evictable))
            return self._take(need)

    def block_hashes(
        self, ids: np.ndarray, count: int, first: int = 0, digest: bytes = b""
    ) -> list[tuple[bytes, bytes]]:
        """:func:`~server.worker.engine_api.chain_block_hashes` at this cache's block size."""
        return chain_block_hashes(ids, self.block_size, count, first, digest)

    def allocate_prefix(self, ids: np.ndarray, num_tokens: int, root: bytes = b"") -> tuple[list[int], int]:
        """Blocks for a sequence of ``num_tokens`` whose first tokens are ``ids``: its longest cached
        full-block prefix (shared), then fresh blocks. Returns (blocks, cached tokens). The last id is
        never served from the cache: its logits are what a prefill must compute. ``root``: the
        chain's start (the request's cache_salt; :meth:`register` gets it as ``done``'s hash)."""
        blocks, cached, _ = self.allocate_prefix_tiers(ids, num_tokens, root)
        return blocks, cached

    def allocate_prefix_tiers(
        self, ids: np.ndarray, num_tokens: int, root: bytes = b""
    ) -> tuple[list[int], int, int]:
        """:meth:`allocate_prefix`, and of the cached tokens those loaded from tier 2: a run of its
        blocks right after the device's hits, when loading them beats recomputing them
        (kv_tier2.Rates); their copy into fresh blocks runs at the engine's next flush."""
        need = self.blocks_for(num_tokens)
        if not self.prefix_caching or ids.size < 2:
            return self.allocate(num_tokens), 0, 0
        wanted = self.block_hashes(ids, min((int(ids.size) - 1) // self.block_size, need), 0, root)
        with self._lock:
            hits = []
            for digest, chunk in wanted:
                block = self._by_hash.get(digest)
                if block is None or self._cached[block][1] != chunk:
                    break
                hits.append(block)
            reusable = sum(1 for b in hits if self._refs[b] == 0)  # evictable now, held once taken
            self._check_fits(need - len(hits), len(self._free) + len(self._evictable) - reusable)
            tier2 = self.tier2
            run = tier2.match(wanted[len(hits) :]) if tier2 is not None else []
            if run and not tier2.rates.worth_loading(len(run) * self.block_size):  # type: ignore[union-attr]
                run = []
            job = LoadJob(self._cached[hits[-1]][0] if hits else root)
            if run:
                # Out of the tier, and the load queued, before _take's spills: a spill may reuse
                # their slots, and must run after the load has read them.
                tier2.take(run, job)  # type: ignore[union-attr]
            for block in hits:
                if self._refs[block] == 0:
                    del self._evictable[block]
                self._refs[block] += 1
            blocks = hits + self._take(need - len(hits))
            for entry, block in zip(run, blocks[len(hits) :]):
                job.moves.append((entry, block))
                self._loading[block] = job
                self._failed.discard(block)
        cached = (len(hits) + len(run)) * self.block_size
        self.hit_tokens_total += cached
        return blocks, cached, len(run) * self.block_size

    def flush_tier2(self, waiting: Iterable[Any] = ()) -> None:
        """The engine thread, between steps: tier 2's queued spills and loads (kv_tier2.KVTier2.flush),
        then the ``waiting`` requests' cached prefixes cut where a load failed (:meth:`settle`)."""
        if self.tier2 is not None:
            self.tier2.flush()
            if self._failed:
                for req in waiting:
                    self.settle(req)

    def loaded(self, job: LoadJob, good: int) -> None:
        """Tier 2 filled the first ``good`` of ``job``'s blocks: they are registered (blocks of a
        request gone meanwhile too: their K/V is there); the rest failed (read by :meth:`settle`)."""
        stored, failed = [], []
        with self._lock:
            for i, (entry, block) in enumerate(job.moves):
                if self._loading.get(block) is not job:
                    failed.append(entry.digest)  # its request freed it before the flush: not loaded
                    continue
                del self._loading[block]
                if i >= good:
                    self._failed.add(block)
                    failed.append(entry.digest)
                elif entry.digest not in self._by_hash:
                    self._by_hash[entry.digest] = block
                    self._cached[block] = (entry.digest, entry.chunk)
                    stored.append(entry.digest)
            if self.events is not None and stored:
                self.events.stored(job.parent, stored)
            if self._chunks is not None:
                if stored:
                    self.post(self._chunks.moved, stored, 1)
                if failed:
                    self.post(self._chunks.evicted, failed, 2)

    def settle(self, req: Any) -> None:
        """A request admitted after its tier-2 loads ran: a load that failed (a missing or corrupt
        file) ends its cached prefix before that block, so prefill computes the rest."""
        if not self._failed:
            return
        with self._lock:
            for i, block in enumerate(req.blocks[: req.cached_prefix // self.block_size]):
                if block in self._failed:
                    cut = req.cached_prefix - i * self.block_size
                    req.cached_prefix -= cut
                    req.tier2_prefix = max(0, req.tier2_prefix - cut)
                    self.hit_tokens_total -= cut
                    break
            self._failed.difference_update(req.blocks)

    def register(
        self,
        blocks: list[int],
        ids: np.ndarray,
        num_tokens: int,
        done: tuple[int, bytes] = (0, b""),
        owner: tuple[str, int] | None = None,
    ) -> tuple[int, bytes]:
        """Register the full blocks among the first ``num_tokens`` positions (their KV computed) of a
        sequence whose ids start with ``ids``, so later sequences may start from them.

        ``done``: (blocks already registered, the last one's hash) from an earlier call for this
        sequence, so a long one is hashed once; returns the new pair. ``owner``: (the request's id,
        its prompt's length): the call that completes the prompt's full blocks stores its keys."""
        if not self.prefix_caching:
            return done
        first, digest = done
        count = min(num_tokens, int(ids.size)) // self.block_size
        if count <= first:
            return done
        parent = digest
        hashes = self.block_hashes(ids, count, first, digest)
        stored: list[bytes] = []
        with self._lock:
            for block, (digest, chunk) in zip(blocks[first:count], hashes):
                if block in self._cached:
                    continue  # a shared prefix block, or registered before
                if digest in self._by_hash:
                    continue  # the same prefix computed twice at once: the first copy is the one kept
                self._by_hash[digest] = block
                self._cached[block] = (digest, chunk)
                stored.append(digest)
            if self.events is not None and stored:
                # the chain's parent: the block before the first one stored now
                index = next(i for i, (d, _) in enumerate(hashes) if d == stored[0])
                self.events.stored(hashes[index - 1][0] if index else parent, stored)
            if self._chunks is not None and owner is not None:
                request_id, prompt_len = owner
                full = prompt_len // self.block_size
                if first < full <= count:
                    chain = self._chain(blocks[:first])
                    if len(chain) == first:
                        chain += [d for d, _ in hashes[: full - first]]
                    self.post(self._chunks.stored, request_id, chain, prompt_len)
        return count, hashes[-1][0]

    def _chain(self, blocks: list[int]) -> list[bytes]:
        """The hashes of a sequence's leading registered blocks (lock held), up to the first that is
        not (a copy of a prefix computed twice at once, whose first copy is the one kept)."""
        chain = []
        for block in blocks:
            entry = self._cached.get(block)
            if entry is None:
                break
            chain.append(entry[0])
        return chain

    def let_go(self, parked: ParkedKV) -> list[int]:
        """A parked entry pushed out of the parked bound, with a second tier: its leading registered
        blocks go back to the cache (its chain remembered: the export reads them by hash, where they
        are then), and so do those past its prompt; it keeps the prompt's rest. Returns the blocks
        let go (the caller frees them); none when its first block is not registered."""
        with self._lock:
            full = parked.blocks[: parked.num_tokens // self.block_size]
            chain = [self._cached[b] for b in itertools.takewhile(self._cached.__contains__, full)]
        if not chain:
            return []
        kept = slice(len(chain), self.blocks_for(parked.num_tokens))
        released = parked.blocks[: kept.start] + parked.blocks[kept.stop :]
        parked.blocks, parked.chain = parked.blocks[kept], chain
        return released

    def read_parked(self, parked: ParkedKV) -> tuple[torch.Tensor, torch.Tensor]:
        """A parked entry's K and V on the CPU (``[layers, tokens, kv_heads, head_dim]``): the blocks
        it let go (:meth:`let_go`) each read where it is now, a device block (held while it is read:
        nothing evicts it meanwhile) or tier 2 (a copy; the block stays there), then the blocks it
        holds. ParkedKVLost where one of the first is in neither or its tier-2 file is unreadable."""
        held: list[int] = []
        parts: list[Any] = []  # per chain block: its index in ``held``, or what tier 2 held for it
        with self._lock:
            for digest, chunk in parked.chain:
                block = self._by_hash.get(digest)
                if block is not None and self._cached[block][1] == chunk:
                    if self._refs[block] == 0:
                        del self._evictable[block]
                    self._refs[block] += 1
                    parts.append(len(held))
                    held.append(block)
                    continue
                kept = self.tier2.export_hold(digest, chunk) if self.tier2 is not None else None
                if kept is None:
                    break
                parts.append(kept)
        try:
            pieces = self._read_chain(parked, held, parts)
        finally:
            self.free(held)
        front = len(parked.chain) * self.block_size
        if parked.num_tokens > front:
            k, v = self.read(parked.blocks, parked.num_tokens - front)
            pieces.append((k.cpu(), v.cpu()))
        return torch.cat([k for k, _ in pieces], 1), torch.cat([v for _, v in pieces], 1)

    def _read_chain(
        self, parked: ParkedKV, held: list[int], parts: list[Any]
    ) -> list[tuple[torch.Tensor, ...]]:
        """:meth:`read_parked`'s chain blocks as (K, V) pieces on the CPU, in chain order."""
        bs, tier = self.block_size, self.tier2
        dk, dv = self.read(held, len(held) * bs) if held else (None, None)
        dk, dv = (dk.cpu(), dv.cpu()) if dk is not None and dv is not None else (dk, dv)
        pieces: list[tuple[torch.Tensor, ...]] = []
        for part in parts:
            if isinstance(part, int):
                assert dk is not None and dv is not None
                pieces.append((dk[:, part * bs : (part + 1) * bs], dv[:, part * bs : (part + 1) * bs]))
                continue
            assert tier is not None
            kv = tier.export_read(part)
            if kv is None:
                break
            pieces.append((kv[0].cpu(), kv[1].cpu()))
        read = sum(1 for p in parts[: len(pieces)] if not isinstance(p, int))
        if tier is not None:
            with self._lock:
                tier.exported_blocks_total += read
                tier.export_failed_blocks_total += len(parked.chain) - len(pieces)
        if len(pieces) < len(parked.chain):
            raise ParkedKVLost(
                f"{len(parked.chain) - len(pieces)} of the {len(parked.chain)} blocks it let go to the "
                "cache are no longer there, or their tier-2 file cannot be read"
            )
        return pieces

    def free(self, blocks: list[int]) -> None:
        if self.dense_prefix is not None and self.dense_prefix.blocks is blocks:
            self.dense_prefix = None  # its prompt is done with them
        with self._lock:
            for block in blocks:
                refs = self._refs[block] - 1
                self._refs[block] = refs
                if refs > 0:
                    continue
                self._loading.pop(block, None)  # a tier-2 load into it, not run yet: not taken
                if block in self._cached:
                    self._evictable[block] = None  # most recently used: last out
                else:
                    self._free.append(block)

    def slots(self, blocks: list[int], start: int, end: int) -> torch.Tensor:
        """Flat slot indices of positions ``start..end-1`` of a sequence with these blocks."""
        # numpy on the host, one tensor made at the end: a batch of prefills asks for one a sequence
        pos = np.arange(start, end, dtype=np.int64)
        table = np.asarray(blocks, dtype=np.int64)
        slots = table[pos // self.block_size] * self.block_size + pos % self.block_size
        return torch.from_numpy(slots).to(self.device)

    def read(self, blocks: list[int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a sequence's first ``num_tokens`` positions: ``[layers, T, kv_heads, head_dim]``."""
        idx = self.slots(blocks, 0, num_tokens)
        return self.k.index_select(1, idx), self.v.index_select(1, idx)

    def write(self, blocks: list[int], k: torch.Tensor, v: torch.Tensor, start: int = 0) -> None:
        """Store K and V (``[layers, T, kv_heads, head_dim]`` of positions ``0..T-1``) at positions
        ``start..T-1`` (those before ``start`` are a shared cached prefix: never written)."""
        end = k.shape[1]
        if start >= end:
            return
        idx = self.slots(blocks, start, end)
        self.k.index_copy_(1, idx, k[:, start:].to(self.device, self.dtype))
        self.v.index_copy_(1, idx, v[:, start:].to(self.device, self.dtype))


def _call_now(fn: Callable[..., Any], *args: Any) -> None:
    fn(*args)


class _OnLoop:
    """Hands a key-log update to its loop (FIFO with the loop's own callbacks); once the loop is
    closed (the worker stopping, the engine finishing a step) the update is dropped: nobody
    follows the log any more, and the engine step must not fail for it."""

    __slots__ = ("loop",)

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def __call__(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # "Event loop is closed"
            pass


class PrefillAttention:
    """One sequence, tokens at positions ``start..start+T-1``, attending to all earlier positions.

    ``goes_on``: the sequence has chunks after this one; it then keeps its K/V dense in the cache
    for them (:mod:`.dense_prefix`: a later chunk reads a view instead of gathering its prefix)."""

    def __init__(
        self, cache: PagedKVCache, blocks: list[int], start: int, length: int, goes_on: bool = False
    ) -> None:
        self.cache = cache
        self.start = start
        self.length = length
        self.new_slots = cache.slots(blocks, start, start + length)
        self.all_slots = cache.slots(blocks, 0, start + length) if start else None
        dense = cache.dense_prefix
        self.dense = dense if dense is not None and dense.blocks is blocks else None
        capacity = len(blocks) * cache.block_size
        if self.dense is None and goes_on and DensePrefix.fits(capacity, cache.num_layers, cache.k[0]):
            self.dense = cache.dense_prefix = DensePrefix(blocks, capacity)
        self._mask: torch.Tensor | None = None  # made once a step, not once a layer

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.cache.k[layer].index_copy_(0, self.new_slots, k)
        self.cache.v[layer].index_copy_(0, self.new_slots, v)
        return self.written(layer, q, k, v)

    def written(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """:meth:`attend` once the chunk's K/V are in the pool."""
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, heads, T, D]
        pool = self.cache.k[layer], self.cache.v[layer]
        if self.dense is not None:
            k_all, v_all = self.dense.extend(layer, self.start, k, v, pool, self.all_slots)
        if self.all_slots is None:
            kh, vh = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
        else:
            if self.dense is None:
                k_all, v_all = (t.index_select(0, self.all_slots) for t in pool)
            kh, vh = k_all.transpose(0, 1).unsqueeze(0), v_all.transpose(0, 1).unsqueeze(0)
            if self._mask is None:
                total = self.start + self.length
                q_pos = torch.arange(self.start, total, device=q.device)[:, None]
                self._mask = torch.arange(total, device=q.device)[None, :] <= q_pos
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=self._mask, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)


class StepAttention:
    """Several backends' rows in one forward, in order: ``parts`` is ``(backend, rows)``. Each part
    attends its own rows exactly as it would in a forward of its own, so the projections and the
    MLP run once over all of a step's tokens (running decodes and prefill chunks alike)."""

    def __init__(self, parts: list[tuple[AttentionBackend, int]]) -> None:
        self.parts = parts

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if len(self.parts) == 1:
            return self.parts[0][0].attend(layer, q, k, v)
        outs = []
        row = 0
        for part, rows in self.parts:
            end = row + rows
            outs.append(part.attend(layer, q[row:end], k[row:end], v[row:end]))
            row = end
        return torch.cat(outs)


class PrefillBatchAttention(StepAttention):
    """Several sequences' prefill chunks, flattened in order: ``spans`` is ``(blocks, start,
    length)`` per sequence; each chunk sees its own sequence's earlier positions only.

    Every chunk's K/V goes to the pool in one write a layer, and a run of chunks at one position
    with one length (a burst of prompts of a length, whole or past equally long cached prefixes)
    attends as one batch: 32 prompts of 64 tokens were 32 writes and 32 attentions a layer, each
    costing more than its arithmetic. The same attention (a batch's rows attend apart), to float32
    rounding: the batched kernel may round a row differently (the engine's note on batch sizes)."""

    def __init__(
        self, cache: PagedKVCache, spans: list[tuple[list[int], int, int]], last_goes_on: bool = False
    ) -> None:
        # last_goes_on: the last span's sequence is cut there (only a plan's last prompt may be)
        goes_on = [False] * (len(spans) - 1) + [last_goes_on]
        parts = [PrefillAttention(cache, *span, cut) for span, cut in zip(spans, goes_on)]
        super().__init__([(part, part.length) for part in parts])
        self.cache = cache
        self.prefills = parts
        self.new_slots = torch.cat([part.new_slots for part in parts]) if len(parts) > 1 else None
        #: (first part, how many, their earlier positions' slots, the mask): runs of parts at one
        #: start with one length, one attention each
        self.runs: list[tuple[int, int, torch.Tensor | None, torch.Tensor | None]] = []
        first = 0
        for i in range(1, len(parts) + 1):
            here = parts[min(i, len(parts) - 1)]
            if i < len(parts) and (here.start, here.length) == (parts[first].start, parts[first].length):
                continue
            run = parts[first:i]
            lead = run[0]
            slots = mask = None
            if lead.start and len(run) > 1:
                slots = torch.cat([part.all_slots for part in run if part.all_slots is not None])
                total = lead.start + lead.length
                q_pos = torch.arange(lead.start, total, device=cache.device)[:, None]
                mask = torch.arange(total, device=cache.device)[None, :] <= q_pos
            self.runs.append((first, len(run), slots, mask))
            first = i

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.new_slots is None:
            return super().attend(layer, q, k, v)
        pool_k, pool_v = self.cache.k[layer], self.cache.v[layer]
        pool_k.index_copy_(0, self.new_slots, k)
        pool_v.index_copy_(0, self.new_slots, v)
        outs = []
        row = 0
        for first, count, slots, mask in self.runs:
            part = self.prefills[first]
            end = row + part.length * count
            if count == 1:
                outs.append(part.written(layer, q[row:end], k[row:end], v[row:end]))
                row = end
                continue
            # [count, heads, length, D]: each sequence's rows their own attention
            qh = q[row:end].unflatten(0, (count, part.length)).transpose(1, 2)
            if slots is None:  # from position 0: the chunks are their sequences
                kh, vh = (t[row:end].unflatten(0, (count, part.length)).transpose(1, 2) for t in (k, v))
                out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
            else:
                kh, vh = (
                    pool.index_select(0, slots).unflatten(0, (count, -1)).transpose(1, 2)
                    for pool in (pool_k, pool_v)
                )
                out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=True)
            outs.append(out.transpose(1, 2).flatten(0, 1))
            row = end
        return torch.cat(outs) if len(outs) > 1 else outs[0]


__all__ = [
    "DENSE_DECODE_BYTES",
    "DecodeAttention",
    "KVCacheFull",
    "PagedKVCache",
    "PrefillAttention",
    "PrefillBatchAttention",
    "StepAttention",
]
