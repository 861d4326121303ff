"""The contract between the HTTP layer and an engine, without torch.

:class:`Engine` is what ``app.py`` calls; :class:`EngineRequest` is what it
submits. The torch engine (``engine.py``) implements it, and so can a
synthetic engine with no model, so the orchestrator's test rigs need no torch.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from fastcore import protocol as wire

from .output import Delta, OutputProcessor, SamplingParams, TokenLogprob
from .tokenizer import Tokenizer

if TYPE_CHECKING:
    from .kv_transfer import KVLayout

#: finish_reason of a context leg after which a generation leg follows.
NOT_FINISHED = wire.FINISH_NOT_FINISHED

# A torch engine's defaults, declared once: TorchEngine's arguments and the worker's flags
# (server/worker/cli.py, which reads them here without importing torch).
#: KV cache size in tokens (the tiny model's; a checkpoint's is sized from free memory)
DEFAULT_KV_TOKENS = 1 << 16
DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_PREFIX_CACHING = True
#: a step's token budget with chunked prefill: one token per running decode, the rest for prompt
#: chunks (a long prompt is cut to fit); 0 prefills each prompt whole (--prefill-chunk-tokens)
DEFAULT_PREFILL_CHUNK_TOKENS = 512
#: while streams decode, a step carrying prompt chunks may take this many times their decode-only
#: step (server/worker/prefill_pacer.py; 0: the token budget alone; --prefill-step-ratio)
DEFAULT_PREFILL_STEP_RATIO = 1.5
#: seconds a context leg's KV stays parked for its generation worker (EngineRequest.park_ttl_s;
#: the app sets it from WorkerSettings.kv_ttl_s, --kv-ttl, which defaults to this)
DEFAULT_KV_TTL_S = 30.0


class KVCacheFull(Exception):
    """Not enough free KV cache for a request's reservation.

    ``ever_fits`` is False when the reservation exceeds the whole cache, so
    waiting would not help (a 400, not a 503).
    """

    def __init__(self, message: str, *, ever_fits: bool = True) -> None:
        super().__init__(message)
        self.ever_fits = ever_fits


def prompt_checksum(prompt_ids: np.ndarray) -> int:
    """CRC-32 of the prompt's int32 LE bytes: ties parked KV to the exact prompt it belongs to."""
    return zlib.crc32(np.ascontiguousarray(prompt_ids, dtype="<i4").tobytes())


@dataclass
class ParkedKV:
    """A context leg's prompt KV, kept for the generation worker until fetched or expired."""

    ctx_request_id: int
    blocks: list[int]
    num_tokens: int
    prompt_crc32: int
    first_token: int
    first_logprob: TokenLogprob | None
    expires_at: float
    #: time.monotonic() when parked (entries are kept in this order)
    parked_at: float = 0.0
    #: with a second KV tier, an entry pushed out of the parked bound lets its leading registered
    #: blocks go (the cache keeps them, on the device or spilled to tier 2): their (chained hash,
    #: ids' bytes), which the export reads them by; ``blocks`` then holds only the prompt's rest
    chain: list[tuple[bytes, bytes]] = field(default_factory=list)


class ParkedKVLost(LookupError):
    """A parked entry's KV let go to the cache could not be read back (dropped from tier 2, a file
    missing or corrupt): the export fails and the generation worker prefills from the ids."""


@dataclass
class EngineRequest:
    request_id: str
    prompt_ids: np.ndarray  # int32, 1-D
    params: SamplingParams
    processor: OutputProcessor
    # Called on the event loop with each Delta (from the engine thread via call_soon_threadsafe).
    on_delta: Callable[[Delta], None]
    # Tokens a context worker already produced: replayed, not sampled (generation_only).
    forced_tokens: list[int] = field(default_factory=list)
    # The prompt's K and V from the context worker ([layers, T, kv_heads, head_dim] tensors), or None to prefill.
    kv_import: tuple[Any, Any] | None = None
    #: the prompt's KV came from the context worker (kv_import is dropped once written; this stays)
    kv_imported: bool = False
    forced_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    # context_only: stop after the first token and park the prompt's KV under this id.
    park_as: int | None = None
    park_ttl_s: float = DEFAULT_KV_TTL_S
    blocks: list[int] = field(default_factory=list)
    cancelled: bool = False
    submitted_at: float = field(default_factory=time.monotonic)
    # Engine-side state.
    #: prompt tokens whose KV came from the prefix cache (shared blocks: never written)
    cached_prefix: int = 0
    #: of them, the tokens loaded from the cache's second tier (usage's tier2_cached_tokens)
    tier2_prefix: int = 0
    #: every token produced (forced or sampled), in order: the sequence is prompt_ids + these
    generated: list[int] = field(default_factory=list)
    #: (blocks registered in the prefix cache, the last one's hash)
    registered: tuple[int, bytes] = (0, b"")
    cached_len: int = 0
    next_token: int = -1
    seed: int = 0
    #: the chain's root in the prefix cache (:func:`cache_salt_root` of the request's ``cache_salt``):
    #: requests with different salts never share a cached block
    cache_root: bytes = b""


def cache_salt_root(salt: str | None) -> bytes:
    """The hash the prefix-cache chain starts from (block -1's): b"" without a salt, else
    BLAKE2b-128 of a domain tag and the salt's UTF-8, so a salted request's first block (and so
    every block after it) is keyed apart from every other salt's and from unsalted ones
    (vLLM salts its first block's hash the same way)."""
    if salt is None:
        return b""
    return hashlib.blake2b(b"fastcore cache_salt\0" + salt.encode(), digest_size=16).digest()


def chain_block_hashes(
    ids: np.ndarray, block_size: int, count: int, first: int = 0, digest: bytes = b""
) -> list[tuple[bytes, bytes]]:
    """(chained hash, ids' bytes) of full blocks ``first..count-1`` of ``ids``: block ``i``'s hash
    covers blocks ``0..i`` (BLAKE2b-128 of the previous hash and the block's int32 LE ids);
    ``digest`` is block ``first - 1``'s hash (b"" for the first block). The prefix cache's keys."""
    raw = np.ascontiguousarray(ids[first * block_size : count * block_size], dtype="<i4").tobytes()
    step = block_size * 4
    out = []
    for i in range(count - first):
        chunk = raw[i * step : (i + 1) * step]
        digest = hashlib.blake2b(digest + chunk, digest_size=16).digest()
        out.append((digest, chunk))
    return out


class Engine(Protocol):
    """What the HTTP layer needs from an engine (the torch one, or a synthetic one)."""

    tokenizer: Tokenizer
    vocab_size: int
    max_context: int

    def start(self, loop: asyncio.AbstractEventLoop) -> None: ...
    def stop(self) -> None: ...
    @property
    def alive(self) -> bool: ...
    @property
    def queue_depth(self) -> int: ...
    @property
    def running(self) -> int: ...
    @property
    def kv_used_tokens(self) -> int: ...
    @property
    def kv_capacity_tokens(self) -> int: ...
    # The prefix cache (docs: server/worker/kv_cache.py): tokens served from it, tokens prefilled,
    # tokens it holds, blocks it evicted.
    @property
    def prefix_hit_tokens(self) -> int: ...
    @property
    def prefill_computed_tokens(self) -> int: ...
    @property
    def prefix_cached_tokens(self) -> int: ...
    @property
    def prefix_evicted_blocks(self) -> int: ...
    @property
    def parked_count(self) -> int: ...
    @property
    def parked_tokens(self) -> int:
        """KV tokens held by parked entries (part of ``kv_used_tokens``)."""

    @property
    def tokens_per_second(self) -> float: ...
    @property
    def kv_layout(self) -> KVLayout: ...
    def reserve(self, req: EngineRequest) -> None:
        """Take the request's KV up front, or raise :class:`KVCacheFull`."""

    def unreserve(self, req: EngineRequest) -> None: ...
    def enqueue(self, req: EngineRequest) -> None: ...
    def abort(self, request_id: str) -> None:
        """Cancel a request. A context leg cancelled before it parks is never parked."""

    def take_parked(self, ctx_request_id: int) -> ParkedKV | None: ...
    def discard_parked(self, ctx_request_id: int) -> bool:
        """Free a parked entry nobody will fetch (its client left); False if none is held.

        After :meth:`abort` of the same request, this frees its KV whether the
        engine parked it before or parks it during the abort: no window leaks it.
        """

    def evict_parked(self, tokens: int, parked_before: float | None = None) -> int:
        """Free the oldest parked entries until ``tokens`` KV tokens are freed (or none is left).

        ``parked_before``: only entries parked before that ``time.monotonic()``.
        Returns how many entries went. Their generation legs get 404 and recompute the prefill.
        """

    def read_parked(self, parked: ParkedKV) -> tuple[Any, Any]:
        """The parked K and V on the host; frees the blocks. Called off the event loop."""

    def expire_parked(self, now: float | None = None) -> int: ...


__all__ = [
    "NOT_FINISHED",
    "Engine",
    "EngineRequest",
    "KVCacheFull",
    "ParkedKV",
    "ParkedKVLost",
    "prompt_checksum",
]
