"""The orchestrator's prefix-cache key space, which workers publish their cache in.

A prompt's keys are :func:`fastcore.chunk_hashes` of its raw ``messages`` (chat) or ``prompt``
(completions) bytes, as the orchestrator's kv_cache_aware router computes them, each XORed with the
request's ``cache_salt`` key (0 without one): requests with different salts never share a key, as
they never share a cached block (vLLM's and our workers' rule). The salt key is the first 8 bytes
of the worker's own chain root for that salt (:func:`server.worker.engine_api.cache_salt_root`).

Both sides compute keys from the same bytes: the worker receives the client's ``messages`` /
``prompt`` span as the orchestrator relayed it, byte for byte.
"""

from __future__ import annotations

import hashlib

import fastcore
from fastcore import JSONSpanError
from fastcore import protocol as wire

__all__ = ["CACHE_SALT", "prompt_keys", "salt_key", "salt_key_of_root"]

CACHE_SALT = "cache_salt"
_CHAT_PATHS = ((wire.MESSAGES,), (CACHE_SALT,))
_COMPLETION_PATHS = ((wire.PROMPT,), (CACHE_SALT,))


def salt_key_of_root(root: bytes) -> int:
    """The key mask of a worker's chain root (b"": no salt, 0)."""
    return int.from_bytes(root[:8], "little") if root else 0


def salt_key(salt: str | None) -> int:
    """The key mask of a ``cache_salt`` value (None: 0); the same digest as the worker's root."""
    if salt is None:
        return 0
    root = hashlib.blake2b(b"fastcore cache_salt\0" + salt.encode("utf-8", "surrogatepass"), digest_size=16)
    return salt_key_of_root(root.digest())


def salt_key_at(body: bytes, span: tuple[int, int] | None) -> int:
    """The key mask of the ``cache_salt`` JSON string at ``span`` of ``body`` (0: none or not a string)."""
    if span is None or body[span[0]] != 0x22:  # '"'
        return 0
    raw = body[span[0] + 1 : span[1] - 1]
    if b"\\" in raw:
        import json

        try:
            return salt_key(json.loads(body[span[0] : span[1]]))
        except ValueError:
            return 0
    return salt_key(raw.decode("utf-8", "surrogateescape"))


def prompt_keys(body: bytes, chat: bool, chunk_bytes: int) -> tuple[list[int], int]:
    """(keys of the prompt's full chunks, the prompt span's length in bytes) of a request body;
    ([], 0) for a body without a prompt span. One non-validating scan."""
    try:
        prompt, salt = fastcore.find_spans(body, _CHAT_PATHS if chat else _COMPLETION_PATHS, validate=False)
    except (JSONSpanError, ValueError):
        return [], 0
    if prompt is None:
        return [], 0
    hashes = fastcore.chunk_hashes(body, prompt[0], prompt[1], chunk_bytes)
    mask = salt_key_at(body, salt)
    if mask:
        hashes = [h ^ mask for h in hashes]
    return hashes, prompt[1] - prompt[0]
