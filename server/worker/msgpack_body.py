"""A msgpack request body read into Python values, held to the JSON policy.

trtllm-serve's orchestrator (TRTLLM_SERVE_ENABLE_MSGSPEC=1) sends leg bodies as
msgpack, flagged ``X-TRTLLM-Msgpack: 1`` with Content-Type application/json.
:func:`load_msgpack_body` decodes such a body once, into the dict ``json.loads``
would give for its JSON twin, which the reader then validates field by field as
any JSON body's (the same 400s naming the same fields). On the way it holds
msgpack to the JSON policy: a map (object) at the top, string keys, no key twice
at the top level, in ``disaggregated_params`` or ``stream_options`` (msgspec
keeps the last copy, as json.loads does), nesting within
fastcore.JSON_MAX_DEPTH, and only values JSON can carry (no bin, ext, NaN or
infinity). Number lengths need no check: msgpack integers are at most 64 bits
and floats doubles, far inside fastcore.JSON_MAX_NUMBER_CHARS; strings need no
lone-surrogate check: msgspec refuses a surrogate's UTF-8 bytes.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from fastcore import protocol as wire
from server.errors import HTTPError

from .json_body import CHECKED_OBJECTS, MAX_NESTING, bad_request, brief

_MSGPACK_MAP = msgspec.msgpack.Decoder(dict[str, msgspec.Raw])
#: an array of integers only (msgspec refuses a bool or a float for ``int``)
_MSGPACK_INTS = msgspec.msgpack.Decoder(list[int])
#: the fields that carry a prompt's token ids as a list
_ID_FIELDS = frozenset({wire.PROMPT_TOKEN_IDS, wire.PROMPT})
_MSGPACK_ITEMS = msgspec.msgpack.Decoder(list[msgspec.Raw])
_MSGPACK_ANY = msgspec.msgpack.Decoder()
#: list elements that need no look inside (floats do: NaN and infinity)
_LEAF_TYPES = frozenset({str, int, bool, type(None)})


class TokenIds(list):
    """A msgpack array that decoded as integers only: a list like any other (it equals its JSON
    twin's), which the reader turns into an array without looking at each element's type again."""

    __slots__ = ()


def _token_ids(data: msgspec.Raw) -> TokenIds | None:
    """``data`` as :class:`TokenIds` when it is a msgpack array of integers, else None (the general
    path decodes and checks it)."""
    head = memoryview(data)[0] if len(data) else 0
    if not (0x90 <= head <= 0x9F or head in (0xDC, 0xDD)):
        return None
    try:
        return TokenIds(_MSGPACK_INTS.decode(data))
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None


def _msgpack_map_header(data: bytes | memoryview) -> tuple[int, int] | None:
    """(entries, header bytes) of the msgpack map ``data`` starts with, None when it is no map."""
    head = data[0]
    if 0x80 <= head <= 0x8F:
        return head & 0x0F, 1
    if head == 0xDE:
        return int.from_bytes(data[1:3], "big"), 3
    if head == 0xDF:
        return int.from_bytes(data[1:5], "big"), 5
    return None


def _msgpack_repeated_key(data: bytes | memoryview, entries: int, header: int) -> str:
    """The first key the map ``data`` holds twice: its entries read again as a flat array of
    2 * ``entries`` undecoded items (an array header in place of the map's)."""
    count = 2 * entries
    if count <= 15:
        array_header = bytes([0x90 | count])
    elif count <= 0xFFFF:
        array_header = b"\xdc" + count.to_bytes(2, "big")
    else:
        array_header = b"\xdd" + count.to_bytes(4, "big")
    items = _MSGPACK_ITEMS.decode(array_header + bytes(data[header:]))
    seen: set[str] = set()
    for item in items[::2]:
        key = msgspec.msgpack.decode(item)
        if key in seen:
            return str(key)
        seen.add(key)
    raise AssertionError("a map with fewer keys than entries repeats one")  # pragma: no cover


def _msgpack_map(data: bytes | memoryview, parent: str | None) -> dict[str, msgspec.Raw]:
    """The msgpack map ``data`` (the body, or the value of its key ``parent``) with its values
    undecoded; a 400 for anything else, for a key that is not a string, or a repeated key."""
    where = "request body" if parent is None else f"'{parent}'"
    try:
        members = _MSGPACK_MAP.decode(data)
    except msgspec.ValidationError as exc:
        if "Expected `object`" in str(exc):
            what = "a JSON object (msgpack map)" if parent is None else "an object"
            raise bad_request(f"{where} must be {what}", parent) from None
        raise bad_request(f"{where}: msgpack map keys must be strings", parent) from None
    except msgspec.DecodeError as exc:
        raise bad_request(f"request body is not valid msgpack: {exc}", parent) from None
    except RecursionError:
        raise _msgpack_too_deep(parent) from None
    header = _msgpack_map_header(data)
    assert header is not None  # it decoded as a map
    if len(members) < header[0]:
        key = _msgpack_repeated_key(data, *header)
        name = key if parent is None else f"{parent}.{key}"
        raise bad_request(
            f"request body has the key '{name}' more than once: parsers differ on which one counts",
            key if parent is None else parent,
        )
    return members


def _msgpack_too_deep(param: str | None) -> HTTPError:
    return bad_request(
        f"request body rejected: msgpack nests arrays and maps deeper than the limit of {MAX_NESTING} levels",
        param,
    )


def _check_msgpack_value(value: Any, depth: int, path: str, param: str) -> None:
    """``value`` (at ``depth``, the body being 1) is JSON's: a 400 naming ``path`` otherwise.

    A list of strings, integers, booleans and nulls (a prompt's token ids) is
    looked at in one pass over its element types, not element by element.
    """
    kind = type(value)
    if kind is list or kind is dict:
        if depth > MAX_NESTING:
            raise _msgpack_too_deep(param)
        if kind is list:
            if not set(map(type, value)) <= _LEAF_TYPES:
                for i, item in enumerate(value):
                    _check_msgpack_value(item, depth + 1, f"{path}[{i}]", param)
            return
        for key, item in value.items():
            if type(key) is not str:
                raise bad_request(f"'{path}': msgpack map keys must be strings (got {brief(key)})", param)
            _check_msgpack_value(item, depth + 1, f"{path}.{key}", param)
    elif kind is float:
        if not math.isfinite(value):
            raise bad_request(f"'{path}' is {value}, which JSON cannot carry", param)
    elif kind not in _LEAF_TYPES:
        what = "bin" if kind is bytes else "ext" if kind is msgspec.msgpack.Ext else kind.__name__
        raise bad_request(f"'{path}' is a msgpack {what} value, which JSON cannot carry", param)


def _msgpack_value(data: msgspec.Raw, depth: int, path: str, param: str) -> Any:
    try:
        value = _MSGPACK_ANY.decode(data)
    except RecursionError:
        raise _msgpack_too_deep(param) from None
    except msgspec.DecodeError as exc:  # a value's insides (its strings' UTF-8) are read only here
        raise bad_request(f"request body is not valid msgpack: {exc} (in '{path}')", param) from None
    _check_msgpack_value(value, depth, path, param)
    return value


def load_msgpack_body(raw: bytes) -> dict[str, Any]:
    """The msgpack body ``raw`` as the dict of the same object; a 400 where msgpack says what JSON
    cannot or fastcore's JSON policy refuses."""
    if not raw:
        raise bad_request("request body is not valid msgpack: it is empty")
    body: dict[str, Any] = {}
    for key, data in _msgpack_map(raw, None).items():
        if key in CHECKED_OBJECTS and _msgpack_map_header(memoryview(data)) is not None:
            # Two levels of nesting are the body and this object: its values start at depth 3.
            body[key] = {
                name: _msgpack_value(item, 3, f"{key}.{name}", key)
                for name, item in _msgpack_map(memoryview(data), key).items()
            }
        elif key in _ID_FIELDS and (ids := _token_ids(data)) is not None:
            body[key] = ids  # integers: nothing in them for JSON's policy to refuse
        else:
            body[key] = _msgpack_value(data, 2, key, key)
    return body


__all__ = ["TokenIds", "load_msgpack_body"]
