"""Shared-secret signing of internal requests (orchestrator -> workers, worker -> worker).

With a shared secret configured, a worker accepts ``context_only`` and
``generation_only`` requests, and KV fetches, only when they carry
``SIGNATURE_HEADER``::

    X-Fastcore-Signature: t=<unix seconds>,n=<32 hex nonce>[,d=<destination>],sha256=<64 hex>

The MAC is HMAC-SHA256 under the secret of ``b"t=<t>,n=<n>[,d=<d>]\\n"``
followed by the exact body bytes (for a KV fetch, which has no body: its
path). The timestamp, the nonce and the destination are inside the MAC, so
none can be changed; a :class:`Verifier` accepts a timestamp within
``window_s`` of its own clock and each nonce once within that window, so a
captured request cannot be replayed to the worker it was sent to. Nonces are
remembered per process, so the destination ``d`` (the receiving worker's
``instance`` id, from its ``/health``) is what stops a replay to another
worker, or to the same worker after a restart: a worker refuses a leg bound
to another instance, and a leg bound to none.

Verification works on raw bytes before anything is parsed: a header that is
not ASCII, malformed, stale or replayed is refused with a reason, never an
exception; digests are compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Sequence

from fastcore import protocol as wire

SIGNATURE_HEADER = "X-Fastcore-Signature"
#: environment variable holding the secret (all processes)
SECRET_ENV = "FASTCORE_SHARED_SECRET"
#: seconds a signed request stays valid either side of the receiver's clock
REPLAY_WINDOW_S = 60.0
#: nonces remembered per verifier: a bound on memory (~100 bytes each)
MAX_NONCES = 200_000

Bytes = bytes | bytearray | memoryview


def _mac(secret: bytes, stamp: bytes, pieces: Sequence[Bytes]) -> str:
    mac = hmac.new(secret, stamp, hashlib.sha256)
    for piece in pieces:
        mac.update(piece)
    return mac.hexdigest()


#: what a destination may hold: a worker's instance id is 32 hex
_DESTINATION_RE = re.compile(rb"[A-Za-z0-9._:-]{1,128}")
#: :meth:`Verifier.check`'s reason for a signature bound to another worker (or to none)
WRONG_DESTINATION = "signed for another worker"


def sign_pieces(
    secret: bytes,
    pieces: Sequence[Bytes],
    *,
    now: float | None = None,
    nonce: str | None = None,
    destination: str | None = None,
) -> str:
    """The ``SIGNATURE_HEADER`` value for the concatenation of ``pieces``, without joining them;
    bound to ``destination`` (the receiving worker's instance id) when given."""
    t = int(time.time() if now is None else now)
    n = secrets.token_hex(16) if nonce is None else nonce
    stamp = b"t=%d,n=%s" % (t, n.encode("ascii"))
    if destination is not None:
        if not _DESTINATION_RE.fullmatch(destination.encode("ascii", "replace")):
            raise ValueError(f"a signature's destination must match {_DESTINATION_RE.pattern.decode()}")
        stamp += b",d=" + destination.encode("ascii")
    digest = _mac(secret, stamp + b"\n", pieces)
    return f"{stamp.decode()},sha256={digest}"


def sign_body(
    secret: bytes,
    body: Bytes,
    *,
    now: float | None = None,
    nonce: str | None = None,
    destination: str | None = None,
) -> str:
    """:func:`sign_pieces` of one body."""
    return sign_pieces(secret, (body,), now=now, nonce=nonce, destination=destination)


class Verifier:
    """Checks signatures under one secret and remembers the nonces it has accepted."""

    def __init__(
        self, secret: bytes, *, window_s: float = REPLAY_WINDOW_S, max_nonces: int = MAX_NONCES
    ) -> None:
        self.secret = secret
        self.window_s = window_s
        self.max_nonces = max_nonces
        # nonce -> when it may be forgotten; insertion order is time order.
        self._seen: OrderedDict[bytes, float] = OrderedDict()

    def check(
        self,
        body: Bytes | Sequence[Bytes],
        header: bytes | str | None,
        *,
        now: float | None = None,
        destination: str | None = None,
        bound: bool = False,
    ) -> str | None:
        """None when ``header`` signs ``body`` (the nonce is then used up), else why not.

        ``destination``: this receiver's id; a signature bound to another is refused
        (:data:`WRONG_DESTINATION`), and so is an unbound one when ``bound`` (legs must be
        bound; a KV fetch, whose sender cannot know the context worker's id, need not)."""
        if not header:
            return "missing"
        if isinstance(header, str):
            try:
                header = header.encode("ascii")
            except UnicodeEncodeError:
                return "malformed"
        parts = bytes(header).split(b",")
        dest = None
        if len(parts) == 4 and parts[2].startswith(b"d="):
            dest = parts.pop(2)[2:]
            if not _DESTINATION_RE.fullmatch(dest):
                return "malformed"
        if (
            len(parts) != 3
            or not parts[0].startswith(b"t=")
            or not parts[1].startswith(b"n=")
            or not parts[2].startswith(b"sha256=")
        ):
            return "malformed"
        t_raw, nonce, digest = parts[0][2:], parts[1][2:], parts[2][7:]
        if not (t_raw.isdigit() and len(t_raw) <= 12 and 8 <= len(nonce) <= 64 and nonce.isalnum()):
            return "malformed"
        pieces = (body,) if isinstance(body, bytes | bytearray | memoryview) else body
        stamp = b"t=%s,n=%s" % (t_raw, nonce) + (b"" if dest is None else b",d=" + dest)
        expected = _mac(self.secret, stamp + b"\n", pieces).encode()
        if not hmac.compare_digest(expected, digest):
            return "bad signature"
        clock = time.time() if now is None else now
        if abs(clock - int(t_raw)) > self.window_s:
            return "stale timestamp"
        if (dest is None and bound) or (
            dest is not None and (destination is None or dest != destination.encode("ascii", "replace"))
        ):
            return WRONG_DESTINATION
        seen = self._seen
        while seen:
            oldest, forget_at = next(iter(seen.items()))
            if forget_at > clock:
                break
            del seen[oldest]
        if nonce in seen:
            return "replayed"
        if len(seen) >= self.max_nonces:
            return "too many signed requests in the replay window"
        # Kept until its timestamp can no longer pass the window check.
        seen[bytes(nonce)] = int(t_raw) + self.window_s
        return None


#: trtllm-serve's header on generation requests that name where the KV is (disagg_auth.py)
TRTLLM_AUTH_HEADER = wire.X_TRTLLM_DISAGG_AUTH


def trtllm_disagg_message(ctx_info_endpoint: object, encoded_opaque_state: object) -> bytes:
    """What trtllm-serve's ``x-trtllm-disagg-auth`` signs.

    The UTF-8 of ``{"ctx_info_endpoint":E,"encoded_opaque_state":S}`` (sorted
    keys, no spaces, absent values ``null``); E is the first element when the
    endpoint is a list.
    """
    if isinstance(ctx_info_endpoint, list):
        ctx_info_endpoint = ctx_info_endpoint[0] if ctx_info_endpoint else None
    return json.dumps(
        {wire.CTX_INFO_ENDPOINT: ctx_info_endpoint, wire.ENCODED_OPAQUE_STATE: encoded_opaque_state},
        sort_keys=True,
        separators=(",", ":"),
    ).encode()


def trtllm_disagg_auth(key: bytes, ctx_info_endpoint: object, encoded_opaque_state: object) -> str:
    """The ``x-trtllm-disagg-auth`` value: ``sha256=<hex>`` of :func:`trtllm_disagg_message` under ``key``."""
    message = trtllm_disagg_message(ctx_info_endpoint, encoded_opaque_state)
    return "sha256=" + hmac.new(key, message, hashlib.sha256).hexdigest()


def check_trtllm_disagg_auth(
    key: bytes, ctx_info_endpoint: object, encoded_opaque_state: object, header: bytes | str | None
) -> bool:
    """Constant-time check of an ``x-trtllm-disagg-auth`` header (any bytes: False, never an error)."""
    if not header:
        return False
    if isinstance(header, str):
        try:
            header = header.encode("ascii")
        except UnicodeEncodeError:
            return False
    expected = trtllm_disagg_auth(key, ctx_info_endpoint, encoded_opaque_state).encode()
    return hmac.compare_digest(expected, bytes(header).strip())


def read_secret(
    value: str | None,
    path: str | None,
    environ: dict[str, str] | None = None,
    *,
    env_name: str = SECRET_ENV,
    what: str = "shared secret",
) -> bytes | None:
    """The secret from a file (``--shared-secret-file``), a value, or ``env_name``, in that order.

    A file's trailing newline is dropped; an empty secret is none. (The same rules read the
    metrics token: ``env_name`` and ``what`` name it.)
    """
    if path:
        with open(path, "rb") as fh:
            secret = fh.read().rstrip(b"\r\n")
        if not secret:
            raise ValueError(f"{what} file {path} is empty")
        return secret
    if value:
        return value.encode()
    env = (os.environ if environ is None else environ).get(env_name)
    return env.encode() if env else None


__all__ = [
    "MAX_NONCES",
    "REPLAY_WINDOW_S",
    "SECRET_ENV",
    "SIGNATURE_HEADER",
    "TRTLLM_AUTH_HEADER",
    "WRONG_DESTINATION",
    "Verifier",
    "check_trtllm_disagg_auth",
    "read_secret",
    "sign_body",
    "sign_pieces",
    "trtllm_disagg_auth",
    "trtllm_disagg_message",
]
