"""The binary KV hand-off format between a context and a generation worker.

::

    offset 0   4 bytes   magic b"FCKV"
           4   u16 LE    format version (1)
           6   u16 LE    reserved, 0
           8   u32 LE    header length H
          12   H bytes   header: UTF-8 JSON object (see below)
      12 + H             K: [layers, tokens, kv_heads, head_dim] in ``dtype``, C order, little-endian
                         V: the same shape, right after K

Header fields: ``dtype`` (torch dtype name, e.g. ``"float32"``),
``num_layers``, ``num_tokens``, ``num_kv_heads``, ``head_dim``,
``prompt_crc32`` (CRC-32 of the prompt's int32 LE bytes, so KV is never
applied to another prompt), ``first_token`` and ``first_logprob``
(``[token, logprob, [[id, logprob], ...]]`` or null).

No pickle: the receiver checks every size against its own model before
viewing the bytes as tensors, so a malformed or hostile body is a
:class:`KVTransferError`, never an arbitrary object or an out-of-bounds read.
"""

from __future__ import annotations

import json
import struct
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from .output import TokenLogprob

MAGIC = b"FCKV"
VERSION = 1
_PREFIX = struct.Struct("<4sHHI")
MAX_HEADER_BYTES = 1 << 16

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


class KVTransferError(ValueError):
    """A KV hand-off body that does not match this worker's model or prompt."""


@dataclass
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def payload_bytes(self, num_tokens: int) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * num_tokens * self.num_kv_heads * self.head_dim * elem


@dataclass
class KVPayload:
    k: torch.Tensor  # [layers, tokens, kv_heads, head_dim], CPU
    v: torch.Tensor
    prompt_crc32: int
    first_token: int
    first_logprob: TokenLogprob | None


def _dtype_name(dtype: torch.dtype) -> str:
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise KVTransferError(f"KV dtype {dtype} cannot be handed off")


def encode_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    prompt_crc32: int,
    first_token: int,
    first_logprob: TokenLogprob | None,
) -> list[memoryview | bytes]:
    """The hand-off body as pieces to write in order (the tensors' bytes are not copied)."""
    k = k.detach().cpu().contiguous()
    v = v.detach().cpu().contiguous()
    header: dict[str, Any] = {
        "dtype": _dtype_name(k.dtype),
        "num_layers": k.shape[0],
        "num_tokens": k.shape[1],
        "num_kv_heads": k.shape[2],
        "head_dim": k.shape[3],
        "prompt_crc32": prompt_crc32,
        "first_token": first_token,
        "first_logprob": None
        if first_logprob is None
        else [first_logprob.token_id, first_logprob.logprob, [list(t) for t in first_logprob.top]],
    }
    head = json.dumps(header, separators=(",", ":")).encode()
    # Viewing as bytes works for every dtype (bf16 has no numpy twin).
    return [
        _PREFIX.pack(MAGIC, VERSION, 0, len(head)) + head,
        k.view(torch.uint8).reshape(-1).numpy().data,  # 1-D, so len() is the byte count
        v.view(torch.uint8).reshape(-1).numpy().data,
    ]


def parse_prefix(data: bytes | bytearray) -> int:
    """Header length from the first 12 bytes; raises on a wrong magic or version."""
    if len(data) < _PREFIX.size:
        raise KVTransferError(f"KV body is {len(data)} bytes, shorter than its {_PREFIX.size}-byte prefix")
    magic, version, _, header_len = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise KVTransferError(f"KV body starts with {magic!r}, not {MAGIC!r}")
    if version != VERSION:
        raise KVTransferError(f"KV format version {version} is not supported (this worker reads {VERSION})")
    if header_len > MAX_HEADER_BYTES:
        raise KVTransferError(f"KV header of {header_len} bytes exceeds {MAX_HEADER_BYTES}")
    return int(header_len)


def check_header(
    raw: bytes | bytearray, layout: KVLayout, *, num_tokens: int, prompt_crc32: int
) -> dict[str, Any]:
    """The parsed header, if it matches this worker's model and the prompt.

    A receiver calls it before reading the payload, so a body meant for
    another model or prompt is refused without pulling its bytes.
    """
    try:
        header = json.loads(bytes(raw))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise KVTransferError(f"KV header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise KVTransferError("KV header is not a JSON object")
    expected = {
        "dtype": _dtype_name(layout.dtype),
        "num_layers": layout.num_layers,
        "num_kv_heads": layout.num_kv_heads,
        "head_dim": layout.head_dim,
        "num_tokens": num_tokens,
        "prompt_crc32": prompt_crc32,
    }
    for key, want in expected.items():
        if header.get(key) != want:
            raise KVTransferError(f"KV header {key} is {header.get(key)!r}, this worker expects {want!r}")
    if not isinstance(header.get("first_token"), int):
        raise KVTransferError("KV header first_token is not an integer")
    return header


def decode_kv(data: bytes | bytearray, layout: KVLayout, *, num_tokens: int, prompt_crc32: int) -> KVPayload:
    """Check ``data`` against this worker's model and the prompt, then view it as K and V."""
    header_len = parse_prefix(data)
    start = _PREFIX.size + header_len
    if len(data) < start:
        raise KVTransferError("KV body ends inside its header")
    header = check_header(
        data[_PREFIX.size : start], layout, num_tokens=num_tokens, prompt_crc32=prompt_crc32
    )
    first_token = header["first_token"]
    size = layout.payload_bytes(num_tokens)
    if len(data) - start != size:
        raise KVTransferError(f"KV payload is {len(data) - start} bytes, expected {size}")
    shape = (layout.num_layers, num_tokens, layout.num_kv_heads, layout.head_dim)
    count = size // 2 // torch.empty((), dtype=layout.dtype).element_size()
    with warnings.catch_warnings():
        # The tensors are only read (copied into the cache), so a read-only buffer is fine.
        warnings.simplefilter("ignore", UserWarning)
        k = torch.frombuffer(data, dtype=layout.dtype, count=count, offset=start).view(shape)
        v = torch.frombuffer(data, dtype=layout.dtype, count=count, offset=start + size // 2).view(shape)
    first_logprob = None
    raw_lp = header.get("first_logprob")
    if raw_lp is not None:
        try:
            token, value, top = raw_lp
            first_logprob = TokenLogprob(int(token), float(value), [(int(t), float(x)) for t, x in top])
        except (TypeError, ValueError):
            raise KVTransferError("KV header first_logprob is malformed") from None
    return KVPayload(k, v, prompt_crc32, first_token, first_logprob)


__all__ = [
    "KVLayout",
    "KVPayload",
    "KVTransferError",
    "check_header",
    "decode_kv",
    "encode_kv",
    "parse_prefix",
]
