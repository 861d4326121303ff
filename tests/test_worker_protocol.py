"""The worker's request parsing: the fast loader (token ids decoded from the body's bytes) against
the stdlib reference (``json.loads`` of the whole body), both routes, both gate forms, both
scanner twins, and every error path of the token field."""

from __future__ import annotations

import base64
import dataclasses
import json
import re
import struct
from types import ModuleType
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

import fastcore
from server.errors import HTTPError, error_body
from server.worker import json_body
from server.worker.json_body import MAX_NESTING, JSONBody, RawJSON, load_json_body
from server.worker.msgpack_body import load_msgpack_body
from server.worker.request import ParsedRequest, read_request
from server.worker.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
VOCAB = TOK.vocab_size  # 262
MAX_CONTEXT = 2048
GEN_PARAMS = {
    "request_type": "generation_only",
    "first_gen_tokens": [65],
    "ctx_request_id": 12,
    "disagg_request_id": 7205759403792793601,
    "encoded_opaque_state": None,
    "ctx_info_endpoint": "http://127.0.0.1:1/kv/12",
    "draft_tokens": None,
    "ctx_usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
}
LAST_MESSAGE = [{"role": "user", "content": "Tell me about Lisbon."}]
HISTORY = [{"role": "system", "content": "You are terse. " * 400}, *LAST_MESSAGE * 20]
FIXED_HYPOTHESIS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def b64(ids: list[int]) -> str:
    return base64.b64encode(struct.pack(f"<{len(ids)}i", *ids)).decode()


def parse(raw: bytes, route: str, loader: str = "fast", scanner: ModuleType | None = None) -> ParsedRequest:
    """The worker's reading of ``raw``: the fast loader over ``scanner`` (a scan twin; default the
    active one), or (``loader="json"``) the stdlib reference; the same field reader after either."""
    body = json_reader(scanner or fastcore).load(raw, route) if loader == "fast" else load_json_body(raw)  # type: ignore[arg-type]
    return read_body(body, route)


def json_reader(scanner: Any) -> JSONBody:
    """The worker's JSON loader on the scan twin ``scanner``."""
    return type("TwinJSONBody", (JSONBody,), {"scanner": scanner})()


def read_body(body: dict[str, Any], route: str) -> ParsedRequest:
    return read_request(body, route, tokenizer=TOK, model_name="tiny", max_context=MAX_CONTEXT)  # type: ignore[arg-type]


def materialised(value: Any) -> Any:
    return value.value() if isinstance(value, RawJSON) else value


def comparable(req: ParsedRequest) -> dict[str, Any]:
    """Every field of ``req``, with the ids as (dtype, list) and the body's RawJSON as its value."""
    out = {f.name: getattr(req, f.name) for f in dataclasses.fields(req)}
    out["prompt_ids"] = (str(req.prompt_ids.dtype), req.prompt_ids.shape, req.prompt_ids.tolist())
    out["body"] = {k: materialised(v) for k, v in req.body.items()}
    return out


def outcome(raw: bytes, route: str, loader: str, scanner: ModuleType | None = None) -> Any:
    try:
        return comparable(parse(raw, route, loader, scanner))
    except HTTPError as exc:
        return (exc.status, exc.param, exc.message)


def error(raw: bytes, route: str, scanner: ModuleType | None = None) -> HTTPError:
    with pytest.raises(HTTPError) as info:
        parse(raw, route, "fast", scanner)
    assert info.value.status in (400, 404)
    return info.value


def same_outcome(raw: bytes, route: str, scanner: ModuleType) -> None:
    """The fast loader gives exactly the reference's request, or the same error."""
    fast, ref = outcome(raw, route, "fast", scanner), outcome(raw, route, "json")
    if isinstance(ref, dict) or isinstance(fast, dict):
        assert fast == ref
        return
    assert fast[:2] == ref[:2], (fast, ref)
    if "not valid JSON" in ref[2]:  # two parsers word a syntax error differently; both give the byte
        assert "not valid JSON" in fast[2] and "(byte " in fast[2]
    else:  # the fast path may add the body offset of a bad base64 character
        assert fast[2].startswith(ref[2]), (fast, ref)


def generation_body(route: str, form: str, ids: list[int], *, history: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 16, "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}, "disaggregated_params": GEN_PARAMS}  # fmt: skip
    if route == "chat":
        body["messages"] = HISTORY if history else LAST_MESSAGE
    if form == "b64":
        body["prompt_token_ids_b64"] = b64(ids)
    elif route == "chat":
        body["prompt_token_ids"] = ids
    else:
        body["prompt"] = ids
    return body


# ---------------------------------------------------------------- the fast path itself

ROUTES_FORMS = [(r, f) for r in ("chat", "completions") for f in ("b64", "list")]


@pytest.mark.parametrize(("route", "form"), ROUTES_FORMS)
@pytest.mark.parametrize("history", [False, True], ids=["last", "history"])
def test_generation_request_ids_come_from_the_bytes(
    jsonspan: ModuleType, route: str, form: str, history: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = list(np.random.default_rng(7).integers(0, VOCAB, 1500))
    raw = json.dumps(generation_body(route, form, [int(i) for i in ids], history=history)).encode()
    want = comparable(parse(raw, route, "json"))
    decoded: list[type] = []
    real_decode = fastcore.decode_tokens

    def spy(data: Any, **kw: Any) -> np.ndarray:
        decoded.append(type(data))
        return real_decode(data, **kw)

    def no_json_loads(*args: Any, **kw: Any) -> Any:
        raise AssertionError("the fast loader called json.loads")

    monkeypatch.setattr(fastcore, "decode_tokens", spy)
    monkeypatch.setattr(json_body.json, "loads", no_json_loads)
    req = parse(raw, route, "fast", jsonspan)
    monkeypatch.undo()
    field = "prompt_token_ids_b64" if form == "b64" else "prompt_token_ids" if route == "chat" else "prompt"
    assert isinstance(req.body[field], RawJSON)  # never materialised
    assert decoded == ([memoryview] if form == "b64" else [])  # base64: from a view of the body, no str
    assert req.prompt_ids.dtype == np.int32 and req.prompt_ids.tolist() == ids
    assert comparable(req) == want


class ScanCalls:
    """A scan twin that records its scans: (function, validate) per call."""

    def __init__(self, twin: ModuleType) -> None:
        self.twin = twin
        self.calls: list[tuple[str, bool]] = []
        self.splice = twin.splice

    def find_spans(self, body: Any, paths: Any, *, validate: bool = True) -> Any:
        self.calls.append(("find_spans", validate))
        return self.twin.find_spans(body, paths, validate=validate)

    def find_span(self, body: Any, path: Any, *, validate: bool = True) -> Any:
        self.calls.append(("find_span", validate))
        return self.twin.find_span(body, path, validate=validate)


@pytest.mark.parametrize(("route", "form"), ROUTES_FORMS)
@pytest.mark.parametrize("history", [False, True], ids=["last", "history"])
def test_a_body_is_read_by_one_validating_scan(jsonspan: ModuleType, route: str, form: str, history: bool) -> None:
    """A well-formed body costs one scan of its bytes, a validating one (no lax scan first, no
    second scan of the spliced rest); pysimdjson's member counts stand in for a scan of the keys."""
    raw = json.dumps(generation_body(route, form, [1, 2, 3], history=history)).encode()
    scanner = ScanCalls(jsonspan)
    req = read_body(json_reader(scanner).load(raw, route), route)  # type: ignore[arg-type]
    assert req.prompt_ids.tolist() == [1, 2, 3]
    assert scanner.calls == [("find_spans", True)]


def test_a_repeated_key_costs_a_second_scan_that_names_it(jsonspan: ModuleType) -> None:
    raw = b'{"prompt": [1], "stream_options": {"include_usage": true, "include_usage": false}, "n": 1}'
    scanner = ScanCalls(jsonspan)
    with pytest.raises(HTTPError, match=r"'stream_options.include_usage' more than once \(byte 58\)"):
        json_reader(scanner).load(raw, "completions")
    assert scanner.calls[:2] == [("find_spans", True), ("find_spans", True)]


def test_a_msgpack_body_is_decoded_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """msgpack -> Python values -> the request: no JSON text is written or parsed on the way."""
    from server.http import Request
    from server.worker.internal_auth import InternalAuth
    from server.worker.request import RequestReader

    def refuse(*args: Any, **kw: Any) -> Any:
        raise AssertionError("a msgpack body went through JSON")

    for route, form in ROUTES_FORMS:
        body = generation_body(route, form, [5, 6, 7], history=True)
        packed = msgspec.msgpack.encode(body)
        want = comparable(parse(json.dumps(body).encode(), route, "json"))
        with monkeypatch.context() as patched:
            patched.setattr(msgspec.json, "encode", refuse)
            patched.setattr(json_body.JSON_BODY, "load", refuse)
            patched.setattr(json_body.SIMDJSON, "parse", refuse)
            patched.setattr(json_body.json, "loads", refuse)
            reader = RequestReader(TOK, "tiny", MAX_CONTEXT, "both")
            request = Request()
            request.headers, request.body = [(b"X-TRTLLM-Msgpack", b"1")], packed
            req = reader.read(request, route, InternalAuth(None, None, "i", accept_trtllm_orchestrator=False))  # type: ignore[arg-type]
        assert req.prompt_ids.dtype == np.int32 and req.prompt_ids.tolist() == [5, 6, 7]
        assert req.msgpack and comparable(req) == {**want, "msgpack": True}


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_gate_forms_give_the_same_request(jsonspan: ModuleType, route: str) -> None:
    ids = [1, 2, 3, 250, 0, 261]
    reqs = [parse(json.dumps(generation_body(route, form, ids)).encode(), route, "fast", jsonspan)
            for form in ("b64", "list")]  # fmt: skip
    assert reqs[0].prompt_ids.tolist() == reqs[1].prompt_ids.tolist() == ids
    assert reqs[0].params == reqs[1].params and reqs[0].disagg == reqs[1].disagg


def test_precedence_of_the_token_fields(jsonspan: ModuleType) -> None:
    # base64 wins over a list; a null base64 leaves the list; completions ignore prompt_token_ids.
    raw = json.dumps({"prompt_token_ids_b64": b64([5]), "prompt_token_ids": [6], "messages": []}).encode()
    req = parse(raw, "chat", "fast", jsonspan)
    assert req.prompt_ids.tolist() == [5] and req.body["prompt_token_ids"] == [6]
    raw = json.dumps({"prompt_token_ids_b64": None, "prompt_token_ids": [6], "messages": []}).encode()
    assert parse(raw, "chat", "fast", jsonspan).prompt_ids.tolist() == [6]
    raw = json.dumps({"prompt": [7, 8], "prompt_token_ids": [6]}).encode()
    assert parse(raw, "completions", "fast", jsonspan).prompt_ids.tolist() == [7, 8]
    # A batch of one, and text in a list, take the general path.
    assert parse(b'{"prompt": [[7, 8]]}', "completions", "fast", jsonspan).prompt_ids.tolist() == [7, 8]
    text = parse(b'{"prompt": ["ab"]}', "completions", "fast", jsonspan)
    assert text.prompt_ids.tolist() == TOK.encode("ab") and not text.prompt_from_ids
    # Escaped base64 (a JSON encoder that writes "\/"): the string's value counts, as before.
    raw = b'{"prompt_token_ids_b64": "' + b64([252, 5]).replace("/", "\\/").encode() + b'"}'
    assert b"\\/" in raw
    assert parse(raw, "completions", "fast", jsonspan).prompt_ids.tolist() == [252, 5]


# ---------------------------------------------------------------- errors


TOKEN_FIELD_ERRORS = [
    # (route, raw body, param, message regex)
    ("completions", b'{"prompt_token_ids_b64": "AQAAAAIA*AAAAwAA"}', "prompt_token_ids_b64",
     r"Invalid base64 character 0x2a at byte 8 \(request body byte 34\)"),
    ("chat", b'{"messages": [], "prompt_token_ids_b64": "AQAAAAIA\xc3\xa9AAA"}', "prompt_token_ids_b64",
     r"Non-ASCII character U\+00E9 at byte 8 \(request body byte 50\)"),
    ("completions", b'{"prompt_token_ids_b64": "AQAAAA="}', "prompt_token_ids_b64", "Invalid base64 length 7: not a multiple of 4"),
    ("completions", b'{"prompt_token_ids_b64": "AQ==AAAAAAAAAAAA"}', "prompt_token_ids_b64",
     r"Misplaced padding character '=' at byte 2 \(request body byte 28\)"),
    ("completions", b'{"prompt_token_ids_b64": "AQAAAAIA"}', "prompt_token_ids_b64", "not a whole number of int32"),
    ("completions", b'{"prompt_token_ids_b64": ""}', "prompt_token_ids_b64", "holds no token ids"),
    ("completions", b'{"prompt_token_ids_b64": 12}', "prompt_token_ids_b64", "must be a base64 string"),
    ("chat", b'{"prompt_token_ids_b64": "' + b64([5, 262]).encode() + b'"}', "prompt_token_ids_b64",
     r"id 262 at index 1 is outside the vocabulary \[0, 262\)"),
    ("chat", b'{"prompt_token_ids_b64": "' + b64([5, -1]).encode() + b'"}', "prompt_token_ids_b64",
     r"id -1 at index 1 is outside the vocabulary"),
    ("chat", b'{"prompt_token_ids_b64": "' + b64([5] * 2049).encode() + b'"}', "prompt_token_ids_b64",
     "more than max_tokens=2048"),
    ("chat", b'{"prompt_token_ids": [1, 2, 262]}', "prompt_token_ids", r"'prompt_token_ids\[2\]' = 262 is outside the vocabulary \[0, 262\)"),
    ("chat", b'{"prompt_token_ids": [1, -2]}', "prompt_token_ids", r"'prompt_token_ids\[1\]' = -2 is outside"),
    ("chat", b'{"prompt_token_ids": [1, 99999999999999999999]}', "prompt_token_ids", r"\[1\]' = 99999999999999999999 is outside"),
    ("chat", b'{"prompt_token_ids": [1, 2.0]}', "prompt_token_ids", r"'prompt_token_ids\[1\]' must be an integer token id"),
    ("chat", b'{"prompt_token_ids": [1, 2e0]}', "prompt_token_ids", r"\[1\]' must be an integer token id"),
    ("chat", b'{"prompt_token_ids": [true]}', "prompt_token_ids", r"\[0\]' must be an integer token id"),
    ("chat", b'{"prompt_token_ids": [1, null]}', "prompt_token_ids", r"\[1\]' must be an integer token id"),
    ("chat", b'{"prompt_token_ids": [1, {"a": 2}]}', "prompt_token_ids", r"\[1\]' must be an integer token id"),
    ("chat", b'{"prompt_token_ids": []}', "prompt_token_ids", "must be a non-empty list of token ids"),
    ("chat", b'{"prompt_token_ids": "1, 2"}', "prompt_token_ids", "must be a non-empty list of token ids"),
    ("chat", b'{"prompt_token_ids": [5, 5, 5' + b", 5" * 2045 + b"]}", "prompt", "the prompt has 2048 tokens"),
    ("completions", b'{"prompt": [1, 300]}', "prompt", r"'prompt\[1\]' = 300 is outside the vocabulary"),
    ("completions", b'{"prompt": [[1, 2], [3]]}', "prompt", "batches are not supported"),
    ("completions", b'{"prompt": [1, "a"]}', "prompt", r"'prompt\[1\]' must be an integer token id"),
    ("completions", b'{"prompt": []}', "prompt", "must be a non-empty list of token ids"),
    # The token field twice: refused whichever copy a parser would keep.
    ("chat", b'{"prompt_token_ids_b64": "BQAAAA==", "prompt_token_ids_b64": "BgAAAA=="}', "prompt_token_ids_b64",
     r"key 'prompt_token_ids_b64' more than once \(byte 37\)"),
    ("chat", b'{"prompt_token_ids": [1], "messages": [], "prompt_token_ids": [2]}', "prompt_token_ids", "more than once"),
    ("completions", b'{"prompt": [1], "prompt": "x"}', "prompt", "more than once"),
    ("completions", b'{"prompt": [1], "disaggregated_params": null, "disaggregated_params": null}', "disaggregated_params", "more than once"),
]  # fmt: skip

BODY_ERRORS = [
    # (route, raw body, message regex): param None
    ("chat", b'{"model": "tiny", "messages": [}', r"not valid JSON: expected a value \(byte 31\)"),
    ("chat", b'{"prompt_token_ids": [1, 2,]}', r"not valid JSON: expected a value \(byte 27\)"),
    ("completions", b'{"prompt": [1, 2]} x', r"not valid JSON: trailing characters after the value \(byte 19\)"),
    ("completions", b'{"prompt": [1, 2]', r"not valid JSON: unexpected end of data \(byte 17\)"),
    ("completions", b'{"prompt_token_ids_b64": "AQAAAA==\n"}', r"not valid JSON: unescaped control character in string \(byte 34\)"),
    ("completions", b'{"prompt": [1], "temperature": NaN}', r"not valid JSON: expected a value \(byte 31\)"),
    ("completions", b'\xef\xbb\xbf{"prompt": [1]}', r"not valid JSON.*\(byte 0\)"),
    ("chat", b"\xff\xfe", r"not valid UTF-8 \(byte 0\)"),
    ("chat", b'{"messages": [{"role": "user", "content": "\xe9"}]}', r"not valid UTF-8 \(byte 43\)"),
    ("chat", b'{"prompt_token_ids_b64": "AQAA\xff"}', r"not valid UTF-8 \(byte 30\)"),
    ("chat", b"[1, 2]", "must be a JSON object"),
    ("chat", b'"x"', "must be a JSON object"),
    ("chat", b"", r"^the request body is empty: send a JSON object \(Content-Type: application/json\)$"),
    ("completions", b"\n ", r"^the request body is empty: send a JSON object"),
    # fastcore's limits (JSON_MAX_NUMBER_CHARS, JSON_MAX_DEPTH): valid JSON, still a 400 that says where.
    ("chat", b'{"seed": ' + b"9" * 5000 + b', "messages": []}', r"rejected: JSON has a number longer than the limit of 256 characters \(byte 9\)"),
    ("chat", b'{"prompt_token_ids": [1, ' + b"9" * 5000 + b"]}", r"number longer than the limit of 256 characters \(byte 25\)"),
    ("completions", b'{"prompt": [1], "user": ' + b"[" * 1000 + b"]" * 1000 + b"}", r"rejected: JSON nests arrays and objects deeper than the limit of 512 levels \(byte 535\)"),
    ("completions", b'{"prompt": [1], "user": ' + b"[" * 1100 + b"]" * 1100 + b"}", r"deeper than the limit of 512 levels \(byte 535\)"),
    ("completions", b'{"prompt": ' + b"[" * 1000 + b"1" + b"]" * 1000 + b"}", r"deeper than the limit of 512 levels \(byte 522\)"),
    ("chat", b'{"prompt_token_ids": ' + b"[" * 5000 + b"]" * 5000 + b"}", r"deeper than the limit of 512 levels \(byte 532\)"),
    ("chat", b'{"x": ' + b'{"a": ' * 600 + b"1" + b"}" * 600 + b', "prompt_token_ids": [1]}', r"deeper than the limit of 512 levels \(byte 3072\)"),
]  # fmt: skip


@pytest.mark.parametrize(("route", "raw", "param", "message"), TOKEN_FIELD_ERRORS)
def test_token_field_errors(jsonspan: ModuleType, route: str, raw: bytes, param: str, message: str) -> None:
    exc = error(raw, route, jsonspan)
    assert exc.status == 400 and exc.param == param
    assert re.search(message, exc.message), exc.message
    body = json.loads(error_body(exc.status, exc.message, param=exc.param, code=exc.code))
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == param


@pytest.mark.parametrize(("route", "raw", "message"), BODY_ERRORS)
def test_body_errors(jsonspan: ModuleType, route: str, raw: bytes, message: str) -> None:
    exc = error(raw, route, jsonspan)
    assert exc.status == 400 and exc.param is None
    assert re.search(message, exc.message), exc.message
    # The reference is a 400 too (it words syntax errors its own way, and takes NaN).
    with pytest.raises(HTTPError) as info:
        parse(raw, route, "json")
    assert info.value.status == 400


def test_nesting_limit_is_exact(jsonspan: ModuleType) -> None:
    def body(depth: int) -> bytes:  # the body object is level 1, "user" holds depth - 1 more
        return b'{"prompt": [1], "user": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"

    for loader in ("fast", "json"):
        assert parse(body(MAX_NESTING), "completions", loader, jsonspan).prompt_ids.tolist() == [1]
        with pytest.raises(HTTPError, match="deeper than the limit of 512 levels"):
            parse(body(MAX_NESTING + 1), "completions", loader, jsonspan)


def test_pysimdjson_refusals_fall_back_to_the_stdlib(jsonspan: ModuleType) -> None:
    """Valid JSON pysimdjson will not parse (beyond 64 bits, 1e400) parses as before; a lone
    surrogate (which it does not parse either) is a 400 naming the string, from both loaders."""
    raw = (b'{"prompt": [1], "seed": 18446744073709551616, "user": "\\ud83d\\ude00", "top_p": 5e-324, '
           b'"metadata": {"n": -9223372036854775809, "x": 1e400}}')  # fmt: skip
    req = parse(raw, "completions", "fast", jsonspan)
    assert comparable(req) == comparable(parse(raw, "completions", "json"))
    assert req.params.seed == 2**64 and req.body["user"] == "\U0001f600"
    lone = raw.replace(b"\\ud83d\\ude00", b"\\ud800")
    for loader in ("fast", "json"):
        with pytest.raises(HTTPError, match="'user' holds a lone surrogate") as info:
            parse(lone, "completions", loader, jsonspan)
        assert info.value.status == 400 and info.value.param == "user"


def test_client_values_in_messages_are_bounded(jsonspan: ModuleType) -> None:
    deep = b'{"prompt": [1], "logit_bias": ' + b"[" * 400 + b"]" * 400 + b"}"
    exc = error(deep, "completions", jsonspan)
    assert exc.param == "logit_bias" and len(exc.message) < 200
    exc = error(b'{"model": "' + b"m" * 100_000 + b'", "prompt": [1]}', "completions", jsonspan)
    assert exc.status == 404 and len(exc.message) < 300


def test_a_lingering_simdjson_proxy_does_not_wedge_the_parser(jsonspan: ModuleType) -> None:
    import simdjson

    parser = json_body.SIMDJSON._parser()
    kept = parser.parse(b"[1, 2]")  # a live proxy: this parser now refuses new documents
    raw = json.dumps(generation_body("chat", "list", [1, 2, 3])).encode()
    assert parse(raw, "chat", "fast", jsonspan).prompt_ids.tolist() == [1, 2, 3]
    assert isinstance(kept, simdjson.Array) and kept.as_list() == [1, 2]


# ---------------------------------------------------------------- equivalence (hypothesis)

json_scalars = (
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12)
)  # fmt: skip
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
token_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40)
bad_ids = st.lists(st.integers(-5, VOCAB + 5) | st.booleans() | st.floats(0, 10) | st.text(max_size=3) | st.none(),
                   max_size=6)  # fmt: skip
id_lists = token_ids | bad_ids | st.lists(token_ids, min_size=1, max_size=2)
b64_values = (
    token_ids.map(b64) | st.lists(st.integers(-(2**31), 2**31 - 1), max_size=4).map(b64)
    | st.text(alphabet="AQBa+/=*é\\", max_size=12) | st.none() | st.integers(0, 3)
)  # fmt: skip
messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "robot"]),
                           "content": st.text(max_size=20)}),
    max_size=3,
) | json_values  # fmt: skip
DISAGG_CHOICES = [
    None,
    GEN_PARAMS,
    {**GEN_PARAMS, "first_gen_tokens": [300]},
    {"request_type": "context_only", "disagg_request_id": 1},
    {"request_type": "other"},
]
OPTIONAL = {
    "model": st.sampled_from(["tiny", "other"]) | json_values,
    "messages": messages,
    "prompt": st.text(min_size=1, max_size=10)
    | id_lists
    | st.lists(st.text(max_size=4), min_size=1, max_size=2)
    | json_values,
    "prompt_token_ids": id_lists | json_values,
    "prompt_token_ids_b64": b64_values,
    "max_tokens": st.integers(-1, 3000) | json_values,
    "temperature": st.floats(-1, 3) | json_values,
    "top_p": st.floats(0, 1.5),
    "top_k": st.integers(-2, 300),
    "seed": st.integers(-(2**70), 2**70),
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3),
    "stop_token_ids": st.lists(st.integers(-1, VOCAB), max_size=3),
    "stream": st.booleans() | json_values,
    "stream_options": st.none() | st.fixed_dictionaries({"include_usage": st.booleans()}) | json_values,
    "n": st.sampled_from([None, 1, 2]),
    "logprobs": st.booleans() | st.integers(0, 25),
    "top_logprobs": st.integers(0, 25),
    "echo": st.booleans(),
    "disaggregated_params": st.sampled_from(DISAGG_CHOICES) | json_values,
    "user": json_values,
    "metadata": json_values,
}


@st.composite
def request_bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    route = draw(st.sampled_from(["chat", "completions"]))
    keys = draw(st.lists(st.sampled_from(sorted(OPTIONAL)), unique=True, max_size=8))
    body = {key: draw(OPTIONAL[key]) for key in keys}
    # Mostly well-formed prompts, so the checks after the prompt run too.
    form = draw(st.sampled_from(["none", "b64", "list", "text"]))
    ids = draw(token_ids)
    if form == "b64":
        body["prompt_token_ids_b64"] = b64(ids)
    elif form == "list":
        body["prompt_token_ids" if route == "chat" else "prompt"] = ids
    elif form == "text":
        body["messages" if route == "chat" else "prompt"] = LAST_MESSAGE if route == "chat" else "Hello"
    style: dict[str, Any] = draw(
        st.sampled_from([{}, {"separators": (",", ":")}, {"indent": 1}, {"ensure_ascii": False}])
    )
    try:
        raw = json.dumps(body, **style).encode()
    except UnicodeEncodeError:  # a lone surrogate with ensure_ascii=False
        raw = json.dumps(body).encode()
    if draw(st.booleans()) and b'"prompt_token_ids_b64": "' in raw:
        raw = raw.replace(b"/", b"\\/")  # an encoder that escapes solidus everywhere
    return route, raw


@FIXED_HYPOTHESIS
@given(request_bodies())
@example(("chat", json.dumps(generation_body("chat", "list", [1, 2], history=True)).encode()))
@example(("completions", json.dumps(generation_body("completions", "b64", [1, 2])).encode()))
def test_fast_loader_equals_json_loads(jsonspan: ModuleType, case: tuple[str, bytes]) -> None:
    route, raw = case
    same_outcome(raw, route, jsonspan)


@FIXED_HYPOTHESIS
@given(request_bodies(), st.data())
def test_fast_loader_equals_json_loads_on_damaged_bodies(
    jsonspan: ModuleType, case: tuple[str, bytes], data: st.DataObject
) -> None:
    """Cut, overwritten or inserted bytes: a 400 from both, or the same request (never a 500)."""
    route, raw = case
    at = data.draw(st.integers(0, len(raw)))
    damage = data.draw(st.sampled_from(["cut", "byte", "insert"]))
    byte = data.draw(
        st.sampled_from([b"[", b"{", b"}", b",", b'"', b"\\", b"\xff", b"\n", b"1", b"-", b"=", b"*"])
    )
    if damage == "cut":
        raw = raw[:at]
    elif damage == "byte":
        raw = raw[:at] + byte + raw[at + 1 :]
    else:
        raw = raw[:at] + byte + raw[at:]
    fast, ref = outcome(raw, route, "fast", jsonspan), outcome(raw, route, "json")
    if isinstance(ref, tuple) and isinstance(fast, tuple):
        assert {fast[0], ref[0]} <= {400, 404}  # which check speaks first may differ
        return
    if isinstance(fast, tuple) and "more than once" in fast[2]:
        return  # the reference silently keeps the last copy; the fast loader refuses
    assert fast == ref


# ---------------------------------------------------------------- one policy with the orchestrator


def both_loaders(raw: bytes, route: str, scanner: ModuleType) -> HTTPError:
    """The 400 the fast loader gives ``raw``; the reference gives the same one."""
    fast = error(raw, route, scanner)
    with pytest.raises(HTTPError) as info:
        parse(raw, route, "json")
    assert (info.value.status, info.value.param, info.value.message) == (fast.status, fast.param, fast.message)
    return fast


@pytest.mark.parametrize("where", ["user", "metadata", "prompt"])
def test_number_length_limit_is_exact(jsonspan: ModuleType, where: str) -> None:
    """A number of JSON_MAX_NUMBER_CHARS characters passes both loaders, one more is the scanner's
    400 with its offset, in a field the worker ignores, nested, or in the token field (general path)."""
    limit = fastcore.JSON_MAX_NUMBER_CHARS

    def body(token: bytes) -> tuple[bytes, int]:
        head = {"user": b'{"prompt": [1], "user": ', "metadata": b'{"prompt": [1], "metadata": {"a": [[',
                "prompt": b'{"prompt": [1, '}[where]  # fmt: skip
        tail = {"user": b"}", "metadata": b"]]}}", "prompt": b"]}"}[where]
        return head + token + tail, len(head)

    for token in (b"1" + b"0" * (limit - 1), b"-0." + b"5" * (limit - 3)):
        raw, _ = body(token)
        if where == "prompt":  # not a token id (the limit is not what refuses it)
            message = both_loaders(raw, "completions", jsonspan).message
            assert "outside the vocabulary" in message or "must be an integer token id" in message
        else:
            assert parse(raw, "completions", "fast", jsonspan).prompt_ids.tolist() == [1]
            assert parse(raw, "completions", "json").prompt_ids.tolist() == [1]
    for token in (b"1" + b"0" * limit, b"-0." + b"5" * (limit - 2)):
        raw, offset = body(token)
        exc = both_loaders(raw, "completions", jsonspan)
        assert exc.param is None and exc.message == (
            f"request body rejected: JSON has a number longer than the limit of {limit} characters (byte {offset})"
        )


def test_a_long_string_of_digits_is_no_number(jsonspan: ModuleType) -> None:
    raw = b'{"prompt": "' + b"7" * 1000 + b'"}'
    assert parse(raw, "completions", "fast", jsonspan).prompt_ids.size == 1001  # BOS + 1000 bytes


@pytest.mark.parametrize(
    ("key", "value"),
    [("max_tokens", "2"), ("model", '"tiny"'), ("temperature", "0.5"), ("stream", "false"), ("n", "1"),
     ("user", '"u"'), ("messages", '[{"role": "user", "content": "x"}]')],
)  # fmt: skip
def test_a_repeated_top_level_key_is_refused(jsonspan: ModuleType, key: str, value: str) -> None:
    """json.loads and pysimdjson keep the last copy, the orchestrator refuses a repeat of what it reads:
    the worker refuses any repeat at the top level, naming the key and the second copy's byte."""
    head = f'{{"messages": [{{"role": "user", "content": "hi"}}], "{key}": {value}, '.encode()
    raw = head + f'"{key}": {value}}}'.encode()
    if key == "messages":
        raw = f'{{"messages": {value}, "max_tokens": 2, "messages": {value}}}'.encode()
        head = raw[: raw.rindex(b'"messages"')]
    exc = both_loaders(raw, "chat", jsonspan)
    assert exc.param == key
    assert exc.message == (
        f"request body has the key '{key}' more than once (byte {len(head)}): parsers differ on which one counts"
    )


@pytest.mark.parametrize("parent", ["disaggregated_params", "stream_options"])
def test_a_repeated_key_inside_the_checked_objects_is_refused(jsonspan: ModuleType, parent: str) -> None:
    inner = '"request_type": "context_only", ' if parent == "disaggregated_params" else ""
    head = f'{{"prompt": [1], "{parent}": {{{inner}"include_usage": true, '.encode()
    raw = head + b'"include_usage": false}}'
    exc = both_loaders(raw, "completions", jsonspan)
    assert exc.param == parent and f"'{parent}.include_usage' more than once (byte {len(head)})" in exc.message
    # Repeats deeper (in a message) are one reading for every parser here (the last): not refused.
    deep = b'{"messages": [{"role": "user", "role": "user", "content": "x"}]}'
    assert parse(deep, "chat", "fast", jsonspan).prompt_ids.size > 0


def test_a_body_with_a_repeat_and_a_limit_is_refused_by_both_loaders(jsonspan: ModuleType) -> None:
    """Which of the two speaks may differ (the fast loader's first scan counts depth before it knows
    the keys); both are 400s that name their problem."""
    deep = b"[" * 600 + b"]" * 600
    for raw in (b'{"prompt": [1], "n": 1, "n": 1, "user": ' + deep + b"}",
                b'{"prompt": [1], "user": ' + deep + b', "n": 1, "n": 1}'):  # fmt: skip
        for loader in ("fast", "json"):
            with pytest.raises(HTTPError) as info:
                parse(raw, "completions", loader, jsonspan)
            assert info.value.status == 400
            assert "deeper than the limit" in info.value.message or "'n' more than once" in info.value.message


STRICT_FIELDS = [
    # (route, field, value as JSON): each a 400 with param = field, from both loaders
    ("chat", "n", "true"), ("chat", "n", "1.0"), ("chat", "n", "2"), ("completions", "n", '"1"'),
    ("chat", "max_tokens", "true"), ("chat", "max_tokens", "1.0"), ("chat", "max_tokens", "0"),
    ("chat", "max_completion_tokens", "false"), ("chat", "max_completion_tokens", "2.5"),
    ("completions", "max_tokens", "1e1"), ("chat", "stream", "1"), ("chat", "stream", '"true"'),
    ("chat", "temperature", "true"), ("chat", "top_p", "false"), ("chat", "temperature", '"0.5"'),
    ("chat", "logprobs", "1"), ("completions", "logprobs", "true"), ("completions", "logprobs", "1.0"),
    ("chat", "seed", "true"), ("chat", "seed", "1.5"), ("chat", "top_k", "2.0"),
    ("chat", "stop", "1"), ("chat", "stop", '["a", 2]'), ("chat", "ignore_eos", "0"),
    ("chat", "model", "5"), ("chat", "stop_token_ids", "0"), ("chat", "stop_token_ids", "true"),
    ("chat", "best_of", "true"), ("chat", "echo", "0"), ("chat", "presence_penalty", "false"),
]  # fmt: skip


@pytest.mark.parametrize(("route", "field", "value"), STRICT_FIELDS)
def test_fields_are_strictly_typed(jsonspan: ModuleType, route: str, field: str, value: str) -> None:
    prompt = '"messages": [{"role": "user", "content": "x"}]' if route == "chat" else '"prompt": [1]'
    raw = f'{{{prompt}, "{field}": {value}}}'.encode()
    assert both_loaders(raw, route, jsonspan).param == field


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"prompt": [1], "stream_options": {"include_usage": 1}}', "include_usage"),
        (b'{"prompt": [1], "disaggregated_params": {"request_type": "context_only", '
         b'"return_prompt_token_ids_b64": 1}}', "disaggregated_params"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 2, "max_tokens": "x"}',
         "max_tokens"),
    ],
)  # fmt: skip
def test_nested_and_paired_fields_are_strictly_typed(jsonspan: ModuleType, raw: bytes, param: str) -> None:
    route = "chat" if b"messages" in raw else "completions"
    assert both_loaders(raw, route, jsonspan).param == param


def test_fields_read_as_the_orchestrator_reads_them(jsonspan: ModuleType) -> None:
    """``model`` null is absent; completions has no ``max_completion_tokens`` (the orchestrator reads
    ``max_tokens`` there); chat's ``max_completion_tokens`` wins, and only it must be >= 1."""
    req = parse(b'{"prompt": [1], "model": null, "max_tokens": 3, "max_completion_tokens": 9}', "completions",
                "fast", jsonspan)  # fmt: skip
    assert req.model == "tiny" and req.params.max_tokens == 3
    chat = b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0, "max_completion_tokens": 4}'
    assert parse(chat, "chat", "fast", jsonspan).params.max_tokens == 4
    for neutral in (b'"n": 1', b'"best_of": 1', b'"echo": false', b'"presence_penalty": 0.0', b'"stop_token_ids": []'):
        assert parse(b'{"prompt": [1], ' + neutral + b"}", "completions", "fast", jsonspan).prompt_ids.size == 1

# ---------------------------------------------------------------- msgpack bodies (X-TRTLLM-Msgpack: 1)


def _without_offsets(message: str) -> str:
    """A 400's message without byte offsets: a msgpack body's JSON twin has other offsets."""
    return re.sub(r" \((request body )?byte \d+\)", "", message)


@FIXED_HYPOTHESIS
@given(request_bodies())
@example(("chat", json.dumps(generation_body("chat", "b64", [1, 2], history=True)).encode()))
@example(("completions", json.dumps(generation_body("completions", "list", [1, 2])).encode()))
def test_a_msgpack_body_is_parsed_as_its_json_twin(case: tuple[str, bytes]) -> None:
    """A msgpack body decoded once gives its JSON twin's request, or the same 400 naming the same field."""
    route, raw = case
    try:
        packed = msgspec.msgpack.encode(json.loads(raw))
    except (OverflowError, UnicodeEncodeError):  # integers beyond 64 bits, lone surrogates: not msgpack
        assume(False)
    got: Any
    try:
        got = comparable(read_body(load_msgpack_body(packed), route))
    except HTTPError as exc:
        got = (exc.status, exc.param, exc.message)
    want = outcome(raw, route, "json")
    if isinstance(want, dict) or isinstance(got, dict):
        assert got == want
        return
    assert got[:2] == want[:2] and _without_offsets(got[2]) == _without_offsets(want[2]), (got, want)


@pytest.mark.parametrize("where", ["body", "disaggregated_params"])
def test_msgpack_nesting_limit_is_the_json_limit(where: str) -> None:
    """Arrays nested to the deepest level JSON takes pass; one more is refused, as JSON is."""
    outer = 1 if where == "body" else 2  # the body is a level, and so is disaggregated_params
    for levels in (MAX_NESTING - outer, MAX_NESTING - outer + 1):
        value: Any = None
        for _ in range(levels):
            value = [value]
        body = {"x": value} if where == "body" else {"disaggregated_params": {"x": value}}
        packed = msgspec.msgpack.encode(body)
        if outer + levels <= MAX_NESTING:
            fastcore.find_span(json.dumps(body).encode(), ())  # the JSON twin passes the limit too
            assert load_msgpack_body(packed) == body
        else:
            with pytest.raises(fastcore.JSONSpanError, match="deeper than the limit"):
                fastcore.find_span(json.dumps(body).encode(), ())
            with pytest.raises(HTTPError, match="deeper than the limit of 512 levels"):
                load_msgpack_body(packed)


@pytest.mark.parametrize("parent", [None, "disaggregated_params", "stream_options"])
@pytest.mark.parametrize("entries", [2, 20, 70_000], ids=["fixmap", "map16", "map32"])
def test_a_repeated_msgpack_key_is_refused(parent: str | None, entries: int) -> None:
    """msgspec keeps the last copy, as json.loads does: a repeat is refused and named, at the
    top level and inside the objects the JSON path checks, whatever the map's header size."""
    pairs = b"".join(msgspec.msgpack.encode(f"k{i}") + b"\x01" for i in range(entries - 1))
    pairs += msgspec.msgpack.encode("k0") + b"\x02"
    header = bytes([0x80 | entries]) if entries < 16 else (
        b"\xde" + entries.to_bytes(2, "big") if entries <= 0xFFFF else b"\xdf" + entries.to_bytes(4, "big"))  # fmt: skip
    mapping = header + pairs
    raw = mapping if parent is None else b"\x81" + msgspec.msgpack.encode(parent) + mapping
    with pytest.raises(HTTPError) as info:
        load_msgpack_body(raw)
    name = "k0" if parent is None else f"{parent}.k0"
    assert info.value.status == 400 and f"the key '{name}' more than once" in info.value.message
    assert info.value.param == ("k0" if parent is None else parent)
    # Elsewhere a repeat is what json.loads makes of it too: the last copy.
    raw = b"\x81\xa4user" + mapping
    assert load_msgpack_body(raw)["user"]["k0"] == 2


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"", "not valid msgpack: it is empty"),
        (b"\xc1", "not valid msgpack: MessagePack data is malformed"),
        (b"\x81\xa1a", "not valid msgpack: Input data was truncated"),
        (b"\x81\xa1a\x01\x00", "trailing characters"),
        (b"\x91\x01", "must be a JSON object"),
        (b"\x81\x01\x02", "request body: msgpack map keys must be strings"),
        (b"\x81\xa1a\x81\x01\x02", "'a': msgpack map keys must be strings (got 1)"),
        (b"\x81\xaestream_options\x81\x01\x02", "'stream_options': msgpack map keys must be strings"),
        (b"\x81\xa1a\xc4\x01x", "'a' is a msgpack bin value"),
        (b"\x81\xa1a\x92\x01\xd4\x01\x00", "'a[1]' is a msgpack ext value"),
        (b"\x81\xa1a\xcb\x7f\xf0\x00\x00\x00\x00\x00\x00", "'a' is inf, which JSON cannot carry"),
        (b"\x81\xa1a" + b"\x91" * 100_000 + b"\xc0", "deeper than the limit of 512 levels"),
        (b"\x81\xa1a\xa2\xff\xfe", "not valid msgpack"),
    ],
)
def test_msgpack_body_errors(raw: bytes, message: str) -> None:
    with pytest.raises(HTTPError) as info:
        load_msgpack_body(raw)
    assert info.value.status == 400 and message in info.value.message, info.value.message


def test_a_msgpack_base64_error_names_no_byte_of_a_json_text() -> None:
    """The byte offset of a bad base64 character is the body's own for JSON; a msgpack body's
    message names the string's byte only (it once named a byte of the JSON text it was turned into)."""
    bad = b64([1, 2, 3])[:5] + "*" + b64([1, 2, 3])[6:]
    with pytest.raises(HTTPError) as info:
        read_body(load_msgpack_body(msgspec.msgpack.encode({"prompt_token_ids_b64": bad})), "completions")
    assert info.value.param == "prompt_token_ids_b64"
    assert "Invalid base64 character 0x2a at byte 5" in info.value.message
    assert "request body byte" not in info.value.message
    exc = error(json.dumps({"prompt_token_ids_b64": bad}).encode(), "completions")
    assert exc.message.endswith("at byte 5 (request body byte 31)")


@pytest.mark.parametrize("ids", [[1, 2, 261], [1, True], [1, 2.0], [1, 2**64 - 1], [5, -1], [], [[1, 2]], ["a"]])
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_msgpack_token_ids_decoded_as_integers_read_as_their_json_twin(ids: list[Any], route: str) -> None:
    """An array of integers decodes as TokenIds (no per-element look); anything else takes the
    general path: the same request or the same 400 as the JSON twin's."""
    from server.worker.msgpack_body import TokenIds

    field = "prompt_token_ids" if route == "chat" else "prompt"
    body = {field: ids, "messages": LAST_MESSAGE} if route == "chat" else {field: ids}
    loaded = load_msgpack_body(msgspec.msgpack.encode(body))
    integers = bool(ids) and all(type(i) is int for i in ids)
    assert (type(loaded[field]) is TokenIds) == (integers or ids == []) and loaded[field] == ids
    got: Any
    try:
        got = comparable(read_body(loaded, route))
    except HTTPError as exc:
        got = (exc.status, exc.param, exc.message)
    assert got == outcome(json.dumps(body).encode(), route, "json")
