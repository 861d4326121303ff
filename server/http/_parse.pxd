# llhttp's C API (third_party/llhttp/include/llhttp.h, vendored: third_party/llhttp/README.md),
# the part server/http/_parse.pyx uses.

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

    void llhttp_settings_init(llhttp_settings_t* settings)
    void llhttp_init(llhttp_t* parser, llhttp_type_t type, const llhttp_settings_t* settings)
    llhttp_errno_t llhttp_execute(llhttp_t* parser, const char* data, size_t len)
    int llhttp_should_keep_alive(const llhttp_t* parser)
    const char* llhttp_method_name(uint8_t method)
    const char* llhttp_get_error_reason(const llhttp_t* parser)


# -- the upstream side's parser, shared with server/http/_upstream.pyx (its compiled connection
# subclasses it and takes the three events as C calls) --------------------------------------------

cdef enum Wanted:
    # the response headers read (the others are skipped)
    OTHER, CONTENT_TYPE, CONTENT_LENGTH, RETRY_AFTER, TRANSFER_ENCODING

cdef enum:
    # bytes of a header name kept to tell the wanted ones apart (the longest is 17)
    NAME_BYTES = 17


cdef class ResponseParser:
    cdef llhttp_t parser
    cdef llhttp_settings_t settings
    cdef object conn
    cdef object error
    cdef char name[NAME_BYTES]
    cdef Py_ssize_t name_len
    cdef Wanted wanted
    cdef bint in_field
    # The values of Content-Type and Retry-After (the last of each), and the framing header seen
    # last (CONTENT_LENGTH or TRANSFER_ENCODING; OTHER: none).
    cdef bytearray content_type, retry_after
    cdef bint has_content_type, has_retry_after
    cdef Wanted framing
    # The head's bounds (limits.py MAX_RESPONSE_HEAD_BYTES, MAX_RESPONSE_HEADERS), counted as the
    # pure twin counts them: each field's bytes and the fields ended, checked as a field ends; the
    # reads that end with the head still in progress (in_head), checked at each read's end.
    cdef bint in_head
    cdef Py_ssize_t head_bytes, head_read, fields
    # A response (not a 1xx) ended: a message after it is bytes nobody asked for (refused) until the
    # connection sends its next request (sets it False).
    cdef public bint ended

    cdef int execute(self, object data) except -1
    cdef int execute_at(self, const char* at, Py_ssize_t n) except -1
    cdef int _after_execute(self, int err, Py_ssize_t n) except -1
    cdef int _event_failed(self) noexcept
    # The events: ``conn``'s on_head, on_body and on_message_complete here; a subclass's own C code
    cdef int head(self, int status, bytes content_type, object content_length, object retry_after) except -1
    cdef int body(self, object piece) except -1
    # a body piece where llhttp saw it (by default made a bytes object and given to ``body``)
    cdef int body_at(self, const char* at, Py_ssize_t n) except -1
    cdef int complete(self, bint keep_alive) except -1


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
