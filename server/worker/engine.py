"""The continuous-batching torch engine.

One dedicated thread owns the model and the KV cache and loops:

1. take newly submitted requests and drop cancelled ones (their blocks go
   back to the pool before the next forward);
2. admit waiting requests, oldest first, while there is room in the batch: a
   KV import from a context worker starts at once, a prompt joins the
   prefilling queue;
3. one forward over every running sequence's next token and chunks of the
   prefilling prompts, oldest first, under the step's token budget
   (``prefill_chunk_tokens``, less one per decode row, and no more than keeps
   the step within ``prefill_step_ratio`` times a decode-only step while
   streams decode, chunks sized by cost: :mod:`.prefill_pacer`): a long prompt
   is cut into chunks over steps, several short ones share a step (one that
   arrives behind a long prompt's chunks runs beside the next, not after them
   all); a prompt
   whose last chunk ran samples its first token and starts decoding (or
   parks, for a context leg);
4. hand the step's outputs to the event loop in one ``call_soon_threadsafe``.

So concurrent requests share decode steps, a prompt as long as the context
delays the running streams by one chunk a step instead of its whole prefill,
and the aiohttp loop never waits on a forward pass. Admission control lives
in :meth:`TorchEngine.submit`: a request reserves the KV blocks for its
prompt plus ``max_tokens`` there, or is refused with :class:`KVCacheFull`
(the server's 503), so the engine never runs out of cache mid-request.

Greedy outputs do not depend on the batch or the chunking: a chunk attends to
its own sequence's earlier positions (in the cache) exactly as a whole prefill
would, and a decode row's attention is masked to its own sequence. (Matmul kernels
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
import operator
import random
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .decode_attention import DecodeAttention, kept_rows
from .engine_api import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_KV_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_PREFILL_CHUNK_TOKENS,
    DEFAULT_PREFILL_STEP_RATIO,
    DEFAULT_PREFIX_CACHING,
    NOT_FINISHED,
    EngineRequest,
    KVCacheFull,
    ParkedKV,
    prompt_checksum,
)
from .kv_cache import PagedKVCache, PrefillBatchAttention, StepAttention
from .kv_transfer import KVLayout
from .model import LlamaForCausalLM, ModelConfig
from .output import Delta, TokenLogprob
from .prefill_pacer import PrefillPacer, shared_chunks, whole_prompts
from .sampler import Sampler
from .split_prefill import SplitPrefill
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class _Prefill:
    """An admitted prompt whose prefill runs in chunks; ``req.cached_len`` is how far it got."""

    req: EngineRequest
    #: what is prefilled: the prompt plus all but the last forced token (a recomputed hand-off)
    ids: torch.Tensor
    ids_np: np.ndarray
    prompt_len: int
    #: logits of the rows from the prompt's last position on, gathered chunk by chunk
    logits: list[torch.Tensor] = field(default_factory=list)

    @property
    def total(self) -> int:
        return int(self.ids_np.size)

    @classmethod
    def of(cls, req: EngineRequest) -> _Prefill:
        prompt = np.ascontiguousarray(req.prompt_ids, dtype=np.int32)
        forced = req.forced_tokens
        ids = np.concatenate([prompt, np.asarray(forced[:-1], dtype=np.int32)]) if forced else prompt
        # From the end of the cached prefix on (at most prompt_len - 1: the last prompt id's
        # logits are always computed).
        req.cached_len = req.cached_prefix
        return cls(req, torch.from_numpy(ids), ids, int(prompt.size))


def _owner(req: EngineRequest) -> tuple[str, int]:
    """A request as the prefix cache's key log knows it: its prompt's keys are stored once the
    prompt's full blocks are registered (kv_cache.PagedKVCache.register)."""
    return req.request_id, int(req.prompt_ids.size)


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
        prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS,
        prefill_step_ratio: float = DEFAULT_PREFILL_STEP_RATIO,
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
        if prefill_chunk_tokens < 0:
            raise ValueError(f"prefill_chunk_tokens must be >= 0 (0: off), got {prefill_chunk_tokens}")
        #: a step's token budget (decode rows and prefill chunks); 0: prompts prefilled whole
        self.prefill_chunk_tokens = prefill_chunk_tokens
        # Paces chunks beside decodes (chunked prefill only: whole prompts are whole).
        ratio = prefill_step_ratio if prefill_chunk_tokens else 0.0
        self.pacer = PrefillPacer(prefill_chunk_tokens, self.cache.block_size, ratio)
        self.split = SplitPrefill()  # a chunk too deep for a step's allowance, a piece a step
        #: admitted prompts whose prefill is under way, oldest first (they hold a sequence slot)
        self._prefilling: list[_Prefill] = []
        self._inbox: collections.deque[EngineRequest] = collections.deque()
        self._waiting: collections.deque[EngineRequest] = collections.deque()
        self._running: list[EngineRequest] = []
        #: the last decode step's batch and its attention, kept while the same streams decode on
        self._decode_kv: tuple[list[EngineRequest], DecodeAttention | None] = ([], None)
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
        #: prefill forwards (each may carry several prompts' chunks)
        self.prefill_steps_total = 0
        self.engine_errors_total = 0
        self.tokens_per_second = 0.0
        self._rate_window: collections.deque[tuple[float, int]] = collections.deque()
        self._rate_tokens = 0  # the window's tokens
        self.sampler = Sampler()  # one token a row, greedy or from the request's seeded stream

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
        """Requests waiting for their first token: queued, or their prompt's prefill under way."""
        return len(self._inbox) + len(self._waiting) + len(self._prefilling)

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
        req.blocks, req.cached_prefix, req.tier2_prefix = self.cache.allocate_prefix_tiers(
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
        self._unhold(parked.blocks if parked is not None else [])
        return parked

    def _unhold(self, blocks: list[int]) -> None:
        for block in blocks:
            users = self._parked_blocks[block] - 1
            if users:
                self._parked_blocks[block] = users
            else:
                del self._parked_blocks[block]
                self._parked_tokens -= self.cache.block_size

    def take_parked(self, ctx_request_id: int) -> ParkedKV | None:
        with self._parked_lock:
            return self._unpark(ctx_request_id)

    def discard_parked(self, ctx_request_id: int) -> bool:
        with self._parked_lock:
            parked = self._unpark(ctx_request_id)
        self.cache.free(parked.blocks if parked is not None else [])
        return parked is not None

    def evict_parked(self, tokens: int, parked_before: float | None = None) -> int:
        """Free the oldest parked entries (parked before ``parked_before``, if given) until
        ``tokens`` KV tokens are freed; returns how many went. With a second tier an entry first
        lets its registered blocks go to the cache, kept for its export (kv_cache.let_go)."""
        freed: list[int] = []
        with self._parked_lock:
            start, went = self._parked_tokens, 0
            # freed: parked KV gone (a block another parked entry still shares is not freed)
            for oldest in list(self._parked.values()):
                before = parked_before is None or oldest.parked_at < parked_before
                if start - self._parked_tokens >= tokens or not before:
                    break
                let_go = self.cache.let_go(oldest) if self.cache.tier2 and not oldest.chain else []
                if not let_go:
                    let_go = self._parked.pop(oldest.ctx_request_id).blocks
                self._unhold(let_go)
                freed += let_go
                went += 1
        self.cache.free(freed)
        return went

    def read_parked(self, parked: ParkedKV) -> tuple[torch.Tensor, torch.Tensor]:
        """The parked K and V on the CPU, then the blocks go back to the pool (call off the loop)."""
        try:  # each block where it is (kv_cache.read_parked: the device or tier 2)
            return self.cache.read_parked(parked)
        finally:
            self.cache.free(parked.blocks)

    def expire_parked(self, now: float | None = None) -> int:
        """Free the KV of context legs whose generation leg never came; returns how many."""
        now = time.monotonic() if now is None else now
        with self._parked_lock:
            expired = [p.ctx_request_id for p in self._parked.values() if p.expires_at <= now]
            gone = [self._unpark(ctx_id) for ctx_id in expired]
        self.cache.free([block for p in gone if p is not None for block in p.blocks])
        return len(gone)

    kv_tiers_info = property(lambda self: self.cache.kv_tiers_info)  # /server_info's tier figures

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
                    while not (
                        self._stop or self._inbox or self._waiting or self._running or self._prefilling
                    ):
                        self._wake.wait(timeout=1.0)
                    if self._stop:
                        break
                    while self._inbox:
                        self._waiting.append(self._inbox.popleft())
                self.cache.flush_tier2(self._waiting)  # spills and loads before any write (kv_tier2)
                outputs: list[tuple[EngineRequest, Delta]] = []
                self._drop_cancelled()
                self._admit(outputs)
                if self._running or self._prefilling:
                    self._step(outputs)
                if outputs:
                    self._deliver(outputs)
        leftovers: list[tuple[EngineRequest, Delta]] = []
        for req in [*self._waiting, *(p.req for p in self._prefilling), *self._running, *self._inbox]:
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
        for state in [p for p in self._prefilling if p.req.cancelled]:
            self._prefilling.remove(state)
            self._release(state.req)

    def _release(self, req: EngineRequest) -> None:
        if req.blocks:
            if req.cached_len and not req.cancelled:  # what it computed, generated tokens included
                ids = req.prompt_ids
                if req.generated:
                    ids = np.concatenate([ids, np.asarray(req.generated, dtype=np.int32)])
                req.registered = self.cache.register(
                    req.blocks, ids, req.cached_len, req.registered, _owner(req)
                )
            self.cache.free(req.blocks)
            req.blocks = []
        self._by_id.pop(req.request_id, None)

    def _admit(self, outputs: list[tuple[EngineRequest, Delta]]) -> None:
        """Waiting requests take free sequence slots in arrival order: a KV import starts at once (no
        compute), a prompt joins the prefilling queue, whose chunks :meth:`_prefill_step` runs."""
        while self._waiting and len(self._running) + len(self._prefilling) < self.max_num_seqs:
            req = self._waiting.popleft()
            try:
                if req.kv_import is not None:
                    self._import(req, outputs)
                else:
                    self._prefilling.append(_Prefill.of(req))
            except Exception as exc:  # a bad request must not take the loop down
                self._prefill_failed(req, exc, outputs)

    def _prefill_failed(
        self, req: EngineRequest, exc: Exception, outputs: list[tuple[EngineRequest, Delta]]
    ) -> None:
        log.error("prefill of %s failed", req.request_id, exc_info=exc)
        self.engine_errors_total += 1
        self._finish_with_error(req, f"prefill failed: {exc}", outputs)

    def _import(self, req: EngineRequest, outputs: list[tuple[EngineRequest, Delta]]) -> None:
        forced = req.forced_tokens
        if len(forced) != 1:
            raise ValueError("a KV import continues from exactly one first token")
        assert req.kv_import is not None
        k, v = req.kv_import
        prompt_len = int(req.prompt_ids.size)
        # A cached prefix is already here (and shared): only the rest is written.
        self.cache.write(req.blocks, k, v, start=req.cached_prefix)
        req.kv_import = None
        req.cached_len = prompt_len
        req.registered = self.cache.register(
            req.blocks, req.prompt_ids, prompt_len, req.registered, _owner(req)
        )
        self._first_tokens(req, forced, req.forced_logprobs or [None] * len(forced), outputs)

    def _plan_chunks(self) -> list[tuple[_Prefill, int]]:
        """This step's prefill chunks, oldest prompt first (so no prompt waits behind a later one).

        Chunked (``prefill_chunk_tokens`` > 0): the step's budget is that many tokens, less one per
        running decode (at least a block's worth, so a full batch still makes progress), planned by
        :func:`.prefill_pacer.shared_chunks`: prompts not yet started that fit go whole; one that
        must be cut takes no more than the pacer allows beside running decodes, and shares the
        budget beyond its guaranteed share with later short prompts (no head-of-line blocking
        behind a long prefill). Off: whole prompts while ``prefill_tokens_per_step`` lasts, at
        least one. Several prompts in one plan share one forward."""
        chunk = self.prefill_chunk_tokens
        if chunk <= 0:
            return whole_prompts(self._prefilling, self.prefill_tokens_per_step)
        budget = max(chunk - len(self._running), min(chunk, self.cache.block_size))
        paced = self.pacer.budget(bool(self._running), self._prefilling[0].req.cached_len)
        return shared_chunks(self._prefilling, budget, paced, self.cache.block_size)

    def _run_chunks(
        self, plan: list[tuple[_Prefill, int]], outputs: list[tuple[EngineRequest, Delta]]
    ) -> None:
        try:
            logits = self._prefill_forward(plan)
        except Exception as exc:
            if len(plan) > 1:
                # Which prompt broke the shared forward? Each again alone (rewriting the same slots),
                # so only that one fails.
                for part in plan:
                    self._run_chunks([part], outputs)
                return
            self._prefilling.remove(plan[0][0])
            self._prefill_failed(plan[0][0].req, exc, outputs)
            return
        self._prefill_done(plan, logits, outputs)

    def _prefill_inputs(
        self, plan: list[tuple[_Prefill, int]]
    ) -> tuple[torch.Tensor, torch.Tensor, PrefillBatchAttention, torch.Tensor]:
        """The plan's chunks flattened: ids, positions, their attention, and the rows whose logits a
        first token or a forced token's logprob needs (positions from the prompt's last on)."""
        ids, positions, rows, spans = [], [], [], []
        offset = 0
        for state, take in plan:
            start = state.req.cached_len
            ids.append(state.ids[start : start + take])
            positions.append(torch.arange(start, start + take))
            first = min(max(start, state.prompt_len - 1), start + take)  # none before the prompt's last
            rows.append(torch.arange(offset + first - start, offset + take))
            spans.append((state.req.blocks, start, take))
            offset += take
        dev = self.device
        attention = PrefillBatchAttention(self.cache, spans, state.req.cached_len + take < state.total)
        return torch.cat(ids).to(dev, torch.int64), torch.cat(positions).to(dev), attention, torch.cat(rows)

    def _prefill_forward(self, plan: list[tuple[_Prefill, int]]) -> torch.Tensor:
        ids, positions, attention, rows = self._prefill_inputs(plan)
        return self.model.forward_step(ids, positions, attention, rows.to(self.device))

    def _prefill_done(
        self,
        plan: list[tuple[_Prefill, int]],
        logits: torch.Tensor,
        outputs: list[tuple[EngineRequest, Delta]],
    ) -> None:
        self.prefill_steps_total += 1
        row = 0
        for state, take in plan:
            req = state.req
            start = req.cached_len
            wanted = max(0, start + take - max(start, state.prompt_len - 1))
            if wanted:
                state.logits.append(logits[row : row + wanted])
                row += wanted
            req.cached_len = start + take
            self.prompt_tokens_total += take
            req.registered = self.cache.register(
                req.blocks, state.ids_np, req.cached_len, req.registered, _owner(req)
            )
            if req.cached_len < state.total:
                continue
            self._prefilling.remove(state)
            try:
                self._prefill_finished(state, outputs)
            except Exception as exc:
                self._prefill_failed(req, exc, outputs)

    def _prefill_finished(self, state: _Prefill, outputs: list[tuple[EngineRequest, Delta]]) -> None:
        req = state.req
        logits = torch.cat(state.logits)
        forced = req.forced_tokens
        if forced:
            logprobs = [self.sampler.forced_logprob(req, logits[i], t) for i, t in enumerate(forced)]
        else:
            token, lp = self.sampler.sample(logits[-1:], [req])[0]
            forced, logprobs = [token], [lp]
            self.generated_tokens_total += 1
        self._first_tokens(req, forced, logprobs, outputs)

    def _first_tokens(
        self,
        req: EngineRequest,
        forced: list[int],
        logprobs: list[TokenLogprob | None],
        outputs: list[tuple[EngineRequest, Delta]],
    ) -> None:
        """Hand out a started request's first token(s); then it finishes, parks or decodes."""
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

    def _step(self, outputs: list[tuple[EngineRequest, Delta]]) -> None:
        """One forward over the running streams' next tokens and this step's prefill chunks: the
        weights are read once for both (Sarathi-Serve's stall-free batches), so a chunk costs the
        streams its own compute only, not a second pass."""
        batch = list(self._running)
        if not batch:
            self._decode_kv = ([], None)  # its dense K/V goes
        plan = self._plan_chunks() if self._prefilling else []
        chunks = [(state.req.cached_len, take) for state, take in plan]  # the pacer's cost of each
        began = self.pacer.clock()
        if self.split.step(self, batch, plan, outputs):  # a chunk too deep for a step: in pieces
            return
        if not plan:
            if batch:
                self._decode_step(batch, outputs)
                self.pacer.decode_step(self.pacer.clock() - began)
            return
        if not batch:
            self._run_chunks(plan, outputs)
            self.cache.prefill_timed(plan, self.pacer.clock() - began)
            return
        try:
            ids, positions, attention = self._decode_inputs(batch)
            p_ids, p_positions, p_attention, p_rows = self._prefill_inputs(plan)
            rows = torch.cat([torch.arange(len(batch)), p_rows + len(batch)]).to(self.device)
            logits = self.model.forward_step(
                torch.cat([ids, p_ids]),
                torch.cat([positions, p_positions]),
                StepAttention([(attention, len(batch)), (p_attention, int(p_ids.numel()))]),
                rows,
            )
            sampled = self.sampler.sample(logits[: len(batch)], batch)
        except Exception:
            # Whose fault? The decodes and the chunks again apart (rewriting the same slots), each
            # failing on its own as it would in a step of its own.
            self._decode_step(batch, outputs)
            self._run_chunks(plan, outputs)
            return
        self._decode_done(batch, sampled, outputs)
        self._prefill_done(plan, logits[len(batch) :], outputs)
        self.pacer.mixed_step(took := self.pacer.clock() - began, chunks)
        self.cache.prefill_timed(plan, took - (self.pacer.decode_s or took))

    def _decode_inputs(
        self, batch: list[EngineRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, DecodeAttention]:
        kept, attention = self._decode_kv
        if (  # the same streams, each one token on since the last step: the usual step, first
            attention is not None
            and len(kept) == len(batch)
            and all(map(operator.is_, kept, batch))
            and attention.lengths.tolist() == [r.cached_len for r in batch]
        ):
            attention.advance(None)
            return self._next_ids(batch), attention.positions, attention
        ids = self._next_ids(batch)
        lengths = [r.cached_len for r in batch]
        found = kept_rows(kept, batch) if attention is not None else None
        if attention is not None and found is not None:
            rows, joined = found
            stay = len(batch) - joined
            if np.array_equal(attention.lengths[rows], lengths[:stay]):
                attention.advance(None if len(rows) == len(kept) else rows)
                new = batch[stay:]
                if not new or attention.join([r.blocks for r in new], [n + 1 for n in lengths[stay:]]):
                    self._decode_kv = (batch, attention)
                    return ids, attention.positions, attention
        attention = DecodeAttention(self.cache, [r.blocks for r in batch], [n + 1 for n in lengths])
        self._decode_kv = (batch, attention)
        return ids, attention.positions, attention

    def _next_ids(self, batch: list[EngineRequest]) -> torch.Tensor:
        if self.device.type == "cpu":  # numpy's array and a view of it: ~2 us, torch.tensor ~5
            return torch.from_numpy(np.array([r.next_token for r in batch], dtype=np.int64))
        return torch.tensor([r.next_token for r in batch], dtype=torch.int64, device=self.device)

    def _decode_step(self, batch: list[EngineRequest], outputs: list[tuple[EngineRequest, Delta]]) -> None:
        try:
            ids, positions, attention = self._decode_inputs(batch)
            logits = self.model.forward_step(ids, positions, attention)
            sampled = self.sampler.sample(logits, batch)
        except Exception as exc:
            log.exception("decode step failed")
            self.engine_errors_total += 1
            for req in batch:
                self._running.remove(req)
                self._finish_with_error(req, f"decode step failed: {exc}", outputs)
            return
        self._decode_done(batch, sampled, outputs)

    def _decode_done(
        self,
        batch: list[EngineRequest],
        sampled: list[tuple[int, TokenLogprob | None]],
        outputs: list[tuple[EngineRequest, Delta]],
    ) -> None:
        self.decode_steps_total += 1
        self._count_tokens(len(batch))
        for req, (token, lp) in zip(batch, sampled):
            req.cached_len += 1
            req.next_token = token
            req.generated.append(token)
            delta = req.processor.add(token, lp)
            outputs.append((req, delta))
            if delta.finish_reason is not None:  # the processor finished (its last delta says so)
                self._running.remove(req)
                self._release(req)

    def _count_tokens(self, n: int) -> None:
        now = time.monotonic()
        self.generated_tokens_total += n
        window = self._rate_window
        window.append((now, n))
        # A running sum: the window holds every step of the last 5 s (thousands at 32 streams),
        # and summing it anew each step cost more than the step's own Python.
        self._rate_tokens += n
        while window and now - window[0][0] > 5.0:
            self._rate_tokens -= window.popleft()[1]
        span = now - window[0][0]
        self.tokens_per_second = self._rate_tokens / span if span > 0 else 0.0

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


__all__ = ["NOT_FINISHED", "EngineRequest", "KVCacheFull", "ParkedKV", "TorchEngine", "prompt_checksum"]
