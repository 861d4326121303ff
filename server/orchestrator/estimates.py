"""Prompt tokens from prompt bytes, learned from what the workers report.

The orchestrator never tokenizes: a router's prefix index holds chunk hashes of the raw prompt
bytes (``messages`` on chat, ``prompt`` on completions), and every token figure it uses (a kv index's
capacity bound, ``use_tokens`` loads, expected hits, conditional disaggregation's
``max_local_prefill_length``) is bytes divided by a bytes-per-token figure. That figure depends on
the model's tokenizer and on the traffic (JSON escapes, code, CJK text: 1 to 8 bytes per token), so
it is learned: each request's first answer with ``usage`` (its context answer; or, where it had
none, local prefill's answer: the generation worker's body, or a stream's last chunk) gives its
``usage.prompt_tokens`` against the bytes of the prompt's span (``messages`` or ``prompt``: not
the body, which a client may pad), a decaying sum of both (long prompts weigh more than short ones,
old answers fade) with each answer's pull bounded (:meth:`BytesPerToken.observe`), seeded by the
``bytes_per_token`` a worker may publish in ``/server_info`` and else by :data:`DEFAULT_BYTES_PER_TOKEN`.

Reading ``usage`` costs no JSON parse: the fast relay's validating scan of the context answer
finds both numbers' spans with the rest (``ContextScan.usage_tokens``); elsewhere (the parsed relay
modes) :func:`read_usage` finds them with one non-validating scan of the answer's bytes
(``fastcore.find_spans``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import fastcore
from fastcore import JSONSpanError
from fastcore import protocol as wire
from fastcore.relay import count_at

from . import twins

__all__ = ["DEFAULT_BYTES_PER_TOKEN", "BytesPerToken", "StreamUsage", "UsageLearner", "read_usage"]

#: the figure before anything is known (agentic chat JSON: about 4)
DEFAULT_BYTES_PER_TOKEN = 4.0
#: a sample outside this range is no tokenizer's (a worker that counts nothing, a stub): ignored
MIN_BYTES_PER_TOKEN, MAX_BYTES_PER_TOKEN = 0.25, 64.0
#: each new answer keeps this much of the sums before it (~100 answers of memory)
DECAY = 0.99
#: a published seed counts as this many tokens already seen (a few answers outweigh it)
SEED_TOKENS = 4096.0
#: an answer's ratio counts at most this factor away from the figure (padding in a prompt, a
#: tokenizer's quirk: it pulls as hard as a ratio twice the figure, in its tokens' share)
OUTLIER_FACTOR = 2.0
#: and moves the figure by at most this factor: no single request moves it much
MAX_STEP = 1.05

_USAGE_PATHS = (
    (wire.USAGE, wire.PROMPT_TOKENS),
    (wire.USAGE, wire.PROMPT_TOKENS_DETAILS, wire.CACHED_TOKENS),
)
_USAGE_KEY = b'"' + wire.USAGE.encode() + b'"'
_BACKSLASH = ord("\\")
#: a stream's usage chunk is looked for in its last piece and this much of the one before
STREAM_TAIL_BYTES = 4096
_DATA = b"data:"


def read_usage(response: bytes) -> tuple[int | None, int | None]:
    """``usage.prompt_tokens`` and ``usage.prompt_tokens_details.cached_tokens`` of a JSON answer
    (None for either when absent or not a non-negative integer).

    A context answer holds the prompt's ids before its ``usage`` (ours and trtllm-serve's put it
    last): scanning them cost ~270 µs at 23k ids. So the last ``"usage"`` key is found from the end
    and only ``{`` + the bytes from it are scanned (non-validating); where that is no object (a
    ``"usage"`` that was a string value, a usage member before the others), the whole answer is."""
    at = response.rfind(_USAGE_KEY)
    if at > 0 and response[at - 1] != _BACKSLASH:
        tail = b"{" + response[at:]
        try:
            prompt, cached = fastcore.find_spans(tail, _USAGE_PATHS, validate=False)
        except (JSONSpanError, ValueError):
            pass
        else:
            if prompt is not None:
                return count_at(tail, prompt), count_at(tail, cached)
    try:
        prompt, cached = fastcore.find_spans(response, _USAGE_PATHS, validate=False)
    except (JSONSpanError, ValueError):
        return None, None
    return count_at(response, prompt), count_at(response, cached)


_TIER2_KEY = b'"tier2_cached_tokens":'


def tier2_tokens(response: bytes) -> int:
    """``usage.prompt_tokens_details.tier2_cached_tokens`` (ours: of ``cached_tokens``, those a
    worker's second tier served) of an answer, found from its end; 0 when absent (one bytes search
    from the end: a worker without a tier writes none)."""
    at = response.rfind(_TIER2_KEY)
    if at < 0:
        return 0
    start = at + len(_TIER2_KEY)
    end = start
    while end < len(response) and end - start < 20 and response[end] in b" 0123456789":
        end += 1
    digits = response[start:end].strip()
    return int(digits) if digits.isdigit() else 0


class BytesPerToken:
    """A pool's smoothed prompt bytes per token (one model per orchestrator: ``config.model``).

    ``value``: the current figure; ``observed``: answers learned from (a seed counts none).
    """

    __slots__ = ("_bytes", "_tokens", "observed", "value")

    def __init__(self, initial: float = DEFAULT_BYTES_PER_TOKEN) -> None:
        self.value = float(initial)
        self._bytes = self._tokens = 0.0
        self.observed = 0

    def seed(self, published: float | None) -> None:
        """A worker's published figure: taken until answers were learned from, then ignored."""
        if published is None or self.observed or not MIN_BYTES_PER_TOKEN <= published <= MAX_BYTES_PER_TOKEN:
            return
        self.value = float(published)
        self._tokens = SEED_TOKENS
        self._bytes = SEED_TOKENS * self.value

    def observe(self, prompt_bytes: int, prompt_tokens: int | None) -> None:
        """One answer: ``prompt_tokens`` tokens for ``prompt_bytes`` bytes of the prompt's span.

        The decayed sums' ratio, bounded twice so that no answer moves the figure much: the answer's
        own ratio counts at most :data:`OUTLIER_FACTOR` from the figure, and the figure moves by at
        most :data:`MAX_STEP`; the sums are then rescaled to the figure, so an outlier does not
        stay in them to pull at every later answer. A tenant's padded prompts move it in proportion
        to their share of the prompt tokens, each by under 5%."""
        if not prompt_tokens or prompt_bytes <= 0:
            return
        ratio = prompt_bytes / prompt_tokens
        if not MIN_BYTES_PER_TOKEN <= ratio <= MAX_BYTES_PER_TOKEN:
            return
        value = self.value
        nbytes: float = prompt_bytes
        low, high = value / OUTLIER_FACTOR, value * OUTLIER_FACTOR
        if ratio < low:
            nbytes = low * prompt_tokens
        elif ratio > high:
            nbytes = high * prompt_tokens
        tokens = self._tokens * DECAY + prompt_tokens
        target = (self._bytes * DECAY + nbytes) / tokens
        low, high = value / MAX_STEP, value * MAX_STEP
        if target < low:
            target = low
        elif target > high:
            target = high
        self._tokens = tokens
        self._bytes = target * tokens
        self.value = target
        self.observed += 1

    def tokens(self, nbytes: int | float) -> int:
        """The tokens ``nbytes`` prompt bytes are estimated to hold."""
        return int(nbytes / self.value)


#: the pure twin (the behavioural reference); where the compiled one is built
#: (server/orchestrator/_tally.pyx, picked by twins.py) ``BytesPerToken`` is its
PURE: dict[str, type] = {"BytesPerToken": BytesPerToken}
if twins.tally is not None:
    BytesPerToken = twins.tally.BytesPerToken  # type: ignore[misc]


class UsageLearner:
    """What each request's first answer with ``usage`` teaches the orchestrator.

    Its ``prompt_tokens`` against the prompt's bytes: both pools' :class:`BytesPerToken` (one model:
    the KV handoff needs the same tokenizer on both sides), and the request's admission charge
    (``settle``: :meth:`.admission.Admission.settle`, set where admission runs). A context answer's
    ``cached_tokens`` against the hit the context pool's kv_cache_aware router predicted on the
    worker it chose (``account``): routing quality, on /metrics.
    """

    __slots__ = ("accounting", "estimates", "settle")

    def __init__(self, context_router: Any, generation_router: Any) -> None:
        estimates = [context_router.estimate, generation_router.estimate]
        self.estimates = [e for i, e in enumerate(estimates) if e not in estimates[:i]]
        self.accounting = context_router if context_router.predicts_hits else None
        self.settle: Callable[[int], None] | None = None

    def context_answer(
        self,
        response: bytes,
        prompt_bytes: int,
        hit_chunks: int | None,
        usage: tuple[int | None, int | None] | None = None,
    ) -> None:
        """``response``: the context answer's bytes; ``prompt_bytes``: its prompt span's;
        ``hit_chunks``: the routed request's expected hit on the context worker (None without a
        routing key); ``usage``: its ``usage``' prompt and cached tokens (:func:`read_usage`'s
        answer) when a scan read them already."""
        prompt, cached = read_usage(response) if usage is None else usage
        if prompt is None:
            return
        for estimate in self.estimates:  # learn()'s, inline: this runs for every request
            estimate.observe(prompt_bytes, prompt)
        settle = self.settle
        if settle is not None:
            settle(prompt)
        if self.accounting is not None and hit_chunks is not None and cached is not None:
            self.accounting.account(hit_chunks, prompt, min(cached, prompt), tier2_tokens(response))

    def answer(self, response: bytes, prompt_bytes: int) -> None:
        """A generation worker's whole answer to a request no context answer taught (local prefill:
        conditional disaggregation's, or the fallback's): one scan of its tail (:func:`read_usage`)."""
        self.learn(prompt_bytes, read_usage(response)[0])

    def learn(self, prompt_bytes: int, prompt_tokens: int | None) -> None:
        """A request's prompt: ``prompt_tokens`` (None: not reported) for ``prompt_bytes``."""
        if prompt_tokens is None:
            return
        for estimate in self.estimates:
            estimate.observe(prompt_bytes, prompt_tokens)
        settle = self.settle
        if settle is not None:
            settle(prompt_tokens)


class StreamUsage:
    """A relayed stream's sink that keeps its last two pieces, for the ``usage`` of its last chunk
    (``stream_options.include_usage``): a reference per piece, the one scan at the end."""

    __slots__ = ("last", "previous", "prompt_bytes", "write")

    def __init__(self, prompt_bytes: int) -> None:
        self.prompt_bytes = prompt_bytes
        self.write: Callable[[bytes], None] = _drop
        self.previous = self.last = b""

    def __call__(self, piece: bytes) -> None:
        self.write(piece)
        self.previous = self.last
        self.last = piece

    def prompt_tokens(self) -> int | None:
        """The last ``data:`` event's ``usage.prompt_tokens`` that the kept tail holds, else None."""
        tail = bytes(self.previous[-STREAM_TAIL_BYTES:]) + bytes(self.last)
        at = tail.rfind(_USAGE_KEY)
        start = tail.rfind(_DATA, 0, at) if at > 0 else -1
        if start < 0:
            return None
        end = tail.find(b"\n", at)
        return read_usage(tail[start + len(_DATA) : end if end > 0 else len(tail)])[0]


def _drop(piece: bytes) -> None:
    pass
