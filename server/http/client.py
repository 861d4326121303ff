"""The upstream client's names in one import (``from server.http.client import X``, as before its
split): the pool (:mod:`server.http.pool`), the connection, response and deadline sweeper with
their twin choice (:mod:`server.http.upstream`, compiled as :mod:`server.http._upstream`) and what
both twins share (:mod:`server.http.upstream_wire`).
"""

from __future__ import annotations

from .pool import CONNECT_TIMEOUT_S, IDLE_TIMEOUT_S, UpstreamPool
from .upstream import Deadlines, HeldWriter, Listener, UpstreamResponse, _Connection, pool_start
from .upstream_wire import REQUEST_HEAD, WRITE_JOINED_BELOW, BodyPiece, UpstreamError, UpstreamTimeout

__all__ = [
    "CONNECT_TIMEOUT_S",
    "IDLE_TIMEOUT_S",
    "REQUEST_HEAD",
    "WRITE_JOINED_BELOW",
    "BodyPiece",
    "Deadlines",
    "HeldWriter",
    "Listener",
    "UpstreamError",
    "UpstreamPool",
    "UpstreamResponse",
    "UpstreamTimeout",
    "_Connection",
    "pool_start",
]
