"""Sampling parameters and per-request output processing, shared by every engine.

No torch here: the torch engine and a synthetic engine both feed sampled
token ids to an :class:`OutputProcessor`, which owns detokenization, stop
tokens, stop strings and ``max_tokens``. Because the processor is a pure
function of the token sequence, a generation worker that replays a context
worker's ``first_gen_tokens`` into it produces the very same text, chunks and
finish reason as a single worker that generated them itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # None: no logprobs; k >= 0: the chosen token's logprob plus the top k.
    logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Delta:
    """What one engine step added to a request: the unit the HTTP layer streams."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None = None
    # Set when the finish is an error of the engine (the stream ends with an error event).
    error: str | None = None
    # vLLM's ``stop_reason`` of a "stop" finish: the stop string that matched or the stop token id
    # (None: an EOS, or no stop rule ended it)
    stop_reason: str | int | None = None


#: sent characters a processor's text may keep before they are cut off (see OutputProcessor.text)
_KEEP_SENT = 1024


class OutputProcessor:
    """Turns one request's sampled tokens into text deltas and decides when it ends.

    - a token in ``stop_token_ids``, or an EOS id (unless ``ignore_eos``),
      ends with ``"stop"``; its text is not part of the output, but it counts
      as a completion token, as in OpenAI's API;
    - a stop string ends with ``"stop"``; the text is cut before it;
    - the stop string or stop token id (not an EOS) that ended it is the last delta's ``stop_reason``;
    - ``max_tokens`` tokens end with ``"length"``.

    While stop strings are set, the last ``len(longest stop) - 1`` characters
    are held back, since they might be the start of a stop string.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        params: SamplingParams,
        prompt_tail: list[int] | None = None,
    ) -> None:
        self.params = params
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_tail or [])
        self.end_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self.end_ids.update(tokenizer.eos_token_ids)
        self.holdback = max((len(s) for s in params.stop), default=1) - 1
        #: the fast path of :meth:`add` takes tokens while the count stays below this: with no stop
        #: strings a token's text is final as it comes, up to the one that reaches ``max_tokens``;
        #: 0 (none) with stop strings and once finished
        self._fast_below = 0 if params.stop else params.max_tokens
        # The text not sent yet, after the sent text's last ``holdback`` characters at least (a
        # stop string's match can start no earlier): what was sent before is cut off now and then
        # (:meth:`_emit`), since a string grown by += is copied whole each time. With no stop
        # strings the fast path's pieces are not added (nothing is held back).
        self.text = ""
        self.emitted = 0  # characters of self.text already sent
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, token_id: int, logprob: TokenLogprob | None = None) -> Delta:
        num_tokens = self.num_tokens + 1
        if num_tokens < self._fast_below and token_id not in self.end_ids:
            # A token that ends nothing, no stop strings (so no text held back), not finished: its
            # text is the delta, as the rules below give it here, without their checks (a decode
            # step's every stream comes this way).
            self.num_tokens = num_tokens
            piece = self.detokenizer.push_one(token_id)
            return Delta(piece, [token_id], [logprob] if logprob is not None else [])
        if self.finish_reason is not None:
            raise RuntimeError("token added to a finished request")
        # Without stop strings only a finishing token comes here: the fast path closes (a token
        # added after it comes here too, and raises).
        self._fast_below = 0
        self.num_tokens = num_tokens
        logprobs = [logprob] if logprob is not None else []
        if token_id in self.end_ids:
            self.finish_reason = "stop"
            if token_id in self.params.stop_token_ids:
                self.stop_reason = token_id
            self.text += self.detokenizer.flush()
            return self._emit([token_id], logprobs, len(self.text))
        self.text += self.detokenizer.push_one(token_id)
        if self.params.stop:
            # Only the new tail (plus a stop's length of overlap) can hold a new match; the
            # earliest match wins, the first listed of those at the same place.
            start = max(0, self.emitted - self.holdback)
            cut, matched = -1, None
            for stop in self.params.stop:
                i = self.text.find(stop, start)
                if i >= 0 and (cut < 0 or i < cut):
                    cut, matched = i, stop
            if cut >= 0:
                self.finish_reason = "stop"
                self.stop_reason = matched
                self.text = self.text[:cut]
                return self._emit([token_id], logprobs, cut)
        if self.num_tokens >= self.params.max_tokens:
            self.finish_reason = "length"
            self.text += self.detokenizer.flush()
            return self._emit([token_id], logprobs, len(self.text))
        return self._emit([token_id], logprobs, max(self.emitted, len(self.text) - self.holdback))

    def finish_early(self, reason: str) -> Delta:
        """End before the request would end by itself (``"not_finished"`` of a context leg)."""
        self.finish_reason = reason
        self._fast_below = 0
        self.text += self.detokenizer.flush()
        return self._emit([], [], len(self.text))

    def _emit(self, token_ids: list[int], logprobs: list[TokenLogprob], upto: int) -> Delta:
        text = self.text[self.emitted : upto]
        self.emitted = max(self.emitted, upto)
        if self.emitted > _KEEP_SENT + self.holdback:
            # Only the last holdback characters sent are read again (add's stop search)
            drop = self.emitted - self.holdback
            self.text = self.text[drop:]
            self.emitted -= drop
        return Delta(text, token_ids, logprobs, self.finish_reason, stop_reason=self.stop_reason)


__all__ = ["Delta", "OutputProcessor", "SamplingParams", "TokenLogprob"]
