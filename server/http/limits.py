"""What one client may hold of a server (:class:`Limits`), with its defaults declared once.

Every default of an HTTP bound is a constant here: :class:`Limits`' fields, the
orchestrator's config keys (``server/orchestrator/config.py``) and the worker's
settings and flags (``server/worker/``) all read them from this module. Where a
worker's bound differs from a client-facing server's it has its own constant
below (``WORKER_*``), with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

#: the default of Limits.peer_share (and of the config keys that set it)
PEER_SHARE = 0.25
MAX_HEADER_BYTES = 16 * 1024
MAX_HEADERS = 100
MAX_BODY_BYTES = 32 * 1024 * 1024
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 60.0
KEEPALIVE_TIMEOUT_S = 60.0
MAX_CONNECTIONS = 8192
MAX_INFLIGHT_BODY_BYTES = 512 * 1024 * 1024
RETRY_AFTER_S = 1

# A worker's own bounds. Every leg a worker takes is larger than the client body it carries: the
# context leg adds its disaggregated_params to the client's body (up to the orchestrator's
# MAX_BODY_BYTES), the generation leg adds the prompt's ids as well (a 128k-token prompt: ~0.9 MB as
# a JSON list, ~0.7 MB as base64) and, with gen_strip_message_history off, keeps the whole history.
# A worker whose body limit were the orchestrator's would answer 413 to legs of bodies the
# orchestrator took; twice it leaves room for the ids of any prompt a model takes.
#: request body size limit of a worker (413 above it)
WORKER_MAX_BODY_BYTES = 2 * MAX_BODY_BYTES
#: body bytes a worker holds at once: 16 bodies at its limit, as the orchestrator's is 16 of its own
WORKER_MAX_INFLIGHT_BODY_BYTES = 16 * WORKER_MAX_BODY_BYTES
#: a worker's clients are orchestrators that keep idle connections to it for reuse, and it must
#: not close one sooner than they let it go (fastcore's UpstreamPool: client.IDLE_TIMEOUT_S, 30 s;
#: aiohttp's connector, trtllm-serve's: 15 s). 75 s is aiohttp's server default, the worker's since
#: aiohttp served it
WORKER_KEEPALIVE_TIMEOUT_S = 75.0

# A worker's answers, as the orchestrator reads them (both response parsers, server/http/_parse*.py).
# A worker is another process, not a trusted part of this one: a head that never ends would take
# the orchestrator's memory as it came (one endless Content-Type: 68 MiB -> 2.9 GiB) and be answered
# only at the request's deadline. Bounded as a client's request head is (MAX_HEADERS), with room to
# spare: a worker's head is a status line and a handful of short headers.
#: bytes of a worker's response header fields (names and values), refused past it (a 502)
MAX_RESPONSE_HEAD_BYTES = 64 * 1024
#: header fields of a worker's response, refused past it (a 502)
MAX_RESPONSE_HEADERS = MAX_HEADERS
#: a worker's answer that the orchestrator holds whole (a context answer, a unary generation answer;
#: the orchestrator's max_worker_body_bytes): the bound of a client's body. A context answer with
#: 128k prompt ids is under 1 MB; a unary generation answer is its text, times n, and with logprobs
#: about 1.3 KB per token at 20 top_logprobs each (OpenAI's most): ~25k such tokens fit, and a longer
#: answer is a stream (relayed as it comes, never held whole: no bound)
MAX_WORKER_ANSWER_BYTES = MAX_BODY_BYTES


@dataclass(slots=True)
class Limits:
    """Bounds on what one client can hold (times in seconds, sizes in bytes)."""

    max_header_bytes: int = MAX_HEADER_BYTES
    max_headers: int = MAX_HEADERS
    max_body_bytes: int = MAX_BODY_BYTES
    header_timeout_s: float = HEADER_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S
    keepalive_timeout_s: float = KEEPALIVE_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS
    #: request body bytes held by the whole server at once (a Content-Length is
    #: counted whole from the headers, a chunked body as it arrives; until
    #: answered); a request that would go past it is a 503 with Retry-After
    max_inflight_body_bytes: int = MAX_INFLIGHT_BODY_BYTES
    #: one client IP holding more than this share of ``max_connections`` (or of
    #: ``max_inflight_body_bytes``) may not take their last share: that part is
    #: kept for the other clients (503 + Retry-After). 1.0: no per-client bound
    #: (a server whose one client is a proxy or the orchestrator)
    peer_share: float = PEER_SHARE
    #: seconds a 503 at a server-wide cap (connections, body bytes) asks the client to wait
    retry_after_s: int = RETRY_AFTER_S
    #: complete requests queued behind the one being answered on a connection
    max_pipelined: int = 16
    #: the client write buffer above which a relayed stream's upstream stops being read
    write_high_water: int = 1 << 20

    def __post_init__(self) -> None:
        if not 0.0 < self.peer_share <= 1.0:
            raise ValueError(f"peer_share must be within (0, 1], got {self.peer_share}")
