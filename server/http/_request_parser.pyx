# cython: auto_pickle=False
"""The request parser in C: llhttp's callbacks for a client connection's bytes.

Twin of :mod:`server.http._parse_py`'s ``RequestParser`` (its docstring has the events and what is
checked; :mod:`server.http._parse` exports this one, :mod:`server.http.parse` chooses). The request
line and the header fields are copied into one C buffer as llhttp hands them over, in as many
pieces as the reads split them; the per-header checks (Host count, Content-Length,
Transfer-Encoding, Expect, Content-Encoding, the header count) run there when a value ends, and the
Python objects of a request (its :class:`Request`, the header tuples, the method, URL, path and
query) are made once, when its head is complete. A chunk's declared size is llhttp's
(``content_length`` at a chunk header): no size line is read again. Each bound is counted as the
pure twin counts it (per read while headers or a trailer section are incomplete, exactly at their
end), so both refuse the same bytes with the same words. llhttp itself and the reads are
:mod:`server.http._llhttp`'s.
"""

from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcpy

from ._llhttp cimport (
    F_CONTENT_LENGTH, HPE_OK, HPE_PAUSED_UPGRADE, HTTP_REQUEST, STOP, BodyReader, equals_lower,
    error_reason, keep_alive, llhttp_errno_t, llhttp_settings_t, llhttp_t, message_events,
    method_name, parse_read, parse_read_at, piece, start, stripped_equals_lower,
)

import sys

from .request import Request, refusal
from . import request as _request

__all__ = ["RequestParser"]

# The refusal codes, read once from their one home (server/http/request.py).
cdef int R_MALFORMED = _request.R_MALFORMED
cdef int R_UPGRADE = _request.R_UPGRADE
cdef int R_URL_BYTES = _request.R_URL_BYTES
cdef int R_HEADER_BYTES = _request.R_HEADER_BYTES
cdef int R_HEADER_COUNT = _request.R_HEADER_COUNT
cdef int R_TRAILER_BYTES = _request.R_TRAILER_BYTES
cdef int R_TRAILER_COUNT = _request.R_TRAILER_COUNT
cdef int R_TRANSFER_ENCODING = _request.R_TRANSFER_ENCODING
cdef int R_EXPECT = _request.R_EXPECT
cdef int R_CONTENT_ENCODING = _request.R_CONTENT_ENCODING
cdef int R_VERSION = _request.R_VERSION
cdef int R_HOSTS = _request.R_HOSTS
cdef int R_TARGET = _request.R_TARGET
cdef int R_CONTENT_LENGTH = _request.R_CONTENT_LENGTH
cdef int R_BODY_BYTES = _request.R_BODY_BYTES
cdef int R_CHUNK_SIZE = _request.R_CHUNK_SIZE
cdef bytes CHUNKED = _request.CHUNKED
cdef bytes CONTINUE = _request.CONTINUE
cdef bytes IDENTITY = _request.IDENTITY[0]

cdef enum:
    # the head buffer's first size, and the size it goes back to after a large head
    HEAD_BUFFER = 2048
    # header slots allocated first (more on demand, up to max_headers + 1)
    FIELDS = 32


cdef struct Field:
    Py_ssize_t name
    Py_ssize_t name_len
    Py_ssize_t value
    Py_ssize_t value_len


cdef class RequestParser:
    """Frames one client connection's bytes into :class:`Request` objects (see the pure twin)."""

    cdef llhttp_t parser
    cdef llhttp_settings_t settings
    cdef object conn
    #: the request being read (None between requests)
    cdef object req
    #: what an event raised, re-raised by feed; or the refusal code and its arguments
    cdef object error
    cdef int refused
    cdef tuple refused_args
    cdef Py_ssize_t max_header_bytes, max_headers, max_body_bytes
    # The request line and header fields, as llhttp handed them over.
    cdef char* buf
    cdef Py_ssize_t used, capacity
    cdef Field* fields
    cdef Py_ssize_t nfields, fields_capacity
    cdef Py_ssize_t url_len
    cdef bint in_field, head_done
    # A field whose value ended, checked when the next field begins or the section ends (where
    # httptools hands a field to the pure twin: both refuse in the same read).
    cdef bint field_pending
    # What the checked headers said.
    cdef Py_ssize_t hosts, transfer_encodings
    cdef bint chunked, expect_continue
    # Bounds, counted as the pure twin counts them.
    cdef Py_ssize_t size, head_bytes, last_read, begin_read
    cdef int chunk_state
    cdef Py_ssize_t chunk_body
    cdef unsigned long long chunk_size
    cdef bint chunk_header_in_read
    cdef Py_ssize_t trailers, trailer_bytes, trailer_read, trailer_field
    # Set at each read's start: headers (a trailer section) were in progress.
    cdef bint mid_headers, mid_trailers
    cdef list chunks
    # where uvloop's reads go (None until it asks: asyncio's loop hands bytes objects)
    cdef BodyReader reader

    def __cinit__(self, conn, limits):
        self.buf = <char*>malloc(HEAD_BUFFER)
        self.fields = <Field*>malloc(FIELDS * sizeof(Field))
        if self.buf == NULL or self.fields == NULL:
            raise MemoryError()
        self.capacity = HEAD_BUFFER
        self.fields_capacity = FIELDS
        self.conn = conn
        self.max_header_bytes = limits.max_header_bytes
        self.max_headers = limits.max_headers
        self.max_body_bytes = limits.max_body_bytes
        message_events(&self.settings, _on_message_begin, _on_header_field, _on_header_field_complete,
                       _on_header_value, _on_header_value_complete, _on_headers_complete, _on_body,
                       _on_message_complete)
        self.settings.on_url = _on_url
        self.settings.on_chunk_header = _on_chunk_header
        self.settings.on_chunk_complete = _on_chunk_complete
        start(&self.parser, HTTP_REQUEST, &self.settings, <void*>self)

    def __dealloc__(self):
        free(self.buf)
        free(self.fields)

    def feed(self, data):
        """Parse one read; raises :class:`Refused`, or what a ``conn`` event raised."""
        self._fed(parse_read(&self.parser, data, _request_read))

    @property
    def buffered(self):
        """Whether the loop reads into this parser's buffers (uvloop asked for one)."""
        return self.reader is not None

    def get_buffer(self, Py_ssize_t sizehint):
        """Where the next read goes (asyncio.BufferedProtocol's, bound on the connection): the rest of
        a body being read whole, else the process's read buffer."""
        if self.reader is None:
            self.reader = BodyReader()
        return self.reader.buffer(&self.parser)

    def feed_buffered(self, Py_ssize_t nbytes):
        """:meth:`feed` of the ``nbytes`` a read put where :meth:`get_buffer` said."""
        self._fed(parse_read_at(&self.parser, self.reader.last_read(), nbytes, _request_read))

    cdef _fed(self, int err):
        try:
            if err != HPE_OK:
                self._raise(<llhttp_errno_t>err)
            self._after_read()
        except BaseException:
            # Never fed again: the body read so far goes back now (the connection drops its
            # request's; the pure twin's pieces are that request's own), not when it closes.
            self.chunks = None
            self.req = None
            if self.reader is not None:
                self.reader.drop()
            raise

    cdef void _start_read(self, Py_ssize_t n) noexcept:
        self.last_read = n
        # Headers (a trailer section) already in progress when this read began: the whole read
        # is header (trailer) bytes.
        self.mid_headers = self.req is not None and not self.head_done
        self.mid_trailers = self.chunk_state == 1 and self.req is not None
        self.chunk_header_in_read = False

    cdef _raise(self, llhttp_errno_t err):
        error = self.error
        if error is not None:
            self.error = None
            raise error
        if self.refused:
            raise refusal(self.refused, *self.refused_args)
        if err == HPE_PAUSED_UPGRADE:
            raise refusal(R_UPGRADE)
        raise refusal(R_MALFORMED, error_reason(&self.parser))

    cdef _after_read(self):
        """The bounds counted per read: incomplete headers, a trailer section, the open chunk's size."""
        if self.req is None:
            return
        cdef Py_ssize_t limit = self.max_header_bytes
        if not self.head_done:
            # The read they began in is not counted (it may carry the previous request's
            # tail); the exact sum is taken when they end.
            if self.mid_headers:
                self.head_bytes += self.last_read
            if self.head_bytes > limit:
                raise refusal(R_HEADER_BYTES, limit)
            return
        if not self.chunked:
            return
        if self.mid_trailers and self.chunk_state == 1 and not self.chunk_header_in_read:
            self.trailer_read += self.last_read
            if self.trailer_read > limit:
                raise refusal(R_TRAILER_BYTES, limit)
        # size - chunk_body: the bytes before this chunk, within the limit (else on_body refused);
        # compared so, a declared size near 2**64 cannot wrap the sum round.
        if self.chunk_header_in_read and self.chunk_state and self.chunk_size > <unsigned long long>(
            self.max_body_bytes - (self.size - self.chunk_body)
        ):
            raise refusal(R_CHUNK_SIZE, self.chunk_size, self.max_body_bytes)

    # -- helpers of the callbacks (C only; a refusal is a code, worded by _raise) --------

    cdef int _refuse(self, int code, tuple args=()) noexcept:
        self.refused = code
        self.refused_args = args
        return STOP

    cdef int _event_failed(self) noexcept:
        # Called from an except clause: what the event raised goes back to feed's caller.
        self.error = sys.exc_info()[1]
        return STOP

    cdef int _append(self, const char* at, size_t n) noexcept:
        cdef Py_ssize_t need = self.used + <Py_ssize_t>n
        cdef Py_ssize_t capacity = self.capacity
        cdef char* grown
        if need > capacity:
            capacity = max(capacity, HEAD_BUFFER)
            while capacity < need:
                capacity *= 2
            grown = <char*>realloc(self.buf, capacity)
            if grown == NULL:
                return -1
            self.buf = grown
            self.capacity = capacity
        memcpy(self.buf + self.used, at, n)
        self.used = need
        return 0

    cdef int _new_field(self) noexcept:
        cdef Py_ssize_t capacity = self.fields_capacity
        cdef Field* grown
        if self.nfields == capacity:
            grown = <Field*>realloc(self.fields, 2 * capacity * sizeof(Field))
            if grown == NULL:
                return -1
            self.fields = grown
            self.fields_capacity = 2 * capacity
        self.fields[self.nfields].name = self.used
        self.fields[self.nfields].name_len = 0
        self.fields[self.nfields].value = self.used
        self.fields[self.nfields].value_len = 0
        self.nfields += 1
        return 0

    cdef int _check_field(self, Field* f) noexcept:
        """The five headers checked, told apart by length before any lower-casing."""
        cdef const char* name = self.buf + f.name
        cdef const char* value = self.buf + f.value
        cdef Py_ssize_t n = f.name_len
        if n == 4 and equals_lower(name, n, b"host"):
            self.hosts += 1
        elif n == 17 and equals_lower(name, n, b"transfer-encoding"):
            self.chunked = True
            self.transfer_encodings += 1
            if self.transfer_encodings > 1 or not stripped_equals_lower(value, f.value_len, CHUNKED):
                return self._refuse(R_TRANSFER_ENCODING)
        elif n == 6 and equals_lower(name, n, b"expect"):
            if not stripped_equals_lower(value, f.value_len, CONTINUE):
                return self._refuse(R_EXPECT)
            self.expect_continue = True
        elif n == 16 and equals_lower(name, n, b"content-encoding"):
            if not (stripped_equals_lower(value, f.value_len, IDENTITY)
                    or stripped_equals_lower(value, f.value_len, b"")):
                return self._refuse(R_CONTENT_ENCODING)
        return 0

    cdef int _head_complete(self) except -2:
        """Check the request line and headers, fill the request, tell the connection."""
        cdef Py_ssize_t limit = self.max_header_bytes
        cdef Py_ssize_t total, i, query
        cdef Field* f
        cdef const char* buf = self.buf
        if self.head_bytes + self.begin_read + self.last_read > limit:
            total = self.url_len
            for i in range(self.nfields):
                total += self.fields[i].name_len + self.fields[i].value_len + 4
            if total > limit:
                return self._refuse(R_HEADER_BYTES, (limit,))
        cdef int major = self.parser.http_major, minor = self.parser.http_minor
        if major != 1 or minor > 1:
            return self._refuse(R_VERSION, (f"{major}.{minor}",))
        version = "1.1" if minor == 1 else "1.0"
        if self.hosts != 1 and (self.hosts or minor == 1):
            return self._refuse(R_HOSTS, (self.hosts,))
        if self.parser.upgrade:
            return self._refuse(R_UPGRADE)
        if self.url_len == 0 or buf[0] != b"/":
            return self._refuse(R_TARGET)
        content_length = None
        if self.parser.flags & F_CONTENT_LENGTH:
            content_length = self.parser.content_length
            if content_length > self.max_body_bytes:
                return self._refuse(R_CONTENT_LENGTH, (content_length, self.max_body_bytes))
        req = self.req
        req.method = method_name(&self.parser)
        url = PyBytes_FromStringAndSize(buf, self.url_len)
        req.url = url
        query = 0
        while query < self.url_len and buf[query] != b"?":
            query += 1
        if query == self.url_len:
            req.path = url
        else:
            req.path = PyBytes_FromStringAndSize(buf, query)
            req.query = PyBytes_FromStringAndSize(buf + query + 1, self.url_len - query - 1)
        headers = []
        for i in range(self.nfields):
            f = &self.fields[i]
            headers.append((PyBytes_FromStringAndSize(buf + f.name, f.name_len),
                            PyBytes_FromStringAndSize(buf + f.value, f.value_len)))
        req.headers = headers
        req.version = version
        req.hosts = self.hosts
        req.content_length = content_length
        req.chunked = self.chunked
        req.expect_continue = self.expect_continue and minor == 1  # RFC 9110 15.2: never a 1xx to HTTP/1.0
        self.head_done = True
        self.conn.on_head(req)
        if self.reader is not None and content_length is not None:
            self.reader.begin(<Py_ssize_t>content_length)
        return 0


# -- llhttp's callbacks ------------------------------------------------------------------


cdef void _request_read(void* owner, Py_ssize_t n) noexcept:
    (<RequestParser>owner)._start_read(n)


# Each returns 0 to go on, or STOP with the reason in the parser (a refusal code, or the
# exception an event raised).


cdef int _on_message_begin(llhttp_t* p) noexcept:
    cdef RequestParser self = <RequestParser>p.data
    self.used = self.nfields = self.url_len = 0
    self.in_field = self.field_pending = self.head_done = self.chunked = self.expect_continue = False
    self.hosts = self.transfer_encodings = self.size = self.head_bytes = 0
    self.begin_read = self.last_read
    # This read is the one the request began in, not one of its head's later reads (uncounted
    # even if the previous request's head was in progress when it began).
    self.mid_headers = False
    if self.capacity > 16 * HEAD_BUFFER:
        # A large head is not kept for the connection's life.
        free(self.buf)
        self.buf = <char*>malloc(HEAD_BUFFER)
        self.capacity = HEAD_BUFFER
        if self.buf == NULL:
            self.capacity = 0
            return STOP
    self.chunks = []
    try:
        req = self.req = Request()
        self.conn.on_message_begin(req)
    except BaseException:
        return self._event_failed()
    return 0


cdef int _on_url(llhttp_t* p, const char* at, size_t n) noexcept:
    cdef RequestParser self = <RequestParser>p.data
    if self._append(at, n):
        return STOP
    self.url_len += <Py_ssize_t>n
    if self.url_len > self.max_header_bytes:
        return self._refuse(R_URL_BYTES, (self.max_header_bytes,))
    return 0


cdef int _on_header_field(llhttp_t* p, const char* at, size_t n) noexcept:
    cdef RequestParser self = <RequestParser>p.data
    if not self.in_field:
        self.in_field = True
        if _field_done(self):
            return STOP
        if not self.head_done and self._new_field():
            return STOP
    return _field_piece(self, at, n, False)


cdef int _on_header_field_complete(llhttp_t* p) noexcept:
    cdef RequestParser self = <RequestParser>p.data
    if not self.head_done:
        self.fields[self.nfields - 1].value = self.used
    return 0


cdef int _on_header_value(llhttp_t* p, const char* at, size_t n) noexcept:
    return _field_piece(<RequestParser>p.data, at, n, True)


cdef inline int _field_piece(RequestParser self, const char* at, size_t n, bint value) noexcept:
    """A piece of the open field's name (``value`` False) or value: copied into the head buffer
    and counted in its field; a trailer field's only counted, never kept."""
    if self.head_done:
        self.trailer_field += <Py_ssize_t>n
        return 0
    if self._append(at, n):
        return STOP
    if value:
        self.fields[self.nfields - 1].value_len += <Py_ssize_t>n
    else:
        self.fields[self.nfields - 1].name_len += <Py_ssize_t>n
    return 0


cdef int _on_header_value_complete(llhttp_t* p) noexcept:
    cdef RequestParser self = <RequestParser>p.data
    self.in_field = False
    self.field_pending = True
    return 0


cdef int _field_done(RequestParser self) noexcept:
    """The checks of the field that ended last, if one is pending."""
    cdef Py_ssize_t limit = self.max_header_bytes
    if not self.field_pending:
        return 0
    self.field_pending = False
    if self.head_done:
        # A trailer field (after a chunked body, RFC 9112 7.1.2): bounded like headers, then
        # dropped; RFC 9110 6.5.1 forbids merging it into the headers.
        self.trailers += 1
        self.trailer_bytes += self.trailer_field + 4
        self.trailer_field = 0
        if self.trailer_bytes > limit:
            return self._refuse(R_TRAILER_BYTES, (limit,))
        if self.trailers > self.max_headers:
            return self._refuse(R_TRAILER_COUNT, (self.max_headers,))
        return 0
    if self._check_field(&self.fields[self.nfields - 1]):
        return STOP
    if self.nfields > self.max_headers:
        return self._refuse(R_HEADER_COUNT, (self.max_headers,))
    return 0


cdef int _on_headers_complete(llhttp_t* p) noexcept:
    cdef RequestParser self = <RequestParser>p.data
    if _field_done(self):
        return STOP
    try:
        return self._head_complete()
    except BaseException:
        return self._event_failed()


cdef int _on_body(llhttp_t* p, const char* at, size_t n) noexcept:
    cdef RequestParser self = <RequestParser>p.data
    self.size += <Py_ssize_t>n
    if self.size > self.max_body_bytes:
        return self._refuse(R_BODY_BYTES, (self.max_body_bytes,))
    try:
        if self.chunked:
            self.chunk_state = 2
            self.chunk_body += <Py_ssize_t>n
            self.conn.on_body_piece(self.req, n)
        if self.reader is not None and self.reader.data is not None:  # (a Content-Length body)
            self.reader.take(at, <Py_ssize_t>n)
            return 0
        self.chunks.append(piece(at, <Py_ssize_t>n))
    except BaseException:
        return self._event_failed()
    return 0


cdef int _on_message_complete(llhttp_t* p) noexcept:
    cdef RequestParser self = <RequestParser>p.data
    req = self.req
    self.req = None
    self.chunk_state = 0
    chunks = self.chunks
    self.chunks = None
    whole = self.reader.finish() if self.reader is not None else None
    try:
        req.keep_alive = keep_alive(&self.parser)
        req.size = self.size
        if whole is not None:
            req.body = whole
        elif chunks:
            req.body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self.conn.on_message_complete(req)
    except BaseException:
        return self._event_failed()
    return 0


cdef int _on_chunk_header(llhttp_t* p) noexcept:
    cdef RequestParser self = <RequestParser>p.data
    self.chunk_state = 1
    self.chunk_body = 0
    self.chunk_header_in_read = True
    self.chunk_size = p.content_length  # the size line's, read by llhttp
    self.trailers = self.trailer_bytes = self.trailer_read = self.trailer_field = 0
    return 0


cdef int _on_chunk_complete(llhttp_t* p) noexcept:
    cdef RequestParser self = <RequestParser>p.data
    self.chunk_state = 0
    return _field_done(self)  # the last chunk's trailer section ended

