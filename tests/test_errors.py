"""server.errors: the OpenAI error shape, and workers' error bodies normalised into it."""

from __future__ import annotations

import json

import pytest

from server.errors import default_code, error_body, normalise_error_body


def shape(body: bytes) -> dict:
    data = json.loads(body)
    assert list(data) == ["error"]
    error = data["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and isinstance(error["code"], str)
    return error


def test_error_body_has_a_string_code_for_every_status() -> None:
    for status in (400, 401, 403, 404, 405, 408, 413, 414, 415, 429, 431, 499, 500, 501, 502, 503, 504, 505, 599):
        error = shape(error_body(status, "m"))
        assert error["code"] == default_code(status)
    assert default_code(404) == "not_found" and default_code(413) == "request_too_large"
    assert default_code(499) == "client_closed_request" and default_code(599) == "server_error"
    assert shape(error_body(400, "m", code="worker_full", param="n")) == {
        "message": "m", "type": "invalid_request_error", "param": "n", "code": "worker_full"
    }


def test_ours_is_kept_byte_for_byte() -> None:
    body = error_body(400, "bad n", param="n", code="invalid_n")
    assert normalise_error_body(400, body) is body


@pytest.mark.parametrize(
    ("body", "message", "param", "code"),
    [
        # trtllm-serve's handler errors
        (b'{"object":"error","message":"bad b64","type":"BadRequestError","param":null,"code":400}', "bad b64", None, None),
        (b'{"object":"error","message":"m","type":"X","param":"prompt","code":"too_long"}', "m", "prompt", "too_long"),
        # its validation errors and its framework's
        (b'{"error":"1 validation error for CompletionRequest"}', "1 validation error for CompletionRequest", None, None),
        (b'{"detail":"Not Found"}', "Not Found", None, None),
        (b'{"detail":[{"loc":["body","n"],"msg":"field required"},{"msg":"extra"}]}', "field required; extra", None, None),
        # OpenAI's shape with a numeric code (another server's)
        (b'{"error":{"message":"m","type":"t","param":null,"code":400}}', "m", None, None),
        # not JSON at all, or nothing
        (b"Bad Request: no", "Bad Request: no", None, None),
        (b"", "the worker answered 400 with no message", None, None),
        (b"[" * 5000, "[" * 2000, None, None),
    ],
)
def test_other_shapes_become_ours_with_the_status_kept(body, message, param, code) -> None:
    error = shape(normalise_error_body(400, body))
    # A string code is kept; none (or trtllm-serve's numeric one) is the status's.
    assert (error["message"], error["param"], error["code"]) == (message, param, code or default_code(400))
    assert error["type"] == "invalid_request_error"
    assert shape(normalise_error_body(503, body))["type"] == "service_unavailable"
