"""Pure-Python twin of ``fastcore._codec``: the int32 <-> base64 token codec.

The wire form (docs/protocol.md, ``prompt_token_ids_b64``) is standard base64
(RFC 4648 section 4, ``=`` padded, no line breaks) of the ids as
little-endian int32. Decoding is strict: only the standard alphabet, ``=``
only as final padding, a length that is a multiple of 4, a decoded length
that is a whole number of int32, zero bits under the padding (so each id
sequence has exactly one encoding), no whitespace.

This module is the behavioural reference for the compiled twin: same
accepted inputs, same exception types, same messages. The message builders
below are imported by the compiled twin too, so the wording lives in one place.
"""

from __future__ import annotations

import base64
import binascii
import operator
import re
import sys
from typing import Any

import numpy as np

from ._scan_py import _as_bytes
from .errors import TokenDecodeError

INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1

# Status codes of the compiled decoder (FC_B64_* in include/b64simd.h; fastcore._codec checks them at import).
BAD_CHAR = 1
MISPLACED_PAD = 2
NONZERO_PAD_BITS = 3

_HOST_LITTLE = sys.byteorder == "little"
# struct-module codes accepted as integer ids -> signed? ('?' is numpy's bool).
_INT_CODES = {
    "b": True, "B": False, "h": True, "H": False, "i": True, "I": False,
    "l": True, "L": False, "q": True, "Q": False, "?": False,
}  # fmt: skip
_FLOAT_CODES = frozenset("efdgFDGZ")
_NOT_BASE64 = re.compile(rb"[^A-Za-z0-9+/]")
_ALPHABET_VALUE = {
    c: i for i, c in enumerate(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")
}


# --------------------------------------------------------------- messages
# Shared with the compiled twin: both raise exactly these.


def _length_error(length: int) -> TokenDecodeError:
    return TokenDecodeError(f"Invalid base64 length {length}: not a multiple of 4", None)


def _too_many_error(count: int, max_tokens: int) -> TokenDecodeError:
    return TokenDecodeError(f"base64 data holds {count} token ids, more than max_tokens={max_tokens}", None)


def _partial_id_error(nbytes: int) -> TokenDecodeError:
    return TokenDecodeError(
        f"Invalid token data: {nbytes} bytes decoded, not a whole number of int32 ids", None
    )


def _decode_error(status: int, offset: int, byte: int) -> TokenDecodeError:
    if status == BAD_CHAR:
        return TokenDecodeError(f"Invalid base64 character 0x{byte:02x} at byte {offset}", offset)
    if status == MISPLACED_PAD:
        return TokenDecodeError(f"Misplaced padding character '=' at byte {offset}", offset)
    return TokenDecodeError(
        f"Non-zero padding bits in base64 character {chr(byte)!r} at byte {offset} (not the canonical encoding)",
        offset,
    )


def _non_ascii_error(text: str) -> TokenDecodeError:
    offset = next(i for i, ch in enumerate(text) if ord(ch) > 127)
    return TokenDecodeError(f"Non-ASCII character U+{ord(text[offset]):04X} at byte {offset}", offset)


def _data_type_error(data: object) -> TypeError:
    return TypeError(f"data must be bytes, bytearray, memoryview or an ASCII str, not {type(data).__name__}")


def _ids_type_error(ids: object) -> TypeError:
    return TypeError(
        f"ids must be a list or tuple of int, an int32/int64 buffer or a CPU torch tensor, not {type(ids).__name__}"
    )


def _not_integer_error(index: int, item: object) -> TypeError:
    return TypeError(f"token id at index {index} must be an integer, not {type(item).__name__}")


def _out_of_range_error(index: int) -> OverflowError:
    return OverflowError(f"token id at index {index} is outside the int32 range [{INT32_MIN}, {INT32_MAX}]")


def _changed_size_error() -> RuntimeError:
    return RuntimeError("ids changed size during encode_tokens")


def _ndim_error(ndim: int) -> ValueError:
    return ValueError(f"token ids must be 1-dimensional, got {ndim} dimensions")


def _out_capacity_error(capacity: int, count: int) -> ValueError:
    return ValueError(f"out holds {capacity} int32 values, need {count}")


# ------------------------------------------------------- shared validation


def _max_tokens_limit(max_tokens: object) -> int:
    """``max_tokens`` as a non-negative int (callers pass -1 for None)."""
    limit = operator.index(max_tokens)  # type: ignore[arg-type]
    if limit < 0:
        raise ValueError(f"max_tokens must be >= 0, got {limit}")
    return limit


def _int_format(fmt: str, itemsize: int, what: str) -> tuple[bool, bool]:
    """(signed, byteswap) for a buffer of integers in struct format ``fmt``.

    Raises TypeError for float formats and anything that is not a plain
    1/2/4/8-byte integer.
    """
    order, code = "@", fmt
    if code[:1] in ("@", "=", "<", ">", "!"):
        order, code = code[0], code[1:]
    if code in _INT_CODES and itemsize in (1, 2, 4, 8):
        byteswap = (order == "<" and not _HOST_LITTLE) or (order in (">", "!") and _HOST_LITTLE)
        return _INT_CODES[code], byteswap
    if code[:1] in _FLOAT_CODES:
        raise TypeError(f"{what} must hold integers, not a buffer of format {fmt!r}")
    raise TypeError(f"unsupported {what} buffer format {fmt!r}: need int32 or int64")


def _check_out_format(fmt: str, itemsize: int) -> None:
    """``out`` of decode_tokens_into must be native int32."""
    signed, byteswap = _int_format(fmt, itemsize, "out")
    if not (signed and itemsize == 4 and not byteswap):
        raise TypeError(f"out must hold int32, not a buffer of format {fmt!r} (itemsize {itemsize})")


def _tensor_as_numpy(obj: object, what: str) -> Any:
    """A CPU torch tensor as a numpy array sharing its memory, else None.

    torch is never imported here: if ``obj`` is a tensor, torch is loaded.
    """
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(obj, torch.Tensor):
        return None
    if obj.device.type != "cpu":
        raise TypeError(f"{what} is a {obj.device.type} tensor: move it to the CPU first")
    if obj.is_floating_point() or obj.is_complex():
        raise TypeError(f"{what} must hold integers, not a tensor of {obj.dtype}")
    return obj.detach().numpy()


# ------------------------------------------------------------------ encode


def _sequence_to_int32(ids: list[Any] | tuple[Any, ...]) -> np.ndarray:
    count = len(ids)
    values = np.empty(count, dtype="<i4")
    for index in range(count):
        item = ids[index]
        if type(item) is not int and type(item) is not bool:
            if not hasattr(type(item), "__index__"):
                raise _not_integer_error(index, item)
            item = operator.index(item)
            if len(ids) != count:  # __index__ ran arbitrary code
                raise _changed_size_error()
        if not INT32_MIN <= item <= INT32_MAX:
            raise _out_of_range_error(index)
        values[index] = item
    return values


def _buffer_to_int32(view: memoryview) -> np.ndarray:
    if view.ndim != 1:
        raise _ndim_error(view.ndim)
    signed, _ = _int_format(view.format, view.itemsize, "ids")
    array = np.asarray(view)  # honours strides and byte order
    if view.itemsize >= 4 and not (signed and view.itemsize == 4):
        bad = (array < INT32_MIN) | (array > INT32_MAX) if signed else array > INT32_MAX
        if bad.any():
            raise _out_of_range_error(int(np.argmax(bad)))
    return array.astype("<i4")


def encode_tokens(ids: Any) -> bytes:
    """Standard base64 of ``ids`` as little-endian int32."""
    if isinstance(ids, (list, tuple)):
        values = _sequence_to_int32(ids)
    elif isinstance(ids, (bytes, bytearray)):
        # bytes are base64 input or text, never ids: most likely a mix-up.
        raise _ids_type_error(ids)
    else:
        try:
            view = memoryview(ids)
        except TypeError:
            tensor = _tensor_as_numpy(ids, "ids")
            if tensor is None:
                raise _ids_type_error(ids) from None
            view = memoryview(tensor)
        values = _buffer_to_int32(view)
    return base64.b64encode(values.tobytes())


# ------------------------------------------------------------------ decode


def _source_bytes(data: Any) -> bytes:
    if isinstance(data, str):
        if not data.isascii():
            raise _non_ascii_error(data)
        return data.encode("ascii")
    if isinstance(data, bytes):
        return bytes(data)
    try:
        view = memoryview(data)
    except TypeError:
        raise _data_type_error(data) from None
    if not view.c_contiguous:
        raise TypeError("data buffer must be C-contiguous")
    return view.tobytes()


def _pad_count(raw: bytes) -> int:
    """How many ``=`` end ``raw`` as padding (at most 2)."""
    if not raw or raw[-1] != 0x3D:
        return 0
    return 2 if len(raw) >= 2 and raw[-2] == 0x3D else 1


def _char_error(raw: bytes) -> TokenDecodeError | None:
    """The error for the first byte of ``raw`` that is no base64 character (or a ``=`` that is
    no final padding), whatever the length; None when there is none.

    The length checks consult it before they raise: a bad character is what a caller needs
    to hear about first (it usually explains the length too).
    """
    bad = _NOT_BASE64.search(raw, 0, len(raw) - _pad_count(raw))
    if bad is None:
        return None
    offset = bad.start()
    byte = raw[offset]
    return _decode_error(MISPLACED_PAD if byte == 0x3D else BAD_CHAR, offset, byte)


def _token_count(raw: bytes, max_tokens: object) -> int:
    """Checks everything that the length alone decides; returns the id count."""
    length = len(raw)
    limit = -1 if max_tokens is None else _max_tokens_limit(max_tokens)
    if length % 4:
        raise _char_error(raw) or _length_error(length)
    nbytes = length // 4 * 3 - _pad_count(raw)
    if limit >= 0 and nbytes // 4 > limit:
        raise _char_error(raw) or _too_many_error(nbytes // 4, limit)
    if nbytes % 4:
        raise _char_error(raw) or _partial_id_error(nbytes)
    return nbytes // 4


def _decode_validated(raw: bytes) -> bytes:
    """The decoded bytes of ``raw``, whose length _token_count accepted."""
    length = len(raw)
    pad = _pad_count(raw)
    error = _char_error(raw)
    if error is not None:
        raise error
    if pad:
        last = length - pad - 1
        if _ALPHABET_VALUE[raw[last]] & (3 if pad == 1 else 15):
            raise _decode_error(NONZERO_PAD_BITS, last, raw[last])
    return binascii.a2b_base64(raw)


def decode_tokens(data: Any, *, max_tokens: int | None = None) -> np.ndarray:
    """The ids in ``data`` as a new 1-D int32 array that owns its memory."""
    raw = _source_bytes(data)
    _token_count(raw, max_tokens)
    return np.frombuffer(_decode_validated(raw), dtype="<i4").astype(np.int32)


def decode_tokens_list(data: Any, *, max_tokens: int | None = None) -> list[int]:
    """The ids in ``data`` as a list of int."""
    raw = _source_bytes(data)
    _token_count(raw, max_tokens)
    ids: list[int] = np.frombuffer(_decode_validated(raw), dtype="<i4").tolist()
    return ids


def decode_tokens_into(data: Any, out: Any, *, max_tokens: int | None = None) -> int:
    """Decodes into the writable int32 buffer ``out``; returns the id count.

    On error the contents of ``out`` are unspecified.
    """
    raw = _source_bytes(data)
    try:
        view = memoryview(out)
    except TypeError:
        tensor = _tensor_as_numpy(out, "out")
        if tensor is None:
            raise TypeError(f"out must be a writable int32 buffer, not {type(out).__name__}") from None
        view = memoryview(tensor)
    if view.readonly:
        raise TypeError("out buffer is read-only")
    _check_out_format(view.format, view.itemsize)
    if not view.c_contiguous:
        raise TypeError("out buffer must be C-contiguous")
    count = _token_count(raw, max_tokens)
    capacity = view.nbytes // 4
    if count > capacity:
        raise _out_capacity_error(capacity, count)
    target = np.frombuffer(view.cast("B"), dtype=np.int32)
    target[:count] = np.frombuffer(_decode_validated(raw), dtype="<i4")
    return count


# ---------------------------------------------------- relayed base64 check

_B64_RUN = re.compile(rb"[A-Za-z0-9+/]*")


def check_token_b64(body: bytes | bytearray | memoryview, start: int = 0, end: int | None = None) -> int:
    """Check that ``body[start:end]`` is ``prompt_token_ids_b64`` content; return the id count.

    Standard alphabet, ``=`` padding only at the end, length a multiple of 4,
    canonical (unused bits zero), decoding to a whole number of int32s. No
    escapes: the bytes are relayed verbatim, so they must be the data itself.
    Raises :class:`fastcore.TokenDecodeError` with the absolute byte offset.
    """
    buf = _as_bytes(body)
    size = len(buf)
    if end is None:
        end = size
    if not 0 <= start <= end <= size:
        raise ValueError(f"need 0 <= start <= end <= len(body) = {size}, got ({start}, {end})")
    i = _B64_RUN.match(buf, start, end).end()  # type: ignore[union-attr]
    data_end = i
    padding = 0
    while i < end and buf[i] == ord("=") and padding < 2:
        padding += 1
        i += 1
    if i < end:
        if padding:
            raise TokenDecodeError(
                f"base64 padding '=' before the end of the data (byte {data_end})", data_end
            )
        raise TokenDecodeError(f"invalid base64 character {chr(buf[i])!r} (byte {i})", i)
    length = end - start
    if length % 4:
        raise TokenDecodeError(f"base64 length {length} is not a multiple of 4", None)
    if padding:
        last = _ALPHABET_VALUE[buf[data_end - 1]] if data_end > start else 0
        if data_end == start or last & (0x0F if padding == 2 else 0x03):
            raise TokenDecodeError(f"non-canonical base64 padding (byte {data_end - 1})", data_end - 1)
    decoded = length // 4 * 3 - padding
    if decoded % 4:
        raise TokenDecodeError(f"base64 decodes to {decoded} bytes, not a whole number of int32 ids", None)
    return decoded // 4


__all__ = ["check_token_b64", "decode_tokens", "decode_tokens_into", "decode_tokens_list", "encode_tokens"]
