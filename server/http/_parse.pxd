# The compiled parsers' C surface, for the module that builds on them: the compiled upstream
# connection (server/http/upstream.py compiled as _upstream, typed by _upstream.pxd) subclasses
# ResponseParser (server/http/_parse.pyx) and takes its three events as C calls, and reads through a
# BodyReader (server/http/_llhttp.pyx, declared in _llhttp.pxd with llhttp's API: cimported here for
# _upstream and _parse.pyx).

from ._llhttp cimport BodyReader, llhttp_settings_t, llhttp_t


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
