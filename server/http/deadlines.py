"""The sweeper of the upstream requests' deadlines (one per pool, or one shared by an owner's pools).

``timeout`` bounds a whole exchange, ``headers_timeout`` (without ``timeout``) the wait for the
response's headers, ``read_timeout`` a silence (a stream may run long; it must not stall that long);
a connection (either twin) is added when it sends a timed request and removed when it ends.
"""

from __future__ import annotations

import asyncio
from typing import Protocol


class Timed(Protocol):
    """A connection with a timed request (either twin of :mod:`server.http.upstream`'s)."""

    loop: asyncio.AbstractEventLoop

    def _check_deadline(self, now: float) -> None: ...


class Deadlines:
    """Enforces the deadlines of the upstream requests in flight on one event loop.

    A timer handle per request (created, then cancelled) costs more than the
    rest of a request's client side; a tick that looks at the requests in
    flight costs nothing per request and runs only while there are some. A
    pool makes its own; an owner of many pools (the orchestrator: one per
    worker) may give them one to share, so one tick serves them all.
    """

    TICK_S = 0.05

    def __init__(self) -> None:
        self.active: set[Timed] = set()
        self.handle: asyncio.TimerHandle | None = None

    def add(self, conn: Timed) -> None:
        self.active.add(conn)
        if self.handle is None:
            self.handle = conn.loop.call_later(self.TICK_S, self.tick, conn.loop)

    def remove(self, conn: Timed) -> None:
        self.active.discard(conn)

    def tick(self, loop: asyncio.AbstractEventLoop) -> None:
        self.handle = None
        now = loop.time()
        for conn in list(self.active):
            conn._check_deadline(now)
        if self.active:
            self.handle = loop.call_later(self.TICK_S, self.tick, loop)
