"""fastcore: the serving core for prefill/decode-disaggregated LLM inference.

Four compiled modules, each with a pure-Python twin of identical behaviour:

- the token codec (``_codec``: ``encode_tokens`` / ``decode_tokens*``): int32
  token ids <-> standard base64 of their little-endian bytes;
- the JSON span scanner (``_scan``: ``find_span`` / ``find_spans`` /
  ``splice``): byte spans of values in raw JSON, so bodies are relayed without
  being parsed;
- the relay kernels (``_relay``, served by :mod:`fastcore.relay`): the bodies
  of the disaggregated legs, one call per body;
- ``chunk_hashes`` (``_hash``): chained 64-bit hashes of a span's fixed-size
  chunks, the orchestrator's prefix-cache routing keys.

The JSON limits every process enforces (``JSON_MAX_DEPTH``,
``JSON_MAX_NUMBER_CHARS``) are defined once, in :mod:`fastcore.limits`, and
exported here: the scanner, the relay kernels and the servers built on this
package all read them from there.

The backend is chosen here, once: the compiled twins unless they are missing
or ``FASTCORE_NO_EXTENSIONS=1`` is set. ``fastcore.backend`` says which is
active and which SIMD kernel the codec dispatched to.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

from .errors import JSONSpanError, RelayError, TokenDecodeError
from .limits import JSON_MAX_DEPTH, JSON_MAX_NUMBER_CHARS

__version__ = "0.1.0"

NO_EXTENSIONS: bool = os.environ.get("FASTCORE_NO_EXTENSIONS", "") not in ("", "0")


def compiled_twin(name: str) -> ModuleType | None:
    """The compiled module ``name`` (dotted), or None where ``FASTCORE_NO_EXTENSIONS=1`` is set or it
    is not built: the one rule by which a pure module picks its twin (aiohttp's: the pure ``x.py`` is
    public, the compiled ``_x`` beside it, chosen at ``x.py``'s end, which binds its public names to
    the compiled ones or keeps its own). This package's four are all or none (below)."""
    if NO_EXTENSIONS:
        return None
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


_TWINS = ("_codec", "_scan", "_relay", "_hash")


def _load_twins() -> tuple[list[ModuleType], str]:
    # All compiled or all pure: the compiled relay cimports the compiled scan and codec.
    if not NO_EXTENSIONS:
        try:
            return [importlib.import_module(f".{name}", __name__) for name in _TWINS], "cython"
        except ImportError:
            pass
    return [importlib.import_module(f".{name}_py", __name__) for name in _TWINS], "python"


(_codec_impl, _scan_impl, _relay_impl, _hash_impl), _kind = _load_twins()

encode_tokens = _codec_impl.encode_tokens
decode_tokens = _codec_impl.decode_tokens
decode_tokens_list = _codec_impl.decode_tokens_list
decode_tokens_into = _codec_impl.decode_tokens_into

find_span = _scan_impl.find_span
find_spans = _scan_impl.find_spans
find_member_spans = _scan_impl.find_member_spans
splice = _scan_impl.splice
chunk_hashes = _hash_impl.chunk_hashes

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
    "compiled_twin",
    "decode_tokens",
    "decode_tokens_into",
    "decode_tokens_list",
    "encode_tokens",
    "find_member_spans",
    "find_span",
    "find_spans",
    "splice",
]
