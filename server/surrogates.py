"""Lone UTF-16 surrogates in a request body: a 400 naming the field, before any tokenizer runs.

JSON may spell a surrogate code point with an escape (``"\\ud800"``) that no
pair completes; RFC 8259 8.2 leaves what a parser does with it open, and
Python's ``json`` (what the worker falls back to when pysimdjson refuses one)
makes it a ``str`` holding U+D800. That is not
Unicode text: every tokenizer fails on it (``str.encode("utf-8")`` raises
``UnicodeEncodeError``, the Hugging Face tokenizers' Rust side refuses it),
and so does anything that writes the text out as UTF-8 (msgpack, orjson). It
is refused here, once, naming where it is (``messages[0].content``), by every
worker role (:class:`server.worker.request.RequestReader`) and by the
orchestrator's parsed relay modes (which write bodies out again), instead of a
500 from whichever tokenizer or encoder meets it first.

A body that is valid UTF-8 can only carry a surrogate through a ``\\uDxxx``
escape, so bodies without one (nearly all) cost one byte search (a regex where the body has escapes).
"""

from __future__ import annotations

import re
from typing import Any

from server.errors import HTTPError

#: ``\\uD800``-``\\uDFFF`` (either case): how a surrogate gets into a valid UTF-8 JSON body
_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
#: in a decoded ``str``, a pair is one astral character: any surrogate left is alone
_SURROGATE = re.compile("[\ud800-\udfff]")


def _first(body: dict[str, Any], lazy: Any) -> tuple[str, int, int] | None:
    """(path, index in its string, code point) of the first lone surrogate in ``body``'s strings
    (keys included), walking without recursion (a body may nest 512 deep)."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if lazy is not None and isinstance(value, lazy):
            # The worker's RawJSON (its token field, left as bytes): only a string can hold one. (lazy is
            # Any: this module cannot import the worker's class, and ``type`` narrows it to object.)
            if value.data[value.start : value.start + 1] != b'"' or not _ESCAPE.search(
                value.data, value.start, value.end
            ):
                continue
            value = value.value()
        if isinstance(value, str):
            found = _SURROGATE.search(value)
            if found is not None:
                return path or "body", found.start(), ord(found.group())
        elif isinstance(value, dict):
            for key, item in reversed(value.items()):
                found = _SURROGATE.search(key)
                if found is not None:
                    return f"{path}.{key!a}" if path else f"{key!a}", found.start(), ord(found.group())
                stack.append((f"{path}.{key}" if path else key, item))
        elif isinstance(value, list):
            for i in range(len(value) - 1, -1, -1):
                stack.append((f"{path}[{i}]", value[i]))
    return None


def check_no_lone_surrogates(raw: bytes, body: dict[str, Any], *, lazy: type | None = None) -> None:
    """Raise a 400 naming the first string of ``body`` (parsed from ``raw``) that holds a lone
    surrogate; ``param`` is its path, as the message names it (``messages[0].content``). ``lazy``: a type of values left as bytes
    (``data``, ``start``, ``end``) whose ``value()`` parses them."""
    # No backslash, no escape: one memchr. The two-byte ``b"\\u" in raw`` this was is the slowest of the
    # three (CPython's search stops at every "u" of the text: ~250 us on 160 KB, the regex ~45 us).
    if b"\\" not in raw or _ESCAPE.search(raw) is None:
        return
    found = _first(body, lazy)
    if found is None:
        return  # escapes that were all pairs
    path, index, code = found
    raise HTTPError(
        400,
        f"'{path}' holds a lone surrogate (U+{code:04X} at character {index}): it is not Unicode text "
        "(a \\uD800-\\uDFFF escape must be half of a pair)",
        param=path,
        code="invalid_unicode",
    )


__all__ = ["check_no_lone_surrogates"]
