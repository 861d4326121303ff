"""What one client may hold of a server (:class:`Limits`), with its defaults declared once."""

from __future__ import annotations

from dataclasses import dataclass

#: the default of Limits.peer_share (and of the config keys that set it)
PEER_SHARE = 0.25


@dataclass(slots=True)
class Limits:
    """Bounds on what one client can hold (times in seconds, sizes in bytes)."""

    max_header_bytes: int = 16 * 1024
    max_headers: int = 100
    max_body_bytes: int = 32 * 1024 * 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    keepalive_timeout_s: float = 60.0
    max_connections: int = 8192
    #: request body bytes held by the whole server at once (a Content-Length is
    #: counted whole from the headers, a chunked body as it arrives; until
    #: answered); a request that would go past it is a 503 with Retry-After
    max_inflight_body_bytes: int = 512 * 1024 * 1024
    #: one client IP holding more than this share of ``max_connections`` (or of
    #: ``max_inflight_body_bytes``) may not take their last share: that part is
    #: kept for the other clients (503 + Retry-After). 1.0: no per-client bound
    #: (a server whose one client is a proxy or the orchestrator)
    peer_share: float = PEER_SHARE
    #: seconds a 503 at a server-wide cap (connections, body bytes) asks the client to wait
    retry_after_s: int = 1
    #: complete requests queued behind the one being answered on a connection
    max_pipelined: int = 16
    #: the client write buffer above which a relayed stream's upstream stops being read
    write_high_water: int = 1 << 20

    def __post_init__(self) -> None:
        if not 0.0 < self.peer_share <= 1.0:
            raise ValueError(f"peer_share must be within (0, 1], got {self.peer_share}")
