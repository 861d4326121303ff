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
from .bytes_per_token import DEFAULT_BYTES_PER_TOKEN, MAX_STEP, BytesPerToken

__all__ = [
    "DEFAULT_BYTES_PER_TOKEN",
    "MAX_STEP",
    "BytesPerToken",
    "StreamUsage",
    "UsageLearner",
    "read_usage",
]

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


#: the pure twin (bytes_per_token.py, the behavioural reference); where the compiled one is built
#: (the same source compiled: server.orchestrator._bytes_per_token, which twins.py picks)
#: ``BytesPerToken`` is its
PURE: dict[str, type] = {"BytesPerToken": BytesPerToken}
if twins.bytes_per_token is not None:
    BytesPerToken = twins.bytes_per_token.BytesPerToken  # type: ignore[misc]


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
