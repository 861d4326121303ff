"""OpenAI-shaped error responses, shared by the worker and the orchestrator.

Every error a client sees is ``{"error": {"message", "type", "param", "code"}}``
with the matching HTTP status, so a worker's 400 relayed by the orchestrator
reaches the client unchanged.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    500: "internal_error",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "gateway_timeout",
}


def default_code(status: int) -> str:
    """The string ``code`` of an error without a more specific one: the status's name, snake-cased."""
    code = _CODES.get(status)
    if code is None:
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = "client error" if status < 500 else "server error"
        code = _CODES[status] = phrase.lower().replace(" ", "_").replace("-", "_")
    return code


_CODES: dict[int, str] = {499: "client_closed_request", 413: "request_too_large"}


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> bytes:
    """The JSON bytes of an OpenAI error object."""
    error: dict[str, Any] = {
        "message": message,
        "type": _TYPES.get(status, "invalid_request_error" if status < 500 else "internal_error"),
        "param": param,
        "code": code if code is not None else default_code(status),
    }
    return json.dumps({"error": error}).encode()


def normalise_error_body(status: int, body: bytes, *, limit: int = 2000) -> bytes:
    """A worker's error body in this module's OpenAI shape, whatever shape it came in.

    fastcore workers already answer ``{"error": {...}}`` (kept as sent).
    trtllm-serve answers ``{"object": "error", "message", "type", "param",
    "code"}`` from its handlers, ``{"error": "<text>"}`` for validation errors
    and ``{"detail": ...}`` from its framework; anything else (not JSON) keeps
    its text as the message, cut at ``limit`` characters.
    """
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        data = None
    if isinstance(data, dict):
        inner = data.get("error")
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            if isinstance(inner.get("code"), str) and set(inner) == {"message", "type", "param", "code"}:
                return body  # ours already
            data = inner
        if isinstance(data.get("message"), str) and (data is inner or data.get("object") == "error"):
            return error_body(
                status, data["message"][:limit], param=_param(data.get("param")), code=_code(data.get("code"))
            )
        if isinstance(inner, str):
            return error_body(status, inner[:limit])
        if "detail" in data:
            detail = data["detail"]
            if isinstance(detail, list):  # a framework's validation errors: their messages
                detail = "; ".join(str(d.get("msg", d)) if isinstance(d, dict) else str(d) for d in detail)
            return error_body(status, str(detail)[:limit])
    text = body.decode("utf-8", "replace").strip()[:limit]
    return error_body(status, text or f"the worker answered {status} with no message")


def _param(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _code(value: Any) -> str | None:
    """A string code kept; a number (trtllm-serve's status) gives way to the default."""
    return value if isinstance(value, str) and value else None


class HTTPError(Exception):
    """Raised inside handlers to end the request with an OpenAI-shaped error."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def header_lines(self) -> bytes:
        """The extra headers as HTTP header lines (``Name: value\\r\\n`` each)."""
        if not self.headers:
            return b""
        return "".join(f"{name}: {value}\r\n" for name, value in self.headers.items()).encode("latin-1")


def check_not_empty(body: bytes) -> None:
    """A 400 that says what to send, for a body with no JSON in it at all (empty or whitespace):
    "malformed JSON at byte 0" would blame a body that was never sent."""
    if not body or body.isspace():
        raise HTTPError(
            400,
            "the request body is empty: send a JSON object (Content-Type: application/json)",
            code="empty_body",
        )
