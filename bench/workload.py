"""Request bodies that look like agentic traffic, shared by the orchestrator benchmarks.

An agentic chat request carries a long message history: a system prompt, tool
calls and their (large) results, and a few user/assistant turns. Text runs at
about 4 bytes per prompt token, so a 40k-token prompt is ~160 KB of JSON.
"""

from __future__ import annotations

import json
import random

_WORDS = (
    "the function returns a list of token ids for each request while the scheduler "
    "batches decode steps across running sequences and frees the cache when done "
    "error traceback file line module config yaml port worker context generation "
    "orchestrator latency throughput prefill decode kv cache block tensor shape"
).split()


def _text(rng: random.Random, n_bytes: int) -> str:
    out: list[str] = []
    size = 0
    while size < n_bytes:
        w = rng.choice(_WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n_bytes]


def agentic_messages(prompt_tokens: int, *, seed: int = 0, bytes_per_token: int = 4) -> list[dict]:
    """A multi-turn history whose text totals ``prompt_tokens * bytes_per_token`` bytes."""
    rng = random.Random(seed)
    total = prompt_tokens * bytes_per_token
    # system 5%, three tool round-trips carrying most of the text, then the last user turn
    shares = [0.05, 0.02, 0.25, 0.03, 0.30, 0.03, 0.28, 0.04]
    roles = ["system", "user", "tool", "assistant", "tool", "assistant", "tool", "user"]
    messages: list[dict] = []
    for i, (role, share) in enumerate(zip(roles, shares)):
        text = _text(rng, max(8, int(total * share)))
        if role == "tool":
            messages.append({"role": "tool", "tool_call_id": f"call_{i}", "content": text})
        else:
            messages.append({"role": role, "content": text})
    return messages


def chat_body(
    prompt_tokens: int,
    *,
    model: str = "tiny",
    max_tokens: int = 16,
    stream: bool = True,
    seed: int = 0,
) -> bytes:
    """A streaming chat completion request with an agentic history."""
    body = {
        "model": model,
        "messages": agentic_messages(prompt_tokens, seed=seed),
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return json.dumps(body).encode()
