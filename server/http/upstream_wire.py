"""What both twins of the upstream connection share (upstream.py, pure and compiled as
``_upstream``): the request head's format, the bound under which a request goes out in one joined
write, a body piece's types, and the two errors an exchange ends in.

A module of its own so that both twins raise and catch the same error classes (each twin of
upstream.py defines its own classes), and the compiled twin imports these without importing the pure
module that chooses it (which would be an import circle through a compiled module).
"""

from __future__ import annotations

BodyPiece = bytes | bytearray | memoryview

#: a request body below this many bytes goes out joined with its head in one write: a vectored write of
#: views costs the event loop more per piece than copying a few KB (bench.routers at 1 KB: -10% CPU);
#: a larger one is written as its pieces, never copied
WRITE_JOINED_BELOW = 32 * 1024

#: a leg's request line and headers: method, the pool's path prefix, path, the pool's fixed lines
#: (Host, extra), the body's size, the leg's own lines (both twins of UpstreamPool.start format it)
REQUEST_HEAD = b"%s %s%s HTTP/1.1\r\n%sContent-Length: %d\r\n%s\r\n"


class UpstreamError(Exception):
    """The worker could not be reached, or its connection failed or broke the protocol."""

    def __init__(self, message: str, *, sent: bool = True, clean_close: bool = False) -> None:
        super().__init__(message)
        #: False when the request provably never reached the worker (connect failed)
        self.sent = sent
        #: the worker closed the connection cleanly (a FIN, no reset) before this error: with no byte
        #: of an answer on a reused connection, the close of an idle connection that raced our write
        self.clean_close = clean_close


class UpstreamTimeout(Exception):
    """A request's ``timeout`` or ``read_timeout`` ran out."""
