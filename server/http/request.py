"""What both request parsers produce: the parsed :class:`Request`, and the refusals (:class:`Refused`);
and what both response parsers raise for a worker's bytes they cannot frame (:class:`BadResponse`).

The parsers (:mod:`server.http._parse`, compiled, and :mod:`server.http._parse_py`, its pure
twin, chosen once in :mod:`server.http.parse`) frame a connection's bytes into requests and refuse
what breaks the protocol or a bound of :class:`~server.http.limits.Limits`. A refusal is one of
the codes below; :func:`refusal` is the one place that words it, for both twins, so the texts the
tests pin are written once.
"""

from __future__ import annotations


class Request:
    """A parsed request: method and path as bytes, raw headers, the whole body."""

    __slots__ = (
        "body",
        "chunked",
        "chunks",
        "content_length",
        "expect_continue",
        "headers",
        "held",
        "hosts",
        "keep_alive",
        "method",
        "path",
        "query",
        "size",
        "url",
        "version",
    )

    def __init__(self) -> None:
        self.method = b""
        self.url = b""
        self.path = b""
        self.query = b""
        self.version = "1.1"
        self.headers: list[tuple[bytes, bytes]] = []
        self.body = b""
        self.chunks: list[bytes] = []
        self.size = 0
        #: body bytes counted against the budgets (a Content-Length whole, from its headers)
        self.held = 0
        #: Host header lines (RFC 9112 3.2: exactly one)
        self.hosts = 0
        self.content_length: int | None = None
        self.expect_continue = False
        self.chunked = False
        self.keep_alive = True

    def header(self, name: bytes) -> bytes | None:
        """The first header called ``name`` (lower case), or None."""
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None


class Refused(Exception):
    """A parser refuses the connection's current request: answer ``status`` with ``message``, then close."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(status, message)
        self.status = status
        self.message = message


class BadResponse(Exception):
    """A response parser (the upstream side) could not frame a worker's bytes, or refuses them:
    llhttp's reason, an upgrade, a head past its bounds, bytes past the response."""


#: BadResponse's words for a 101 (an upgrade): a worker's connection carries HTTP only
UPGRADE_RESPONSE = "protocol upgrades are not supported"
#: ... for a head whose fields' bytes pass server/http/limits.py MAX_RESPONSE_HEAD_BYTES (filled with it)
RESPONSE_HEAD_BYTES = "response head exceeds {} bytes"
#: ... for more header fields than MAX_RESPONSE_HEADERS (filled with it)
RESPONSE_HEADERS = "more than {} response headers"
#: ... for a message after a response, before the next request was sent
PAST_THE_RESPONSE = "bytes past the end of the response"

# The refusals, by code (the compiled twin reads these numbers once at import).
R_MALFORMED = 1
R_UPGRADE = 2
R_URL_BYTES = 3
R_HEADER_BYTES = 4
R_HEADER_COUNT = 5
R_TRAILER_BYTES = 6
R_TRAILER_COUNT = 7
R_TRANSFER_ENCODING = 8
R_EXPECT = 9
R_CONTENT_ENCODING = 10
R_VERSION = 11
R_HOSTS = 12
R_TARGET = 13
R_CONTENT_LENGTH = 14
R_BODY_BYTES = 15
R_CHUNK_SIZE = 16

#: code -> status, and the message with its arguments as ``str.format`` fields
_REFUSALS: dict[int, tuple[int, str]] = {
    # never the request's bytes: llhttp's reason only
    R_MALFORMED: (400, "malformed HTTP request: {}"),
    R_UPGRADE: (501, "protocol upgrades (Upgrade, CONNECT) are not supported"),
    R_URL_BYTES: (414, "request line exceeds {} bytes"),
    R_HEADER_BYTES: (431, "request headers exceed {} bytes"),
    R_HEADER_COUNT: (431, "more than {} request headers"),
    R_TRAILER_BYTES: (431, "request trailers exceed {} bytes"),
    R_TRAILER_COUNT: (431, "more than {} request trailer fields"),
    R_TRANSFER_ENCODING: (501, "only 'Transfer-Encoding: chunked' is supported"),
    R_EXPECT: (417, "only 'Expect: 100-continue' is supported"),
    # A compressed body would reach JSON readers as garbage (or be a decompression bomb):
    # refused up front, never decoded.
    R_CONTENT_ENCODING: (415, "Content-Encoding is not supported: send the request body uncompressed"),
    R_VERSION: (505, "HTTP/{} is not supported; use HTTP/1.1"),
    # RFC 9112 3.2: a 400 to an HTTP/1.1 request without Host, to any with more than one.
    R_HOSTS: (400, "the request has {} Host headers; send exactly one"),
    R_TARGET: (400, "the request target must be a path (origin-form)"),
    R_CONTENT_LENGTH: (413, "request body of {} bytes exceeds the limit of {} bytes"),
    R_BODY_BYTES: (413, "request body exceeds the limit of {} bytes"),
    R_CHUNK_SIZE: (413, "a chunk of {} bytes takes the request body past the limit of {} bytes"),
}


def refusal(code: int, *args: object) -> Refused:
    """The :class:`Refused` for ``code``, its message filled with ``args``."""
    status, message = _REFUSALS[code]
    return Refused(status, message.format(*args))


#: the Transfer-Encoding, Expect and Content-Encoding values accepted (stripped, lower case)
CHUNKED = b"chunked"
CONTINUE = b"100-continue"
IDENTITY = (b"identity", b"")
