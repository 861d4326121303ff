"""The continuous-batching torch engine.

One dedicated thread owns the model and the KV cache and loops:

1. take newly submitted requests and drop cancelled ones (their blocks go
   back to the pool before the next forward);
2. start waiting requests while there is room in the batch: prefill each
   alone (or load its KV from a context worker), sample its first token;
3. one batched decode forward over every running sequence, one token each;
4. hand the step's outputs to the event loop in one ``call_soon_threadsafe``.

So concurrent requests share decode steps, new prefills join between steps,
and the aiohttp loop never waits on a forward pass. Admission control lives
in :meth:`TorchEngine.submit`: a request reserves the KV blocks for its
prompt plus ``max_tokens`` there, or is refused with :class:`KVCacheFull`
(the server's 503), so the engine never runs out of cache mid-request.

Greedy outputs do not depend on the batch: a prefill always runs alone,
and a decode row's attention is masked to its own sequence. (Matmul kernels
may round a row differently for another batch size, at the 1e-7 level; a
greedy choice flips only on an exact near-tie.)

Randomness is per request and per position: token ``i`` of a seeded request
is drawn with a generator seeded from ``(seed, i)``, so the same seed gives
the same text whatever else is in the batch, and a generation worker that
continues a context worker's first token draws what a single worker would.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import random
import threading
import time

import numpy as np
import torch

from .engine_api import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_KV_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_PREFIX_CACHING,
    NOT_FINISHED,
    EngineRequest,
    KVCacheFull,
    ParkedKV,
    prompt_checksum,
)
from .kv_cache import DecodeAttention, PagedKVCache, PrefillAttention
from .kv_transfer import KVLayout
from .model import LlamaForCausalLM, ModelConfig
from .output import Delta, SamplingParams, TokenLogprob
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)


class TorchEngine:
    """Owns the model, the paged KV cache and the engine thread."""

    def __init__(
        self,
        config: ModelConfig,
        model: LlamaForCausalLM,
        tokenizer: Tokenizer,
        *,
        device: torch.device | str = "cpu",
        kv_tokens: int = DEFAULT_KV_TOKENS,
        block_size: int = DEFAULT_BLOCK_SIZE,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        prefill_tokens_per_step: int = 2048,
        prefix_caching: bool = DEFAULT_PREFIX_CACHING,
    ) -> None:
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = config.vocab_size
        self.max_context = config.max_context
        self.cache = PagedKVCache(
            config, kv_tokens, block_size=block_size, device=self.device, dtype=self.dtype,
            prefix_caching=prefix_caching,
        )  # fmt: skip
        self.max_num_seqs = max_num_seqs
        self.prefill_tokens_per_step = prefill_tokens_per_step
        self._inbox: collections.deque[EngineRequest] = collections.deque()
        self._waiting: collections.deque[EngineRequest] = collections.deque()
        self._running: list[EngineRequest] = []
        self._by_id: dict[str, EngineRequest] = {}
        self._wake = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Insertion order is parking order: the first entry is the oldest.
        self._parked: dict[int, ParkedKV] = {}
        self._parked_tokens = 0
        # Parked entries per block: entries whose prompts share a cached prefix share its blocks,
        # which count once in _parked_tokens (the KV parked entries really hold).
        self._parked_blocks: dict[int, int] = {}
        self._parked_lock = threading.Lock()
        # Statistics read by /metrics (single writers, read under the GIL).
        self.prompt_tokens_total = 0
        self.generated_tokens_total = 0
        self.decode_steps_total = 0
        self.engine_errors_total = 0
        self.tokens_per_second = 0.0
        self._rate_window: collections.deque[tuple[float, int]] = collections.deque()

    # ------------------------------------------------------------ event-loop side

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="fastcore-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def queue_depth(self) -> int:
        return len(self._inbox) + len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    def submit(self, req: EngineRequest) -> None:
        """Reserve the request's KV and queue it; :class:`KVCacheFull` when it does not fit now."""
        self.reserve(req)
        self.enqueue(req)

    def reserve(self, req: EngineRequest) -> None:
        """Take the KV blocks for the prompt plus ``max_tokens`` (just the prompt for a context leg)."""
        reserve = int(req.prompt_ids.size) + (1 if req.park_as is not None else req.params.max_tokens)
        req.blocks, req.cached_prefix = self.cache.allocate_prefix(
            req.prompt_ids, min(reserve, self.max_context), req.cache_root
        )
        req.registered = (0, req.cache_root)
        req.seed = req.params.seed if req.params.seed is not None else random.getrandbits(63)

    def unreserve(self, req: EngineRequest) -> None:
        """Give back a reservation that was never queued (the client left during a KV fetch)."""
        if req.blocks:
            self.cache.free(req.blocks)
            req.blocks = []

    def enqueue(self, req: EngineRequest) -> None:
        with self._wake:
            self._by_id[req.request_id] = req
            self._inbox.append(req)
            self._wake.notify()

    def abort(self, request_id: str) -> None:
        """Cancel a request; the engine frees its blocks before its next forward (and never parks it)."""
        req = self._by_id.get(request_id)
        if req is None:
            return
        req.cancelled = True
        with self._wake:
            self._wake.notify()

    def _unpark(self, ctx_request_id: int) -> ParkedKV | None:
        """Remove an entry from the parked set (caller holds ``_parked_lock``)."""
        parked = self._parked.pop(ctx_request_id, None)
        if parked is not None:
            for block in parked.blocks:
                users = self._parked_blocks[block] - 1
                if users:
                    self._parked_blocks[block] = users
                else:
                    del self._parked_blocks[block]
                    self._parked_tokens -= self.cache.block_size
        return parked

    def take_parked(self, ctx_request_id: int) -> ParkedKV | None:
        with self._parked_lock:
            return self._unpark(ctx_request_id)

    def discard_parked(self, ctx_request_id: int) -> bool:
        with self._parked_lock:
            parked = self._unpark(ctx_request_id)
        if parked is None:
            return False
        self.cache.free(parked.blocks)
        return True

    def evict_parked(self, tokens: int, parked_before: float | None = None) -> int:
        """Free the oldest parked entries (parked before ``parked_before``, if given) until
        ``tokens`` KV tokens are freed; returns how many went."""
        evicted: list[ParkedKV] = []
        with self._parked_lock:
            start = self._parked_tokens
            # freed: parked KV gone (a block another parked entry still shares is not freed)
            while start - self._parked_tokens < tokens and self._parked:
                oldest = next(iter(self._parked.values()))
                if parked_before is not None and oldest.parked_at >= parked_before:
                    break
                parked = self._unpark(oldest.ctx_request_id)
                assert parked is not None
                evicted.append(parked)
        for parked in evicted:
            self.cache.free(parked.blocks)
        return len(evicted)

    def read_parked(self, parked: ParkedKV) -> tuple[torch.Tensor, torch.Tensor]:
        """The parked K and V on the CPU, then the blocks go back to the pool (call off the loop)."""
        try:
            k, v = self.cache.read(parked.blocks, parked.num_tokens)
            return k.cpu(), v.cpu()
        finally:
            self.cache.free(parked.blocks)

    def expire_parked(self, now: float | None = None) -> int:
        """Free the KV of context legs whose generation leg never came; returns how many."""
        now = time.monotonic() if now is None else now
        with self._parked_lock:
            expired = [p.ctx_request_id for p in self._parked.values() if p.expires_at <= now]
            gone = [self._unpark(ctx_id) for ctx_id in expired]
        for p in gone:
            assert p is not None
            self.cache.free(p.blocks)
        return len(gone)

    @property
    def kv_layout(self) -> KVLayout:
        return KVLayout(self.cache.num_layers, self.cache.kv_heads, self.cache.head_dim, self.dtype)

    @property
    def kv_used_tokens(self) -> int:
        return self.cache.used_tokens

    @property
    def kv_capacity_tokens(self) -> int:
        return self.cache.capacity_tokens

    @property
    def prefix_caching(self) -> bool:
        return self.cache.prefix_caching

    @property
    def prefix_hit_tokens(self) -> int:
        return self.cache.hit_tokens_total

    @property
    def prefill_computed_tokens(self) -> int:
        return self.prompt_tokens_total

    @property
    def prefix_cached_tokens(self) -> int:
        return self.cache.cached_blocks * self.cache.block_size

    @property
    def prefix_evicted_blocks(self) -> int:
        return self.cache.evicted_blocks_total

    @property
    def parked_count(self) -> int:
        return len(self._parked)

    @property
    def parked_tokens(self) -> int:
        return self._parked_tokens

    # ------------------------------------------------------------ engine thread

    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self._wake:
                    while not self._stop and not self._inbox and not self._waiting and not self._running:
                        self._wake.wait(timeout=1.0)
                    if self._stop:
                        break
                    while self._inbox:
                        self._waiting.append(self._inbox.popleft())
                outputs: list[tuple[EngineRequest, Delta]] = []
                self._drop_cancelled()
                self._admit(outputs)
                if self._running:
                    self._decode_step(outputs)
                if outputs:
                    self._deliver(outputs)
        leftovers: list[tuple[EngineRequest, Delta]] = []
        for req in [*self._waiting, *self._running, *self._inbox]:
            self._finish_with_error(req, "the worker is shutting down", leftovers)
        self._deliver(leftovers)

    def _drop_cancelled(self) -> None:
        for queue in (self._waiting,):
            for req in [r for r in queue if r.cancelled]:
                queue.remove(req)
                self._release(req)
        for req in [r for r in self._running if r.cancelled]:
            self._running.remove(req)
            self._release(req)

    def _release(self, req: EngineRequest) -> None:
        if req.blocks:
            if req.cached_len and not req.cancelled:  # what it computed, generated tokens included
                ids = req.prompt_ids
                if req.generated:
                    ids = np.concatenate([ids, np.asarray(req.generated, dtype=np.int32)])
                req.registered = self.cache.register(req.blocks, ids, req.cached_len, req.registered)
            self.cache.free(req.blocks)
            req.blocks = []
        self._by_id.pop(req.request_id, None)

    def _admit(self, outputs: list[tuple[EngineRequest, Delta]]) -> None:
        budget = self.prefill_tokens_per_step
        while self._waiting and len(self._running) < self.max_num_seqs:
            # At least one prefill per step, then only while the step's token budget lasts,
            # so a burst of long prompts does not stall the running decodes.
            if budget <= 0:
                break
            req = self._waiting.popleft()
            budget -= int(req.prompt_ids.size) - req.cached_prefix
            try:
                self._start(req, outputs)
            except Exception as exc:  # a bad request must not take the loop down
                log.exception("prefill of %s failed", req.request_id)
                self.engine_errors_total += 1
                self._finish_with_error(req, f"prefill failed: {exc}", outputs)

    def _start(self, req: EngineRequest, outputs: list[tuple[EngineRequest, Delta]]) -> None:
        prompt = torch.from_numpy(np.ascontiguousarray(req.prompt_ids, dtype=np.int32))
        prompt_len = int(prompt.numel())
        forced = req.forced_tokens
        if req.kv_import is not None:
            if len(forced) != 1:
                raise ValueError("a KV import continues from exactly one first token")
            k, v = req.kv_import
            # A cached prefix is already here (and shared): only the rest is written.
            self.cache.write(req.blocks, k, v, start=req.cached_prefix)
            req.kv_import = None
            req.cached_len = prompt_len
            req.registered = self.cache.register(req.blocks, req.prompt_ids, prompt_len, req.registered)
            logprobs = req.forced_logprobs or [None] * len(forced)
        else:
            # Recompute the context: the prompt plus all but the last forced token, from the
            # end of the cached prefix on (at most prompt_len - 1: the last prompt id's logits
            # are always computed).
            ids = torch.cat([prompt, torch.tensor(forced[:-1], dtype=torch.int32)]) if forced else prompt
            total = int(ids.numel())
            start = req.cached_prefix
            attention = PrefillAttention(self.cache, req.blocks, start, total - start)
            rows = torch.arange(prompt_len - 1 - start, total - start, device=self.device)
            logits = self.model.forward_step(
                ids[start:].to(self.device, torch.int64),
                torch.arange(start, total, device=self.device),
                attention,
                rows,
            )
            self.prompt_tokens_total += total - start
            req.cached_len = total
            req.registered = self.cache.register(req.blocks, ids.numpy(), total, req.registered)
            if forced:
                logprobs = [self._forced_logprob(req, logits[i], t) for i, t in enumerate(forced)]
            else:
                token, lp = self._sample(logits[-1:], [req])[0]
                forced, logprobs = [token], [lp]
                self.generated_tokens_total += 1
        for token, lp in zip(forced, logprobs):
            req.generated.append(token)
            delta = req.processor.add(token, lp)
            outputs.append((req, delta))
            if req.processor.finished:
                break
        if req.processor.finished:
            self._release(req)
            return
        if req.park_as is not None:
            outputs.append((req, req.processor.finish_early(NOT_FINISHED)))
            self._park(req, forced[0], logprobs[0])
            return
        req.next_token = forced[-1]
        self._running.append(req)

    def _park(self, req: EngineRequest, first_token: int, first_logprob: TokenLogprob | None) -> None:
        assert req.park_as is not None
        parked = ParkedKV(
            ctx_request_id=req.park_as,
            blocks=req.blocks,
            num_tokens=int(req.prompt_ids.size),
            prompt_crc32=prompt_checksum(req.prompt_ids),
            first_token=first_token,
            first_logprob=first_logprob,
            expires_at=time.monotonic() + req.park_ttl_s,
            parked_at=time.monotonic(),
        )
        req.blocks = []  # now owned by the parked entry, or freed here
        with self._parked_lock:
            # Checked under the lock discard_parked takes: a client that left
            # during the prefill (the app aborts, then discards) has either set
            # ``cancelled`` before this, or finds the entry parked after it.
            cancelled = req.cancelled
            if not cancelled:
                self._parked[parked.ctx_request_id] = parked
                for block in parked.blocks:
                    users = self._parked_blocks.get(block, 0)
                    if not users:
                        self._parked_tokens += self.cache.block_size
                    self._parked_blocks[block] = users + 1
        if cancelled:
            self.cache.free(parked.blocks)
        self._by_id.pop(req.request_id, None)

    def _decode_step(self, outputs: list[tuple[EngineRequest, Delta]]) -> None:
        batch = list(self._running)
        try:
            ids = torch.tensor([r.next_token for r in batch], dtype=torch.int64, device=self.device)
            positions = torch.tensor([r.cached_len for r in batch], dtype=torch.int64, device=self.device)
            attention = DecodeAttention(
                self.cache, [r.blocks for r in batch], [r.cached_len + 1 for r in batch]
            )
            logits = self.model.forward_step(ids, positions, attention)
            sampled = self._sample(logits, batch)
        except Exception as exc:
            log.exception("decode step failed")
            self.engine_errors_total += 1
            for req in batch:
                self._running.remove(req)
                self._finish_with_error(req, f"decode step failed: {exc}", outputs)
            return
        self.decode_steps_total += 1
        self._count_tokens(len(batch))
        for req, (token, lp) in zip(batch, sampled):
            req.cached_len += 1
            req.next_token = token
            req.generated.append(token)
            delta = req.processor.add(token, lp)
            outputs.append((req, delta))
            if req.processor.finished:
                self._running.remove(req)
                self._release(req)

    def _count_tokens(self, n: int) -> None:
        now = time.monotonic()
        self.generated_tokens_total += n
        window = self._rate_window
        window.append((now, n))
        while window and now - window[0][0] > 5.0:
            window.popleft()
        span = now - window[0][0]
        self.tokens_per_second = sum(c for _, c in window) / span if span > 0 else 0.0

    def _finish_with_error(
        self, req: EngineRequest, message: str, outputs: list[tuple[EngineRequest, Delta]]
    ) -> None:
        self._release(req)
        outputs.append((req, Delta("", [], [], finish_reason="error", error=message)))

    def _deliver(self, outputs: list[tuple[EngineRequest, Delta]]) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return

        def dispatch() -> None:
            for req, delta in outputs:
                if not req.cancelled:
                    req.on_delta(delta)

        try:
            loop.call_soon_threadsafe(dispatch)
        except RuntimeError:  # loop closed while shutting down
            pass

    # ------------------------------------------------------------ sampling

    def _forced_logprob(self, req: EngineRequest, logits: torch.Tensor, token: int) -> TokenLogprob | None:
        if req.params.logprobs is None:
            return None
        return self._logprob_record(torch.log_softmax(logits.float(), -1), token, req.params.logprobs)

    @staticmethod
    def _logprob_record(logprobs: torch.Tensor, token: int, top: int) -> TokenLogprob:
        top_list: list[tuple[int, float]] = []
        if top:
            values, indices = logprobs.topk(top)
            top_list = list(zip(indices.tolist(), values.tolist()))
        return TokenLogprob(token, float(logprobs[token]), top_list)

    def _sample(
        self, logits: torch.Tensor, batch: list[EngineRequest]
    ) -> list[tuple[int, TokenLogprob | None]]:
        """One token per row: greedy rows by argmax, the others from their own seeded stream."""
        logits = logits.float()
        tokens = logits.argmax(-1).tolist()
        results: list[tuple[int, TokenLogprob | None]] = []
        for row, req in enumerate(batch):
            p = req.params
            token = tokens[row]
            if not p.greedy:
                token = self._draw(logits[row], p, req.seed, req.processor.num_tokens)
            lp = None
            if p.logprobs is not None:
                lp = self._logprob_record(torch.log_softmax(logits[row], -1), token, p.logprobs)
            results.append((token, lp))
        return results

    @staticmethod
    def _draw(logits: torch.Tensor, p: SamplingParams, seed: int, step: int) -> int:
        scores = (logits / p.temperature).cpu()
        if p.top_k and p.top_k < scores.numel():
            kth = scores.topk(p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, -math.inf)
        probs = torch.softmax(scores, -1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            drop = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        generator = torch.Generator().manual_seed((seed * 1_000_003 + step) & (2**63 - 1))
        # Exponential-race sampling (argmax p/E, E ~ Exp(1)) draws exactly from probs.
        noise = torch.empty_like(probs).exponential_(generator=generator)
        return int((probs / noise).argmax())


__all__ = ["NOT_FINISHED", "EngineRequest", "KVCacheFull", "ParkedKV", "TorchEngine", "prompt_checksum"]
