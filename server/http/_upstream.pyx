# cython: language_level=3, auto_pickle=False, nonecheck=True
"""The upstream side's connection and response in C: twin of :mod:`server.http.upstream`'s
``_Connection`` and :class:`~server.http.upstream.UpstreamResponse` (their docstrings say what each
method does; the behaviour is theirs, line for line).

:class:`Connection` *is* its response parser (a subclass of :mod:`server.http._parse`'s
``ResponseParser``): llhttp's head, body and end events are C calls into it, which set the
:class:`Response`'s typed fields, with no Python frame per event, per read or per body piece of
a stream. What stays a Python call is what the connection tells others: the listener's
``response_head``/``response_done``/``response_error``, the sink, the held writer, the pool (its methods ``keep``,
``forget``, ``open_for``: upstream.py's ``ConnectionPool``) and the deadline sweeper (``add``,
``remove``). :mod:`server.http.upstream` chooses these two classes and :func:`pool_start` (its
``pure_start`` is the twin) at its end, where this module is built, for
:class:`~server.http.pool.UpstreamPool`'s ``connection_class``, ``response_class`` and ``start``.
"""

# nonecheck (the header): a typed object that is None (a response its listener released while the
# read that ended it is still parsed) raises AttributeError, caught as a failed read, instead of a
# write through NULL's neighbour; one predicted compare per access, within callgrind's noise on a
# loop of send/answer cycles (setup.py turns it on everywhere only in the sanitized build)
import socket
import struct

from ._parse cimport BodyReader, ResponseParser

from .request import PAST_THE_RESPONSE, BadResponse
from .upstream_wire import REQUEST_HEAD, WRITE_JOINED_BELOW, UpstreamError, UpstreamTimeout

__all__ = ["Connection", "Deadlines", "Response", "pool_start"]

cdef Py_ssize_t _JOINED_BELOW = WRITE_JOINED_BELOW
cdef bytes _SEMICOLON = b";"
cdef bytes _EMPTY = b""
cdef tuple _NOTHING = ()
cdef double _TICK_S = 0.05  # deadlines.py Deadlines.TICK_S


cdef class Response:
    """A response: :class:`~server.http.upstream.UpstreamResponse`'s twin (same attributes, same methods)."""

    cdef public object _conn
    cdef public int status
    cdef public bytes content_type
    cdef public object retry_after
    #: None: no Content-Length (close-delimited unless chunked, which is -1)
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

    def __init__(self, conn, Py_ssize_t max_body=0, listener=None):
        self._conn = conn
        self.status = 0
        self.content_type = _EMPTY
        self.retry_after = None
        self.content_length = None
        self.chunks = []
        self.size = 0
        self.limit = max_body
        self.truncated = False
        self.sink = None
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.error = None
        self.listener = listener
        self._headers = None if conn is None else conn.loop.create_future()
        self._done = None
        self._whole = max_body != 0
        self.sending = _NOTHING
        self.reused = False
        self.abandoned = False
        self.writer = None

    @property
    def media_type(self):
        return self.content_type.split(_SEMICOLON, 1)[0].strip().lower()

    def body(self):
        chunks = self.chunks
        return chunks[0] if len(chunks) == 1 else _EMPTY.join(chunks)

    async def read(self, Py_ssize_t limit=0):
        if self.complete and not limit:
            chunks = self.chunks
            return chunks[0] if len(chunks) == 1 else _EMPTY.join(chunks)
        if limit:
            self.limit = limit
            if self.size > limit:
                self._truncate()
        if not self.complete and not self.truncated:
            await self._wait_done()
        chunks = self.chunks
        body = chunks[0] if len(chunks) == 1 else _EMPTY.join(chunks)
        return body[:limit] if limit else body

    async def stream(self, sink):
        for chunk in self.chunks:
            sink(chunk)
        self.chunks = []
        self.sink = sink
        if not self.complete:
            if self.writer is not None:
                self.writer.flush()
            await self._wait_done()

    def pause_reading(self):
        if self._conn is not None:
            self._conn.pause()

    def resume_reading(self):
        if self._conn is not None:
            self._conn.resume()

    def release(self):
        if self._conn is None:
            self.abandoned = True
            self.listener = None
            return
        (<Connection?>self._conn).finish(self)

    def headers_arrived(self):
        if self._headers is None:
            self._headers = self._conn.loop.create_future()
        return self._headers

    def on_error(self, exc):
        if self.complete or self.error is not None:
            return False
        self.error = exc
        if self.listener is not None:
            self.listener.response_error(self, exc)
            return True
        _wake(self._headers, exc)
        _wake(self._done, exc)
        return True

    def _truncate(self):
        self.truncated = True
        kept = _EMPTY.join(self.chunks)[: self.limit]
        self.chunks = [kept]
        _wake(self._done, None)

    async def _wait_done(self):
        if self.error is not None:
            raise self.error
        self._done = self._conn.loop.create_future()
        await self._done

    @staticmethod
    def _wake(fut, exc):
        _wake(fut, exc)


cdef inline _wake(fut, exc):
    if fut is not None and not fut.done():
        if exc is None:
            fut.set_result(None)
        else:
            fut.set_exception(exc)


cdef class Deadlines:
    """:class:`server.http.deadlines.Deadlines`' twin (same attributes, same methods): compiled so that
    a compiled connection's ``add`` and ``remove`` are C calls, not a Python frame each per timed
    request (bench.front_instructions: +2% a request with the pure sweeper's methods)."""

    cdef public set active
    cdef public object handle

    TICK_S = _TICK_S

    def __init__(self):
        self.active = set()
        self.handle = None

    cpdef add(self, conn):
        self.active.add(conn)
        if self.handle is None:
            loop = conn.loop
            self.handle = loop.call_later(_TICK_S, self.tick, loop)

    cpdef remove(self, conn):
        self.active.discard(conn)

    def tick(self, loop):
        self.handle = None
        now = loop.time()
        for conn in list(self.active):
            conn._check_deadline(now)
        if self.active:
            self.handle = loop.call_later(_TICK_S, self.tick, loop)


cdef inline _sweeper_add(sweeper, conn):
    """``sweeper.add(conn)``: a C call where it is this module's :class:`Deadlines`."""
    if type(sweeper) is Deadlines:
        (<Deadlines>sweeper).add(conn)
    else:
        sweeper.add(conn)


cdef inline _sweeper_remove(sweeper, conn):
    if type(sweeper) is Deadlines:
        (<Deadlines>sweeper).remove(conn)
    else:
        sweeper.remove(conn)


cdef class Connection(ResponseParser):
    """One keep-alive connection to a worker: upstream.py ``_Connection``'s twin, its own parser."""

    cdef public object pool
    cdef public object loop
    cdef public object transport
    cdef public Response response
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
    # where uvloop's reads go (get_buffer/buffer_updated: asyncio.BufferedProtocol's methods, which
    # uvloop calls on any protocol that has them and is no asyncio.Protocol; asyncio's own loop calls
    # data_received), None until it asks: a whole body of a known length into its own bytes
    cdef BodyReader reader

    def __init__(self, pool):
        self.conn = None  # (the parser's Python events are this class's C methods)
        self.pool = pool
        self.loop = pool.loop
        self.transport = None
        self.response = None
        self.closed = False
        self.requests = 0
        self.idle_since = 0.0
        self.timed = False
        self.sweeper = pool.deadlines
        self.deadline = 0.0
        self.deadline_to_headers = False
        self.read_timeout = 0.0
        self.last_io = 0.0
        self.got_bytes = False
        self.paused = False
        self.interim = False
        self.pending = []
        self.feeding = False
        self.release_after_feed = False
        self.reader = None

    # -- transport events (asyncio.Protocol's) ---------------------------------------------

    def connection_made(self, transport):
        self.transport = transport

    def connection_lost(self, exc):
        self.closed = True
        self.pool.forget(self)
        resp = self.response
        if resp is None or resp.complete:
            return
        if resp.headers_done and resp.content_length is None and exc is None:
            self.complete(False)
            return
        why = f": {exc}" if exc else ""
        stage = "mid-response" if resp.headers_done else "before answering"
        self._fail(UpstreamError(f"connection closed {stage}{why}", clean_close=exc is None))

    def eof_received(self):
        return None

    def pause_writing(self):
        pass

    def resume_writing(self):
        pass

    def data_received(self, data):
        self._received(data, NULL, 0)

    @property
    def buffered(self):
        """Whether the loop reads into this connection's buffers (uvloop asked for one)."""
        return self.reader is not None

    def get_buffer(self, Py_ssize_t sizehint):
        if self.reader is None:
            self.reader = BodyReader()
        return self.reader.buffer(&self.parser)

    def buffer_updated(self, Py_ssize_t nbytes):
        self._received(None, self.reader.last_read(), nbytes)

    cdef _received(self, object data, const char* at, Py_ssize_t n):
        """One read: ``data`` (data_received), else ``n`` bytes at ``at`` (a buffer uvloop read into)."""
        cdef Response resp = self.response
        cdef bint failed
        if resp is None:  # bytes nobody asked for: the connection cannot be trusted
            self.close()
            return
        self.got_bytes = True
        if self.read_timeout:
            self.last_io = self.loop.time()
        writer = resp.writer
        if writer is not None:
            writer.hold()
        self.feeding = True
        failed = True
        try:
            if data is not None:
                self.execute(data)
            else:
                self.execute_at(at, n)
            failed = False
        except BadResponse as exc:
            self._flush(resp)
            self._fail(UpstreamError(f"malformed HTTP response: {exc}"))
        except Exception as exc:
            self._flush(resp)
            self._fail(exc)
        else:
            if self.pending:
                self._flush(resp)
        self.feeding = False
        writer = resp.writer
        if writer is not None:
            writer.flush()
        if self.release_after_feed:
            self.release_after_feed = False
            if failed:
                self.close()
            elif self.response is None and not self.closed:
                self.pool.keep(self)

    cdef _flush(self, Response resp):
        pending = self.pending
        if pending and resp.sink is not None:
            self.pending = []
            resp.sink(pending[0] if len(pending) == 1 else _EMPTY.join(pending))

    # -- the parser's events, as C calls ---------------------------------------------------

    cdef int head(self, int status, bytes content_type, object content_length, object retry_after) except -1:
        cdef Response resp = self.response
        if resp is None:
            raise BadResponse(PAST_THE_RESPONSE)
        if 100 <= status < 200 and status != 101:
            self.interim = True
            return 0
        if resp._whole and content_length is not None and content_length > resp.limit:
            raise UpstreamError(f"response body exceeds {resp.limit} bytes")
        resp.content_type = content_type
        resp.content_length = content_length
        resp.retry_after = retry_after
        if self.deadline_to_headers:
            self.deadline = 0.0
        resp.status = status
        resp.headers_done = True
        if self.reader is not None:
            if resp._whole and content_length is not None and <Py_ssize_t>content_length <= resp.limit:
                self.reader.begin(<Py_ssize_t>content_length)
            else:
                self.reader.drop()
        if not resp._whole:
            if resp.listener is not None:
                resp.listener.response_head(resp)
            else:
                _wake(resp._headers, None)
        return 0

    cdef int body(self, object piece) except -1:
        cdef Response resp = self.response
        if resp is None:
            raise BadResponse(PAST_THE_RESPONSE)
        if self.interim:
            return 0
        if resp.sink is not None:
            resp.size += len(piece)
            self.pending.append(piece)
            return 0
        if resp.truncated:
            return 0
        resp.size += len(piece)
        resp.chunks.append(piece)
        if resp.limit and resp.size > resp.limit:
            if resp._whole:
                raise UpstreamError(f"response body exceeds {resp.limit} bytes")
            resp._truncate()
        return 0

    cdef int body_at(self, const char* at, Py_ssize_t n) except -1:
        cdef Response resp = self.response
        if resp is None:
            raise BadResponse(PAST_THE_RESPONSE)
        if self.reader is None or self.reader.data is None or self.interim:
            return ResponseParser.body_at(self, at, n)
        self.reader.take(at, n)
        resp.size += n
        return 0

    cdef int complete(self, bint keep_alive) except -1:
        cdef Response resp = self.response
        if resp is None:
            raise BadResponse(PAST_THE_RESPONSE)
        if self.interim:
            self.interim = False
            return 0
        if self.reader is not None and self.reader.data is not None:
            whole = self.reader.finish()
            if whole is not None:
                resp.chunks = [whole]
        self._cancel_timer()
        if self.pending:
            self._flush(resp)
        resp.complete = True
        resp.keep_alive = keep_alive
        if resp.listener is not None:
            resp.listener.response_done(resp)
            return 0
        _wake(resp._headers, None)
        _wake(resp._done, None)
        return 0

    # -- requests ------------------------------------------------------------------------------

    def send(self, Response resp, bytes head, pieces, Py_ssize_t size, timeout, read_timeout, headers_timeout=None):
        cdef double now
        transport = self.transport
        if transport is None or transport.is_closing():
            self.closed = True
            raise UpstreamError("connection closed before the request was sent", sent=False)
        resp._conn = self
        self.response = resp
        self.ended = False  # its answer may begin
        self.requests += 1
        self.got_bytes = False
        self.interim = False
        now = self.loop.time()
        self.read_timeout = read_timeout or 0.0
        self.last_io = now
        self.deadline_to_headers = not timeout and bool(headers_timeout)
        if timeout:
            self.deadline = now + timeout
        else:
            self.deadline = now + headers_timeout if headers_timeout else 0.0
        if self.deadline or self.read_timeout:
            self.timed = True
            _sweeper_add(self.sweeper, self)
        if size < _JOINED_BELOW:
            transport.write(_EMPTY.join((head, *pieces)))
        else:
            transport.writelines((head, *pieces))
        return resp

    def unseen(self, exc):
        return not exc.sent or (exc.clean_close and not self.got_bytes)  # upstream.py's: a reset is not

    def _check_deadline(self, double now):
        resp = self.response
        if resp is None or resp.complete:
            self._cancel_timer()
            return
        if self.paused:
            self.last_io = now
        if (self.deadline and now >= self.deadline) or (
            self.read_timeout and now >= self.last_io + self.read_timeout
        ):
            self._fail(UpstreamTimeout("timed out"))

    cdef _cancel_timer(self):
        if self.timed:
            self.timed = False
            _sweeper_remove(self.sweeper, self)

    def _fail(self, exc):
        cdef Response resp = self.response
        self._cancel_timer()
        if resp is None:
            return
        if resp.reused and isinstance(exc, UpstreamError) and self.unseen(exc) and resp.listener is not None:
            resp.reused = False
            self.response = None
            self.close()
            self.pool.open_for(resp)
            return
        if not resp.on_error(exc):
            self.close()  # what failed came after its end (bytes past the response): not used again
            return
        self.close(reset=isinstance(exc, UpstreamTimeout))

    def finish(self, Response resp):
        if resp is not self.response:
            return
        self.response = None
        self._cancel_timer()
        if self.paused:
            self.resume()
        if resp.complete and resp.keep_alive and not self.closed and not resp.truncated:
            if self.feeding:
                self.release_after_feed = True
            else:
                self.pool.keep(self)
        else:
            self.close(reset=not resp.complete)

    def pause(self):
        if not self.paused and not self.closed and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume(self):
        if self.paused and not self.closed and self.transport is not None:
            self.paused = False
            self.last_io = self.loop.time()
            self.transport.resume_reading()

    def close(self, *, bint reset=False):
        if self.reader is not None:
            self.reader.drop()  # a body read into when it failed goes now, not with this object
        if not self.closed:
            self.closed = True
            self.pool.forget(self)
            transport = self.transport
            if transport is None:
                return
            if reset:
                sock = transport.get_extra_info("socket")
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                except (AttributeError, OSError):
                    pass
                transport.abort()
            else:
                transport.close()


# -- the pool's start, in C ----------------------------------------------------------------------

def pool_start(pool, listener, bytes method, bytes path, pieces=_NOTHING, *, bytes headers=_EMPTY, timeout=None,
               read_timeout=None, Py_ssize_t max_body=0, headers_timeout=None):
    """:func:`server.http.upstream.pure_start`, line for line in one C call (no Python frame for
    it, ``_size``, ``_head``, ``_idle_connection`` or ``_send_on``): the response, sent on the newest
    idle connection still open and not idle too long (the stale ones closed on the way), else on one
    being opened; a pooled one found closing as it is written to is closed and a new one opened.
    ``UpstreamPool`` is given it as its ``start`` where the compiled twins are (upstream.py)."""
    cdef Py_ssize_t size = 0
    cdef list idle
    cdef double now, limit
    resp = pool.response_class(None, max_body, listener)
    for piece in pieces:
        size += len(piece)
    head = REQUEST_HEAD % (method, pool.prefix, path, pool._fixed, size, headers)
    resp.sending = (head, pieces, size, timeout, read_timeout, headers_timeout)
    idle = pool.idle
    if idle:
        now = pool.loop.time()
        limit = pool.idle_timeout_s
        while idle:
            conn = idle.pop()
            if conn.closed or conn.transport is None or conn.transport.is_closing():
                continue
            if now - conn.idle_since > limit:
                conn.close()
                continue
            try:
                conn.send(resp, head, pieces, size, timeout, read_timeout, headers_timeout)
            except UpstreamError:
                conn.close()
                break
            resp.reused = True
            return resp
    pool.open_for(resp)
    return resp
