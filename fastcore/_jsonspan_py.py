"""JSON span scanner, pure-Python twin of ``fastcore._jsonspan``.

One iterative pass over raw JSON bytes that validates the grammar (RFC 8259)
and records the byte spans of the values at a few requested paths, so a
server can cut a field out of a body, or splice one in, without building
Python objects for the rest of the document.

The compiled twin walks the same state machine byte by byte; this twin takes
the same decisions but lets ``re`` and the UTF-8 codec consume the long runs
(string bodies, arrays of numbers). Every input gives both twins the same
spans, or the same exception with the same message and byte offset: the
tests hold them to that on the JSONTestSuite corpus and on generated bodies.

Semantics shared by both twins:

- A path is a tuple of object keys (``str``) and array indexes (``int``).
  ``-1`` as the *last* component means the last element of the array (the
  scan is single-pass, so only the final component may be negative).
- Keys match as a parser decodes them (``"a\\u0062"`` is the key ``ab``);
  a lone surrogate escape matches the same lone surrogate in the path.
- A key that some path needs, met twice in the same object, raises
  ``JSONSpanError``: parsers disagree on which occurrence wins.
- ``validate=True`` (default) checks the whole document: grammar, escapes,
  UTF-8 in strings (overlongs, encoded surrogates and code points above
  U+10FFFF are rejected; lone surrogate *escapes* are accepted, as Python's
  ``json`` does). A byte order mark is rejected.
- ``validate=False`` still walks the containers on the requested paths with
  the full grammar, but skips every other container by bracket counting and
  every string by looking for its closing quote only, without checking what
  lies inside. It never reads outside the body.
- The limits of :mod:`fastcore.limits` hold in both modes: a container opened
  deeper than ``JSON_MAX_DEPTH`` levels (the document is level 1) raises at its
  bracket, skipped containers included; a number token longer than
  ``JSON_MAX_NUMBER_CHARS`` raises at its first byte once the token is scanned
  (``validate=False`` does not look at the numbers inside skipped containers).
  Either ``JSONSpanError`` has ``limit`` set to the constant's name.
"""

from __future__ import annotations

import json
import operator
import re
from collections.abc import Iterable, Sequence

import numpy as np

from . import protocol as P
from .errors import JSONSpanError, RelayError, TokenDecodeError
from .limits import JSON_MAX_DEPTH, JSON_MAX_NUMBER_CHARS

Path = tuple[str | int, ...]
Span = tuple[int, int]

# Status codes shared with the compiled twin; one table turns them into messages.
E_EOF = 1
E_VALUE = 2
E_OBJECT_SEPARATOR = 3
E_ARRAY_SEPARATOR = 4
E_KEY = 5
E_COLON = 6
E_TRAILING = 7
E_CONTROL = 8
E_ESCAPE = 9
E_UNICODE_ESCAPE = 10
E_UTF8 = 11
E_DIGIT = 12
E_LITERAL = 13
E_DUPLICATE_KEY = 14
E_DEPTH = 15
E_NUMBER_LENGTH = 16

MESSAGES = {
    E_EOF: "JSON is malformed: unexpected end of data",
    E_VALUE: "JSON is malformed: expected a value",
    E_OBJECT_SEPARATOR: "JSON is malformed: expected ',' or '}'",
    E_ARRAY_SEPARATOR: "JSON is malformed: expected ',' or ']'",
    E_KEY: "JSON is malformed: expected '\"' to start an object key",
    E_COLON: "JSON is malformed: expected ':'",
    E_TRAILING: "JSON is malformed: trailing characters after the value",
    E_CONTROL: "JSON is malformed: unescaped control character in string",
    E_ESCAPE: "JSON is malformed: invalid escape",
    E_UNICODE_ESCAPE: "JSON is malformed: invalid \\u escape",
    E_UTF8: "JSON is malformed: invalid UTF-8 in string",
    E_DIGIT: "JSON is malformed: expected a digit",
    E_LITERAL: "JSON is malformed: invalid literal",
    E_DEPTH: f"JSON nests arrays and objects deeper than the limit of {JSON_MAX_DEPTH} levels",
    E_NUMBER_LENGTH: f"JSON has a number longer than the limit of {JSON_MAX_NUMBER_CHARS} characters",
}
_LIMITS = {E_DEPTH: "JSON_MAX_DEPTH", E_NUMBER_LENGTH: "JSON_MAX_NUMBER_CHARS"}


def make_error(code: int, offset: int, key: str | None = None) -> JSONSpanError:
    """The one place status codes become exceptions (the compiled twin calls it too)."""
    if code == E_DUPLICATE_KEY:
        return JSONSpanError(
            f"JSON has duplicate key {key!r} in one object on the requested path", offset, key=key
        )
    return JSONSpanError(MESSAGES[code], offset, _LIMITS.get(code))


class _Fail(Exception):
    def __init__(self, code: int, offset: int, key: str | None = None) -> None:
        self.code = code
        self.offset = offset
        self.key = key


_WS = re.compile(rb"[ \t\n\r]*")
# A run of string bytes that need no decision: everything but quote, backslash and controls.
_STRING_RUN = re.compile(rb'[^"\\\x00-\x1f]*')
_STRING_RUN_UNCHECKED = re.compile(rb'[^"\\]*')
_SKIP_RUN = re.compile(rb'[^"\[\]{}]*')
_NUMBER = re.compile(rb"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
# Token-id lists dominate our bodies; one match consumes a well-formed one. On
# anything else the byte-level path below runs and finds the exact error. Its
# numbers are bounded so that none it takes passes JSON_MAX_NUMBER_CHARS
# (3 * _RUN + 5 characters at most); a longer one fails the match and the
# byte-level path decides.
_RUN = (JSON_MAX_NUMBER_CHARS - 5) // 3
_BOUNDED_NUMBER = rb"-?(?:0|[1-9][0-9]{0,%d})(?:\.[0-9]{1,%d})?(?:[eE][+-]?[0-9]{1,%d})?" % (_RUN, _RUN, _RUN)
_NUMBER_ARRAY = re.compile(
    rb"\[[ \t\n\r]*(?:" + _BOUNDED_NUMBER + rb"[ \t\n\r]*,[ \t\n\r]*)*+" + _BOUNDED_NUMBER + rb"[ \t\n\r]*\]"
)
_HEX = frozenset(b"0123456789abcdefABCDEF")
_DIGITS = frozenset(b"0123456789")
_SIMPLE_ESCAPES = {
    ord('"'): b'"',
    ord("\\"): b"\\",
    ord("/"): b"/",
    ord("b"): b"\b",
    ord("f"): b"\f",
    ord("n"): b"\n",
    ord("r"): b"\r",
    ord("t"): b"\t",
}
_OPEN_OBJECT, _CLOSE_OBJECT, _OPEN_ARRAY, _CLOSE_ARRAY = b"{}[]"
_QUOTE, _BACKSLASH, _COMMA, _COLON = b'"\\,:'


class _Node:
    """One step of the compiled path set: a value some path passes through or ends at."""

    __slots__ = ("items", "key_start", "keys", "label", "last", "last_span", "seen", "span", "terminal")

    def __init__(self, label: str | int | None) -> None:
        self.label = label
        self.keys: dict[bytes, _Node] = {}
        self.items: dict[int, _Node] = {}
        self.last = False  # some path ends with -1 here
        self.terminal = False  # some path ends here
        self.seen = False
        self.span: Span | None = None
        self.key_start = -1
        self.last_span: Span | None = None


def _compile(paths: Iterable[Sequence[str | int]]) -> tuple[_Node, list[tuple[_Node, bool]]]:
    root = _Node(None)
    ends: list[tuple[_Node, bool]] = []
    for path in paths:
        if isinstance(path, (str, bytes, bytearray, memoryview)) or not isinstance(path, Sequence):
            raise TypeError(f"a path must be a tuple of str keys and int indexes, not {type(path).__name__}")
        node = root
        is_last = False
        for depth, component in enumerate(path):
            if isinstance(component, bool) or not isinstance(component, (str, int)):
                raise TypeError(
                    f"path component {component!r} must be a str key or an int index, "
                    f"not {type(component).__name__}"
                )
            if isinstance(component, int) and component < 0:
                if component != -1 or depth != len(path) - 1:
                    raise ValueError(
                        f"path {tuple(path)!r}: only -1 (the last element) is supported as a "
                        "negative index, and only as the final component"
                    )
                node.last = True
                is_last = True
                break
            if isinstance(component, str):
                key = component.encode("utf-8", "surrogatepass")
                child = node.keys.get(key)
                if child is None:
                    child = node.keys[key] = _Node(component)
            else:
                child = node.items.get(component)
                if child is None:
                    child = node.items[component] = _Node(component)
            node = child
        if not is_last:
            node.terminal = True
        ends.append((node, is_last))
    return root, ends


def _body_view(body: object) -> memoryview:
    """``body`` as a flat byte view; the same errors, worded the same, as the compiled twin."""
    try:
        view = memoryview(body)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"body must be bytes-like, not {type(body).__name__}") from None
    if not view.c_contiguous:
        raise BufferError("body must be a contiguous buffer")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _as_bytes(body: object) -> bytes:
    return body if isinstance(body, bytes) else _body_view(body).tobytes()


def _skip_ws(buf: bytes, pos: int) -> int:
    return _WS.match(buf, pos).end()  # type: ignore[union-attr]


def _scan_string(buf: bytes, pos: int, n: int, validate: bool) -> tuple[int, bool]:
    """End (past the closing quote) of the string opening at ``pos``, and whether it has escapes."""
    i = pos + 1
    escaped = False
    if not validate:
        while True:
            j = _STRING_RUN_UNCHECKED.match(buf, i).end()  # type: ignore[union-attr]
            if j >= n:
                raise _Fail(E_EOF, n)
            if buf[j] == _QUOTE:
                return j + 1, escaped
            escaped = True
            if j + 1 >= n:
                raise _Fail(E_EOF, n)
            i = j + 2
    while True:
        j = _STRING_RUN.match(buf, i).end()  # type: ignore[union-attr]
        if j > i and not buf[i:j].isascii():
            try:
                buf[i:j].decode("utf-8")
            except UnicodeDecodeError as exc:
                raise _Fail(E_UTF8, i + exc.start) from None
        if j >= n:
            raise _Fail(E_EOF, n)
        c = buf[j]
        if c == _QUOTE:
            return j + 1, escaped
        if c != _BACKSLASH:
            raise _Fail(E_CONTROL, j)
        escaped = True
        if j + 1 >= n:
            raise _Fail(E_EOF, n)
        e = buf[j + 1]
        if e in _SIMPLE_ESCAPES:
            i = j + 2
        elif e == ord("u"):
            for k in range(j + 2, j + 6):
                if k >= n:
                    raise _Fail(E_EOF, n)
                if buf[k] not in _HEX:
                    raise _Fail(E_UNICODE_ESCAPE, j)
            i = j + 6
        else:
            raise _Fail(E_ESCAPE, j)


def _hex4(buf: bytes, start: int, end: int) -> int:
    """The code unit of ``\\uXXXX`` whose hex digits start at ``start``, or -1."""
    if start + 4 > end:
        return -1
    value = 0
    for k in range(start, start + 4):
        c = buf[k]
        if c not in _HEX:
            return -1
        value = value * 16 + int(chr(c), 16)
    return value


def _decode_key(buf: bytes, start: int, end: int) -> bytes:
    """The key between ``start`` and ``end`` (no quotes) unescaped to UTF-8 (lone surrogates kept)."""
    out = bytearray()
    i = start
    while i < end:
        c = buf[i]
        if c != _BACKSLASH:
            out.append(c)
            i += 1
            continue
        e = buf[i + 1]  # a string never ends in an unpaired backslash
        simple = _SIMPLE_ESCAPES.get(e)
        if simple is not None:
            out += simple
            i += 2
            continue
        if e != ord("u"):
            raise _Fail(E_ESCAPE, i)
        unit = _hex4(buf, i + 2, end)
        if unit < 0:
            raise _Fail(E_UNICODE_ESCAPE, i)
        i += 6
        if 0xD800 <= unit < 0xDC00 and i + 1 < end and buf[i] == _BACKSLASH and buf[i + 1] == ord("u"):
            low = _hex4(buf, i + 2, end)
            if 0xDC00 <= low < 0xE000:
                unit = 0x10000 + ((unit - 0xD800) << 10) + (low - 0xDC00)
                i += 6
        out += chr(unit).encode("utf-8", "surrogatepass")
    return bytes(out)


def _scan_number(buf: bytes, pos: int, n: int) -> int:
    """Past the number at ``pos``; a malformed one fails where it breaks, a long one at ``pos``."""
    end = _number_end(buf, pos, n)
    if end - pos > JSON_MAX_NUMBER_CHARS:
        raise _Fail(E_NUMBER_LENGTH, pos)
    return end


def _number_end(buf: bytes, pos: int, n: int) -> int:
    m = _NUMBER.match(buf, pos)
    if m is not None:
        end = m.end()
        if end >= n or buf[end] not in b".eE":
            return end
    # Byte by byte, to stop where the compiled twin stops.
    i = pos
    if buf[i] == ord("-"):
        i += 1
    if i >= n:
        raise _Fail(E_EOF, n)
    c = buf[i]
    if c == ord("0"):
        i += 1
    elif c in _DIGITS:
        i += 1
        while i < n and buf[i] in _DIGITS:
            i += 1
    else:
        raise _Fail(E_DIGIT, i)
    if i < n and buf[i] == ord("."):
        i += 1
        if i >= n:
            raise _Fail(E_EOF, n)
        if buf[i] not in _DIGITS:
            raise _Fail(E_DIGIT, i)
        while i < n and buf[i] in _DIGITS:
            i += 1
    if i < n and buf[i] in b"eE":
        i += 1
        if i < n and buf[i] in b"+-":
            i += 1
        if i >= n:
            raise _Fail(E_EOF, n)
        if buf[i] not in _DIGITS:
            raise _Fail(E_DIGIT, i)
        while i < n and buf[i] in _DIGITS:
            i += 1
    return i


def _scan_literal(buf: bytes, pos: int, n: int, word: bytes) -> int:
    if buf.startswith(word, pos):
        return pos + len(word)
    for k, expected in enumerate(word):
        if pos + k >= n:
            raise _Fail(E_EOF, n)
        if buf[pos + k] != expected:
            raise _Fail(E_LITERAL, pos + k)
    raise AssertionError("unreachable")  # pragma: no cover


def _skip_container(buf: bytes, pos: int, n: int, outer: int) -> int:
    """Past the container opening at ``pos``, by bracket counting only (``validate=False``).

    ``outer``: the containers open around it; the depth limit counts them too.
    """
    limit = JSON_MAX_DEPTH - outer
    depth = 0
    i = pos
    while True:
        j = _SKIP_RUN.match(buf, i).end()  # type: ignore[union-attr]
        if j >= n:
            raise _Fail(E_EOF, n)
        c = buf[j]
        if c == _QUOTE:
            i, _ = _scan_string(buf, j, n, False)
            continue
        if c == _OPEN_OBJECT or c == _OPEN_ARRAY:
            depth += 1
            if depth > limit:
                raise _Fail(E_DEPTH, j)
        else:
            depth -= 1
        i = j + 1
        if depth == 0:
            return i


class _Frame:
    __slots__ = ("elem_start", "index", "is_object", "last_span", "node", "start")

    def __init__(self, is_object: bool, node: _Node | None, start: int) -> None:
        self.is_object = is_object
        self.node = node
        self.start = start
        self.index = 0
        self.elem_start = -1
        self.last_span: Span | None = None


def _scan(buf: bytes, root: _Node | None, validate: bool) -> None:
    """Validate ``buf`` (as ``validate`` asks) and fill in the spans of the nodes under ``root``."""
    n = len(buf)
    stack: list[_Frame] = []
    pos = _skip_ws(buf, 0)
    node = root  # the path node of the value about to be parsed
    expecting_key = False
    while True:
        if expecting_key:
            # At the first non-blank byte where a member of the innermost object starts.
            frame = stack[-1]
            if pos >= n:
                raise _Fail(E_EOF, n)
            if buf[pos] != _QUOTE:
                raise _Fail(E_KEY, pos)
            key_start = pos
            pos, escaped = _scan_string(buf, pos, n, validate)
            node = None
            parent = frame.node
            if parent is not None and parent.keys:
                key = _decode_key(buf, key_start + 1, pos - 1) if escaped else buf[key_start + 1 : pos - 1]
                node = parent.keys.get(key)
                if node is not None:
                    if node.seen:
                        raise _Fail(E_DUPLICATE_KEY, key_start, node.label)  # type: ignore[arg-type]
                    node.seen = True
                    node.key_start = key_start
            pos = _skip_ws(buf, pos)
            if pos >= n:
                raise _Fail(E_EOF, n)
            if buf[pos] != _COLON:
                raise _Fail(E_COLON, pos)
            pos = _skip_ws(buf, pos + 1)
            expecting_key = False

        # Parse one value at pos (non-blank or end of data) for `node`.
        if pos >= n:
            raise _Fail(E_EOF, n)
        start = pos
        c = buf[pos]
        value_node = node
        if c == _QUOTE:
            pos, _ = _scan_string(buf, pos, n, validate)
        elif c == ord("-") or c in _DIGITS:
            pos = _scan_number(buf, pos, n)
        elif c == ord("t"):
            pos = _scan_literal(buf, pos, n, b"true")
        elif c == ord("f"):
            pos = _scan_literal(buf, pos, n, b"false")
        elif c == ord("n"):
            pos = _scan_literal(buf, pos, n, b"null")
        elif c == _OPEN_OBJECT or c == _OPEN_ARRAY:
            if len(stack) >= JSON_MAX_DEPTH:
                raise _Fail(E_DEPTH, pos)
            is_object = c == _OPEN_OBJECT
            descend = node is not None and (bool(node.keys) if is_object else bool(node.items) or node.last)
            if not descend and not validate:
                pos = _skip_container(buf, pos, n, len(stack))
            elif not descend and not is_object and (m := _NUMBER_ARRAY.match(buf, pos)) is not None:
                pos = m.end()
            else:
                frame = _Frame(is_object, node, start)
                stack.append(frame)
                pos = _skip_ws(buf, pos + 1)
                if pos >= n:
                    raise _Fail(E_EOF, n)
                closer = _CLOSE_OBJECT if is_object else _CLOSE_ARRAY
                if buf[pos] != closer:
                    if is_object:
                        expecting_key = True
                        continue
                    node = frame.node.items.get(0) if frame.node is not None else None
                    frame.elem_start = pos
                    continue
                pos += 1
                stack.pop()
                _close(frame)
        else:
            raise _Fail(E_VALUE, pos)
        if value_node is not None and value_node.terminal:
            value_node.span = (start, pos)

        # After a value: separators and closers, possibly several levels up.
        while True:
            if not stack:
                pos = _skip_ws(buf, pos)
                if pos != n:
                    raise _Fail(E_TRAILING, pos)
                return
            frame = stack[-1]
            if not frame.is_object and frame.node is not None and frame.node.last:
                frame.last_span = (frame.elem_start, pos)
            pos = _skip_ws(buf, pos)
            if pos >= n:
                raise _Fail(E_EOF, n)
            c = buf[pos]
            if c == _COMMA:
                pos = _skip_ws(buf, pos + 1)
                if frame.is_object:
                    expecting_key = True
                else:
                    frame.index += 1
                    node = frame.node.items.get(frame.index) if frame.node is not None else None
                    frame.elem_start = pos
                break
            if c != (_CLOSE_OBJECT if frame.is_object else _CLOSE_ARRAY):
                raise _Fail(E_OBJECT_SEPARATOR if frame.is_object else E_ARRAY_SEPARATOR, pos)
            pos += 1
            stack.pop()
            _close(frame)
            if frame.node is not None and frame.node.terminal:
                frame.node.span = (frame.start, pos)


def _close(frame: _Frame) -> None:
    if frame.node is not None and frame.node.last and not frame.is_object:
        frame.node.last_span = frame.last_span


def _run(
    body: object, paths: Iterable[Sequence[str | int]], validate: bool
) -> tuple[bytes, list[tuple[_Node, bool]]]:
    buf = _as_bytes(body)
    root, ends = _compile(paths)
    try:
        _scan(buf, root, bool(validate))
    except _Fail as fail:
        raise make_error(fail.code, fail.offset, fail.key) from None
    return buf, ends


def find_spans(
    body: bytes | bytearray | memoryview, paths: Iterable[Sequence[str | int]], *, validate: bool = True
) -> list[Span | None]:
    """Half-open byte spans of the values at ``paths`` (``None`` where absent), in one pass."""
    _, ends = _run(body, paths, validate)
    return [node.last_span if is_last else node.span for node, is_last in ends]


def find_span(
    body: bytes | bytearray | memoryview, path: Sequence[str | int], *, validate: bool = True
) -> Span | None:
    """Half-open byte span of the value at ``path`` (a string's span includes its quotes), or ``None``."""
    return find_spans(body, [path], validate=validate)[0]


def find_member_spans(
    body: bytes | bytearray | memoryview, paths: Iterable[Sequence[str | int]], *, validate: bool = True
) -> list[Span | None]:
    """Like :func:`find_spans`, but a path ending in a key spans the whole member, key to value.

    Deleting a member then means cutting this span plus one adjacent comma.
    """
    _, ends = _run(body, paths, validate)
    spans: list[Span | None] = []
    for node, is_last in ends:
        if is_last:
            spans.append(node.last_span)
        elif node.span is not None and isinstance(node.label, str):
            spans.append((node.key_start, node.span[1]))
        else:
            spans.append(node.span)
    return spans


def splice(body: bytes | bytearray | memoryview, edits: Iterable[Sequence[object]]) -> bytes:
    """``body`` with each ``(start, end, replacement)`` applied; edits sorted, non-overlapping.

    Several edits may share a position (insertions land in the given order).
    The output is allocated once; pieces of ``body`` and the replacements are
    copied straight into it.
    """
    view = _body_view(body)
    size = len(view)
    pieces: list[object] = []
    previous = 0
    for number, edit in enumerate(edits):
        try:
            start, end, replacement = edit
        except (TypeError, ValueError):
            raise TypeError(f"edit {number} must be a (start, end, replacement) tuple") from None
        if (
            isinstance(start, bool)
            or isinstance(end, bool)
            or not isinstance(start, int)
            or not isinstance(end, int)
        ):
            raise TypeError(f"edit {number}: start and end must be ints")
        if not 0 <= start <= end <= size:
            raise ValueError(
                f"edit {number}: need 0 <= start <= end <= len(body) = {size}, got ({start}, {end})"
            )
        if start < previous:
            raise ValueError(f"edit {number}: starts at {start}, before the previous edit ends ({previous})")
        try:
            piece = memoryview(replacement)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(
                f"edit {number}: replacement must be bytes-like, not {type(replacement).__name__}"
            ) from None
        if not piece.c_contiguous:
            raise BufferError(f"edit {number}: replacement must be a contiguous buffer")
        pieces.append(view[previous:start])
        pieces.append(piece.cast("B") if piece.format != "B" or piece.ndim != 1 else piece)
        previous = end
    pieces.append(view[previous:])
    return b"".join(pieces)  # type: ignore[arg-type]


_B64_ALPHABET = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")
_B64_RUN = re.compile(rb"[A-Za-z0-9+/]*")
_B64_VALUE = {c: i for i, c in enumerate(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")}


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
        last = _B64_VALUE[buf[data_end - 1]] if data_end > start else 0
        if data_end == start or last & (0x0F if padding == 2 else 0x03):
            raise TokenDecodeError(f"non-canonical base64 padding (byte {data_end - 1})", data_end - 1)
    decoded = length // 4 * 3 - padding
    if decoded % 4:
        raise TokenDecodeError(f"base64 decodes to {decoded} bytes, not a whole number of int32 ids", None)
    return decoded // 4


# -- relay kernels ---------------------------------------------------------------------------------------
#
# What the orchestrator's fast relay (server/orchestrator/relay_modes.FastRelay) does with each body,
# one call per body: one validating scan plus every check, small-field decode and output byte it
# needs. The compiled twin does all of it in C, with no Python objects in between; this twin is the
# reference. RelayError messages are the orchestrator's HTTP error texts (``field`` is the offending
# field, the 400's ``param``), except strip_internal_fields', which callers prefix.

#: Everything either leg needs from a client body, found in one pass (fastcore.relay's read_client_body).
CLIENT_PATHS: tuple[Path, ...] = (
    (),
    (P.MESSAGES,),
    (P.DISAGGREGATED_PARAMS,),
    (P.PROMPT_TOKEN_IDS_B64,),
    (P.PROMPT_TOKEN_IDS,),
    (P.STREAM,),
    (P.STREAM_OPTIONS,),
    (P.PROMPT,),
    (P.MESSAGES, -1),
)
#: The same, plus the small fields the orchestrator acts on (read_client_request).
CLIENT_REQUEST_PATHS: tuple[Path, ...] = (
    *CLIENT_PATHS,
    (P.MODEL,),
    (P.MAX_TOKENS,),
    (P.MAX_COMPLETION_TOKENS,),
    (P.STREAM_OPTIONS, P.INCLUDE_USAGE),
)
(
    C_ROOT,
    C_MESSAGES,
    C_DISAGG,
    C_B64,
    C_IDS,
    C_STREAM,
    C_STREAM_OPTIONS,
    C_PROMPT,
    C_LAST_MESSAGE,
    C_MODEL,
    C_MAX_TOKENS,
    C_MAX_COMPLETION_TOKENS,
    C_INCLUDE_USAGE,
) = range(13)
#: The client-body spans of the internal fields, and each field's name: a client may send none of
#: ``fastcore.protocol.internal_request_fields(chat)`` (the one rule; both twins' kernels and
#: fastcore.relay's builders enforce it from here).
CLIENT_INTERNAL: tuple[tuple[int, str], ...] = (
    (C_DISAGG, P.DISAGGREGATED_PARAMS),
    (C_B64, P.PROMPT_TOKEN_IDS_B64),
    (C_IDS, P.PROMPT_TOKEN_IDS),
)


def check_internal_fields(spans: Sequence[Span | None], chat: bool) -> None:
    """Raise ``RelayError`` (the 400's message, ``field``) for an internal field in a client body's
    ``spans`` (those of ``CLIENT_PATHS`` first)."""
    forbidden = P.internal_request_fields(chat)
    for index, name in CLIENT_INTERNAL:
        if spans[index] is not None and name in forbidden:
            raise RelayError(P.internal_field_message(name), name)


_DP: Path = (P.CHOICES, 0, P.DISAGGREGATED_PARAMS)
#: What leg (3) needs from a context response (fastcore.relay's parse_context_response).
CONTEXT_PATHS: tuple[Path, ...] = (
    (),
    (P.CHOICES, 0, P.FINISH_REASON),
    _DP,
    (P.USAGE,),
    (P.PROMPT_TOKEN_IDS,),
    (P.PROMPT_TOKEN_IDS_B64,),
    (*_DP, P.REQUEST_TYPE),
    (*_DP, P.CTX_USAGE),
)
#: The same, plus what the orchestrator checks before relaying and what it signs trtllm-serve's
#: ``x-trtllm-disagg-auth`` over (read_context_response; ContextScan.auth_fields decodes the last two).
CONTEXT_RESPONSE_PATHS: tuple[Path, ...] = (
    *CONTEXT_PATHS,
    (P.CHOICES, 0),
    (P.USAGE, P.COMPLETION_TOKENS),
    (*_DP, P.CTX_INFO_ENDPOINT),
    (*_DP, P.ENCODED_OPAQUE_STATE),
)
(
    X_ROOT,
    X_FINISH,
    X_DP,
    X_USAGE,
    X_IDS,
    X_B64,
    X_REQUEST_TYPE,
    X_CTX_USAGE,
    X_FIRST_CHOICE,
    X_COMPLETION_TOKENS,
    X_CTX_INFO_ENDPOINT,
    X_ENCODED_OPAQUE_STATE,
) = range(12)

_STRIP_PATHS: dict[int, tuple[Path, ...]] = {}


def strip_paths(choices: int) -> tuple[Path, ...]:
    """strip_internal_fields' paths for the first ``choices`` choices (built once per count).

    ``("choices", choices)`` says whether there are more: then the caller scans again with more.
    """
    paths = _STRIP_PATHS.get(choices)
    if paths is None:
        paths = _STRIP_PATHS[choices] = (
            (),
            *((name,) for name in P.INTERNAL_RESPONSE_FIELDS),
            (P.CHOICES, choices),
            *((P.CHOICES, i, name) for i in range(choices) for name in P.INTERNAL_CHOICE_FIELDS),
        )
    return paths


#: An int of more digits than this is not a token count (and int() of thousands of digits is slow).
MAX_INT_DIGITS = 20
_NULL, _TRUE, _FALSE, _MINUS = b"ntf-"
_COMMON_FINISH_REASONS: dict[bytes, str | None] = {
    b"null": None,
    **{f'"{r}"'.encode(): r for r in P.COMMON_FINISH_REASONS},
}
_MEMBER_SEPARATOR = re.compile(rb"[ \t\n\r]*,[ \t\n\r]*")
_CONTEXT_502 = "context worker response cannot be relayed: "
_GENERATION_ONLY = json.dumps(P.GENERATION_ONLY).encode()


class _Scan:
    __slots__ = ()

    def _relay_key(self) -> tuple[object, ...]:
        return tuple(getattr(self, name) for name in self._FIELDS)  # type: ignore[attr-defined]

    def __eq__(self, other: object) -> bool:
        # Equal across the twins: the compiled scan classes have the same _relay_key.
        key = getattr(other, "_relay_key", None)
        if key is None or type(other).__name__ != type(self).__name__:
            return NotImplemented
        return bool(self._relay_key() == key())

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._FIELDS if name != "body")  # type: ignore[attr-defined]
        return f"{type(self).__name__}({fields})"


class ClientScan(_Scan):
    """A client body read by :func:`read_client_request`: its small fields decoded, the spans both legs
    splice (those of ``CLIENT_REQUEST_PATHS``, ``None`` where absent) and the body as ``bytes``."""

    _FIELDS = ("body", "chat", "spans", "empty", "stream", "include_usage", "max_tokens", "model")
    __slots__ = _FIELDS

    def __init__(
        self,
        body: bytes,
        chat: bool,
        spans: tuple[Span | None, ...],
        empty: bool,
        stream: bool,
        include_usage: bool,
        max_tokens: int | None,
        model: str | None,
    ) -> None:
        self.body = body
        self.chat = chat
        self.spans = spans
        self.empty = empty  # the object has no members: fields are added without a leading comma
        self.stream = stream
        self.include_usage = include_usage
        self.max_tokens = max_tokens
        self.model = model


class ContextScan(_Scan):
    """A context response read by :func:`read_context_response` (spans of ``CONTEXT_RESPONSE_PATHS``)."""

    _FIELDS = ("body", "spans", "finish_reason", "finished")
    __slots__ = _FIELDS

    def __init__(
        self, body: bytes, spans: tuple[Span | None, ...], finish_reason: str | None, finished: bool
    ) -> None:
        self.body = body
        self.spans = spans
        self.finish_reason = finish_reason
        self.finished = finished  # the context response is the answer: no generation leg

    def auth_fields(self) -> tuple[object, object]:
        """``choices[0].disaggregated_params``' ``ctx_info_endpoint`` and ``encoded_opaque_state``,
        decoded (``None`` where absent): what trtllm-serve's ``x-trtllm-disagg-auth`` signs. Decoded
        only when asked: the scan found their spans at no extra pass."""
        return _json_at(self.body, self.spans[X_CTX_INFO_ENDPOINT]), _json_at(
            self.body, self.spans[X_ENCODED_OPAQUE_STATE]
        )


def _json_at(buf: bytes, span: Span | None) -> object:
    """The JSON value at ``span`` of a validated body, decoded (``None`` when absent)."""
    return None if span is None else json.loads(buf[span[0] : span[1]])


def _is_empty(buf: bytes, span: Span) -> bool:
    return _WS.match(buf, span[0] + 1).end() == span[1] - 1  # type: ignore[union-attr]


def _bool_at(buf: bytes, span: Span | None, key: str) -> bool | None:
    if span is None:
        return None
    first = buf[span[0]]
    if first == _TRUE:
        return True
    if first == _FALSE:
        return False
    if first == _NULL:
        return None
    raise RelayError(f"'{key}' must be a boolean", key)


def _str_at(buf: bytes, span: Span | None, key: str) -> str | None:
    if span is None:
        return None
    start, end = span
    first = buf[start]
    if first == _NULL:
        return None
    if first != _QUOTE:
        raise RelayError(f"'{key}' must be a string", key)
    if buf.find(b"\\", start + 1, end - 1) < 0:
        return buf[start + 1 : end - 1].decode("utf-8")  # the scan checked its UTF-8
    value: str = json.loads(buf[start:end])  # escapes: a short string, the stdlib decodes them right
    return value


def _int_at(buf: bytes, span: Span | None) -> int | None:
    """The integer at ``span``: ``None`` if absent, not a number, over 20 digits or not integral."""
    if span is None:
        return None
    start, end = span
    first = buf[start]
    if not (first == _MINUS or 0x30 <= first <= 0x39) or end - start - (first == _MINUS) > MAX_INT_DIGITS:
        return None
    raw = buf[start:end]
    # A valid JSON number is an integer unless it has a fraction or an exponent.
    if raw.find(b".") >= 0 or raw.find(b"e") >= 0 or raw.find(b"E") >= 0:
        return None
    return int(raw)


def _max_tokens_at(buf: bytes, span: Span | None, key: str) -> int | None:
    """``max_tokens`` / ``max_completion_tokens``: an integer (not a bool) or null."""
    value = _int_at(buf, span)
    if value is None and span is not None:
        start, end = span
        first = buf[start]
        if first == _NULL:
            return None
        if (first == _MINUS or 0x30 <= first <= 0x39) and end - start - (first == _MINUS) > MAX_INT_DIGITS:
            raise RelayError(f"'{key}' must be an integer of at most {MAX_INT_DIGITS} digits", key)
        raise RelayError(f"'{key}' must be an integer", key)
    return value


def read_client_request(body: bytes | bytearray | memoryview, chat: bool) -> ClientScan:
    """Validate a client body and read what the orchestrator needs of it, in one pass.

    ``chat``: the route (``/v1/chat/completions``). Raises ``JSONSpanError`` (malformed, or a
    repeated key the relay reads) or ``RelayError`` with the 400's message and ``field``: not an
    object, an internal field, a small field of the wrong type (``stream``, ``stream_options``,
    ``include_usage``, ``model``, ``max_tokens``, ``max_completion_tokens``), no ``messages``
    element (chat) or no ``prompt`` (completions), a token limit below 1.
    """
    buf = _as_bytes(body)
    chat = bool(chat)
    spans = tuple(find_spans(buf, CLIENT_REQUEST_PATHS))
    root = spans[C_ROOT]
    assert root is not None  # a scan that succeeds has the document's span
    if buf[root[0]] != _OPEN_OBJECT:
        raise RelayError("request body must be a JSON object")
    check_internal_fields(spans, chat)
    stream = _bool_at(buf, spans[C_STREAM], "stream")
    include_usage = None
    options = spans[C_STREAM_OPTIONS]
    if options is not None:
        first = buf[options[0]]
        if first == _OPEN_OBJECT:
            include_usage = _bool_at(buf, spans[C_INCLUDE_USAGE], P.INCLUDE_USAGE)
        elif first != _NULL:
            raise RelayError("'stream_options' must be an object", P.STREAM_OPTIONS)
    model = _str_at(buf, spans[C_MODEL], "model")
    if chat:
        if spans[C_LAST_MESSAGE] is None:  # absent, not an array, or empty
            raise RelayError("'messages' must be a non-empty array", "messages")
        # Both are checked (as a request model would); the first set one counts.
        completion = _max_tokens_at(buf, spans[C_MAX_COMPLETION_TOKENS], P.MAX_COMPLETION_TOKENS)
        tokens = _max_tokens_at(buf, spans[C_MAX_TOKENS], P.MAX_TOKENS)
        key, value = (
            (P.MAX_COMPLETION_TOKENS, completion) if completion is not None else (P.MAX_TOKENS, tokens)
        )
    else:
        prompt = spans[C_PROMPT]
        if prompt is None or buf[prompt[0]] not in (_QUOTE, _OPEN_ARRAY):
            raise RelayError("'prompt' must be a string or an array", "prompt")
        key, value = P.MAX_TOKENS, _max_tokens_at(buf, spans[C_MAX_TOKENS], P.MAX_TOKENS)
    if value is not None and value < 1:
        raise RelayError(f"'{key}' must be at least 1, got {value}", key)
    return ClientScan(buf, chat, spans, _is_empty(buf, root), bool(stream), bool(include_usage), value, model)


def _client_scan(client: object) -> ClientScan:
    if type(client) is not ClientScan:
        raise TypeError(f"client must be a ClientScan of this twin, not {type(client).__name__}")
    return client


def _context_scan(context: object) -> ContextScan:
    if type(context) is not ContextScan:
        raise TypeError(f"context must be a ContextScan of this twin, not {type(context).__name__}")
    return context


def context_request(client: ClientScan, disagg_request_id: int, return_b64: bool) -> bytes:
    """Leg (1) from a read client body: ``stream`` false, ``stream_options`` null, and
    ``disaggregated_params`` (context_only, the id, ``return_prompt_token_ids_b64`` if asked) added."""
    client = _client_scan(client)
    if isinstance(disagg_request_id, bool) or not isinstance(disagg_request_id, int):
        raise TypeError("disagg_request_id must be an int")
    spans = client.spans
    edits: list[tuple[int, int, bytes]] = []
    added: list[bytes] = []
    for index, name, value in (
        (C_STREAM, b"stream", b"false"),
        (C_STREAM_OPTIONS, b"stream_options", b"null"),
    ):
        span = spans[index]
        if span is None:
            added.append(b'"' + name + b'":' + value)
        else:
            edits.append((span[0], span[1], value))
    params = b'{"request_type":"%s","disagg_request_id":%d' % (P.CONTEXT_ONLY.encode(), disagg_request_id)
    if return_b64:
        params += b',"%s":true' % P.RETURN_PROMPT_TOKEN_IDS_B64.encode()
    added.append(b'"%s":' % P.DISAGGREGATED_PARAMS.encode() + params + b"}")
    edits.sort()
    text = b",".join(added)
    root = spans[C_ROOT]
    assert root is not None
    edits.append((root[1] - 1, root[1] - 1, text if client.empty else b"," + text))
    return splice(client.body, edits)


def read_context_response(body: bytes | bytearray | memoryview, max_tokens: int | None) -> ContextScan:
    """Validate a context response and decide whether a generation leg follows, in one pass.

    ``max_tokens``: the client's limit (``finish_reason`` "length" with ``usage.completion_tokens``
    already at it is the answer). Raises ``JSONSpanError`` (malformed, a repeated key the relay
    reads) or ``RelayError`` with the 502's message: not an object, a ``finish_reason`` that is not
    a string, no ``choices[0]``, or no ``disaggregated_params`` object when a generation leg follows.
    """
    buf = _as_bytes(body)
    spans = tuple(find_spans(buf, CONTEXT_RESPONSE_PATHS))
    root = spans[X_ROOT]
    assert root is not None
    if buf[root[0]] != _OPEN_OBJECT:
        raise RelayError(_CONTEXT_502 + "context response is not a JSON object")
    finish_reason: str | None = None
    finish = spans[X_FINISH]
    if finish is not None:
        raw = buf[finish[0] : finish[1]]
        if raw in _COMMON_FINISH_REASONS:
            finish_reason = _COMMON_FINISH_REASONS[raw]
        elif raw[0] == _QUOTE:
            finish_reason = json.loads(raw)  # a short string with escapes: the stdlib decodes them right
        else:
            raise RelayError(
                _CONTEXT_502 + "context response: choices[0].finish_reason is not a string", P.FINISH_REASON
            )
    if spans[X_FIRST_CHOICE] is None:
        raise RelayError("context worker response has no choices[0]", "choices")
    follows = finish_reason in P.GENERATION_FOLLOWS
    if follows and finish_reason == P.FINISH_LENGTH and max_tokens is not None:
        # Our context worker says "length" when the client's max_tokens is 1: that leg already
        # produced everything the client asked for.
        completion_tokens = _int_at(buf, spans[X_COMPLETION_TOKENS])
        if completion_tokens is not None:
            follows = completion_tokens < max_tokens
    params = spans[X_DP]
    if follows and (params is None or buf[params[0]] != _OPEN_OBJECT):
        raise RelayError(
            "context worker response lacks choices[0].disaggregated_params", P.DISAGGREGATED_PARAMS
        )
    return ContextScan(buf, spans, finish_reason, not follows)


def generation_request(
    client: ClientScan, context: ContextScan, tokids_b64: bool, strip_history: bool
) -> bytes:
    """Leg (3): the client's body plus the context leg's ``disaggregated_params`` (``request_type``
    generation_only, ``ctx_usage`` the context leg's ``usage``) and prompt ids.

    ``tokids_b64`` (gate ``gen_tokids_ctxbytes``): the context response's ``prompt_token_ids_b64``
    string, checked and copied verbatim, or, when the worker answered with the list only, the list
    (:func:`_token_b64`); otherwise its ``prompt_token_ids`` list as
    ``prompt_token_ids`` (chat) or ``prompt`` (completions). ``strip_history`` (gate
    ``gen_strip_message_history``): chat ``messages`` keeps its last element. Raises ``RelayError``
    with the 502's message when the context response lacks what the leg needs.
    """
    client = _client_scan(client)
    context = _context_scan(context)
    body, spans, ctx, found = client.body, client.spans, context.body, context.spans
    view = memoryview(ctx)
    params = found[X_DP]
    if params is None or ctx[params[0]] != _OPEN_OBJECT:
        raise RelayError(
            _CONTEXT_502 + "context response has no choices[0].disaggregated_params object",
            P.DISAGGREGATED_PARAMS,
        )
    usage_span = found[X_USAGE]
    usage = ctx[usage_span[0] : usage_span[1]] if usage_span is not None else b"null"
    replaced: list[tuple[int, int, bytes]] = []
    added: list[bytes] = []
    request_type, ctx_usage = found[X_REQUEST_TYPE], found[X_CTX_USAGE]
    if request_type is None:
        added.append(b'"request_type":' + _GENERATION_ONLY)
    else:
        replaced.append((request_type[0], request_type[1], _GENERATION_ONLY))
    if ctx_usage is None:
        added.append(b'"ctx_usage":' + usage)
    else:
        replaced.append((ctx_usage[0], ctx_usage[1], usage))
    replaced.sort()
    pieces: list[bytes | memoryview] = [
        b'"disaggregated_params":' if client.empty else b',"disaggregated_params":'
    ]
    previous = params[0]
    for start, end, replacement in replaced:
        pieces += [view[previous:start], replacement]
        previous = end
    if added:
        pieces.append(view[previous : params[1] - 1])
        if not _is_empty(ctx, params):
            pieces.append(b",")
        pieces += [b",".join(added), b"}"]
    else:
        pieces.append(view[previous : params[1]])
    edits: list[tuple[int, int, bytes | memoryview]] = []
    b64 = _token_b64(ctx, found) if tokids_b64 else None
    if b64 is not None:
        pieces += [b',"prompt_token_ids_b64":', view[b64[0] : b64[1]]]
    else:
        ids = found[X_IDS]
        if ids is None or ctx[ids[0]] != _OPEN_ARRAY:
            raise RelayError(
                _CONTEXT_502 + "context response has no prompt_token_ids list", P.PROMPT_TOKEN_IDS
            )
        prompt = spans[C_PROMPT]
        if client.chat:
            pieces += [b',"prompt_token_ids":', view[ids[0] : ids[1]]]
        elif prompt is not None:
            edits.append((prompt[0], prompt[1], view[ids[0] : ids[1]]))
        else:
            pieces += [b',"prompt":', view[ids[0] : ids[1]]]
    messages, last_message = spans[C_MESSAGES], spans[C_LAST_MESSAGE]
    if strip_history and client.chat and messages is not None and last_message is not None:
        # Cut everything before and after the last element; keep its raw bytes.
        edits.append((messages[0], last_message[0], b"["))
        edits.append((last_message[1], messages[1], b"]"))
    root = spans[C_ROOT]
    assert root is not None
    edits.append((root[1] - 1, root[1] - 1, b"".join(pieces)))
    return splice(body, edits)


def _token_b64(ctx: bytes, found: tuple[Span | None, ...]) -> Span | None:
    """The checked ``prompt_token_ids_b64`` string of a context response (gate on), or ``None`` for
    the list fallback: a worker asked for base64 that answers with the ``prompt_token_ids`` list only
    (``prompt_token_ids_b64`` absent or null, as trtllm-serve's completions and its chat responses
    when not asked) is relayed with the list (docs/protocol.md (2)). ``RelayError`` (502): neither form,
    a ``prompt_token_ids_b64`` that is not a string, or not valid token base64."""
    b64 = found[X_B64]
    if b64 is None or ctx[b64[0]] == _NULL:
        ids = found[X_IDS]
        if ids is not None and ctx[ids[0]] == _OPEN_ARRAY:
            return None
    if b64 is None or ctx[b64[0]] != _QUOTE:
        raise RelayError(
            _CONTEXT_502 + "context response has no prompt_token_ids_b64 string (is the context "
            "worker's return_prompt_token_ids_b64 support on?) and no prompt_token_ids list",
            P.PROMPT_TOKEN_IDS_B64,
        )
    try:
        check_token_b64(ctx, b64[0] + 1, b64[1] - 1)
    except TokenDecodeError as exc:
        raise RelayError(
            _CONTEXT_502 + f"context response: invalid prompt_token_ids_b64: {exc}", P.PROMPT_TOKEN_IDS_B64
        ) from exc
    return b64


def strip_internal_fields(body: bytes | bytearray | memoryview, validate: bool = True) -> bytes:
    """``body`` (a worker's response) without ``disaggregated_params`` in any choice and without
    top-level ``prompt_token_ids`` / ``prompt_token_ids_b64``; ``body`` itself (when ``bytes``) if
    there is nothing to cut.

    The scan validates the whole body; ``validate=False`` (see ``find_spans``) is for bytes the
    caller has validated. Raises ``JSONSpanError``, or ``RelayError`` if the body is not an object.
    """
    buf = _as_bytes(body)
    choices = 8
    while True:
        spans = find_member_spans(buf, strip_paths(choices), validate=validate)
        if spans[3] is None:
            break
        choices *= 4  # more choices than asked for: rare (n > 8), scan again
    root = spans[0]
    assert root is not None
    if buf[root[0]] != _OPEN_OBJECT:
        raise RelayError("the response body must be a JSON object")
    members = sorted(span for span in spans[1:3] + spans[4:] if span is not None)
    if not members:
        return buf
    return splice(buf, _deletions(buf, members))


def _deletions(buf: bytes, members: list[Span]) -> list[tuple[int, int, bytes]]:
    """Edits deleting ``members`` (key-to-value spans, sorted) and exactly the commas they leave."""
    runs: list[list[int]] = []
    for start, end in members:
        if runs and _MEMBER_SEPARATOR.fullmatch(buf, runs[-1][1], start):
            runs[-1][1] = end  # adjacent members of one object go as one run
        else:
            runs.append([start, end])
    edits = []
    for start, end in runs:
        after = _skip_ws(buf, end)
        if buf[after] == _COMMA:  # not the last member: take the comma after the run
            edits.append((start, _skip_ws(buf, after + 1), b""))
            continue
        comma = buf.rfind(b",", 0, start)
        if comma >= 0 and _WS.fullmatch(buf, comma + 1, start):
            edits.append((comma, end, b""))  # the last member: take the comma before it
        else:
            edits.append((start, end, b""))  # the only member
    return edits


# -- chunk hashes (the routers' prefix keys) --------------------------------------------------------------
#
# ``chunk_hashes(data, start, end, chunk)``: one 64-bit hash per FULL chunk of ``data[start:end]``,
# chained, so hash i covers chunks 0..i and two byte strings share their first k hashes exactly when
# they share their first k chunks (up to 64-bit collisions). The orchestrator's kv_cache_aware router
# keys its per-worker prefix index with them (server/orchestrator/routing.py). The function, both
# twins, bit for bit:
#
# - a chunk is ``chunk`` bytes, a multiple of 32 in [32, CHUNK_MAX]; its bytes are read as
#   little-endian uint64 words w[0..chunk/8), word k going to lane k % 4;
# - four lanes start at CHUNK_LANE_SEEDS; each word steps its lane: a = (a ^ w) * CHUNK_PRIMES[lane]
#   (mod 2**64), then a ^= a >> 29: 8 bytes per step, the four lanes independent (so the multiplies
#   of a step overlap in the CPU);
# - the chunk's digest is d = a0 ^ rotl(a1, 17) ^ rotl(a2, 31) ^ rotl(a3, 47);
# - the chain: h starts at CHUNK_CHAIN_SEED; for each chunk h = fmix64((h * CHUNK_CHAIN_MUL) ^ d)
#   (MurmurHash3's 64-bit finalizer), and that h is the chunk's hash.
#
# Not a cryptographic hash: a collision only routes one request to a worse worker.

CHUNK_MAX = 1 << 20
CHUNK_LANE_SEEDS = (0x243F6A8885A308D3, 0x13198A2E03707344, 0xA4093822299F31D0, 0x082EFA98EC4E6C89)
CHUNK_PRIMES = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93)
CHUNK_CHAIN_SEED = 0x452821E638D01377
CHUNK_CHAIN_MUL = 0x9FB21C651E98DF25
_M64 = (1 << 64) - 1
_SEEDS = np.array(CHUNK_LANE_SEEDS, dtype=np.uint64)
_PRIMES = np.array(CHUNK_PRIMES, dtype=np.uint64)
_U64LE = np.dtype("<u8")


def _rotl(x: np.ndarray, k: int) -> np.ndarray:
    return (x << np.uint64(k)) | (x >> np.uint64(64 - k))  # type: ignore[no-any-return]


def check_chunk_args(size: int, start: object, end: object, chunk: object) -> tuple[int, int, int]:
    """``start``, ``end``, ``chunk`` as ints, or ``ValueError`` naming the bad one (both twins' words)."""
    start, end, chunk = operator.index(start), operator.index(end), operator.index(chunk)  # type: ignore[arg-type]
    if not 0 <= start <= size:
        raise ValueError(f"start must be in [0, len(data) = {size}], got {start}")
    if not start <= end <= size:
        raise ValueError(f"end must be in [start = {start}, len(data) = {size}], got {end}")
    if not 32 <= chunk <= CHUNK_MAX or chunk % 32:
        raise ValueError(f"chunk must be a multiple of 32 in [32, {CHUNK_MAX}], got {chunk}")
    return start, end, chunk


def chunk_hashes(data: bytes | bytearray | memoryview, start: int, end: int, chunk: int) -> list[int]:
    """The chained 64-bit hashes of the full ``chunk``-byte chunks of ``data[start:end]`` (see above).

    A tail shorter than ``chunk`` has no hash. Raises ``ValueError`` naming ``start``, ``end`` or
    ``chunk`` when one is out of range, ``TypeError`` for a ``data`` that is not bytes-like.
    """
    view = _body_view(data)
    start, end, chunk = check_chunk_args(len(view), start, end, chunk)
    n = (end - start) // chunk
    if not n:
        return []
    steps = chunk // 32
    words = np.frombuffer(view, dtype=_U64LE, count=n * chunk // 8, offset=start).reshape(n, steps, 4)
    lanes = np.tile(_SEEDS, (n, 1))
    shift = np.uint64(29)
    for step in range(steps):  # every chunk at once: chunks are independent until the chain
        lanes ^= words[:, step, :]
        lanes *= _PRIMES  # wraps mod 2**64
        lanes ^= lanes >> shift
    digests = lanes[:, 0] ^ _rotl(lanes[:, 1], 17) ^ _rotl(lanes[:, 2], 31) ^ _rotl(lanes[:, 3], 47)
    out = []
    h = CHUNK_CHAIN_SEED
    for d in digests.tolist():
        x = ((h * CHUNK_CHAIN_MUL) & _M64) ^ d
        x ^= x >> 33
        x = (x * 0xFF51AFD7ED558CCD) & _M64
        x ^= x >> 33
        x = (x * 0xC4CEB9FE1A85EC53) & _M64
        h = x ^ (x >> 33)
        out.append(h)
    return out


__all__ = [
    "CLIENT_PATHS",
    "CLIENT_REQUEST_PATHS",
    "CONTEXT_PATHS",
    "CONTEXT_RESPONSE_PATHS",
    "MESSAGES",
    "ClientScan",
    "ContextScan",
    "check_token_b64",
    "chunk_hashes",
    "context_request",
    "find_member_spans",
    "find_span",
    "find_spans",
    "generation_request",
    "make_error",
    "read_client_request",
    "read_context_response",
    "splice",
    "strip_internal_fields",
    "strip_paths",
]
