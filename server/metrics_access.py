"""Who may read ``GET /metrics`` on a client-facing port (the orchestrator's and every worker's).

The page is an oracle for whoever reads it: the workers' prefix-cache hit
counters tell one client whether another's prompt was sent (a guess equal to
it adds cached tokens, a wrong one none), the orchestrator's series name every
worker URL, and the KV fetch failures' reasons (``unreachable``, ``http_404``)
tell which local ports answer. So it is served, as an operator would expose
an admin endpoint, to:

- with a metrics token (``metrics_token_file`` / ``--metrics-token-file`` /
  ``$FASTCORE_METRICS_TOKEN``): a request carrying ``Authorization: Bearer
  <token>``, from any address, loopback included (on a shared host a tenant
  is a local process too); otherwise 401 with ``WWW-Authenticate: Bearer``;
- without one: loopback peers only (Prometheus or ``fastcore-serve up`` on the
  same host); anyone else gets 403 naming how to allow it.

Prometheus sends the token with ``authorization: {credentials_file: PATH}`` in
its scrape config.
"""

from __future__ import annotations

import hmac
import ipaddress

from server.errors import HTTPError

#: the environment variable holding the token (every process)
METRICS_TOKEN_ENV = "FASTCORE_METRICS_TOKEN"
_HOW = f"metrics_token_file, --metrics-token-file or ${METRICS_TOKEN_ENV}"


def is_loopback_peer(peer: object) -> bool:
    """Whether a socket's ``peername`` is a loopback address (IPv4, IPv6, IPv4-mapped IPv6);
    a Unix socket's (a str) counts: only local processes reach one."""
    if isinstance(peer, str):
        return True
    if not isinstance(peer, tuple) or not peer:
        return False
    try:
        address = ipaddress.ip_address(str(peer[0]).split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return bool(address.is_loopback or (mapped is not None and mapped.is_loopback))


class MetricsAccess:
    """The ``/metrics`` policy of one server: a bearer token, else loopback only."""

    def __init__(self, token: bytes | None) -> None:
        self.token = token or None

    def refusal(self, authorization: bytes | None, peer: object) -> HTTPError | None:
        """None when this request may read the page, else the error to answer."""
        if self.token is None:
            if is_loopback_peer(peer):
                return None
            return HTTPError(
                403,
                "GET /metrics is served to loopback clients only; to scrape it from elsewhere set a "
                f"metrics token ({_HOW}) and send it as Authorization: Bearer <token>",
                code="metrics_forbidden",
            )
        scheme, _, credentials = (authorization or b"").strip().partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(credentials.strip(), self.token):
            return None
        return HTTPError(
            401,
            "GET /metrics needs Authorization: Bearer <the metrics token>"
            + (" (the one given is wrong)" if authorization else ""),
            code="metrics_token_required",
            headers={"WWW-Authenticate": 'Bearer realm="metrics"'},
        )


__all__ = ["METRICS_TOKEN_ENV", "MetricsAccess", "is_loopback_peer"]
