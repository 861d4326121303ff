"""A lean HTTP/1.1 layer for the orchestrator's hot path: asyncio protocols, llhttp framing.

aiohttp's per-request objects (web.Request/Response, ClientSession request
and response objects, header multidicts, timers) cost the orchestrator more
CPU per request than the relay itself. This package keeps what a two-leg
proxy needs and nothing else:

- :mod:`server.http.server`: the listening side. One protocol object per
  client connection; framing by llhttp (strict: request smuggling, obs-fold,
  bare LF, chunk-size overflow are parse errors) through the request parser
  of :mod:`server.http.parse` (compiled, or its pure twin on httptools);
  bounded header bytes and count, header/body/idle timeouts, connection cap,
  pipelining with a bounded queue, backpressure from a slow reader to the
  upstream socket.
- :mod:`server.http.pool`: keep-alive connections per worker, request
  bodies written as their pieces (vectored); :mod:`server.http.upstream`:
  the connection, response and deadline sweeper (one source, compiled as
  ``_upstream``), response framing by the response parser of
  :mod:`server.http.parse`, streamed bodies handed to a sink as they arrive
  (:mod:`server.http.client` re-exports all of it).
- :mod:`server.http.memory`: glibc's ``malloc_trim``, which gives the C heap
  back once large bodies stop coming.

Never hand-written HTTP parsing: only the status line and headers we *write*
are formatted here.
"""

from .pool import UpstreamPool
from .server import Handling, HTTPServer, Limits, Request, Responder, handler_failed
from .upstream import Deadlines, HeldWriter, Listener, UpstreamResponse
from .upstream_wire import BodyPiece, UpstreamError, UpstreamTimeout

__all__ = [
    "BodyPiece",
    "Deadlines",
    "HTTPServer",
    "Handling",
    "HeldWriter",
    "Limits",
    "Listener",
    "Request",
    "Responder",
    "UpstreamError",
    "UpstreamPool",
    "UpstreamResponse",
    "UpstreamTimeout",
    "handler_failed",
]
