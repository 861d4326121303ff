"""Shared-secret signing of internal requests (orchestrator -> workers).

With a shared secret configured, a worker accepts ``context_only`` and
``generation_only`` requests only when they carry ``SIGNATURE_HEADER``: the
hex HMAC-SHA256 of the exact body bytes under that secret. The orchestrator
signs the bodies it builds; clients cannot forge internal fields.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

SIGNATURE_HEADER = "X-Fastcore-Signature"


def sign_body(secret: bytes, body: bytes | bytearray | memoryview) -> str:
    """``"sha256=<hex>"`` for ``body`` under ``secret``."""
    return "sha256=" + hmac.new(secret, body, hashlib.sha256).hexdigest()


def sign_pieces(secret: bytes, pieces: Sequence[bytes | bytearray | memoryview]) -> str:
    """:func:`sign_body` of the concatenation of ``pieces``, without joining them."""
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for piece in pieces:
        mac.update(piece)
    return "sha256=" + mac.hexdigest()


def verify_body(secret: bytes, body: bytes, signature: str | None) -> bool:
    """Constant-time check of a ``SIGNATURE_HEADER`` value against ``body``."""
    if not signature:
        return False
    return hmac.compare_digest(sign_body(secret, body), signature)
