"""Exceptions raised by fastcore, shared by the compiled and pure-Python twins.

Each subclasses the builtin a caller would already catch and carries the
position of the problem, so a server can turn it into a 400 that says where.
"""

from __future__ import annotations

import binascii


class TokenDecodeError(binascii.Error):
    """Invalid ``prompt_token_ids_b64`` data (a ``binascii.Error``, so a ``ValueError``).

    ``offset`` is the byte offset of the first bad character, or ``None`` when
    the problem is the length as a whole.
    """

    def __init__(self, message: str, offset: int | None = None) -> None:
        super().__init__(message)
        self.offset = offset


class JSONSpanError(ValueError):
    """Malformed JSON (or an ambiguous duplicate key, or a limit passed) met by the span scanner.

    ``offset`` is the byte offset where the scanner stopped. ``limit`` names the
    :mod:`fastcore.limits` constant the document passes (``"JSON_MAX_DEPTH"``,
    ``"JSON_MAX_NUMBER_CHARS"``), else ``None``: valid JSON refused by policy,
    which a server words differently from malformed JSON. ``key`` is the key a
    duplicate-key error repeats, else ``None``.
    """

    def __init__(self, message: str, offset: int, limit: str | None = None, key: str | None = None) -> None:
        super().__init__(f"{message} (byte {offset})")
        self.offset = offset
        self.limit = limit
        #: the repeated key, for a duplicate-key error
        self.key = key


class RelayError(ValueError):
    """A body the relay refuses to forward; ``field`` names the offending field."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


__all__ = ["JSONSpanError", "RelayError", "TokenDecodeError"]
