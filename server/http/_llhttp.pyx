# cython: auto_pickle=False
"""llhttp, compiled in once for the process, and what both compiled parsers share to drive it.

:mod:`server.http._parse` (the request parser) and :mod:`server.http._response_parser` (the
upstream side's, which :mod:`server.http._upstream`'s connection subclasses) cimport this module
(``_llhttp.pxd``): their callbacks are theirs, the rest is here, in C calls:

- ``message_events`` and ``start``: a parser's settings and its llhttp state;
- ``parse_read`` / ``parse_read_at``: llhttp over one read, a bytes object's (a body piece that is the
  whole read is handed on as that object: ``piece``) or a buffer's that was read into;
- ``keep_alive``, ``error_reason``, ``method_name``: llhttp's answers about a message;
- ``ReadWindow`` and ``BodyReader``: where a connection's reads go under uvloop (a body of a known
  length straight into its own bytes object, the rest parsed in place in one read buffer).
"""

from cpython.bytearray cimport PyByteArray_AS_STRING
from cpython.bytes cimport PyBytes_CheckExact, PyBytes_FromStringAndSize
from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from libc.string cimport memcpy


# llhttp's functions: called here only (the other modules do not link llhttp; they call these
# through _llhttp.pxd's functions).
cdef extern from "llhttp.h":
    void llhttp_settings_init(llhttp_settings_t* settings)
    void llhttp_init(llhttp_t* parser, llhttp_type_t type, const llhttp_settings_t* settings)
    llhttp_errno_t llhttp_execute(llhttp_t* parser, const char* data, size_t len)
    int llhttp_should_keep_alive(const llhttp_t* parser)
    const char* llhttp_method_name(uint8_t method)
    const char* llhttp_get_error_reason(const llhttp_t* parser)


cdef void message_events(llhttp_settings_t *settings, llhttp_cb begin, llhttp_data_cb field,
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


cdef void start(llhttp_t* parser, llhttp_type_t kind, const llhttp_settings_t* settings, void* owner) noexcept:
    """``parser`` begun on ``settings`` (kept by the caller for the parser's life), its callbacks'
    ``p.data`` the ``owner``."""
    llhttp_init(parser, kind, settings)
    parser.data = owner


cdef bint keep_alive(const llhttp_t* parser) noexcept:
    """Whether the connection stays open after the message that ended (llhttp's word)."""
    return llhttp_should_keep_alive(parser) != 0


cdef str error_reason(const llhttp_t* parser):
    """Why llhttp stopped, in its words."""
    return llhttp_get_error_reason(parser).decode("latin-1")


cdef bytes method_name(const llhttp_t* parser):
    """The request's method, as llhttp spells it."""
    return <bytes>llhttp_method_name(parser.method)


# The bytes object being parsed, while it is (else None): a body piece that is the whole of it is
# handed on as that object, not copied (the middle reads of a large body, a streamed response's).
cdef object _read = None
cdef const char* _read_at = NULL
cdef Py_ssize_t _read_len = 0


cdef object piece(const char* at, Py_ssize_t n):
    """A body piece as bytes: the read itself when the piece is all of it, else a copy."""
    if at == _read_at and n == _read_len and _read is not None:
        return _read
    return PyBytes_FromStringAndSize(at, n)


cdef int parse_read(llhttp_t* parser, object data, ReadHook hook) except -1:
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


cdef int parse_read_at(llhttp_t* parser, const char* at, Py_ssize_t n, ReadHook hook) except -1:
    """:func:`parse_read` over bytes that are no Python object's (a buffer read into): pieces are copied."""
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
    """A writable window on the bytes a whole body is read into (see _llhttp.pxd)."""

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
    """Where a connection's reads go under uvloop (see _llhttp.pxd): both the request parser and the
    upstream connection (server/http/upstream.py compiled as _upstream) read through one."""

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
