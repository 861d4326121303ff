"""A step's tokens from its logits: greedy rows by argmax, the others from their request's own
seeded stream, with the logprobs a request asked for.

Randomness is per request and per position: token ``i`` of a seeded request is drawn with a
generator seeded from ``(seed, i)``, so the same seed gives the same text whatever else is in the
batch (server/worker/engine.py's guarantee).
"""

from __future__ import annotations

import itertools
import math
import operator
from typing import TYPE_CHECKING

import torch

from .output import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from .engine_api import EngineRequest


class Sampler:
    """The engine's sampling; it remembers the last batch found all greedy (:meth:`sample`)."""

    def __init__(self) -> None:
        #: the last batch sample found all greedy without logprobs (_all_greedy)
        self._greedy_batch: list[EngineRequest] = []

    def forced_logprob(self, req: EngineRequest, logits: torch.Tensor, token: int) -> TokenLogprob | None:
        """A replayed token's logprob record (None when the request asked for none)."""
        if req.params.logprobs is None:
            return None
        return self.logprob_record(torch.log_softmax(logits.float(), -1), token, req.params.logprobs)

    @staticmethod
    def logprob_record(logprobs: torch.Tensor, token: int, top: int) -> TokenLogprob:
        top_list: list[tuple[int, float]] = []
        if top:
            values, indices = logprobs.topk(top)
            top_list = list(zip(indices.tolist(), values.tolist()))
        return TokenLogprob(token, float(logprobs[token]), top_list)

    def sample(
        self, logits: torch.Tensor, batch: list[EngineRequest]
    ) -> list[tuple[int, TokenLogprob | None]]:
        """One token per row: greedy rows by argmax, the others from their own seeded stream."""
        logits = logits.float()
        if logits.is_cpu and not logits.requires_grad:  # (a step outside inference mode: torch's)
            # numpy's argmax: the same index (the first maximum, the first NaN) as torch's, whose
            # CPU kernel took ~10 us at 32 x 262 (tiny) and ~870 at 32 x 32k, numpy's 2.5 and 66
            tokens = logits.numpy().argmax(-1).tolist()
        else:
            tokens = logits.argmax(-1).tolist()
        if self._all_greedy(batch):
            return list(zip(tokens, itertools.repeat(None)))
        results: list[tuple[int, TokenLogprob | None]] = []
        for row, req in enumerate(batch):
            p = req.params
            token = tokens[row]
            if not p.greedy:
                token = self.draw(logits[row], p, req.seed, req.processor.num_tokens)
            lp = None
            if p.logprobs is not None:
                lp = self.logprob_record(torch.log_softmax(logits[row], -1), token, p.logprobs)
            results.append((token, lp))
        return results

    def _all_greedy(self, batch: list[EngineRequest]) -> bool:
        """Whether every row is greedy without logprobs (argmax is all it needs): remembered for the
        batch of the last step that was, as its streams usually decode on together."""
        known = self._greedy_batch
        if len(known) == len(batch) and all(map(operator.is_, known, batch)):
            return True
        if all(req.params.greedy and req.params.logprobs is None for req in batch):
            if len(batch) > 1:  # not a prompt's first token: the decoding streams stay known
                self._greedy_batch = list(batch)
            return True
        return False

    @staticmethod
    def draw(logits: torch.Tensor, p: SamplingParams, seed: int, step: int) -> int:
        """Token ``step`` of a request seeded ``seed``, from ``logits`` under ``p``'s temperature,
        top-k and top-p."""
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


__all__ = ["Sampler"]
