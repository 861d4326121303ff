"""JSON span scanner, pure-Python twin of ``fastcore._scan``.

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

import re
from collections.abc import Iterable, Sequence

from .errors import JSONSpanError
from .limits import JSON_MAX_DEPTH, JSON_MAX_NUMBER_CHARS

Path = tuple[str | int, ...]
Span = tuple[int, int]

# Status codes shared with the compiled twin (its Status enum, checked against these at import; its
# own are 100 and up); one table turns them into messages.
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


def _read_key(buf: bytes, pos: int, n: int, validate: bool, parent: _Node | None) -> tuple[int, _Node | None]:
    """The member key at ``pos`` (the first non-blank byte of a member of ``parent``'s object),
    through its colon: the value's first non-blank byte and its path node (``None``: not on a path)."""
    if pos >= n:
        raise _Fail(E_EOF, n)
    if buf[pos] != _QUOTE:
        raise _Fail(E_KEY, pos)
    key_start = pos
    pos, escaped = _scan_string(buf, pos, n, validate)
    node = None
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
    return _skip_ws(buf, pos + 1), node


def _scan(buf: bytes, root: _Node | None, validate: bool) -> None:
    """Validate ``buf`` (as ``validate`` asks) and fill in the spans of the nodes under ``root``."""
    n = len(buf)
    stack: list[_Frame] = []
    pos = _skip_ws(buf, 0)
    node = root  # the path node of the value about to be parsed
    expecting_key = False
    while True:
        if expecting_key:
            pos, node = _read_key(buf, pos, n, validate, stack[-1].node)
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


__all__ = [
    "MESSAGES",
    "find_member_spans",
    "find_span",
    "find_spans",
    "make_error",
    "splice",
]
