"""Bytes of prompt per prompt token, as this worker's tokenizer counts them (``/server_info``).

An orchestrator never tokenizes: it sizes a prompt by the bytes of its span (``messages`` on chat,
``prompt`` on completions, raw JSON as the client sent it: server/orchestrator/estimates.py) and
divides by a bytes-per-token figure. The worker is the one that knows the figure: it tokenizes. It
publishes ``bytes_per_token`` in ``/server_info``, in the orchestrator's units (span bytes, JSON
escapes and chat roles included, against the ids the worker prefills, its chat template's
included): seeded at start from its tokenizer on :data:`SAMPLE_MESSAGES`, then a running ratio
over the prompts it tokenizes (decaying sums, so a change of traffic shows within ~100 requests).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import fastcore
from fastcore import JSONSpanError
from fastcore import protocol as wire

__all__ = ["DECAY", "SAMPLE_MESSAGES", "PromptBytesPerToken", "prompt_span_bytes"]

log = logging.getLogger("fastcore.worker")

#: a chat turn of ordinary English with a little code (the seed's sample): long enough (~1,100
#: bytes) that the roles' JSON and the template's tokens weigh as little as in a real prompt
SAMPLE_MESSAGES: list[dict[str, str]] = [
    {"role": "system", "content": "You are a careful assistant. Answer briefly and cite the file you read."},
    {
        "role": "user",
        "content": (
            "The service starts two workers, one for prefill and one for decode, and an orchestrator "
            "in front of them. When a request arrives, the orchestrator picks a context worker, waits "
            "for its first token, then hands the KV cache to a generation worker, which streams the "
            "rest of the answer back through the orchestrator to the client. In config.yaml I set "
            "`max_local_prefill_length: 512` under conditional_disagg_config and chose the "
            "kv_cache_aware router for both pools, with chunk_bytes left at its default. I expected "
            "short follow-up turns of a conversation to be prefilled on the generation worker, and "
            "long first turns to go through the context worker. Instead, every prompt of about "
            "1,400 tokens still goes to local prefill, and the context worker sits idle while the "
            "generation worker stalls its running streams for each long prompt. The metrics show "
            "the pool estimating far fewer tokens than the workers report in usage. Which lines of "
            "pools.py and estimates.py decide where a request goes, how is the token count of a "
            "prompt estimated before any worker has answered, and what should I change so that the "
            "estimate matches what the tokenizer really produces for my traffic?"
        ),
    },
]
#: each prompt keeps this much of the sums before it (the orchestrator's decay too)
DECAY = 0.99
#: a ratio outside this is no tokenizer's (an empty template, a broken body): not counted
_MIN, _MAX = 0.25, 64.0
_CHAT_SPAN = ((wire.MESSAGES,),)
_COMPLETION_SPAN = ((wire.PROMPT,),)


def prompt_span_bytes(body: bytes, chat: bool) -> int:
    """The length of a JSON body's ``messages`` (chat) or ``prompt`` span; 0 without one."""
    try:
        (span,) = fastcore.find_spans(body, _CHAT_SPAN if chat else _COMPLETION_SPAN, validate=False)
    except (JSONSpanError, ValueError):
        return 0
    return 0 if span is None else span[1] - span[0]


def _sample(tokenizer: Any) -> tuple[int, int]:
    """(span bytes, prompt ids) of :data:`SAMPLE_MESSAGES` as a chat request, or of its text as a
    completion's ``prompt`` where the tokenizer renders no chat."""
    try:
        text = tokenizer.apply_chat_template(SAMPLE_MESSAGES, add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False)
        span = json.dumps(SAMPLE_MESSAGES).encode()
    except Exception:  # any template's failure: the plain text is measured instead
        log.debug("bytes_per_token: the sample chat did not render; measuring its text", exc_info=True)
        prompt = " ".join(m["content"] for m in SAMPLE_MESSAGES)
        ids = tokenizer.encode(prompt)
        span = json.dumps(prompt).encode()
    return len(span), len(ids)


class PromptBytesPerToken:
    """The running ratio: decayed sums of prompt span bytes and prompt ids, seeded by a sample."""

    __slots__ = ("_bytes", "_tokens", "seed")

    def __init__(self, tokenizer: Any) -> None:
        nbytes, tokens = _sample(tokenizer)
        if not tokens or not _MIN <= nbytes / tokens <= _MAX:
            nbytes, tokens = 4, 1  # a tokenizer that counts nothing: the orchestrator's default
        #: the sample's own figure (the first value published)
        self.seed = nbytes / tokens
        self._bytes = float(nbytes)
        self._tokens = float(tokens)

    @property
    def value(self) -> float:
        return round(self._bytes / self._tokens, 4)

    def observe(self, span_bytes: int, prompt_tokens: int) -> None:
        """A prompt of ``span_bytes`` bytes tokenized into ``prompt_tokens`` ids."""
        if prompt_tokens <= 0 or not _MIN <= span_bytes / prompt_tokens <= _MAX:
            return
        self._bytes = self._bytes * DECAY + span_bytes
        self._tokens = self._tokens * DECAY + prompt_tokens
