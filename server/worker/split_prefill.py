"""A prefill chunk deep in a long prompt, run a piece a step beside the running streams' decodes.

The pacer (:mod:`.prefill_pacer`) keeps a step that carries a chunk within ``ratio`` times a
decode-only step by giving the chunk fewer tokens. Deep in a long prompt even its floor, one block,
costs far more than that: each token attends over every position before it. At a 16,384-token
context on a CPU (tiny model, one thread) a 16-token chunk 15k deep cost ~4 ms against a 0.7 ms
decode step, ~1.5 ms a layer of it SDPA's own kernel (16 queries x 15k keys), so the streams' p99
during the prefill was 2.6-10x their p99 alone. Fewer tokens do not help: one token still reads
every earlier position's K/V (~0.4 ms a layer at 15k) and a step's fixed cost stays, so the prompt
takes several times longer for the same stall (measured: 172431e).

What bounds a step instead is splitting the chunk's work itself: :class:`SplitChunk` runs the
chunk's forward layer by layer, and each layer's attention over the keys a piece at a time (each
piece's output and log-sum-exp merged into the running ones, as flash attention merges its key
blocks), pausing wherever the step's allowance runs out and going on at the next step with its
hidden state, queries and partial sums kept. A step then costs a decode step plus at most the
allowance, however deep the chunk; the chunk's K/V reach the pool layer by layer (its own slots,
which no other sequence reads) and it counts as prefilled only when its last layer is done.

The allowance is the pacer's, in its units (:meth:`.PrefillPacer.work`: a token's projections and
MLP are one, a token attending ``context_tokens`` positions another): a piece of ``k`` keys of one
of ``L`` layers for ``T`` tokens is ``T * k / (context_tokens * L)`` units, a layer's projections
``T / L``. Its seconds a unit are measured from the pieces' own time (:meth:`.PrefillPacer.piece_step`).

:class:`SplitPrefill` decides, a step at a time, whether the engine's plan goes this way: only
while streams decode, the plan's last chunk is cut (or the plan is that chunk alone) and not
even a block of it fits the allowance whole; the plan's other prompts (short ones that arrived
behind it: :func:`.prefill_pacer.shared_chunks`) run whole in a forward of their own beside the
pieces, so their first tokens do not wait for the chunk's last piece. Numbers: the same attention to float32 rounding (pieces merged in
float32; the tests hold logits within 1e-4 of the unsplit chunk's, the issue's bar against
transformers, and greedy text identical).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, cast

import torch

from . import cpu_kernels
from .model import LlamaDecoderLayer, LlamaForCausalLM, apply_rotary_tables

if TYPE_CHECKING:
    from .kv_cache import PrefillAttention

#: the fewest keys a piece attends (smaller pieces cost more in calls than they save in time)
MIN_PIECE_KEYS = 256

_flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def piece_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` ``[1, kv_heads, rows, D]`` over ``k``/``v`` ``[1, kv_heads, keys, D]`` (``mask``: an
    additive float ``[rows, keys]`` or None): the attention's output and each row's log-sum-exp
    of its scores (``[1, kv_heads, rows]``). SDPA's CPU flash kernel where it runs (it returns
    both), else the same in plain float32 matmuls."""
    if _flash is not None and q.device.type == "cpu":
        out, lse = _flash(q, k, v, attn_mask=mask)
        return out, lse
    q, k, v = q.float(), k.float(), v.float()  # in float32 whatever the model's dtype, as SDPA
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(q.shape[-1] ** -0.5)
    if mask is not None:
        scores.add_(mask)
    lse = torch.logsumexp(scores, -1)
    return torch.matmul(scores.sub_(lse.unsqueeze(-1)).exp_(), v), lse


def merge(
    out: torch.Tensor | None, lse: torch.Tensor | None, more: torch.Tensor, more_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two attentions of the same rows over disjoint keys (``out``/``lse`` so far, None at first;
    ``more``/``more_lse`` the next) as one over both."""
    if out is None or lse is None:
        return more, more_lse
    both = torch.logaddexp(lse, more_lse)
    return out * (lse - both).exp_().unsqueeze(-1) + more * (more_lse - both).exp_().unsqueeze(-1), both


class SplitChunk:
    """One chunk's forward (``LlamaModel.forward`` over its ``ids`` at ``positions``, then the
    ``rows``' logits), paused between pieces: :meth:`advance` runs it within a step's units."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        state: Any,
        take: int,
        ids: torch.Tensor,
        positions: torch.Tensor,
        part: PrefillAttention,
        rows: torch.Tensor,
        context_tokens: int,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.model = model
        #: the engine's prefill state and tokens this chunk is (its plan: [(state, take)])
        self.state, self.take = state, take
        self.start = part.start
        self.part = part
        self.rows = rows
        layers = len(model.model.layers)
        self.per_key = take / (context_tokens * layers)  # units a key of one layer costs
        self.per_layer = take / layers  # units of a layer's projections and MLP
        self.clock = clock
        #: seconds a unit of the pieces took (the last piece's): what a layer's projections and MLP
        #: are charged by their time, not their arithmetic (tens of small ops, ~0.3-0.5 ms on a
        #: loaded CPU at 16 tokens, most of a step's allowance; charged at their 1 unit a token,
        #: the step that ran them ran past its time)
        self.unit_s: float | None = None
        self.left = 0.0  # units this step may still take
        self.spent = 0.0  # units this step took
        self.seconds = 0.0  # the pieces' time so far (the cache's prefill rate)
        self._own: torch.Tensor | None = None  # the causal mask of the chunk's own keys
        self._run = self._forward(ids, positions)

    def current(self, prefilling: list[Any]) -> bool:
        """Whether the chunk is still the oldest prompt's next (not cancelled, failed or done)."""
        state = self.state
        return bool(prefilling) and prefilling[0] is state and state.req.cached_len == self.start

    def advance(self, units: float) -> torch.Tensor | None:
        """Runs the chunk on for about ``units`` (at least one piece); its logits once done."""
        self.left, self.spent = units, 0.0
        try:
            next(self._run)
        except StopIteration as done:
            logits: torch.Tensor = done.value
            return logits
        return None

    def _keys(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This chunk's K/V written to the pool; K and V of every position up to its end
        (``[start + T, kv_heads, D]``), as :class:`.PrefillAttention` reads them."""
        part = self.part
        pool = part.cache.k[layer], part.cache.v[layer]
        pool[0].index_copy_(0, part.new_slots, k)
        pool[1].index_copy_(0, part.new_slots, v)
        if part.dense is not None:
            return part.dense.extend(layer, part.start, k, v, pool, part.all_slots)
        if part.all_slots is None:
            return k, v
        keys, values = (t.index_select(0, part.all_slots) for t in pool)
        return keys, values

    def _attend(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> Generator[None, None, Any]:
        """``q`` ``[T, heads, D]`` over ``keys``/``values`` a piece at a time: ``[T, heads * D]``.

        The earlier positions in pieces of what the step has left (no mask: every query sees
        them all), then the chunk's own positions as one more (causal: a mask made once)."""
        t, heads, d = q.shape
        kv_heads = keys.shape[1]
        group = heads // kv_heads  # head h reads kv head h // group (SDPA's enable_gqa)
        qg = q.view(t, kv_heads, group, d).permute(1, 2, 0, 3).reshape(1, kv_heads, group * t, d)
        kh, vh = keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)
        total, start = keys.shape[0], self.start
        if self._own is None:  # rows (group, token) over the chunk's keys: token i sees 0..i
            own = torch.full((t, t), float("-inf"), device=q.device, dtype=q.dtype).triu_(1)
            self._own = own.repeat(group, 1)
        out = lse = None
        a = 0
        while a < total:
            if self._spent():
                yield
            if a < start:
                b = min(start, a + max(MIN_PIECE_KEYS, int((self.left - self.spent) / self.per_key)))
                b = start if start - b < MIN_PIECE_KEYS else b  # no sliver left for a step of its own
                mask = None
            else:
                b, mask = total, self._own
            began = self.clock()
            out, lse = merge(out, lse, *piece_attention(qg, kh[:, :, a:b], vh[:, :, a:b], mask))
            units = (b - a) * self.per_key
            self.spent += units
            if mask is None:
                self.unit_s = (self.clock() - began) / units
            a = b
        assert out is not None
        if self._spent():
            yield  # the layer's output and the next one's projections: the next step's
        # merged in float32 (each slice's log-sum-exp is), back to the model's dtype
        return out.view(kv_heads, group, t, d).permute(2, 0, 1, 3).reshape(t, heads * d).to(q.dtype)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor) -> Generator[None, None, torch.Tensor]:
        """``LlamaModel.forward`` and ``forward_step``'s logits, a layer's attention in pieces; its
        norms, residual adds, rotation and SiLU through :mod:`.cpu_kernels`' C where the model's
        forward runs them (a piece's projections are part of a step's floor)."""
        m = self.model.model
        x = m.embed_tokens(ids)
        kernels = m._kernels_apply(x)
        cos, sin = m.rotary_emb.tables(positions, x.dtype)
        for layer in cast("list[LlamaDecoderLayer]", m.layers):
            began = self.clock()
            attn = layer.self_attn
            n, d = x.shape[0], attn.head_dim
            if kernels:
                norm = layer.input_layernorm
                qkv = attn.qkv(cpu_kernels.rms_norm(x, norm.weight, norm.eps)).view(n, -1, d)
                cpu_kernels.rope_(qkv, attn.rotated_heads, cos, sin)
                q, k, v = qkv.split_with_sizes(attn.head_split, 1)
            else:
                qk, v = attn.qkv(layer.input_layernorm(x)).view(n, -1, d).split_with_sizes(attn._qk_v, 1)
                q, k = apply_rotary_tables(qk, cos, sin).split_with_sizes(attn._q_k, 1)
            keys, values = self._keys(layer.index, k, v)
            self._charge(began)
            out = yield from self._attend(q, keys, values)
            began = self.clock()
            if kernels:  # x (the embedding's or this loop's own sum) is the residual, added in place
                x.add_(layer.kernels_out(out, x))
            else:
                x = x + attn.o_proj(out)
                x = x + layer.mlp(layer.post_attention_layernorm(x))
            self._charge(began)
        final = cpu_kernels.rms_norm(x, m.norm.weight, m.norm.eps) if kernels else m.norm(x)
        return self.model.logits(final.index_select(0, self.rows))

    def _spent(self) -> bool:
        """Whether the step's allowance is spent: less than half the smallest piece left (a piece
        sized to what is left rounds its keys down, and would leave a sliver for another)."""
        return self.left - self.spent < MIN_PIECE_KEYS * self.per_key / 2

    def _charge(self, began: float) -> None:
        """Half a layer's projections and MLP done since ``began``: their units, or their time in
        units where that is more."""
        least = self.per_layer / 2
        took = (self.clock() - began) / self.unit_s if self.unit_s else 0.0
        self.spent += max(least, took)


class SplitPrefill:
    """The engine's one :class:`SplitChunk` at a time, and whether a step runs one."""

    def __init__(self) -> None:
        self.job: SplitChunk | None = None
        #: the last job's seconds a unit, the next one's until its first piece measures its own
        self.unit_s: float | None = None

    def step(self, engine: Any, batch: list[Any], plan: list[Any], outputs: list[Any]) -> bool:
        """Runs this step if its plan goes by pieces (the streams' decode step, then the chunk on
        for the pacer's allowance): True; else leaves it to the engine (False). Called at every
        step, so a job whose prompt was cancelled or failed since is dropped at once."""
        pacer = engine.pacer
        job = self.job
        if job is not None and not job.current(engine._prefilling):
            job = self.job = None  # cancelled or failed since: its blocks may be gone
        if not batch or not plan:
            return False
        if job is None:
            if not pacer.ratio or pacer.decode_s is None:
                return False
            state, take = plan[-1]  # a cut prompt is a plan's last; before it, whole later prompts
            if len(plan) > 1 and take == state.total - state.req.cached_len:
                return False  # nothing cut: whole prompts, as any step's
            if pacer.tokens_for(state.req.cached_len, pacer.allowance) >= take:
                return False  # the chunk fits whole
            ids, positions, attention, rows = engine._prefill_inputs(plan[-1:])
            job = self.job = SplitChunk(
                engine.model,
                state,
                take,
                ids,
                positions,
                attention.prefills[0],
                rows.to(engine.device),
                pacer.context_tokens,
                pacer.clock,
            )
            job.unit_s = self.unit_s
        began = pacer.clock()
        engine._decode_step(batch, outputs)
        decoded = pacer.clock()
        pacer.decode_step(decoded - began)  # the streams' step alone, as their contexts grow
        beside = [part for part in plan if part[0] is not job.state]
        if beside:  # short prompts that arrived behind the chunk: their own forward, not after it
            engine._run_chunks(beside, outputs)
            decoded = pacer.clock()
        try:
            logits = job.advance(pacer.allowance)
        except Exception as exc:
            self.job = None
            engine._prefilling.remove(job.state)
            engine._prefill_failed(job.state.req, exc, outputs)
            return True
        took = pacer.clock() - decoded
        job.seconds += took
        self.unit_s = job.unit_s
        pacer.piece_step(took, job.spent)
        if logits is not None:
            self.job = None
            done = [(job.state, job.take)]
            engine._prefill_done(done, logits, outputs)
            engine.cache.prefill_timed(done, job.seconds)
        return True


__all__ = ["MIN_PIECE_KEYS", "SplitChunk", "SplitPrefill", "merge", "piece_attention"]
