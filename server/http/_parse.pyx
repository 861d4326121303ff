# cython: auto_pickle=False
"""The HTTP parsers in C: llhttp's callbacks compiled, one Python call per message event.

Twin of :mod:`server.http._parse_py` (its docstring has the events and what is checked; chosen
once in :mod:`server.http.parse`). The request line and the header fields are copied into one C
buffer as llhttp hands them over, in as many pieces as the reads split them; the per-header
checks (Host count, Content-Length, Transfer-Encoding, Expect, Content-Encoding, the header
count) run there when a value ends, and the Python objects of a request (its :class:`Request`,
the header tuples, the method, URL, path and query) are made once, when its head is complete. A
chunk's declared size is llhttp's (``content_length`` at a chunk header): no size line is read
again. Each bound is counted as the pure twin counts it (per read while headers or a trailer
section are incomplete, exactly at their end), so both refuse the same bytes with the same words.

:class:`ResponseParser`, the upstream side's, reads the four response headers the orchestrator
uses in C (the others are never made into Python objects) and calls its connection once for the
head, once per body piece and once at the end.
"""

from cpython.bytearray cimport PyByteArray_AS_STRING
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_CheckExact, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memcpy

import sys

from .limits import MAX_RESPONSE_HEAD_BYTES, MAX_RESPONSE_HEADERS
from .request import PAST_THE_RESPONSE, RESPONSE_HEAD_BYTES, RESPONSE_HEADERS, UPGRADE_RESPONSE, BadResponse, Request, refusal
from . import request as _request

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

__all__ = ["RequestParser", "ResponseParser"]

# A worker's response head: its bounds and the refusals' words, read once from their one home.
cdef Py_ssize_t _HEAD_BYTES = MAX_RESPONSE_HEAD_BYTES
cdef Py_ssize_t _HEADERS = MAX_RESPONSE_HEADERS
cdef str _HEAD_BYTES_WORDS = RESPONSE_HEAD_BYTES.format(MAX_RESPONSE_HEAD_BYTES)
cdef str _HEADERS_WORDS = RESPONSE_HEADERS.format(MAX_RESPONSE_HEADERS)
cdef str _PAST_WORDS = PAST_THE_RESPONSE

cdef enum:
    # a refusal stops llhttp with this (any non-zero return of a callback stops it)
    STOP = -1
    # the head buffer's first size, and the size it goes back to after a large head
    HEAD_BUFFER = 2048
    # header slots allocated first (more on demand, up to max_headers + 1)
    FIELDS = 32


cdef struct Field:
    Py_ssize_t name
    Py_ssize_t name_len
    Py_ssize_t value
    Py_ssize_t value_len


cdef inline unsigned char _lower(unsigned char c) noexcept:
    return c + 32 if 65 <= c <= 90 else c


cdef inline bint _is_space(unsigned char c) noexcept:
    # bytes.strip()'s whitespace
    return c == 32 or 9 <= c <= 13


cdef bint _equals_lower(const char* at, Py_ssize_t n, bytes lower) noexcept:
    """``at[:n].lower() == lower``."""
    cdef const char* want = PyBytes_AS_STRING(lower)
    cdef Py_ssize_t i
    if n != PyBytes_GET_SIZE(lower):
        return False
    for i in range(n):
        if _lower(<unsigned char>at[i]) != <unsigned char>want[i]:
            return False
    return True


cdef bint _stripped_equals_lower(const char* at, Py_ssize_t n, bytes lower) noexcept:
    """``at[:n].strip().lower() == lower``."""
    while n and _is_space(<unsigned char>at[0]):
        at += 1
        n -= 1
    while n and _is_space(<unsigned char>at[n - 1]):
        n -= 1
    return _equals_lower(at, n, lower)


ctypedef void (*ReadHook)(void* owner, Py_ssize_t n) noexcept


# The bytes object being parsed, while it is (else None): a body piece that is the whole of it is
# handed on as that object, not copied (the middle reads of a large body, a streamed response's).
cdef object _read = None
cdef const char* _read_at = NULL
cdef Py_ssize_t _read_len = 0


cdef object _piece(const char* at, Py_ssize_t n):
    """A body piece as bytes: the read itself when the piece is all of it, else a copy."""
    if at == _read_at and n == _read_len and _read is not None:
        return _read
    return PyBytes_FromStringAndSize(at, n)


cdef int _execute(llhttp_t* parser, object data, ReadHook hook) except -1:
    """llhttp over one read's bytes (a bytes object's without a buffer request); ``hook``, if any,
    is told the read's length first. The llhttp_errno_t it returned."""
    global _read, _read_at, _read_len
    cdef Py_buffer view
    cdef object outer = _read
    cdef const char* outer_at = _read_at
    cdef Py_ssize_t outer_len = _read_len
    if PyBytes_CheckExact(data):
        if hook != NULL:
            hook(parser.data, PyBytes_GET_SIZE(data))
        # Saved and restored, not cleared: an event may parse another connection's bytes.
        _read, _read_at, _read_len = data, PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data)
        try:
            return llhttp_execute(parser, _read_at, <size_t>_read_len)
        finally:
            _read, _read_at, _read_len = outer, outer_at, outer_len
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    _read, _read_at, _read_len = None, NULL, 0  # a buffer not ours to keep: pieces are copied
    try:
        if hook != NULL:
            hook(parser.data, view.len)
        return llhttp_execute(parser, <const char*>view.buf, <size_t>view.len)
    finally:
        _read, _read_at, _read_len = outer, outer_at, outer_len
        PyBuffer_Release(&view)


cdef void _message_events(llhttp_settings_t *settings, llhttp_cb begin, llhttp_data_cb field,
                          llhttp_cb field_complete, llhttp_data_cb value, llhttp_cb value_complete,
                          llhttp_cb head, llhttp_data_cb body, llhttp_cb complete) noexcept:
    """``settings`` reset, with the events of a message's head and body: the request and the
    response parser each take these (the request parser adds its URL and chunk events)."""
    llhttp_settings_init(settings)
    settings.on_message_begin = begin
    settings.on_header_field = field
    settings.on_header_field_complete = field_complete
    settings.on_header_value = value
    settings.on_header_value_complete = value_complete
    settings.on_headers_complete = head
    settings.on_body = body
    settings.on_message_complete = complete


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
        _message_events(&self.settings, _on_message_begin, _on_header_field, _on_header_field_complete,
                        _on_header_value, _on_header_value_complete, _on_headers_complete, _on_body,
                        _on_message_complete)
        self.settings.on_url = _on_url
        self.settings.on_chunk_header = _on_chunk_header
        self.settings.on_chunk_complete = _on_chunk_complete
        llhttp_init(&self.parser, HTTP_REQUEST, &self.settings)
        self.parser.data = <void*>self

    def __dealloc__(self):
        free(self.buf)
        free(self.fields)

    def feed(self, data):
        """Parse one read; raises :class:`Refused`, or what a ``conn`` event raised."""
        self._fed(_execute(&self.parser, data, _request_read))

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
        self._fed(_execute_at(&self.parser, self.reader.last_read(), nbytes, _request_read))

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
        raise refusal(R_MALFORMED, llhttp_get_error_reason(&self.parser).decode("latin-1"))

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
        if n == 4 and _equals_lower(name, n, b"host"):
            self.hosts += 1
        elif n == 17 and _equals_lower(name, n, b"transfer-encoding"):
            self.chunked = True
            self.transfer_encodings += 1
            if self.transfer_encodings > 1 or not _stripped_equals_lower(value, f.value_len, CHUNKED):
                return self._refuse(R_TRANSFER_ENCODING)
        elif n == 6 and _equals_lower(name, n, b"expect"):
            if not _stripped_equals_lower(value, f.value_len, CONTINUE):
                return self._refuse(R_EXPECT)
            self.expect_continue = True
        elif n == 16 and _equals_lower(name, n, b"content-encoding"):
            if not (_stripped_equals_lower(value, f.value_len, IDENTITY)
                    or _stripped_equals_lower(value, f.value_len, b"")):
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
        req.method = <bytes>llhttp_method_name(self.parser.method)
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
    if self.head_done:  # a trailer field: counted, never kept
        self.trailer_field += <Py_ssize_t>n
        return 0
    if self._append(at, n):
        return STOP
    self.fields[self.nfields - 1].name_len += <Py_ssize_t>n
    return 0


cdef int _on_header_field_complete(llhttp_t* p) noexcept:
    cdef RequestParser self = <RequestParser>p.data
    if not self.head_done:
        self.fields[self.nfields - 1].value = self.used
    return 0


cdef int _on_header_value(llhttp_t* p, const char* at, size_t n) noexcept:
    cdef RequestParser self = <RequestParser>p.data
    if self.head_done:
        self.trailer_field += <Py_ssize_t>n
        return 0
    if self._append(at, n):
        return STOP
    self.fields[self.nfields - 1].value_len += <Py_ssize_t>n
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
        self.chunks.append(_piece(at, <Py_ssize_t>n))
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
        req.keep_alive = llhttp_should_keep_alive(&self.parser) != 0
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


# -- reading into buffers (uvloop's get_buffer/buffer_updated) ----------------------------------

cdef extern from "Python.h":
    enum:
        PyBUF_FORMAT
        PyBUF_ND

cdef char* _FORMAT_B = "B"

#: the largest body read into one bytes object allocated at its head: a Content-Length is the peer's
#: word, so a larger one (up to the body bound) is kept as its pieces come, memory growing with the
#: bytes that do arrive, never allocated ahead (a 40k-token prompt's request is ~160 KB)
WHOLE_READ_MAX = 8 * 1024 * 1024
cdef Py_ssize_t _WHOLE_READ_MAX = WHOLE_READ_MAX
READ_BUFFER = 64 * 1024
# One read buffer for every client connection of the process: uvloop asks for a buffer, reads into
# it and hands it back in one synchronous step per read (libuv's alloc, read, read callbacks), so no
# two reads ever use it at once, and what must outlive a read is copied out of it as it is parsed
# (the request line and headers into the parser's buffer, body pieces into bytes objects, a whole
# body into its own bytes).
cdef bytearray _SCRATCH = bytearray(READ_BUFFER)
cdef char* _SCRATCH_AT = PyByteArray_AS_STRING(_SCRATCH)
#: what a read between two messages takes: the next head and the start of its body, not a whole read
#: buffer of body bytes that would then be copied into the body's own bytes object once the head
#: says its size (up to 64 KB of copying per large body); the rest of a body of a known length is
#: read straight into it, and a read in the middle of any other message takes the whole buffer
HEAD_READ = 16 * 1024
cdef object _SCRATCH_HEAD = memoryview(_SCRATCH)[:HEAD_READ]


cdef class ReadWindow:
    """A writable window on the bytes a whole body is read into (see _parse.pxd)."""

    def __getbuffer__(self, Py_buffer* view, int flags):
        self.shape[0] = self.size
        view.buf = self.at
        view.obj = self
        view.len = self.size
        view.readonly = 0
        view.itemsize = 1
        view.format = NULL
        if flags & PyBUF_FORMAT:
            view.format = _FORMAT_B
        view.ndim = 1
        view.shape = self.shape if flags & PyBUF_ND else NULL
        view.strides = NULL
        view.suboffsets = NULL
        view.internal = NULL

    def __releasebuffer__(self, Py_buffer* view):
        pass


cdef class BodyReader:
    """Where a connection's reads go under uvloop (see _parse.pxd): both the request parser and the
    upstream connection (server/http/_upstream.pyx) read through one."""

    cdef bint begin(self, Py_ssize_t size):
        """A body of ``size`` bytes begins: read into its own bytes object if within the bound (a
        Content-Length is the peer's word: a larger one is kept as its pieces come)."""
        self.drop()
        if not 0 < size <= _WHOLE_READ_MAX:
            return False
        self.data = PyBytes_FromStringAndSize(NULL, size)
        self.at = PyBytes_AS_STRING(self.data)
        self.size = size
        self.filled = 0
        return True

    cdef object buffer(self, const llhttp_t* parser):
        """What get_buffer hands uvloop: the rest of the body being read, else the read buffer (its first
        ``HEAD_READ`` bytes between messages: ``parser``, the connection's llhttp, has none begun)."""
        cdef ReadWindow window
        if self.data is not None and self.filled < self.size:
            window = self.window
            if window is None:
                window = self.window = ReadWindow()
            window.owner = self.data
            window.at = self.at + self.filled
            window.size = self.size - self.filled
            self.into = True
            return window
        self.into = False
        return _SCRATCH_HEAD if parser.finish == HTTP_FINISH_SAFE else _SCRATCH

    cdef const char* last_read(self) noexcept:
        """Where the read buffer_updated reports went."""
        return self.at + self.filled if self.into else _SCRATCH_AT

    cdef int take(self, const char* at, Py_ssize_t n) except -1:
        """A body piece llhttp saw at ``at``: in place already, or copied there from the read buffer."""
        if n > self.size - self.filled:  # (llhttp frames by the same Content-Length)
            raise RuntimeError("body longer than its Content-Length")
        if at != self.at + self.filled:
            memcpy(self.at + self.filled, at, n)
        self.filled += n
        return 0

    cdef object finish(self):
        """The body read (None if none came), handed over: the reader keeps no reference to it."""
        data = self.data
        filled, size = self.filled, self.size
        self.drop()
        if data is None or not filled:
            return None
        return data if filled == size else data[:filled]

    cdef void drop(self) noexcept:
        self.data = None
        if self.window is not None:
            self.window.owner = None


cdef int _execute_at(llhttp_t* parser, const char* at, Py_ssize_t n, ReadHook hook) except -1:
    """:func:`_execute` over bytes that are no Python object's (a buffer read into): pieces are copied."""
    global _read, _read_at, _read_len
    cdef object outer = _read
    cdef const char* outer_at = _read_at
    cdef Py_ssize_t outer_len = _read_len
    _read, _read_at, _read_len = None, NULL, 0
    try:
        if hook != NULL:
            hook(parser.data, n)
        return llhttp_execute(parser, at, <size_t>n)
    finally:
        _read, _read_at, _read_len = outer, outer_at, outer_len


# -- the upstream side ----------------------------------------------------------------------

cdef class ResponseParser:
    """Frames one upstream connection's bytes into responses (see the pure twin). Its fields and
    events are declared in _parse.pxd: server/http/_upstream.pyx's connection is one (a subclass
    whose ``head``, ``body`` and ``complete`` are C methods, no Python call per event)."""

    def __cinit__(self, conn):
        self.conn = conn
        self.content_type = bytearray()
        self.retry_after = bytearray()
        _message_events(&self.settings, _response_begin, _response_field, _response_field_complete,
                        _response_value, _response_value_complete, _response_head, _response_body,
                        _response_complete)
        llhttp_init(&self.parser, HTTP_RESPONSE, &self.settings)
        self.parser.data = <void*>self

    def feed(self, data):
        """Parse one read; raises :class:`BadResponse`, or what a ``conn`` event raised."""
        self.execute(data)

    cdef int execute(self, object data) except -1:
        cdef Py_ssize_t n = PyBytes_GET_SIZE(data) if PyBytes_CheckExact(data) else len(data)
        return self._after_execute(_execute(&self.parser, data, NULL), n)

    cdef int execute_at(self, const char* at, Py_ssize_t n) except -1:
        """:meth:`execute` over bytes that are no Python object's (a buffer read into): pieces are copied."""
        return self._after_execute(_execute_at(&self.parser, at, n, NULL), n)

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
        raise BadResponse(llhttp_get_error_reason(&self.parser).decode("latin-1"))

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
        return self.body(_piece(at, n))

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
    if n == 12 and _equals_lower(self.name, n, b"content-type"):
        self.wanted = CONTENT_TYPE
        self.has_content_type = True
        del self.content_type[:]
    elif n == 11 and _equals_lower(self.name, n, b"retry-after"):
        self.wanted = RETRY_AFTER
        self.has_retry_after = True
        del self.retry_after[:]
    elif n == 14 and _equals_lower(self.name, n, b"content-length"):
        self.framing = CONTENT_LENGTH
    elif n == 17 and _equals_lower(self.name, n, b"transfer-encoding"):
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
        self.complete(llhttp_should_keep_alive(p) != 0)
    except BaseException:
        return self._event_failed()
    return 0
