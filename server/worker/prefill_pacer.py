"""How many prompt tokens the next engine step may prefill beside the running streams' decodes.

A token budget alone (``--prefill-chunk-tokens``) does not bound a step's time: a chunk's attention
grows with its position, so the last 512-token chunk of a 2,048-token prompt costs several times
the first, and what a chunk costs against a decode step depends on the model and the device (on a
GPU a 512-token chunk of a 1B model costs about a decode step; on a CPU, with the tiny model, tens
of them). The pacer measures both and keeps a step that carries chunks within ``ratio`` times the
running streams' decode-only step: their inter-token latency during a long prefill stays near
their pace alone, at the cost of that prompt's time to first token. With nothing decoding it
gives the whole budget (nobody waits on the step).

Measured, not modelled: after each step with chunks it rescales the allowance by how far the
step's chunk time was from the time it may take, falling at once and rising at most 1.5x a step,
so a noisy step costs a few smaller chunks, never a stall; it starts from a block's worth.
"""

from __future__ import annotations

import time


class PrefillPacer:
    #: weight of a new decode-only step time in the running average
    DECODE_WEIGHT = 0.2
    #: the most the allowance grows after one step that stayed within its time
    GROWTH = 1.5
    #: what the engine times its steps with
    clock = staticmethod(time.perf_counter)

    def __init__(self, max_tokens: int, min_tokens: int, ratio: float) -> None:
        if ratio != 0.0 and not ratio > 1.0:  # a NaN too
            raise ValueError(f"prefill step ratio must be > 1 (0: off), got {ratio}")
        self.max_tokens = max_tokens
        self.min_tokens = min(min_tokens, max_tokens)
        self.ratio = ratio
        #: prompt tokens the next step beside running decodes may take: from a block up, so the
        #: first chunk beside the streams is no spike (it grows 1.5x a step while steps fit)
        self.allowance = self.min_tokens if ratio else max_tokens
        #: running average of a decode-only step's seconds (None until one is measured)
        self.decode_s: float | None = None

    def budget(self, decoding: bool) -> int:
        """The next step's prefill tokens: the allowance while streams decode, else the whole budget."""
        if not self.ratio or not decoding:
            return self.max_tokens
        return self.allowance

    def decode_step(self, seconds: float) -> None:
        """A step of decodes alone took ``seconds``."""
        if self.decode_s is None:
            self.decode_s = seconds
        else:
            self.decode_s += self.DECODE_WEIGHT * (seconds - self.decode_s)

    def mixed_step(self, seconds: float, tokens: int) -> None:
        """A step of decodes and ``tokens`` prompt tokens took ``seconds``."""
        if not self.ratio or self.decode_s is None or tokens <= 0:
            return
        may_take = (self.ratio - 1.0) * self.decode_s
        took = max(seconds - self.decode_s, 1e-9)
        fits = tokens * may_take / took
        grown = min(fits, self.allowance * self.GROWTH)
        self.allowance = int(max(self.min_tokens, min(self.max_tokens, grown)))


__all__ = ["PrefillPacer"]
