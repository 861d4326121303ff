# cython: auto_pickle=False
"""The HTTP parsers in C, twin of :mod:`server.http._parse_py` (its docstring has the events and
what is checked; chosen once in :mod:`server.http.parse`): llhttp's callbacks compiled, one Python
call per message event. Three modules, one concern each:

- :mod:`server.http._request_parser`: ``RequestParser``, a client connection's (exported here);
- this module: ``ResponseParser``, the upstream side's. It reads the four response headers the
  orchestrator uses in C (the others are never made into Python objects), bounds the head as the
  pure twin does, and calls its connection once for the head, once per body piece and once at the
  end; :mod:`server.http._upstream`'s connection is one (a subclass whose events are C calls,
  declared in ``_parse.pxd``);
- :mod:`server.http._llhttp`: llhttp itself (compiled in once), the reads both parsers drive it
  with and the buffers uvloop reads into (``WHOLE_READ_MAX``, ``READ_BUFFER``, ``HEAD_READ``:
  exported here).
"""

from cpython.bytes cimport PyBytes_CheckExact, PyBytes_GET_SIZE
from libc.string cimport memcpy

from ._llhttp cimport (
    HPE_OK, HPE_PAUSED_UPGRADE, HTTP_RESPONSE, STOP, equals_lower, error_reason, keep_alive,
    message_events, parse_read, parse_read_at, piece, start,
)

import sys

from ._llhttp import HEAD_READ, READ_BUFFER, WHOLE_READ_MAX
from ._request_parser import RequestParser
from .limits import MAX_RESPONSE_HEAD_BYTES, MAX_RESPONSE_HEADERS
from .request import PAST_THE_RESPONSE, RESPONSE_HEAD_BYTES, RESPONSE_HEADERS, UPGRADE_RESPONSE, BadResponse

__all__ = ["RequestParser", "ResponseParser"]

# A worker's response head: its bounds and the refusals' words, read once from their one home.
cdef Py_ssize_t _HEAD_BYTES = MAX_RESPONSE_HEAD_BYTES
cdef Py_ssize_t _HEADERS = MAX_RESPONSE_HEADERS
cdef str _HEAD_BYTES_WORDS = RESPONSE_HEAD_BYTES.format(MAX_RESPONSE_HEAD_BYTES)
cdef str _HEADERS_WORDS = RESPONSE_HEADERS.format(MAX_RESPONSE_HEADERS)
cdef str _PAST_WORDS = PAST_THE_RESPONSE


cdef class ResponseParser:
    """Frames one upstream connection's bytes into responses (see the pure twin). Its fields and
    events are declared in _parse.pxd: the compiled upstream connection is one (upstream.py, a subclass
    whose ``head``, ``body`` and ``complete`` are C methods, no Python call per event)."""

    def __cinit__(self, conn):
        self.conn = conn
        self.content_type = bytearray()
        self.retry_after = bytearray()
        message_events(&self.settings, _response_begin, _response_field, _response_field_complete,
                       _response_value, _response_value_complete, _response_head, _response_body,
                       _response_complete)
        start(&self.parser, HTTP_RESPONSE, &self.settings, <void*>self)

    def feed(self, data):
        """Parse one read; raises :class:`BadResponse`, or what a ``conn`` event raised."""
        self.execute(data)

    cdef int execute(self, object data) except -1:
        cdef Py_ssize_t n = PyBytes_GET_SIZE(data) if PyBytes_CheckExact(data) else len(data)
        return self._after_execute(parse_read(&self.parser, data, NULL), n)

    cdef int execute_at(self, const char* at, Py_ssize_t n) except -1:
        """:meth:`execute` over bytes that are no Python object's (a buffer read into): pieces are copied."""
        return self._after_execute(parse_read_at(&self.parser, at, n, NULL), n)

    cdef int _after_execute(self, int err, Py_ssize_t n) except -1:
        if err == HPE_OK:
            if self.in_head:
                # A head still in progress after this read: the whole read counts against its bound
                # (what llhttp keeps of it here is a Content-Type or Retry-After value, at most the
                # bound and one read; the pure twin's httptools keeps any field, as much).
                self.head_read += n
                if self.head_read > _HEAD_BYTES:
                    raise BadResponse(_HEAD_BYTES_WORDS)
            return 0
        error = self.error
        if error is not None:
            self.error = None
            raise error
        if err == HPE_PAUSED_UPGRADE:
            raise BadResponse(UPGRADE_RESPONSE)
        raise BadResponse(error_reason(&self.parser))

    cdef int _event_failed(self) noexcept:
        self.error = sys.exc_info()[1]
        return STOP

    cdef int head(self, int status, bytes content_type, object content_length, object retry_after) except -1:
        self.conn.on_head(status, content_type, content_length, retry_after)
        return 0

    cdef int body(self, object piece) except -1:
        self.conn.on_body(piece)
        return 0

    cdef int body_at(self, const char* at, Py_ssize_t n) except -1:
        return self.body(piece(at, n))

    cdef int complete(self, bint keep_alive) except -1:
        self.conn.on_message_complete(keep_alive)
        return 0


cdef int _response_refused(ResponseParser self, str words) noexcept:
    """Stop llhttp; ``execute`` raises :class:`BadResponse` with ``words``."""
    try:
        self.error = BadResponse(words)
    except BaseException:
        return self._event_failed()
    return STOP


cdef inline int _field_ended(ResponseParser self) noexcept:
    """A field ended (the next began, or the head ended): the head's bounds, as the pure twin checks
    them when httptools hands it that field (its bytes first: a bound passed in a read is refused in
    that read by either twin, in the same words)."""
    if self.head_bytes > _HEAD_BYTES:
        return _response_refused(self, _HEAD_BYTES_WORDS)
    if self.fields > _HEADERS:
        return _response_refused(self, _HEADERS_WORDS)
    return 0


cdef int _response_begin(llhttp_t* p) noexcept:
    cdef ResponseParser self = <ResponseParser>p.data
    if self.ended:
        # One response per request: a worker that writes more than it was asked for (a second
        # answer behind the first) cannot be trusted with the connection, nor its bytes be taken
        # for the next request's answer.
        return _response_refused(self, _PAST_WORDS)
    self.has_content_type = self.has_retry_after = self.in_field = False
    self.framing = OTHER
    self.in_head = True
    self.head_bytes = self.head_read = self.fields = 0
    return 0


cdef int _response_field(llhttp_t* p, const char* at, size_t n) noexcept:
    cdef ResponseParser self = <ResponseParser>p.data
    cdef Py_ssize_t keep
    if not self.in_field:
        if self.fields and _field_ended(self):
            return STOP
        self.fields += 1
        self.in_field = True
        self.name_len = 0
    self.head_bytes += <Py_ssize_t>n
    keep = min(<Py_ssize_t>n, NAME_BYTES - min(self.name_len, NAME_BYTES))
    if keep > 0:
        memcpy(self.name + self.name_len, at, keep)
    self.name_len += <Py_ssize_t>n
    return 0


cdef int _response_field_complete(llhttp_t* p) noexcept:
    cdef ResponseParser self = <ResponseParser>p.data
    cdef Py_ssize_t n = self.name_len
    self.in_field = False
    self.wanted = OTHER
    if n == 12 and equals_lower(self.name, n, b"content-type"):
        self.wanted = CONTENT_TYPE
        self.has_content_type = True
        del self.content_type[:]
    elif n == 11 and equals_lower(self.name, n, b"retry-after"):
        self.wanted = RETRY_AFTER
        self.has_retry_after = True
        del self.retry_after[:]
    elif n == 14 and equals_lower(self.name, n, b"content-length"):
        self.framing = CONTENT_LENGTH
    elif n == 17 and equals_lower(self.name, n, b"transfer-encoding"):
        self.framing = TRANSFER_ENCODING  # chunked: framed, not close-delimited
    return 0


cdef int _response_value(llhttp_t* p, const char* at, size_t n) noexcept:
    cdef ResponseParser self = <ResponseParser>p.data
    self.head_bytes += <Py_ssize_t>n
    try:
        if self.wanted == CONTENT_TYPE:
            self.content_type += (<const unsigned char*>at)[:n]
        elif self.wanted == RETRY_AFTER:
            self.retry_after += (<const unsigned char*>at)[:n]
    except BaseException:
        return self._event_failed()
    return 0


cdef int _response_value_complete(llhttp_t* p) noexcept:
    (<ResponseParser>p.data).wanted = OTHER
    return 0


cdef int _response_head(llhttp_t* p) noexcept:
    cdef ResponseParser self = <ResponseParser>p.data
    if self.fields and _field_ended(self):
        return STOP
    self.in_head = False
    try:
        content_length = None
        if self.framing == CONTENT_LENGTH:
            content_length = p.content_length
        elif self.framing == TRANSFER_ENCODING:
            content_length = -1
        self.head(
            p.status_code,
            bytes(self.content_type) if self.has_content_type else b"",
            content_length,
            bytes(self.retry_after) if self.has_retry_after else None,
        )
    except BaseException:
        return self._event_failed()
    return 1 if p.upgrade else 0  # as httptools: an upgrade has no body to parse


cdef int _response_body(llhttp_t* p, const char* at, size_t n) noexcept:
    cdef ResponseParser self = <ResponseParser>p.data
    try:
        self.body_at(at, <Py_ssize_t>n)
    except BaseException:
        return self._event_failed()
    return 0


cdef int _response_complete(llhttp_t* p) noexcept:
    cdef ResponseParser self = <ResponseParser>p.data
    if not 100 <= p.status_code < 200:  # a 1xx is followed by the answer
        self.ended = True
    try:
        self.complete(keep_alive(p))
    except BaseException:
        return self._event_failed()
    return 0
