# The C types of upstream.py, compiled in Cython's pure-Python mode as server.http._upstream
# (setup.py): Cython looks this file up by the compiled module's name. The response, the sweeper
# and the connection are cdef classes (their flags C ints, their times doubles, the response typed
# where the connection reads it); the connection subclasses _parse's ResponseParser, whose events
# (head, body, body_at, complete) it overrides as C methods, and reads through a BodyReader.

cimport cython

from server.http._parse cimport BodyReader, ResponseParser

cdef Py_ssize_t _JOINED_BELOW


cdef class UpstreamResponse:
    cdef public object _conn
    cdef public int status
    cdef public bytes content_type
    cdef public object retry_after
    cdef public object content_length
    cdef public list chunks
    cdef public Py_ssize_t size
    cdef public Py_ssize_t limit
    cdef public bint truncated
    cdef public object sink
    cdef public bint headers_done
    cdef public bint complete
    cdef public bint keep_alive
    cdef public object error
    cdef public object listener
    cdef public object _headers
    cdef public object _done
    cdef public bint _whole
    cdef public tuple sending
    cdef public bint reused
    cdef public bint abandoned
    cdef public object writer


cdef _wake(object fut, object exc)


cdef class DeadlineSweeper:
    cdef public set active
    cdef public object handle

    cpdef add(self, conn)
    cpdef remove(self, conn)


cdef _sweeper_add(object sweeper, object conn)
cdef _sweeper_remove(object sweeper, object conn)


cdef class _Connection(ResponseParser):
    cdef public object pool
    cdef public object loop
    cdef public object transport
    cdef public UpstreamResponse response
    cdef public bint closed
    cdef public Py_ssize_t requests
    cdef public double idle_since
    cdef public bint timed
    cdef public object sweeper
    cdef public double deadline
    cdef public bint deadline_to_headers
    cdef public double read_timeout
    cdef public double last_io
    cdef public bint got_bytes
    cdef public bint paused
    cdef public bint interim
    cdef public list pending
    cdef public bint feeding
    cdef public bint release_after_feed
    cdef BodyReader reader

    @cython.locals(resp=UpstreamResponse, failed=bint)
    cdef _received(self, object data, Py_ssize_t nbytes)
    cdef _flush(self, UpstreamResponse resp)
    @cython.locals(resp=UpstreamResponse)
    cdef int on_head(self, int status, bytes content_type, object content_length, object retry_after) except -1
    @cython.locals(resp=UpstreamResponse)
    cdef int on_body(self, object body) except -1
    @cython.locals(resp=UpstreamResponse)
    cdef int on_message_complete(self, bint keep_alive) except -1
    cdef int head(self, int status, bytes content_type, object content_length, object retry_after) except -1
    cdef int body(self, object piece) except -1
    @cython.locals(resp=UpstreamResponse)
    cdef int body_at(self, const char* at, Py_ssize_t n) except -1
    @cython.locals(size=Py_ssize_t, now=double)
    cpdef send(self, UpstreamResponse resp)
    cdef _cancel_timer(self)


@cython.locals(size=Py_ssize_t)
cpdef Py_ssize_t body_size(pieces) except -1
@cython.locals(size=Py_ssize_t)
cpdef tuple outgoing(pool, bytes method, bytes path, pieces, bytes headers, timeout, read_timeout, headers_timeout)
@cython.locals(idle=list, now=double, limit=double)
cpdef idle_connection(pool)
cdef bint send_on(conn, resp, bint reused) except -1
