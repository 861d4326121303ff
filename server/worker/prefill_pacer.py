"""How many prompt tokens the next engine step may prefill beside the running streams' decodes.

A token budget alone (``--prefill-chunk-tokens``) does not bound a step's time: a chunk's attention
grows with its position, so the last 512-token chunk of a 2,048-token prompt costs several times
the first (at a 16k context, tens of times), and what a chunk costs against a decode step depends
on the model and the device (on a GPU a 512-token chunk of a 1B model costs about a decode step; on
a CPU, with the tiny model, tens of them). The pacer measures both and keeps a step that carries
chunks within ``ratio`` times the running streams' decode-only step: their inter-token latency
during a long prefill stays near their pace alone, at the cost of that prompt's time to first
token. With nothing decoding it gives the whole budget (nobody waits on the step).

Chunks are sized by their cost, not their tokens: a chunk of ``t`` tokens from position ``s``
does ``t * (1 + (s + t / 2) / context_tokens)`` units of work (:meth:`PrefillPacer.work`): each
token's projections and MLP, plus its attention over the positions before it, ``context_tokens``
of which cost what the rest of a token does (~1,024 measured on the tiny model on a CPU; only the
shape is assumed, the seconds a unit takes are measured). The allowance is in those units, so a
chunk deep in a long prompt gets fewer tokens than one at its start for the same time: with a
token allowance the 16k prompt's later chunks each ran past the step's time by the growth of
their context since the last measurement.

Measured, not modelled: after each step with chunks it rescales the allowance by how far the
step's chunk time was from the time it may take, falling at once and rising at most 1.5x a
step, so a noisy step costs a few smaller chunks, never a stall; it starts from a block's worth
at position 0 and never gives less than ``min_tokens`` (a block). On a CPU a chunk's step has a
fixed cost of its own (~0.5 ms with the tiny model, against a 0.7 ms decode step), so at ratio
1.5 nothing fits and that floor is the pace. A smaller floor deep in a long prompt was measured
and not kept: at a 16k context, two tokens instead of 16 from 2k on tripled the prompt's time to
first token (CPU 5.5 -> 15.4 s) for the same p99 against the streams' decode steps (4.5x), as
the streams' own contexts grew over the extra steps. Where not even a block fits the allowance,
:mod:`.split_prefill` runs the block a piece a step instead (layer by layer, the attention a slice
of keys at a time), in these units, and :meth:`PrefillPacer.piece_step` rescales the allowance
from the pieces' own time.
"""

from __future__ import annotations

import math
import time
from typing import Any, Protocol, TypeVar


class PrefillPacer:
    #: weight of a new decode-only step time in the running average
    DECODE_WEIGHT = 0.2
    #: the most the allowance grows past the work of one step that stayed within its time
    GROWTH = 1.5
    #: attended positions whose attention costs what a token's projections and MLP do
    CONTEXT_TOKENS = 1024
    #: what the engine times its steps with
    clock = staticmethod(time.perf_counter)

    def __init__(
        self, max_tokens: int, min_tokens: int, ratio: float, context_tokens: int = CONTEXT_TOKENS
    ) -> None:
        if ratio != 0.0 and not ratio > 1.0:  # a NaN too
            raise ValueError(f"prefill step ratio must be > 1 (0: off), got {ratio}")
        self.max_tokens = max_tokens
        self.min_tokens = min(min_tokens, max_tokens)
        self.ratio = ratio
        self.context_tokens = context_tokens
        #: work units the next step beside running decodes may take: from a block at position 0 up,
        #: so the first chunk beside the streams is no spike (it grows 1.5x a step while steps fit)
        self.allowance = self.work(0, self.min_tokens)
        #: running average of a decode-only step's seconds (None until one is measured)
        self.decode_s: float | None = None

    def work(self, start: int, tokens: int) -> float:
        """The cost units of a chunk of ``tokens`` tokens from position ``start``."""
        return tokens * (1.0 + (start + tokens / 2.0) / self.context_tokens)

    def tokens_for(self, start: int, work: float) -> int:
        """The most tokens from ``start`` whose :meth:`work` is at most ``work``."""
        k = self.context_tokens
        b = 1.0 + start / k  # work = t * b + t^2 / (2k): the positive root of that = work
        return int(k * (math.sqrt(b * b + 2.0 * work / k) - b) + 1e-9)

    def budget(self, decoding: bool, start: int = 0) -> int:
        """The next step's prefill tokens for a chunk from position ``start``: the allowance while
        streams decode (at least ``min_tokens``), else the whole budget."""
        if not self.ratio or not decoding:
            return self.max_tokens
        return max(self.min_tokens, min(self.max_tokens, self.tokens_for(start, self.allowance)))

    def decode_step(self, seconds: float) -> None:
        """A step of decodes alone took ``seconds``."""
        if self.decode_s is None:
            self.decode_s = seconds
        else:
            self.decode_s += self.DECODE_WEIGHT * (seconds - self.decode_s)

    def mixed_step(self, seconds: float, chunks: list[tuple[int, int]]) -> None:
        """A step of decodes and ``chunks`` (each ``(start, tokens)``) took ``seconds``."""
        done = sum(self.work(start, tokens) for start, tokens in chunks)
        if not self.ratio or self.decode_s is None or done <= 0:
            return
        self._rescale(done, seconds - self.decode_s, self.work(chunks[-1][0], self.max_tokens))

    def piece_step(self, seconds: float, done: float) -> None:
        """A chunk's pieces (:mod:`.split_prefill`) did ``done`` units in ``seconds`` beside a
        decode step of their own."""
        if self.ratio and self.decode_s is not None and done > 0:
            self._rescale(done, seconds, math.inf)

    def _rescale(self, done: float, took: float, most: float) -> None:
        """The allowance after ``done`` units took ``took`` seconds past the decodes' own."""
        assert self.decode_s is not None
        fits = done * (self.ratio - 1.0) * self.decode_s / max(took, 1e-9)
        # Grows from what it granted (a step may do less: a prompt's last chunk, whole tokens), to
        # at most a full chunk's work where this one ran (not past what the budget lets it use).
        self.allowance = min(fits, max(done, self.allowance) * self.GROWTH, most)


class _Prompt(Protocol):
    req: Any

    @property
    def total(self) -> int: ...


P = TypeVar("P", bound=_Prompt)


def whole_prompts(prefilling: list[P], budget: int) -> list[tuple[P, int]]:
    """Whole prompts (the engine's unchunked plan) while ``budget`` tokens last, at least one."""
    plan: list[tuple[P, int]] = []
    for state in prefilling:
        left = state.total - state.req.cached_len
        if plan and left > budget:
            break
        plan.append((state, left))
        budget -= left
        if budget <= 0:
            break
    return plan


#: the part of a step's budget a cut prompt keeps when later prompts would take the rest
OLDEST_SHARE = 0.5


def shared_chunks(prefilling: list[P], budget: int, paced: int, least: int) -> list[tuple[P, int]]:
    """A chunked step's plan: ``(prompt, tokens)`` under ``budget`` tokens, oldest first.

    Not yet started prompts that fit go whole; the first that must be cut (or was cut before: the
    oldest) takes up to ``paced`` tokens, but keeps only its guaranteed share (:data:`OLDEST_SHARE`
    of what was left for it, at least ``least``: a block) where later prompts that were never cut
    fit whole in the rest: those run in the same forward, before it (only a plan's last prompt may
    be cut). So a short prompt behind a long one's prefill gets its first token at once instead of
    after that whole prefill (head-of-line blocking), while the long one still progresses at every
    step and no prompt waits behind later ones forever: a prompt that fits nowhere becomes the
    oldest once those ahead of it are done. Whole prompts count against ``paced`` too."""
    plan: list[tuple[P, int]] = []
    for n, state in enumerate(prefilling):
        req = state.req
        left = state.total - req.cached_len
        fits = req.cached_len == req.cached_prefix and left <= budget  # not started: goes whole
        take = min(left, budget, paced)
        if not fits and take <= 0:
            return plan
        if fits or take == left:  # whole, or its last chunk: not cut, the plan goes on
            plan.append((state, left))
            budget -= left
            paced -= left
            if budget <= 0:
                return plan
            continue
        keep = min(take, max(least, int(min(budget, paced) * OLDEST_SHARE)))
        room = budget - keep
        later: list[tuple[P, int]] = []
        for other in prefilling[n + 1 :]:
            o_left = other.total - other.req.cached_len
            if other.req.cached_len == other.req.cached_prefix and o_left <= room:
                later.append((other, o_left))
                room -= o_left
        if later:  # they take what they need; the cut prompt the rest (no less than its share)
            used = sum(t for _, t in later)
            take = max(keep, min(left, budget - used, paced - used))
        return plan + later + [(state, take)]
    return plan


__all__ = ["OLDEST_SHARE", "PrefillPacer", "shared_chunks", "whole_prompts"]
