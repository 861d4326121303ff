# llhttp's C API (third_party/llhttp/include/llhttp.h, vendored: third_party/llhttp/README.md), the
# part the parsers use, and what server/http/_llhttp.pyx shares with both of them (_parse.pyx's
# request parser, _response_parser.pyx's) and with _upstream (upstream.py compiled): one llhttp in
# the process, compiled into _llhttp; the others reach it through the C functions declared here.

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from libc.stdint cimport uint8_t, uint16_t, uint64_t


cdef extern from "llhttp.h":
    ctypedef struct llhttp_t:
        uint64_t content_length
        uint8_t method
        uint8_t http_major
        uint8_t http_minor
        uint8_t upgrade
        uint16_t flags
        uint16_t status_code
        uint8_t finish
        void* data

    ctypedef int (*llhttp_data_cb)(llhttp_t*, const char*, size_t) noexcept
    ctypedef int (*llhttp_cb)(llhttp_t*) noexcept

    ctypedef struct llhttp_settings_t:
        llhttp_cb on_message_begin
        llhttp_data_cb on_url
        llhttp_data_cb on_header_field
        llhttp_data_cb on_header_value
        llhttp_cb on_headers_complete
        llhttp_data_cb on_body
        llhttp_cb on_message_complete
        llhttp_cb on_header_field_complete
        llhttp_cb on_header_value_complete
        llhttp_cb on_chunk_header
        llhttp_cb on_chunk_complete

    ctypedef enum llhttp_type_t:
        HTTP_REQUEST
        HTTP_RESPONSE

    ctypedef enum llhttp_errno_t:
        HPE_OK
        HPE_PAUSED_UPGRADE
        HPE_USER

    enum:
        F_CONTENT_LENGTH
        HTTP_FINISH_SAFE


cdef enum:
    # a refusal stops llhttp with this (any non-zero return of a callback stops it)
    STOP = -1


# -- header names and values, compared in place (inline: each parser compiles its own copy) -------

cdef inline unsigned char lower(unsigned char c) noexcept:
    return c + 32 if 65 <= c <= 90 else c


cdef inline bint is_space(unsigned char c) noexcept:
    # bytes.strip()'s whitespace
    return c == 32 or 9 <= c <= 13


cdef inline bint equals_lower(const char* at, Py_ssize_t n, bytes lowered) noexcept:
    """``at[:n].lower() == lowered``."""
    cdef const char* want = PyBytes_AS_STRING(lowered)
    cdef Py_ssize_t i
    if n != PyBytes_GET_SIZE(lowered):
        return False
    for i in range(n):
        if lower(<unsigned char>at[i]) != <unsigned char>want[i]:
            return False
    return True


cdef inline bint stripped_equals_lower(const char* at, Py_ssize_t n, bytes lowered) noexcept:
    """``at[:n].strip().lower() == lowered``."""
    while n and is_space(<unsigned char>at[0]):
        at += 1
        n -= 1
    while n and is_space(<unsigned char>at[n - 1]):
        n -= 1
    return equals_lower(at, n, lowered)


# -- driving llhttp --------------------------------------------------------------------------------

ctypedef void (*ReadHook)(void* owner, Py_ssize_t n) noexcept

cdef void message_events(llhttp_settings_t* settings, llhttp_cb begin, llhttp_data_cb field,
                         llhttp_cb field_complete, llhttp_data_cb value, llhttp_cb value_complete,
                         llhttp_cb head, llhttp_data_cb body, llhttp_cb complete) noexcept
cdef void start(llhttp_t* parser, llhttp_type_t kind, const llhttp_settings_t* settings, void* owner) noexcept
cdef int parse_read(llhttp_t* parser, object data, ReadHook hook) except -1
cdef int parse_read_at(llhttp_t* parser, const char* at, Py_ssize_t n, ReadHook hook) except -1
cdef object piece(const char* at, Py_ssize_t n)
cdef bint keep_alive(const llhttp_t* parser) noexcept
cdef str error_reason(const llhttp_t* parser)
cdef bytes method_name(const llhttp_t* parser)


# -- reading into buffers (uvloop's get_buffer/buffer_updated) -------------------------------------

cdef class ReadWindow:
    # A writable window on bytes being read into (uvloop's get_buffer/buffer_updated).
    cdef object owner
    cdef char* at
    cdef Py_ssize_t size
    cdef Py_ssize_t shape[1]


cdef class BodyReader:
    # Where a connection's reads go under uvloop (both sides): a body of a known length, up to
    # WHOLE_READ_MAX, into its own bytes object (``data``, ``filled`` of ``size`` so far) through
    # ``window``; anything else into the process's read buffer. ``into``: the last buffer handed out
    # was the window. The body's bytes object is the reader's alone until ``finish`` hands it over.
    cdef object data
    cdef char* at
    cdef Py_ssize_t size, filled
    cdef ReadWindow window
    cdef bint into

    cdef bint begin(self, Py_ssize_t size)
    cdef object buffer(self, const llhttp_t* parser)
    cdef const char* last_read(self) noexcept
    cdef int take(self, const char* at, Py_ssize_t n) except -1
    cdef object finish(self)
    cdef void drop(self) noexcept
