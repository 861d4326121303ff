"""The HTTP parsers' pure-Python twins: llhttp through httptools, a Python call per header.

Twin of :mod:`server.http._parse` (same class, same events, same refusals; chosen once in
:mod:`server.http.parse`). A :class:`RequestParser` belongs to one client connection
(``conn``, the :class:`~server.http.server._Connection`) and calls it once per message event:

- ``conn.on_message_begin(req)``: a request's first byte;
- ``conn.on_head(req)``: its request line and headers are read and pass every check here
  (``req.method`` is set from then on);
- ``conn.on_body_piece(req, n)``: ``n`` more bytes of a chunked body (the connection counts them
  against its budgets; a Content-Length body was counted whole at ``on_head``);
- ``conn.on_message_complete(req)``: the request is whole (``req.body``, ``req.keep_alive``).

:meth:`RequestParser.feed` raises :class:`~server.http.request.Refused` for what the protocol or a
bound refuses, and re-raises what a ``conn`` event raised; either way the parser is not fed again.
What is checked here: llhttp (strict) refuses Content-Length with Transfer-Encoding, two
Content-Lengths, obs-fold, bare LF line ends and chunk-size overflow; a Transfer-Encoding other
than ``chunked`` (501), an Expect other than ``100-continue`` (417), a Content-Encoding (415), an
HTTP/1.1 request without exactly one Host (400), a version other than 1.0/1.1 (505), an upgrade
(501), a target that is not a path (400); the request line's bytes (414), the headers' bytes and
count (431), a chunked body's trailer section's (431, its fields then dropped), and the body's
bytes (413: from Content-Length before the body, from each chunk's declared size, while reading).

A :class:`ResponseParser` belongs to one upstream connection (``conn``, a worker's; the
:class:`~server.http.client._Connection`) and calls it per response: ``conn.on_head(status,
content_type, content_length, retry_after)`` (the four fields the orchestrator reads;
``content_length`` is None without one, -1 when chunked), ``conn.on_body(piece)`` per body piece,
``conn.on_message_complete(keep_alive)``. Its :meth:`~ResponseParser.feed` raises
:class:`~server.http.request.BadResponse` for bytes it cannot frame, and re-raises what an event
raised. A worker is another process: its head is bounded as a client's is (the fields' bytes, counted
per read while the head is in progress and exactly as each field ends, and their count:
:mod:`server.http.limits` ``MAX_RESPONSE_HEAD_BYTES``, ``MAX_RESPONSE_HEADERS``), and one response
answers one request: a message after a response (not a 1xx) is refused until the connection sets
``ended`` False as it sends its next request.
"""

from __future__ import annotations

from typing import Any

import httptools

from .limits import MAX_RESPONSE_HEAD_BYTES, MAX_RESPONSE_HEADERS, Limits
from .request import (
    CHUNKED,
    CONTINUE,
    IDENTITY,
    PAST_THE_RESPONSE,
    R_BODY_BYTES,
    R_CHUNK_SIZE,
    R_CONTENT_ENCODING,
    R_CONTENT_LENGTH,
    R_EXPECT,
    R_HEADER_BYTES,
    R_HEADER_COUNT,
    R_HOSTS,
    R_MALFORMED,
    R_TARGET,
    R_TRAILER_BYTES,
    R_TRAILER_COUNT,
    R_TRANSFER_ENCODING,
    R_UPGRADE,
    R_URL_BYTES,
    R_VERSION,
    RESPONSE_HEAD_BYTES,
    RESPONSE_HEADERS,
    UPGRADE_RESPONSE,
    BadResponse,
    Request,
    refusal,
)

__all__ = ["RequestParser", "ResponseParser"]

#: bytes of the reads before a chunk's size line kept to find that line when reads split it
_SIZE_LINE_TAIL = 64

# len() of the header names checked: content-length, transfer-encoding, expect, content-encoding, host
_CHECKED_LENGTHS = frozenset((14, 17, 6, 16, 4))

_HEAD_BYTES_WORDS = RESPONSE_HEAD_BYTES.format(MAX_RESPONSE_HEAD_BYTES)
_HEADERS_WORDS = RESPONSE_HEADERS.format(MAX_RESPONSE_HEADERS)


class RequestParser:
    """Frames one client connection's bytes into :class:`Request` objects (see the module's docstring)."""

    __slots__ = (
        "begin_read",
        "chunk_body",
        "chunk_header_in_read",
        "chunk_state",
        "conn",
        "head_bytes",
        "last_read",
        "max_body_bytes",
        "max_header_bytes",
        "max_headers",
        "parser",
        "req",
        "size_line_tail",
        "trailer_bytes",
        "trailer_read",
        "trailers",
    )

    def __init__(self, conn: Any, limits: Limits) -> None:
        self.conn = conn
        self.parser = httptools.HttpRequestParser(self)
        #: the request being read (None between requests)
        self.req: Request | None = None
        self.max_header_bytes = limits.max_header_bytes
        self.max_headers = limits.max_headers
        self.max_body_bytes = limits.max_body_bytes
        # Chunked bodies: 0 between chunks, 1 after a chunk's size line, 2 in its data
        # (1 until the message ends after the last, empty, chunk: its trailer section).
        self.chunk_state = 0
        #: data bytes of the current chunk within the current read
        self.chunk_body = 0
        self.chunk_header_in_read = False
        self.size_line_tail = b""
        #: trailer fields, their bytes (exact, per field), and bytes of reads wholly in the trailer section
        self.trailers = 0
        self.trailer_bytes = 0
        self.trailer_read = 0
        #: bytes of the reads after the one a request began in, while its headers were incomplete
        self.head_bytes = 0
        #: the length of the read being parsed, and of the one the current request began in
        self.last_read = 0
        self.begin_read = 0

    def feed(self, data: bytes) -> None:
        """Parse one read; raises :class:`Refused`, or what a ``conn`` event raised."""
        self.last_read = len(data)
        begun = self.req  # the request in progress when this read began
        # Headers already in progress when this read began: the whole read is header bytes.
        mid_headers = begun is not None and not begun.method
        # Likewise a trailer section (after the last chunk's size line): bounded like headers.
        mid_trailers = self.chunk_state == 1 and begun is not None
        self.chunk_header_in_read = False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            raise refusal(R_UPGRADE) from None
        except httptools.HttpParserCallbackError as exc:
            # What an event raised (a refusal here, the connection's stop, or a bug): httptools
            # keeps it as the context of its own error.
            raise (exc.__context__ or exc) from None
        except httptools.HttpParserError as exc:
            raise refusal(R_MALFORMED, exc) from None
        req = self.req
        if req is not None and not req.method:
            # Headers still incomplete after this read: bound what they may
            # take. The read they began in is not counted (it may carry the
            # previous request's tail); the exact sum is taken when they end. Nor is a read
            # that began in another request's head: it is the read this one began in.
            if mid_headers and req is begun:
                self.head_bytes += len(data)
            if self.head_bytes > self.max_header_bytes:
                raise refusal(R_HEADER_BYTES, self.max_header_bytes)
        elif req is not None and req.chunked:
            self._after_chunked_read(data, mid_trailers)

    def _after_chunked_read(self, data: bytes, mid_trailers: bool) -> None:
        """A read of a chunked body: bound its trailer section, refuse a declared chunk past the body limit."""
        limit = self.max_header_bytes
        if mid_trailers and self.chunk_state == 1 and not self.chunk_header_in_read:
            # llhttp hands a field to httptools piece by piece, which joins
            # them by concatenation: only a bound keeps that linear. The read
            # the section began in is not counted (the exact sum is taken per field).
            self.trailer_read += len(data)
            if self.trailer_read > limit:
                raise refusal(R_TRAILER_BYTES, limit)
        if self.chunk_header_in_read and self.chunk_state:
            # A chunk still open at the end of the read (one that ended in it was counted whole
            # by on_body; reading its "size line" there read its data as hex).
            self._check_chunk_size(data)
        # The tail of every read so far, not only of the last: a size line that several reads
        # split (a client writing a byte at a time) is still found whole.
        tail = self.size_line_tail + data if len(data) < _SIZE_LINE_TAIL else data
        self.size_line_tail = tail[-_SIZE_LINE_TAIL:]

    def _check_chunk_size(self, data: bytes) -> None:
        """413 when the size line of the chunk open at the end of ``data`` goes past the body limit.

        httptools does not expose the chunk size llhttp read (its
        ``content_length``; the compiled twin reads it there), so it is read
        again here from the line llhttp accepted: the open chunk's data is the
        read's last ``chunk_body`` bytes, and its size line ("hex[;ext]" CRLF,
        no LF inside: llhttp strict) just before them. A line not wholly
        within the last 64 bytes before this read and this read is left to
        the byte count of :meth:`on_body`.
        """
        end = len(data) - self.chunk_body
        text = data[end - 4096 : end] if end >= 4096 else self.size_line_tail + data[:end]
        if not text.endswith(b"\r\n"):
            return
        start = text.rfind(b"\n", 0, len(text) - 1)
        if start < 0:
            return
        try:
            size = int(text[start + 1 : -2].split(b";", 1)[0], 16)
        except ValueError:
            return  # not a size line: the trailer section of the last chunk
        req = self.req
        assert req is not None
        limit = self.max_body_bytes
        if req.size - self.chunk_body + size > limit:
            raise refusal(R_CHUNK_SIZE, size, limit)

    # -- httptools' callbacks ------------------------------------------------------

    def on_message_begin(self) -> None:
        req = self.req = Request()
        self.head_bytes = 0
        self.begin_read = self.last_read
        self.size_line_tail = b""
        self.conn.on_message_begin(req)

    def on_url(self, url: bytes) -> None:
        req = self.req
        assert req is not None
        req.url += url
        if len(req.url) > self.max_header_bytes:
            raise refusal(R_URL_BYTES, self.max_header_bytes)

    def on_header(self, name: bytes, value: bytes) -> None:
        # The hot path: six headers a request. Only five names matter here,
        # told apart by length before any lower-casing.
        req = self.req
        assert req is not None
        if req.method:
            self._trailer(name, value)
            return
        headers = req.headers
        headers.append((name, value))
        if len(name) in _CHECKED_LENGTHS:
            self._check_header(req, name.lower(), value)
        if len(headers) > self.max_headers:
            raise refusal(R_HEADER_COUNT, self.max_headers)

    def _trailer(self, name: bytes, value: bytes) -> None:
        """A trailer field (after a chunked body, RFC 9112 7.1.2): bounded like headers, then dropped.

        Nothing here reads trailers, and RFC 9110 6.5.1 forbids merging them
        into the headers unless their fields allow it: a field there must not
        route, authenticate or encode the request.
        """
        self.trailers += 1
        self.trailer_bytes += len(name) + len(value) + 4
        if self.trailer_bytes > self.max_header_bytes:
            raise refusal(R_TRAILER_BYTES, self.max_header_bytes)
        if self.trailers > self.max_headers:
            raise refusal(R_TRAILER_COUNT, self.max_headers)

    def on_chunk_header(self) -> None:
        self.chunk_state = 1
        self.chunk_body = 0
        self.chunk_header_in_read = True
        self.trailers = self.trailer_bytes = self.trailer_read = 0

    def on_chunk_complete(self) -> None:
        self.chunk_state = 0

    @staticmethod
    def _check_header(req: Request, key: bytes, value: bytes) -> None:
        if key == b"host":
            req.hosts += 1
        elif key == b"content-length":
            req.content_length = int(value)  # llhttp checked: digits, one header
        elif key == b"transfer-encoding":
            req.chunked = True
            if value.strip().lower() != CHUNKED or sum(k.lower() == key for k, _ in req.headers) > 1:
                raise refusal(R_TRANSFER_ENCODING)
        elif key == b"expect":
            if value.strip().lower() != CONTINUE:
                raise refusal(R_EXPECT)
            req.expect_continue = True
        elif key == b"content-encoding":
            if value.strip().lower() not in IDENTITY:
                raise refusal(R_CONTENT_ENCODING)

    def on_headers_complete(self) -> None:
        req = self.req
        assert req is not None
        # Header bytes: counted per read while the headers were incomplete (feed); the reads
        # they began and ended in are summed only when they could have carried more than the limit.
        limit = self.max_header_bytes
        if self.head_bytes + self.begin_read + self.last_read > limit:
            size = len(req.url) + sum(len(k) + len(v) + 4 for k, v in req.headers)
            if size > limit:
                raise refusal(R_HEADER_BYTES, limit)
        parser = self.parser
        req.version = parser.get_http_version()
        if req.version not in ("1.1", "1.0"):
            raise refusal(R_VERSION, req.version)
        if req.hosts != 1 and (req.hosts or req.version == "1.1"):
            raise refusal(R_HOSTS, req.hosts)
        if parser.should_upgrade():
            raise refusal(R_UPGRADE)
        req.method = parser.get_method()
        url = req.url
        if url[:1] != b"/":
            raise refusal(R_TARGET)
        query = url.find(b"?")
        if query < 0:
            req.path = url
        else:
            req.path, req.query = url[:query], url[query + 1 :]
        if req.content_length and req.content_length > self.max_body_bytes:
            raise refusal(R_CONTENT_LENGTH, req.content_length, self.max_body_bytes)
        if req.version == "1.0":
            req.expect_continue = False  # RFC 9110 15.2: never a 1xx to HTTP/1.0
        self.conn.on_head(req)

    def on_body(self, body: bytes) -> None:
        req = self.req
        assert req is not None
        n = len(body)
        req.size += n
        if req.size > self.max_body_bytes:
            raise refusal(R_BODY_BYTES, self.max_body_bytes)
        if req.chunked:
            self.chunk_state = 2
            self.chunk_body += n
            self.conn.on_body_piece(req, n)
        req.chunks.append(body)

    def on_message_complete(self) -> None:
        req = self.req
        assert req is not None
        self.req = None
        self.chunk_state = 0
        req.keep_alive = self.parser.should_keep_alive()
        chunks = req.chunks
        if chunks:
            req.body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            req.chunks = []
        self.conn.on_message_complete(req)


# len() of the response header names read: content-type, content-length, retry-after, transfer-encoding
_WANTED_LENGTHS = frozenset((12, 14, 11, 17))


class ResponseParser:
    """Frames one upstream connection's bytes into responses (see the module's docstring)."""

    __slots__ = (
        "conn",
        "content_length",
        "content_type",
        "ended",
        "fields",
        "head_bytes",
        "head_read",
        "in_head",
        "interim",
        "parser",
        "retry_after",
    )

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.parser = httptools.HttpResponseParser(self)
        self.content_type = b""
        self.content_length: int | None = None
        self.retry_after: bytes | None = None
        #: a response (not a 1xx) ended: the next message is refused until the connection sets it False
        self.ended = False
        #: the response being read is a 1xx (the answer follows it)
        self.interim = False
        #: the head is in progress; its fields' bytes and count, the bytes of its reads (see the docstring)
        self.in_head = False
        self.head_bytes = self.head_read = self.fields = 0

    def feed(self, data: bytes) -> None:
        """Parse one read; raises :class:`BadResponse`, or what a ``conn`` event raised."""
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            raise BadResponse(UPGRADE_RESPONSE) from None
        except httptools.HttpParserCallbackError as exc:
            raise (exc.__context__ or BadResponse(str(exc))) from None
        except httptools.HttpParserError as exc:
            raise BadResponse(str(exc)) from None
        if self.in_head:
            # A head still in progress after this read: the whole read counts against its bound
            # (httptools joins a field's pieces itself: only this keeps what it holds bounded).
            self.head_read += len(data)
            if self.head_read > MAX_RESPONSE_HEAD_BYTES:
                raise BadResponse(_HEAD_BYTES_WORDS)

    # -- httptools' callbacks ------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.ended:  # one response per request: a worker that writes more is not trusted again
            raise BadResponse(PAST_THE_RESPONSE)
        self.content_type = b""
        self.content_length = None
        self.retry_after = None
        self.in_head = True
        self.head_bytes = self.head_read = self.fields = 0

    def on_header(self, name: bytes, value: bytes) -> None:
        # A field ended: the head's bounds (its bytes first, as the compiled twin checks them).
        self.head_bytes += len(name) + len(value)
        self.fields += 1
        if self.head_bytes > MAX_RESPONSE_HEAD_BYTES:
            raise BadResponse(_HEAD_BYTES_WORDS)
        if self.fields > MAX_RESPONSE_HEADERS:
            raise BadResponse(_HEADERS_WORDS)
        # Four names matter, told apart by length first (Date and Server are
        # in every response and matter not).
        if len(name) not in _WANTED_LENGTHS:
            return
        key = name.lower()
        if key == b"content-type":
            self.content_type = value
        elif key == b"content-length":
            self.content_length = int(value)
        elif key == b"retry-after":
            self.retry_after = value
        elif key == b"transfer-encoding":
            self.content_length = -1  # chunked: framed, not close-delimited

    def on_headers_complete(self) -> None:
        self.in_head = False
        status = self.parser.get_status_code()
        self.interim = 100 <= status < 200
        self.conn.on_head(status, self.content_type, self.content_length, self.retry_after)

    def on_body(self, body: bytes) -> None:
        self.conn.on_body(body)

    def on_message_complete(self) -> None:
        if not self.interim:
            self.ended = True
        self.conn.on_message_complete(self.parser.should_keep_alive())
