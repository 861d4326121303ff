"""Each tenant's own prefix cache: the ``cache_salt`` the orchestrator sends, derived from the tenant.

A worker's prefix cache answers whoever sends a prompt it has seen: the time to the first token
and ``usage.prompt_tokens_details.cached_tokens`` tell one client that another sent it. Workers
key their cache by ``cache_salt`` (server/worker/engine_api.py ``cache_salt_root``), so with API
keys (server/orchestrator/tenants.py) the orchestrator replaces each request's salt by one of its
tenant's: ``"t:"`` and the hex of BLAKE2b-128 of the tenant's name and, when the client sent one,
``"\\0"`` and the client's salt. No tenant can then send a salt that lands in another's blocks (a
tenant name has no NUL, so two tenants' inputs never coincide), a tenant's own salts still split
its cache as before, and the key never leaves the orchestrator (the name, not the key, is hashed:
the same in every orchestrator process and host, so their routers and the workers agree).

The body both legs carry is rewritten once, before routing (``Orchestrator.prepare``): the router's
prefix keys (server/cache_keys.py, routing/keys.py ``request_key``) read the same salt as the workers
cache under, and every path (both legs, the local prefill, both relay modes) sends it.

trtllm-serve's chat request takes ``cache_salt``; its completion request does not (and refuses a
field it does not model): on completions a salt is added only where every worker of both pools
says it takes one (``Pool.salts_completions``: a fastcore worker's ``/server_info``); a client's
own salt is replaced there as anywhere (a trtllm-serve worker refuses any).
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache

import fastcore
from fastcore import JSONSpanError
from fastcore import protocol as wire
from server.errors import HTTPError

from .relay_common import scan_refusal

__all__ = ["TENANT_SALT_PREFIX", "salted_body", "tenant_salt"]

#: every salt the orchestrator derives starts so (the rest: 32 hex digits)
TENANT_SALT_PREFIX = "t:"
_PATHS = ((), (wire.CACHE_SALT,))
_PERSON = b"fastcore-tenant"  # BLAKE2b's personalisation: this digest is no other's
_SPACE = b" \t\r\n"


def tenant_salt(tenant: str, client_salt: str | None) -> str:
    """The salt a request of ``tenant`` is cached under, for the client's ``client_salt`` (None: none)."""
    data = tenant.encode()
    if client_salt is not None:
        data += b"\0" + client_salt.encode("utf-8", "surrogatepass")
    return TENANT_SALT_PREFIX + hashlib.blake2b(data, digest_size=16, person=_PERSON).hexdigest()


@lru_cache(maxsize=1024)  # one per tenant (the key file names them): no client's value is kept
def _member(tenant: str) -> bytes:
    """The ``"cache_salt":"..."`` member a body without one is given (a hash per request saved)."""
    return b'"%s":"%s"' % (wire.CACHE_SALT.encode(), tenant_salt(tenant, None).encode())


def _client_salt(body: bytes, span: tuple[int, int]) -> str | None:
    """The client's ``cache_salt`` as the workers read it (server/worker/request.py ``_cache_salt``):
    null is none; anything but a string with a non-blank character is their 400, worded as theirs."""
    raw = body[span[0] : span[1]]
    if raw == b"null":
        return None
    value: object = None
    if raw[:1] == b'"':  # a validated body: the string's UTF-8 is valid, escapes are the stdlib's to read
        value = raw[1:-1].decode() if b"\\" not in raw else json.loads(raw)
    if type(value) is not str or not value.strip():
        shown = raw[:40].decode("utf-8", "replace") + ("..." if len(raw) > 40 else "")
        raise HTTPError(
            400,
            f"Parameter '{wire.CACHE_SALT}' must be a non-empty string if provided (got {shown})",
            param=wire.CACHE_SALT,
        )
    return value


def salted_body(body: bytes, tenant: str, add: bool = True) -> bytes:
    """``body`` (a client body the relay has read and checked) with its top-level ``cache_salt`` set
    to ``tenant``'s salt for it: the client's value replaced, or, absent, the member added first
    (``add`` False: a body without one is left so). One non-validating scan of the top level and
    one copy. A client's salt the workers would refuse, or a repeated one, is the 400 naming it."""
    try:
        root, span = fastcore.find_spans(body, _PATHS, validate=False)
    except JSONSpanError as exc:  # a repeated cache_salt: which one a worker would read is a guess
        raise scan_refusal(body, exc, "request body", 400) from None
    assert root is not None and body[root[0]] == 0x7B  # the relay refused anything but an object
    if span is None:
        if not add:
            return body
        inner = root[0] + 1
        while body[inner] in _SPACE:
            inner += 1
        member = _member(tenant) if body[inner] == 0x7D else _member(tenant) + b","  # "}": none to separate
        return fastcore.splice(body, ((root[0] + 1, root[0] + 1, member),))
    salt = b'"%s"' % tenant_salt(tenant, _client_salt(body, span)).encode()
    return fastcore.splice(body, ((span[0], span[1], salt),))
