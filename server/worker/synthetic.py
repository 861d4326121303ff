"""The synthetic engine: the worker's protocol with no model behind it.

``fastcore-serve worker --model synthetic --prompt-tokens N`` serves the same
routes, roles, bodies and SSE streams as the torch worker (it is the same
app, see ``app.py``), but an "engine step" is a timer: a configurable
prefill latency, then a configurable latency per token (both 0 by default).
With instant workers the orchestrator in front of them is the bottleneck,
which is what ``bench.orchestrator`` and ``bench.load`` measure.

What is real:

- every prompt is ``N`` token ids of real data (seeded, below the vocab size,
  never an end-of-sequence id), so a context leg returns ``N`` ids as a JSON
  list or as ``prompt_token_ids_b64`` exactly as the torch worker would, and
  a generation leg decodes and checks them (``fastcore.decode_tokens``);
- generated ids are a deterministic function of the prompt length and the
  position, so a generation worker continuing a context worker's first token
  produces what a single worker would, and greedy equality tests hold;
- the KV hand-off runs through the real endpoint and wire format, with a
  one-layer, one-head, width-1 float16 "cache" (4 bytes per prompt token):
  headers, checksums and the first token are checked, and next to no fake
  cache bytes are shipped.

With ``--prompt-tokens 0`` the prompt is the text instead: its chat template
is ``<|role|>\ncontent\n`` per message (then ``<|assistant|>\n``), and every
``--bytes-per-token`` bytes of it (4 by default; 1 to 8, so that traces made
with other tokenizers can be replayed) are one id, so prompts that share text
share ids (an agentic conversation's turns do). The prefix cache is then
modelled like the torch engine's (:class:`PrefixCacheModel`): full blocks of
16 ids keyed by the same chained hash, least recently used first out beyond
``--kv-tokens`` (which ``kv_capacity_tokens`` then reports), and a prefill
costs ``--prefill-latency-ms`` plus ``--prefill-ms-per-1k-tokens`` per 1,000
ids not served from the cache. A response's ``usage`` says how many prompt ids
the cache served (``prompt_tokens_details.cached_tokens``).

``--prefill-tokens-per-s R`` makes the prefill compute one resource of the
worker (:class:`PrefillQueue`), as a real engine's is: the ids each request
must compute queue first come first served at ``R`` ids a second, so one long
uncached prompt delays every prompt behind it, and routing that saves prefill
saves time-to-first-token under load. Without it each request's prefill is a
timer of its own (nothing queues).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np

from fastcore import protocol as wire

from .engine_api import (
    DEFAULT_BLOCK_SIZE,
    NOT_FINISHED,
    EngineRequest,
    ParkedKV,
    chain_block_hashes,
    prompt_checksum,
)
from .kv_events import ChunkEventLog, KvEventLog
from .synthetic_script import Script

SYNTHETIC_VOCAB = 32_000
SYNTHETIC_EOS = SYNTHETIC_VOCAB - 1
# The generation room above the prompt: max_tokens may be as large as this.
GENERATION_ROOM = 1 << 16
#: the longest prompt of the text mode (--prompt-tokens 0), in ids
TEXT_MAX_CONTEXT = 1 << 20
#: the modelled prefix cache's block size (the torch engine's default)
BLOCK_SIZE = DEFAULT_BLOCK_SIZE
#: sequences at once and KV tokens of a synthetic engine (SyntheticEngine's defaults, and its floor
#: and fallback under the worker's --max-num-seqs and --kv-tokens): no model memory to bound them
MAX_NUM_SEQS = 4096
KV_TOKENS = 1 << 20
#: text bytes per id of the text mode (--bytes-per-token): the default, and the range taken
DEFAULT_BYTES_PER_TOKEN = 4
MAX_BYTES_PER_TOKEN = 8

_WORDS = (
    "alpha", "beta", "gamma", "delta", "kernel", "token", "cache", "batch", "stream", "decode",
    "prefill", "worker", "router", "tensor", "layer", "head", "rotary", "norm", "splice", "span",
)  # fmt: skip


class SyntheticTokenizer:
    """Any text is the same ``prompt_tokens`` ids; id ``i`` decodes to a word.

    ``encode`` returns the precomputed int32 array itself (a sequence of ints):
    the worker turns it into its prompt without a copy, so a synthetic
    worker spends no time per prompt token on tokenization.
    """

    vocab_size = SYNTHETIC_VOCAB
    eos_token_ids: ClassVar[list[int]] = [SYNTHETIC_EOS]
    bos_token_id = None

    def __init__(
        self, prompt_tokens: int, seed: int = 0, bytes_per_token: int = DEFAULT_BYTES_PER_TOKEN
    ) -> None:
        if prompt_tokens < 0:
            raise ValueError("--prompt-tokens must be at least 1 (or 0: the text's own ids)")
        if not (type(bytes_per_token) is int and 1 <= bytes_per_token <= MAX_BYTES_PER_TOKEN):
            raise ValueError(
                f"--bytes-per-token must be an integer from 1 to {MAX_BYTES_PER_TOKEN}, "
                f"got {bytes_per_token!r}"
            )
        #: --prompt-tokens 0: ids from the text (``bytes_per_token`` bytes each) instead of one fixed prompt
        self.from_text = prompt_tokens == 0
        self.bytes_per_token = bytes_per_token
        #: the little-endian value of each id's bytes (uint64 arithmetic wraps: still deterministic)
        self._weights = (np.uint64(256) ** np.arange(bytes_per_token, dtype=np.uint64)).astype(np.uint64)
        rng = np.random.default_rng(seed)
        self.prompt_ids = rng.integers(0, SYNTHETIC_EOS, size=prompt_tokens, dtype=np.int32)
        self.prompt_ids.setflags(write=False)

    def encode(self, text: str, add_special_tokens: bool = True) -> Any:
        if not self.from_text:
            return self.prompt_ids
        raw = text.encode("utf-8", "surrogatepass")
        width = self.bytes_per_token
        raw += b"\0" * (-len(raw) % width)
        if width in (1, 2, 4, 8):  # one id per little-endian unsigned integer of the text
            values = np.frombuffer(raw, dtype=f"<u{width}")
        else:
            values = np.frombuffer(raw, dtype=np.uint8).reshape(-1, width).astype(np.uint64) @ self._weights
        ids = (values.astype(np.uint64) % np.uint64(SYNTHETIC_EOS)).astype(np.int32)
        return ids if ids.size else np.zeros(1, dtype=np.int32)

    #: --script: the answers' ids decode to their text (synthetic_script.py)
    script: Script | None = None

    def decode(self, ids: Sequence[int]) -> str:
        script = self.script
        if script is not None:
            return "".join(
                piece if (piece := script.piece(int(i))) is not None else " " + _WORDS[int(i) % len(_WORDS)]
                for i in ids
            )
        return "".join(" " + _WORDS[int(i) % len(_WORDS)] for i in ids)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        if not self.from_text:
            return ""  # encode() ignores the text: every prompt is the configured ids
        # tools and calls are text of the prompt too (an agent's prompt is mostly its tools)
        parts = [f"<|tools|>\n{json.dumps(tools)}\n"] if tools else []
        parts += [f"<|{m.get('role', '')}|>\n{_text(m.get('content'))}{_calls(m)}\n" for m in messages]
        if add_generation_prompt:
            parts.append("<|assistant|>\n")
        return "".join(parts)


def _calls(message: dict[str, Any]) -> str:
    calls = message.get("tool_calls")
    return json.dumps(calls) if calls else ""


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def synthetic_token(prompt_len: int, position: int) -> int:
    """The id generated at ``position`` (0 = first) after a prompt of ``prompt_len`` ids.

    Never EOS, so a request runs to ``max_tokens`` unless a stop rule ends it.
    """
    return (prompt_len * 31 + position * 7919 + 1) % SYNTHETIC_EOS


class PrefixCacheModel:
    """The torch engine's prefix cache without the KV: which full blocks of ``BLOCK_SIZE`` ids are
    held, keyed by the same chained hash (:func:`chain_block_hashes`), least recently used first
    out beyond ``capacity_tokens``. The synthetic engine keeps one per worker; ``bench.trace``
    replays a whole trace through one of the fleet's total size (its pooled oracle).

    ``tier2_tokens``: a second tier (host memory, as SGLang's HiCache, vLLM's offloading): full
    blocks evicted from the device go there instead of vanishing, least recently used first out
    beyond it; a prefix hit there is loaded back (``tier2_hit``: its ids, which cost
    ``ids / load_tokens_per_s`` instead of a prefill). A tier slower than recomputing
    (``load_tokens_per_s`` below ``prefill_tokens_per_s``) is kept but never taken (SGLang's trap:
    loading would cost more than the prefill it saves)."""

    def __init__(
        self,
        capacity_tokens: int,
        enabled: bool = True,
        tier2_tokens: int = 0,
        load_tokens_per_s: float = 0.0,
        prefill_tokens_per_s: float = 0.0,
    ) -> None:
        self.enabled = enabled
        self.capacity_tokens = capacity_tokens
        #: chained block hash -> None, least recently used first
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        self._max_blocks = max(1, capacity_tokens // BLOCK_SIZE)
        self.evicted_blocks = 0
        self.tier2_tokens = tier2_tokens
        self._tier2: OrderedDict[bytes, None] = OrderedDict()
        self._max_tier2 = tier2_tokens // BLOCK_SIZE
        #: ids a second a tier-2 hit loads (0: instantly), and the prefill's rate it is compared to
        self.load_tokens_per_s = load_tokens_per_s
        self.prefill_tokens_per_s = prefill_tokens_per_s
        #: tier-2 hits are loaded: there is a tier and loading beats recomputing
        self.tier2_taken = self._max_tier2 > 0 and not (
            load_tokens_per_s and prefill_tokens_per_s and load_tokens_per_s <= prefill_tokens_per_s
        )
        #: the ids of the last lookup served from tier 2
        self.tier2_hit = 0
        #: trtllm-serve's KV cache events (server/worker/kv_events.py), once someone polls them
        self.events: KvEventLog | None = None
        #: the orchestrators' key space (GET /cache_events), once one follows it
        self.chunks: ChunkEventLog | None = None

    block_size = BLOCK_SIZE

    @property
    def num_blocks(self) -> int:
        return self._max_blocks

    @property
    def cached_tokens(self) -> int:
        return len(self._blocks) * BLOCK_SIZE

    @property
    def tier2_cached_tokens(self) -> int:
        return len(self._tier2) * BLOCK_SIZE

    def load_seconds(self, ids: int) -> float:
        """The time to load ``ids`` from tier 2."""
        return ids / self.load_tokens_per_s if self.load_tokens_per_s else 0.0

    def lookup(self, ids: np.ndarray, root: bytes = b"") -> tuple[int, list[bytes]]:
        """Ids of ``ids`` the cache serves (never the last one: its logits are computed), device and
        tier 2 together (``tier2_hit``: those of tier 2), and every full block's hash (chained from
        ``root``: the request's cache_salt, as the torch engine's cache does). The device blocks
        that hit become the most recently used; tier 2's are loaded back by :meth:`remember`."""
        hashes = [h for h, _ in chain_block_hashes(ids, BLOCK_SIZE, int(ids.size) // BLOCK_SIZE, 0, root)]
        hit = tier2_hit = 0
        if self.enabled:
            blocks, tier2, taken = self._blocks, self._tier2, self.tier2_taken
            for digest in hashes[: (int(ids.size) - 1) // BLOCK_SIZE]:
                if digest in blocks:
                    blocks.move_to_end(digest)
                elif taken and digest in tier2:
                    tier2_hit += 1
                else:
                    break
                hit += 1
        self.tier2_hit = tier2_hit * BLOCK_SIZE
        return hit * BLOCK_SIZE, hashes

    def remember(self, hashes: list[bytes]) -> None:
        """The blocks a prefill computed, a tier-2 hit loaded (or a KV import brought): held now,
        most recently used; the device's least recently used go to tier 2, tier 2's out."""
        if not self.enabled:
            return
        blocks, tier2 = self._blocks, self._tier2
        events = self.events
        new = [i for i, d in enumerate(hashes) if d not in blocks] if events is not None else []
        loaded = [d for d in hashes if d in tier2] if tier2 else []
        for digest in loaded:
            del tier2[digest]
        for digest in hashes:
            blocks[digest] = None
            blocks.move_to_end(digest)
        gone, spilled = [], []
        while len(blocks) > self._max_blocks:
            digest = blocks.popitem(last=False)[0]
            self.evicted_blocks += 1
            if self._max_tier2:
                tier2[digest] = None
                spilled.append(digest)
            else:
                gone.append(digest)
        dropped = []
        while len(tier2) > self._max_tier2:
            dropped.append(tier2.popitem(last=False)[0])
        if events is not None:  # trtllm-serve's events say the device's blocks (cache level 0)
            if new:
                events.stored(hashes[new[0] - 1] if new[0] else b"", [hashes[i] for i in new])
            events.removed(gone + spilled)
        chunks = self.chunks
        if chunks is not None:
            if loaded:
                chunks.moved(loaded, 1)
            if spilled:
                chunks.moved(spilled, 2)
            if gone:
                chunks.evicted(gone)
            if dropped:
                chunks.evicted(dropped, 2)


class _PrefillJob:
    __slots__ = ("computed", "cost", "done", "timer")

    def __init__(
        self, cost: Callable[[], int], computed: Callable[[], None] | None, done: asyncio.Future[None]
    ) -> None:
        self.cost = cost
        self.computed = computed
        self.done = done
        self.timer: asyncio.TimerHandle | None = None

    def finish(self) -> None:
        if self.computed is not None:
            self.computed()
        if not self.done.done():
            self.done.set_result(None)


class PrefillQueue:
    """A worker's prefill compute, shared: ``tokens_per_s`` ids a second, first come first served.

    This is chunked prefill with a per-step token budget (vLLM's, trtllm's) in the limit of short
    steps: each step's budget goes to the oldest request still prefilling, so a request's first
    token waits for the uncached ids of every request ahead of it. A request's cost is asked for
    when its turn comes (``cost()``), as an engine looks its prefix up when it schedules it, and
    ``computed()`` is called the moment its ids are (the blocks are cached then): so a prefix that
    an earlier request in the queue computes is a hit by the time it counts. A request cancelled
    while waiting leaves the queue; one cancelled during its turn has spent the time it ran.
    """

    def __init__(self, tokens_per_s: float) -> None:
        if not tokens_per_s > 0:
            raise ValueError(f"--prefill-tokens-per-s must be > 0, got {tokens_per_s}")
        self.tokens_per_s = tokens_per_s
        self._jobs: deque[_PrefillJob] = deque()
        #: seconds spent prefilling (busy), for utilisation
        self.busy_s = 0.0

    @property
    def waiting(self) -> int:
        """Requests queued behind the one prefilling now."""
        return max(0, len(self._jobs) - 1)

    async def run(self, cost: Callable[[], int], computed: Callable[[], None] | None = None) -> None:
        """Wait for this request's turn, then for its ``cost()`` ids to be computed."""
        job = _PrefillJob(cost, computed, asyncio.get_running_loop().create_future())
        self._jobs.append(job)
        if len(self._jobs) == 1:
            self._start_head()
        try:
            await job.done
        except asyncio.CancelledError:
            self._leave(job)
            raise

    def _start_head(self) -> None:
        while self._jobs:
            job = self._jobs[0]
            seconds = max(0, job.cost()) / self.tokens_per_s
            if seconds > 0:
                self.busy_s += seconds
                job.timer = asyncio.get_running_loop().call_later(seconds, self._finish_head)
                return
            self._jobs.popleft()  # all cached: nothing to compute, no turn taken
            job.finish()

    def _finish_head(self) -> None:
        self._jobs.popleft().finish()
        self._start_head()

    def _leave(self, job: _PrefillJob) -> None:
        if self._jobs and self._jobs[0] is job:
            if job.timer is not None:  # the rest of its turn is given to the next
                self.busy_s -= max(0.0, job.timer.when() - asyncio.get_running_loop().time())
                job.timer.cancel()
            self._jobs.popleft()
            self._start_head()
        else:
            try:
                self._jobs.remove(job)
            except ValueError:
                pass


class SyntheticEngine:
    """An :class:`~server.worker.engine_api.Engine` whose steps are timers on the event loop."""

    def __init__(
        self,
        prompt_tokens: int,
        *,
        prefill_latency_s: float = 0.0,
        token_latency_s: float = 0.0,
        max_num_seqs: int = MAX_NUM_SEQS,
        seed: int = 0,
        prefill_s_per_token: float = 0.0,
        kv_tokens: int = KV_TOKENS,
        prefix_caching: bool = True,
        bytes_per_token: int = DEFAULT_BYTES_PER_TOKEN,
        prefill_tokens_per_s: float = 0.0,
        script: Script | None = None,
        kv_tier2_tokens: int = 0,
        tier2_load_tokens_per_s: float = 0.0,
    ) -> None:
        self.tokenizer = SyntheticTokenizer(prompt_tokens, seed, bytes_per_token)
        #: --script: the texts the requests generate, in turn, instead of the position's words
        self.script = self.tokenizer.script = script
        self.vocab_size = SYNTHETIC_VOCAB
        self.max_context = (TEXT_MAX_CONTEXT if prompt_tokens == 0 else prompt_tokens) + GENERATION_ROOM
        self.prefill_latency_s = prefill_latency_s
        self.prefill_s_per_token = prefill_s_per_token
        self.prefix_caching = prefix_caching
        #: the modelled prefix cache (text mode)
        if kv_tier2_tokens < 0 or tier2_load_tokens_per_s < 0:
            raise ValueError("--kv-tier2-tokens and --tier2-load-tokens-per-s must be >= 0")
        self.cache = PrefixCacheModel(
            kv_tokens, prefix_caching, kv_tier2_tokens, tier2_load_tokens_per_s, prefill_tokens_per_s
        )
        #: the shared prefill compute (--prefill-tokens-per-s), or None: every prefill its own timer
        self.prefill_queue = PrefillQueue(prefill_tokens_per_s) if prefill_tokens_per_s else None
        self.prefix_hit_tokens = 0
        #: of them, the ids loaded from tier 2
        self.tier2_hit_tokens = 0
        self.prefill_computed_tokens = 0
        self.token_latency_s = token_latency_s
        self.max_num_seqs = max_num_seqs
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._reserved: set[str] = set()
        self._parked: dict[int, ParkedKV] = {}
        self._started_at = time.monotonic()
        self.generated_tokens_total = 0

    # -- lifecycle ---------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def stop(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        self._tasks.clear()

    @property
    def alive(self) -> bool:
        return self._loop is not None and not self._loop.is_closed()

    # -- statistics for /metrics ----------------------------------------------
    @property
    def queue_depth(self) -> int:
        return 0 if self.prefill_queue is None else self.prefill_queue.waiting

    @property
    def bytes_per_token(self) -> int | None:
        """Text bytes per prompt id (/server_info), in the text mode; None when every prompt is fixed ids."""
        return self.tokenizer.bytes_per_token if self.tokenizer.from_text else None

    @property
    def kv_tiers_info(self) -> dict[str, Any]:
        """/server_info's tier figures (docs/protocol.md): tier 2's size and load rate beside the
        prefill rate, so that a router weighs a tier-2 hit (nothing without a tier)."""
        cache = self.cache
        if not cache.tier2_tokens:
            return {}
        info: dict[str, Any] = {wire.INFO_KV_TIER2_CAPACITY_TOKENS: cache.tier2_tokens}
        if cache.load_tokens_per_s:
            info[wire.INFO_KV_TIER2_LOAD_TOKENS_PER_S] = cache.load_tokens_per_s
        if cache.prefill_tokens_per_s:
            info[wire.INFO_PREFILL_TOKENS_PER_S] = cache.prefill_tokens_per_s
        return info

    @property
    def prefix_evicted_blocks(self) -> int:
        return self.cache.evicted_blocks

    @property
    def running(self) -> int:
        return len(self._tasks)

    @property
    def kv_used_tokens(self) -> int:
        return 0

    @property
    def kv_capacity_tokens(self) -> int:
        # The text mode's modelled cache is its KV: what a cache-aware router should size its view by.
        if self.tokenizer.from_text:
            return self.cache.capacity_tokens
        return self.max_context * self.max_num_seqs

    @property
    def parked_count(self) -> int:
        return len(self._parked)

    @property
    def parked_tokens(self) -> int:
        return 0  # a parked entry holds no cache here (kv_used_tokens is 0 too)

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens_total / max(1e-9, time.monotonic() - self._started_at)

    @property
    def kv_layout(self) -> Any:
        import torch

        from .kv_transfer import KVLayout

        return KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float16)

    # -- requests ----------------------------------------------------------
    def reserve(self, req: EngineRequest) -> None:
        from .engine_api import KVCacheFull

        if len(self._reserved) >= self.max_num_seqs:
            raise KVCacheFull(f"{self.max_num_seqs} sequences are running")
        self._reserved.add(req.request_id)

    def unreserve(self, req: EngineRequest) -> None:
        self._reserved.discard(req.request_id)

    def enqueue(self, req: EngineRequest) -> None:
        assert self._loop is not None, "engine not started"
        task = self._loop.create_task(self._run(req))
        self._tasks[req.request_id] = task
        task.add_done_callback(functools.partial(self._finished, req.request_id))

    def abort(self, request_id: str) -> None:
        task = self._tasks.get(request_id)
        if task is not None:
            task.cancel()

    def _finished(self, request_id: str, _task: asyncio.Task[None]) -> None:
        self._tasks.pop(request_id, None)
        self._reserved.discard(request_id)

    @property
    def prefix_cached_tokens(self) -> int:
        return self.cache.cached_tokens

    def _prefix(self, ids: np.ndarray, root: bytes = b"") -> tuple[int, list[bytes]]:
        return self.cache.lookup(ids, root)

    def _remember(self, hashes: list[bytes], req: EngineRequest | None = None) -> None:
        self.cache.remember(hashes)
        if self.cache.chunks is not None and req is not None:
            self.cache.chunks.stored(req.request_id, hashes, int(req.prompt_ids.size))

    async def _prefill(self, req: EngineRequest) -> None:
        """The prompt's prefill: counted, timed, queued for the shared compute when there is one;
        its full blocks are held once computed (text mode)."""
        prompt_len = int(req.prompt_ids.size)
        modelled = self.tokenizer.from_text
        hashes: list[bytes] = []

        def uncached() -> int:  # looked up when the prefill is scheduled
            nonlocal hashes
            hit = 0
            if modelled:
                hit, hashes = self._prefix(req.prompt_ids, req.cache_root)
                req.tier2_prefix = self.cache.tier2_hit
                self.tier2_hit_tokens += req.tier2_prefix
            req.cached_prefix = hit
            self.prefix_hit_tokens += hit
            self.prefill_computed_tokens += prompt_len - hit
            return prompt_len - hit

        def computed() -> None:
            if modelled:
                self._remember(hashes, req)

        queue = self.prefill_queue
        if queue is None:
            to_compute = uncached()
            delay = self.prefill_latency_s + (to_compute * self.prefill_s_per_token if modelled else 0.0)
            delay += self.cache.load_seconds(req.tier2_prefix)  # a tier-2 hit is loaded, not computed
            if delay:
                await asyncio.sleep(delay)
            computed()
            return
        if self.prefill_latency_s:  # fixed overhead, in parallel with others'
            await asyncio.sleep(self.prefill_latency_s)
        if modelled and (self.prefill_s_per_token or self.cache.load_tokens_per_s):
            # the load from tier 2 is a copy of its own (not the prefill's compute), then the
            # --prefill-ms-per-1k-tokens' time, if any
            await queue.run(uncached)
            delay = (prompt_len - req.cached_prefix) * self.prefill_s_per_token
            await asyncio.sleep(delay + self.cache.load_seconds(req.tier2_prefix))
            computed()
        else:
            await queue.run(uncached, computed)

    async def _run(self, req: EngineRequest) -> None:
        prompt_len = int(req.prompt_ids.size)
        forced = list(req.forced_tokens)
        imported = req.kv_import is not None and bool(forced)
        modelled = self.tokenizer.from_text
        if imported:  # the context worker computed it: no prefill here, but this worker holds it now
            if modelled:
                req.cached_prefix, hashes = self._prefix(req.prompt_ids, req.cache_root)
                self._remember(hashes, req)
        else:
            await self._prefill(req)
        position = 0
        script = self.script
        answer = script.answer_of(forced) if script is not None else 0
        while True:
            if position < len(forced):
                token = forced[position]
            elif script is not None:
                token = script.token(answer, position)
            else:
                token = synthetic_token(prompt_len, position)
            if position >= len(forced) and position > 0 and self.token_latency_s:
                await asyncio.sleep(self.token_latency_s)
            delta = req.processor.add(token, None)
            self.generated_tokens_total += 1
            position += 1
            if req.processor.finished:
                req.on_delta(delta)
                return
            if req.park_as is not None:
                req.on_delta(delta)
                req.on_delta(req.processor.finish_early(NOT_FINISHED))
                self._park(req, token)
                return
            req.on_delta(delta)
            if position >= len(forced) and not self.token_latency_s and position % 64 == 0:
                await asyncio.sleep(0)  # let other requests in on a long instant stream

    # -- KV hand-off (width-1 tensors, real format and checks) ------------------
    def _park(self, req: EngineRequest, first_token: int) -> None:
        assert req.park_as is not None
        self._parked[req.park_as] = ParkedKV(
            ctx_request_id=req.park_as,
            blocks=[],
            num_tokens=int(req.prompt_ids.size),
            prompt_crc32=prompt_checksum(req.prompt_ids),
            first_token=first_token,
            first_logprob=None,
            expires_at=time.monotonic() + req.park_ttl_s,
            parked_at=time.monotonic(),
        )

    def take_parked(self, ctx_request_id: int) -> ParkedKV | None:
        return self._parked.pop(ctx_request_id, None)

    def discard_parked(self, ctx_request_id: int) -> bool:
        # Everything runs on the loop: an aborted leg's task never parks, one that has is here.
        return self.take_parked(ctx_request_id) is not None

    def evict_parked(self, tokens: int, parked_before: float | None = None) -> int:
        return 0  # no parked entry holds cache: evicting one would free none

    def read_parked(self, parked: ParkedKV) -> tuple[Any, Any]:
        import torch

        shape = (1, parked.num_tokens, 1, 1)
        return torch.zeros(shape, dtype=torch.float16), torch.zeros(shape, dtype=torch.float16)

    def expire_parked(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        expired = [k for k, p in self._parked.items() if p.expires_at <= now]
        for k in expired:
            del self._parked[k]
        return len(expired)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("synthetic model (--model synthetic)")
    group.add_argument(
        "--prompt-tokens", type=int, default=4096, help="every prompt is this many token ids (default 4096)"
    )
    group.add_argument("--prefill-latency-ms", type=float, default=0.0, help="time to the first token")
    group.add_argument("--token-latency-ms", type=float, default=0.0, help="time per further token")
    group.add_argument(
        "--prefill-ms-per-1k-tokens",
        type=float,
        default=0.0,
        help="--prompt-tokens 0: prefill time per 1,000 prompt ids not served from the "
        "modelled prefix cache, each request on its own timer (default 0)",
    )
    group.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=0.0,
        help="the worker's prefill compute: prompt ids not served from the cache are computed "
        "at this rate, shared first come first served, so prefills queue (default 0: "
        "no shared compute)",
    )
    group.add_argument(
        "--kv-tier2-tokens",
        type=int,
        default=0,
        help="a second KV tier of this many tokens (host memory; the torch engine's: files too, "
        "--kv-tier2-path; synthetic: --prompt-tokens 0): full blocks evicted from the device "
        "cache go there, least recently used out, and a hit there is loaded back instead of "
        "prefilled when loading is faster (default 0: none)",
    )
    group.add_argument(
        "--tier2-load-tokens-per-s",
        type=float,
        default=0.0,
        help="the rate a tier-2 hit loads at (default 0: instantly); at or below "
        "--prefill-tokens-per-s the tier is not taken (recomputing is faster)",
    )
    group.add_argument(
        "--script",
        default=None,
        metavar="FILE",
        help="the text the requests generate, in turn: the file's text, or a .json file's list "
        "of answer strings (tests of tool-call parsing and stream assembly)",
    )
    group.add_argument(
        "--bytes-per-token",
        type=int,
        default=DEFAULT_BYTES_PER_TOKEN,
        help=f"--prompt-tokens 0: text bytes per prompt id, 1 to {MAX_BYTES_PER_TOKEN} "
        f"(/server_info's bytes_per_token; default {DEFAULT_BYTES_PER_TOKEN})",
    )


def build_engine(args: argparse.Namespace) -> SyntheticEngine:
    return SyntheticEngine(
        args.prompt_tokens,
        prefill_latency_s=args.prefill_latency_ms / 1000.0,
        token_latency_s=args.token_latency_ms / 1000.0,
        max_num_seqs=max(args.max_num_seqs, MAX_NUM_SEQS),
        prefill_s_per_token=args.prefill_ms_per_1k_tokens / 1e6,
        kv_tokens=args.kv_tokens or KV_TOKENS,
        prefix_caching=args.prefix_caching,
        bytes_per_token=args.bytes_per_token,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        kv_tier2_tokens=args.kv_tier2_tokens,
        tier2_load_tokens_per_s=args.tier2_load_tokens_per_s,
        script=None
        if args.script is None
        else Script.load(args.script, eos=SYNTHETIC_EOS, vocab=SYNTHETIC_VOCAB),
    )
