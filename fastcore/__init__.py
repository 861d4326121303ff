"""fastcore: the serving core for prefill/decode-disaggregated LLM inference.

Two compiled modules, each with a pure-Python twin of identical behaviour:

- the token codec (``encode_tokens`` / ``decode_tokens*``): int32 token ids
  <-> standard base64 of their little-endian bytes;
- the JSON span scanner (``find_span`` / ``find_spans`` / ``splice``): byte
  spans of values in raw JSON, so bodies are relayed without being parsed;
  ``chunk_hashes``: chained 64-bit hashes of a span's fixed-size chunks, the
  orchestrator's prefix-cache routing keys.

The JSON limits every process enforces (``JSON_MAX_DEPTH``,
``JSON_MAX_NUMBER_CHARS``) are defined once, in :mod:`fastcore.limits`, and
exported here: the scanner, the relay kernels and the servers built on this
package all read them from there.

The backend is chosen here, once: the compiled twins unless they are missing
or ``FASTCORE_NO_EXTENSIONS=1`` is set. ``fastcore.backend`` says which is
active and which SIMD kernel the codec dispatched to.
"""

from __future__ import annotations

import os
from types import ModuleType

from .errors import JSONSpanError, RelayError, TokenDecodeError
from .limits import JSON_MAX_DEPTH, JSON_MAX_NUMBER_CHARS

__version__ = "0.1.0"

NO_EXTENSIONS: bool = os.environ.get("FASTCORE_NO_EXTENSIONS", "") not in ("", "0")


def _load_twins() -> tuple[ModuleType, ModuleType, str]:
    if not NO_EXTENSIONS:
        try:
            from . import _codec, _jsonspan
        except ImportError:
            pass
        else:
            return _codec, _jsonspan, "cython"
    from . import _codec_py, _jsonspan_py

    return _codec_py, _jsonspan_py, "python"


_codec_impl, _jsonspan_impl, _kind = _load_twins()

encode_tokens = _codec_impl.encode_tokens
decode_tokens = _codec_impl.decode_tokens
decode_tokens_list = _codec_impl.decode_tokens_list
decode_tokens_into = _codec_impl.decode_tokens_into

find_span = _jsonspan_impl.find_span
find_spans = _jsonspan_impl.find_spans
splice = _jsonspan_impl.splice
chunk_hashes = _jsonspan_impl.chunk_hashes

#: ``"cython (avx2)"``, ``"cython (scalar)"`` or ``"python"``.
backend: str = f"{_kind} ({_codec_impl.SIMD_PATH})" if _kind == "cython" else "python"

__all__ = [
    "JSON_MAX_DEPTH",
    "JSON_MAX_NUMBER_CHARS",
    "JSONSpanError",
    "RelayError",
    "TokenDecodeError",
    "backend",
    "chunk_hashes",
    "decode_tokens",
    "decode_tokens_into",
    "decode_tokens_list",
    "encode_tokens",
    "find_span",
    "find_spans",
    "splice",
]
