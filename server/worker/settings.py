"""A worker's settings: everything the app reads, filled once by the CLI (or a test), checked once."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from fastcore._hash_py import CHUNK_MAX
from server import tracing
from server.http import Limits
from server.http import limits as http_limits

from .engine_api import DEFAULT_KV_TTL_S
from .tool_calls import TOOL_CALL_PARSERS

ROLES = ("both", "context", "generation")


def host_port(entry: str) -> tuple[str, int | None]:
    """``HOST[:PORT]`` (an IPv6 address in brackets) as a lower-case host and a port or None."""
    parts = urlsplit("//" + entry.strip())
    try:
        port = parts.port
    except ValueError:
        port = -1
    host = parts.hostname
    if not host or port == -1 or parts.path or parts.query or parts.fragment or parts.username is not None:
        raise ValueError(f"KV source {entry!r} is not HOST[:PORT]")
    return host, port


@dataclass
class WorkerSettings:
    """Everything the app reads, filled once by the CLI (or a test)."""

    role: str = "both"
    model_name: str = "tiny"
    shared_secret: bytes | None = None
    #: the bearer token GET /metrics asks for; None: /metrics is served to loopback peers only
    metrics_token: bytes | None = None
    #: the key of trtllm-serve's ``x-trtllm-disagg-auth`` (its ``internal_request_auth_key``);
    #: None: the shared secret
    trtllm_auth_key: bytes | None = None
    #: a trtllm-serve orchestrator fronts this worker: its unsigned legs are accepted, and
    #: completions answer the prompt ids as a list (see the module docstring)
    accept_trtllm_orchestrator: bool = False
    kv_ttl_s: float = DEFAULT_KV_TTL_S
    kv_fetch_timeout_s: float = 10.0
    #: the most of the KV cache parked entries may hold together; beyond it the oldest go
    max_parked_fraction: float = 0.5
    #: hosts (``HOST[:PORT]``) a generation worker fetches KV from; see :class:`KVSources`
    kv_allow: tuple[str, ...] = ()
    # Base URL put in ctx_info_endpoint; default: the Host the request came in on.
    public_url: str | None = None
    retry_after_s: int = http_limits.RETRY_AFTER_S
    #: how long a request that does not fit in the KV cache waits for room before its 503
    admission_wait_s: float = 10.0
    #: requests waiting for KV at once; one more is refused at once (503)
    max_waiting: int = 256
    #: a stream whose client reads nothing for this long (its write buffer stays above the high-water
    #: mark) is dropped and its KV freed: a client that never reads cannot hold KV until max_tokens
    stream_stall_timeout_s: float = 30.0
    # The listening side's bounds (server.http.Limits).
    max_body_bytes: int = http_limits.WORKER_MAX_BODY_BYTES
    max_header_bytes: int = http_limits.MAX_HEADER_BYTES
    header_timeout_s: float = http_limits.HEADER_TIMEOUT_S
    body_timeout_s: float = http_limits.BODY_TIMEOUT_S
    keepalive_timeout_s: float = http_limits.WORKER_KEEPALIVE_TIMEOUT_S
    max_connections: int = http_limits.MAX_CONNECTIONS
    max_inflight_body_bytes: int = http_limits.WORKER_MAX_INFLIGHT_BODY_BYTES
    #: one client IP's share of max_connections and max_inflight_body_bytes (Limits.peer_share)
    client_ip_share: float = http_limits.PEER_SHARE
    device: str = "cpu"
    #: GET /cache_events' chunk size: the worker's, whatever a caller asks (the orchestrators'
    #: kv_cache_aware chunk_bytes; its default, 512)
    cache_events_chunk_bytes: int = 512
    #: OpenTelemetry traces (OTLP/HTTP); None: OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT or off (server/tracing.py)
    otlp_traces_endpoint: str | None = None
    #: how a chat answer's tool calls are read out of its text (server/worker/tool_calls.py)
    tool_call_parser: str = "none"

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                f"got {self.tool_call_parser!r}"
            )
        endpoint = tracing.configured_endpoint(self.otlp_traces_endpoint)
        if endpoint is not None:  # tracing asked for: the SDK must be there, the URL OTLP/HTTP
            tracing.check_endpoint(endpoint)
        if self.admission_wait_s < 0 or self.max_waiting < 0:
            raise ValueError("admission_wait_s and max_waiting must not be negative")
        if not self.stream_stall_timeout_s > 0:
            raise ValueError(f"stream_stall_timeout_s must be > 0, got {self.stream_stall_timeout_s}")
        if not 0.0 <= self.max_parked_fraction <= 1.0:
            raise ValueError(f"max_parked_fraction must be within [0, 1], got {self.max_parked_fraction}")
        chunk = self.cache_events_chunk_bytes
        if chunk < 32 or chunk % 32 or chunk > CHUNK_MAX:
            raise ValueError(
                f"cache_events_chunk_bytes must be a multiple of 32 in [32, {CHUNK_MAX}], got {chunk}"
            )
        self.kv_allow = tuple(self.kv_allow)
        for entry in self.kv_allow:
            host_port(entry)

    def limits(self) -> Limits:
        return Limits(
            max_header_bytes=self.max_header_bytes,
            max_body_bytes=self.max_body_bytes,
            header_timeout_s=self.header_timeout_s,
            body_timeout_s=self.body_timeout_s,
            keepalive_timeout_s=self.keepalive_timeout_s,
            max_connections=self.max_connections,
            max_inflight_body_bytes=self.max_inflight_body_bytes,
            peer_share=self.client_ip_share,
            retry_after_s=self.retry_after_s,
        )


__all__ = ["ROLES", "WorkerSettings", "host_port"]
