"""OpenAI request parsing and response building for workers (no torch, no engine).

:func:`parse_request` turns the raw body of ``/v1/chat/completions`` or
``/v1/completions`` into a :class:`ParsedRequest`: validated sampling
parameters, the prompt as int32 ids (tokenized, or taken as given from
``prompt_token_ids`` / ``prompt_token_ids_b64`` / a list ``prompt``), and the
``disaggregated_params`` of docs/protocol.md. Every problem raises
:class:`server.errors.HTTPError` with a 400/404 naming the field.

The body is never ``json.loads``-ed whole: a scan of the raw bytes finds the
token field, whose ids are decoded from those bytes into an array, and only
the rest becomes Python values (see :func:`load_request_body`).

The builders (:func:`completion_body`, :func:`stream_chunk`, ...) produce the
OpenAI JSON and SSE shapes. The torch worker and a synthetic engine share
them, and so can the orchestrator when it answers from a context response.
"""

from __future__ import annotations

import json
import math
import reprlib
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import numpy as np
import simdjson

import fastcore
from fastcore import JSONSpanError
from fastcore import protocol as wire
from server import openai_shapes
from server.errors import HTTPError, check_not_empty
from server.surrogates import check_no_lone_surrogates

from .output import Delta, SamplingParams, TokenLogprob
from .tokenizer import Tokenizer

if TYPE_CHECKING:
    from .engine_api import EngineRequest

Route = Literal["chat", "completions"]

CONTEXT_ONLY = wire.CONTEXT_ONLY
GENERATION_ONLY = wire.GENERATION_ONLY
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 16


@dataclass
class DisaggParams:
    request_type: str  # "context_only" or "generation_only"
    disagg_request_id: Any = None
    return_prompt_token_ids_b64: bool = False
    first_gen_tokens: list[int] = field(default_factory=list)
    ctx_request_id: int | None = None
    ctx_info_endpoint: str | None = None
    raw: dict[str, Any] = field(default_factory=dict)


@dataclass
class ParsedRequest:
    route: Route
    # The JSON body; its token field (the one prompt_ids came from) is a RawJSON of its bytes.
    body: dict[str, Any]
    model: str
    stream: bool
    include_usage: bool
    params: SamplingParams
    # int32, 1-D; from the tokenizer or straight from the request's ids.
    prompt_ids: np.ndarray
    prompt_from_ids: bool
    disagg: DisaggParams | None
    # Chat: logprobs as {"content": [...]}; completions: the legacy columns.
    want_logprobs: bool = False
    #: vLLM's and trtllm-serve's ``cache_salt``: requests with different salts share no cached KV
    cache_salt: str | None = None

    @property
    def is_context_only(self) -> bool:
        return self.disagg is not None and self.disagg.request_type == CONTEXT_ONLY

    @property
    def is_generation_only(self) -> bool:
        return self.disagg is not None and self.disagg.request_type == GENERATION_ONLY


def bad_request(message: str, param: str | None = None) -> HTTPError:
    return HTTPError(400, message, param=param)


_BRIEF = reprlib.Repr()
_BRIEF.maxlevel = 3
_BRIEF.maxstring = 80
_BRIEF.maxother = 80


def _brief(value: Any) -> str:
    """``repr(value)`` bounded in length and depth: error messages echo client values."""
    return _BRIEF.repr(value)


# ---------------------------------------------------------------- request bodies
#
# Two loaders give the same dict (tests/test_worker_protocol.py holds them to it):
#
# - load_json_body: the stdlib reference, json.loads of the whole body;
# - load_request_body (what parse_request uses): one scan of the raw bytes
#   (fastcore.find_spans) finds the prompt's token field, which is left in the
#   body as a RawJSON and decoded later straight from the body's bytes
#   (base64: fastcore.decode_tokens on a memoryview; a list: pysimdjson into an
#   int64 buffer); the rest of the body, with that value spliced to `null`, is
#   parsed by pysimdjson into Python values (json.loads where pysimdjson refuses
#   valid JSON: integers beyond 64 bits, 1e400, lone surrogate escapes).
#
# Either way the body is strict RFC 8259 JSON or a 400 that says where it is not
# (byte offset), within fastcore's limits (nesting, number length: the policy the
# orchestrator's scanner enforces too, so a body one side passes the other never
# fails on), and without a repeated key at the top level, in
# ``disaggregated_params`` or in ``stream_options`` (json.loads and pysimdjson keep
# the last copy, the orchestrator refuses a repeat of what it reads: neither
# copy is guessed). One validating scan of the bytes pysimdjson reads checks all
# of it (_check_members).

#: Deepest nesting of arrays and objects a body may have (the body itself is level 1):
#: fastcore's policy, below json.loads' recursion limit (~1000) and pysimdjson's (1024).
MAX_NESTING = fastcore.JSON_MAX_DEPTH

#: Top-level keys found by the first scan: the prompt's token fields (which one a
#: parser keeps differs between parsers) and the internal parameters.
_SINGLE_KEYS = (wire.PROMPT_TOKEN_IDS_B64, wire.PROMPT_TOKEN_IDS, wire.PROMPT, wire.DISAGGREGATED_PARAMS)
_BODY_PATHS = ((), *((key,) for key in _SINGLE_KEYS))
#: Objects whose keys are checked for repeats, besides the body's own.
_CHECKED_OBJECTS = (wire.DISAGGREGATED_PARAMS, wire.STREAM_OPTIONS)
_OPEN_BRACE, _QUOTE, _OPEN_BRACKET, _N = b'{"[n'


class RawJSON:
    """A JSON value left as its bytes in the request body: the prompt's token ids.

    ``parse_request`` decodes it straight from ``data[start:end]``; :meth:`value`
    gives the Python value ``json.loads`` would (tests, and the rare body the
    fast decoders leave to the general path).
    """

    __slots__ = ("data", "end", "scanner", "start")

    def __init__(self, data: bytes, start: int, end: int, scanner: ModuleType) -> None:
        self.data = data
        self.start = start
        self.end = end
        self.scanner = scanner

    def value(self) -> Any:
        if self.data[self.start] != _QUOTE:
            # The body's first scan skipped this container counting brackets (so its depth is
            # checked): its numbers' lengths are checked here, on this rare general path.
            error = _limit_refusal(self.data, self.scanner)
            if error is not None:
                raise error
        return _loads(memoryview(self.data)[self.start : self.end], self.data, self.scanner)

    def __repr__(self) -> str:
        return f"RawJSON({self.end - self.start} bytes at {self.start})"


def _scan_error(raw: bytes, exc: JSONSpanError, scanner: ModuleType) -> HTTPError:
    """The 400 for a scan of ``raw`` that stopped: a limit passed, a repeated key, or malformed JSON."""
    if exc.limit is not None:
        # fastcore's policy (fastcore.limits): the orchestrator words it the same way.
        return bad_request(f"request body rejected: {exc}")
    if exc.key is not None:
        name = param = exc.key
        for parent in _CHECKED_OBJECTS:  # the repeat may be inside one of the checked objects
            try:
                span = scanner.find_span(raw, (parent,), validate=False)
            except JSONSpanError:  # the parent repeats too, later: its own repeat is the next 400
                span = None
            if span is not None and span[0] < exc.offset < span[1]:
                name, param = f"{parent}.{exc.key}", parent
                break
        return bad_request(
            f"request body has the key '{name}' more than once (byte {exc.offset}): "
            "parsers differ on which one counts",
            param,
        )
    return bad_request(f"request body is not valid JSON: {str(exc).removeprefix('JSON is malformed: ')}")


def _limit_refusal(raw: bytes, scanner: ModuleType) -> HTTPError | None:
    """The 400 for ``raw`` past fastcore's limits (byte offset), or None: within them, or malformed
    first (the caller's parser words that)."""
    try:
        scanner.find_span(raw, ())
    except JSONSpanError as exc:
        if exc.limit is not None:
            return _scan_error(raw, exc, scanner)
    return None


def _limit_error(exc: BaseException, raw: bytes, scanner: ModuleType) -> HTTPError:
    """The 400 for valid JSON that Python's parser cannot turn into values (nesting, integer length):
    past fastcore's limits, whose scan says where; Python's own limit otherwise."""
    error = _limit_refusal(raw, scanner)
    if error is not None:
        return error
    if isinstance(exc, RecursionError):  # pragma: no cover - the limits are far below Python's
        return bad_request("request body nests arrays and objects too deeply")
    return bad_request(  # pragma: no cover - as above
        f"request body holds an integer too long to convert (more than {sys.get_int_max_str_digits()} digits)"
    )


def _malformed(raw: bytes, scanner: ModuleType) -> HTTPError | None:
    """The 400 saying where ``raw`` stops being JSON or passes a limit (byte offset), or None when
    it is valid."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return bad_request(f"request body is not valid UTF-8 (byte {exc.start})")
    try:
        scanner.find_span(raw, ())
    except JSONSpanError as exc:
        return _scan_error(raw, exc, scanner)
    return None


def _member_paths(body: dict[str, Any]) -> tuple[tuple[str, ...], ...]:
    """Scanner paths of every key of ``body`` and of its checked objects: a scan for them refuses a
    repeat of any (each distinct key is requested, so each copy after the first is one)."""
    paths: list[tuple[str, ...]] = [(key,) for key in body]
    for parent in _CHECKED_OBJECTS:
        inner = body.get(parent)
        if type(inner) is dict:
            paths += [(parent, key) for key in inner]
    return tuple(paths)


def _check_members(data: bytes, body: dict[str, Any], raw: bytes, scanner: ModuleType) -> None:
    """One validating scan of ``data`` (what became ``body``; ``raw`` itself or ``raw`` with its token
    value cut to ``null``): the grammar, fastcore's limits and repeated keys (:func:`_member_paths`).

    A 400 says where in ``raw``: an error is found again by a scan of ``raw``, which holds every
    byte of ``data`` at or after the same offset.
    """
    paths = _member_paths(body)
    try:
        scanner.find_spans(data, paths)
    except JSONSpanError as exc:
        error = exc
        if data is not raw:  # the offset as in the body the client sent
            try:
                scanner.find_spans(raw, paths)
            except JSONSpanError as found:
                error = found
        raise _scan_error(raw, error, scanner) from None


def _loads(data: bytes | memoryview, raw: bytes, scanner: ModuleType) -> Any:
    """``json.loads(data)`` (a piece of ``raw``), every failure a 400."""
    try:
        return json.loads(bytes(data) if isinstance(data, memoryview) else data)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise _malformed(raw, scanner) or bad_request("request body is not valid JSON") from None
    except (RecursionError, ValueError) as exc:
        raise _limit_error(exc, raw, scanner) from None


class _Simdjson:
    """pysimdjson parsers, one per thread (a parser holds one document; its buffers are reused)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def _parser(self, fresh: bool = False) -> Any:  # simdjson.Parser (its stub overloads on recursive)
        parser = None if fresh else getattr(self._local, "parser", None)
        if parser is None:
            parser = self._local.parser = simdjson.Parser()
        return parser

    def parse(self, data: bytes | memoryview, recursive: bool) -> Any:
        try:
            return self._parser().parse(data, recursive=recursive)
        except RuntimeError as exc:
            # A proxy of the previous document still alive (held by a traceback, say)
            # blocks the parser: a fresh one replaces it.
            if not str(exc).startswith("Tried to re-use"):
                raise
            return self._parser(fresh=True).parse(data, recursive=recursive)

    def int64_list(self, data: memoryview) -> np.ndarray | None:
        """``data`` as int64 when it is a JSON array of integers within int64 and nothing else.

        None otherwise (another type, nesting, a number that is not an integer,
        malformed): the caller then takes the general path. ``as_buffer`` would
        flatten nested arrays, so the caller passes only arrays without a ``[``
        inside; the element count is checked against the array's length.
        """
        try:
            doc = self.parse(data, recursive=False)
        except (ValueError, RuntimeError):
            return None
        try:
            if not isinstance(doc, simdjson.Array):
                return None
            buffer = doc.as_buffer(of_type="i")
            count = len(doc)
        except (TypeError, ValueError, RuntimeError):
            return None
        finally:
            del doc  # no proxy outlives this call: the parser stays usable
        ids = np.frombuffer(buffer, dtype=np.int64)
        return ids if ids.size == count else None


_simdjson = _Simdjson()


def load_json_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object via ``json.loads``, or a 400 that says where it is malformed (byte offset).

    The reference the fast loader (:func:`load_request_body`) is held to, and the
    "before" of ``bench.worker``. ``json.loads`` gives the values; the policy on
    top (fastcore's limits, no repeated key) is the fast loader's, checked by the
    same scan: what ``json.loads`` alone reads but RFC 8259 does not (``NaN``)
    still passes here.
    """
    check_not_empty(raw)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        offset = len(text[: exc.pos].encode("utf-8"))
        raise bad_request(f"request body is not valid JSON: {exc.msg} (byte {offset})") from None
    except (RecursionError, ValueError) as exc:
        raise _limit_error(exc, raw, fastcore) from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    try:
        _check_members(raw, body, raw, fastcore)
    except HTTPError as exc:
        if "not valid JSON" not in exc.message:  # json.loads decides the grammar here
            raise
    return body


def _token_field(raw: bytes, route: Route, spans: list[tuple[int, int] | None]) -> int | None:
    """Index in ``_SINGLE_KEYS`` of the field the prompt's ids come from (as :func:`_prompt`
    chooses), when its value is a string (base64) or an array; None otherwise."""
    b64, ids, prompt = spans[1], spans[2], spans[3]
    if b64 is not None and raw[b64[0]] != _N:  # present and not null: the ids are here, or an error
        return 0 if raw[b64[0]] == _QUOTE else None
    if route == "chat":
        if ids is not None and raw[ids[0]] == _OPEN_BRACKET:
            return 1
        return None
    if prompt is not None and raw[prompt[0]] == _OPEN_BRACKET:
        return 2
    return None


def load_request_body(raw: bytes, route: Route, *, scanner: ModuleType | None = None) -> dict[str, Any]:
    """The body as a JSON object with the prompt's token field left as a :class:`RawJSON`.

    Same dict as :func:`load_json_body` (the token field aside), same 400s, plus:
    ``prompt_token_ids_b64``, ``prompt_token_ids``, ``prompt`` or
    ``disaggregated_params`` twice in the body is a 400 (json.loads keeps the
    last, other parsers the first: the orchestrator and the worker must not read
    different prompts). ``scanner``: a scanner twin (default: fastcore's active one).

    The first scan is ``validate=False``: it walks the top-level object with the
    full grammar and skips the insides of other values (counting their depth);
    every byte it skips is validated after, by one validating scan of the body
    with the token value spliced to ``null`` (:func:`_check_members`: grammar,
    limits, a repeated key at the top level, in ``disaggregated_params`` or
    ``stream_options``) or by the token field's strict decoder, so a malformed
    body is a 400 all the same, its offset from a validating scan.
    """
    if not isinstance(raw, bytes):
        raw = bytes(raw)
    check_not_empty(raw)
    jsonspan = scanner if scanner is not None else fastcore
    try:
        spans = jsonspan.find_spans(raw, _BODY_PATHS, validate=False)
    except JSONSpanError as exc:
        # Where the whole body first goes wrong (a validating scan), else what this scan found.
        raise _malformed(raw, jsonspan) or _scan_error(raw, exc, jsonspan) from None
    root = spans[0]
    assert root is not None
    if raw[root[0]] != _OPEN_BRACE:
        raise _malformed(raw, jsonspan) or bad_request("request body must be a JSON object")
    field = _token_field(raw, route, spans)
    rest = raw
    if field is not None:
        start, end = spans[field + 1]
        rest = jsonspan.splice(raw, ((start, end, b"null"),))
    try:
        body = _simdjson.parse(rest, recursive=True)
    except (ValueError, RuntimeError):  # ValueError includes UnicodeDecodeError
        error = _malformed(raw, jsonspan)
        if error is not None:
            raise error from None
        # Valid JSON that pysimdjson refuses: the stdlib's values, as load_json_body gives.
        body = _loads(rest, raw, jsonspan)
    _check_members(rest, body, raw, jsonspan)
    if field is not None:
        body[_SINGLE_KEYS[field]] = RawJSON(raw, start, end, jsonspan)
    return body


# ---------------------------------------------------------------- msgpack bodies
#
# trtllm-serve's orchestrator (TRTLLM_SERVE_ENABLE_MSGSPEC=1) sends leg bodies as
# msgpack, flagged ``X-TRTLLM-Msgpack: 1`` with Content-Type application/json.
# msgpack_to_json turns such a body into the JSON bytes of the same object, which
# then go through parse_request like any JSON body: one validation, the same 400s
# naming the same fields. Before that it holds msgpack to the JSON policy: a map
# (object) at the top, string keys, no key twice at the top level, in
# ``disaggregated_params`` or ``stream_options`` (msgspec keeps the last copy, as
# json.loads does), nesting within fastcore.JSON_MAX_DEPTH, and only values JSON
# can carry (no bin, ext, NaN or infinity). Number lengths need no check: msgpack
# integers are at most 64 bits and floats doubles, far inside
# fastcore.JSON_MAX_NUMBER_CHARS.

_MSGPACK_MAP = msgspec.msgpack.Decoder(dict[str, msgspec.Raw])
_MSGPACK_ITEMS = msgspec.msgpack.Decoder(list[msgspec.Raw])
_MSGPACK_ANY = msgspec.msgpack.Decoder()
#: list elements that need no look inside (floats do: NaN and infinity)
_LEAF_TYPES = frozenset({str, int, bool, type(None)})


def _msgpack_map_header(data: bytes | memoryview) -> tuple[int, int] | None:
    """(entries, header bytes) of the msgpack map ``data`` starts with, None when it is no map."""
    head = data[0]
    if 0x80 <= head <= 0x8F:
        return head & 0x0F, 1
    if head == 0xDE:
        return int.from_bytes(data[1:3], "big"), 3
    if head == 0xDF:
        return int.from_bytes(data[1:5], "big"), 5
    return None


def _msgpack_repeated_key(data: bytes | memoryview, entries: int, header: int) -> str:
    """The first key the map ``data`` holds twice: its entries read again as a flat array of
    2 * ``entries`` undecoded items (an array header in place of the map's)."""
    count = 2 * entries
    if count <= 15:
        array_header = bytes([0x90 | count])
    elif count <= 0xFFFF:
        array_header = b"\xdc" + count.to_bytes(2, "big")
    else:
        array_header = b"\xdd" + count.to_bytes(4, "big")
    items = _MSGPACK_ITEMS.decode(array_header + bytes(data[header:]))
    seen: set[str] = set()
    for item in items[::2]:
        key = msgspec.msgpack.decode(item)
        if key in seen:
            return str(key)
        seen.add(key)
    raise AssertionError("a map with fewer keys than entries repeats one")  # pragma: no cover


def _msgpack_map(data: bytes | memoryview, parent: str | None) -> dict[str, msgspec.Raw]:
    """The msgpack map ``data`` (the body, or the value of its key ``parent``) with its values
    undecoded; a 400 for anything else, for a key that is not a string, or a repeated key."""
    where = "request body" if parent is None else f"'{parent}'"
    try:
        members = _MSGPACK_MAP.decode(data)
    except msgspec.ValidationError as exc:
        if "Expected `object`" in str(exc):
            what = "a JSON object (msgpack map)" if parent is None else "an object"
            raise bad_request(f"{where} must be {what}", parent) from None
        raise bad_request(f"{where}: msgpack map keys must be strings", parent) from None
    except msgspec.DecodeError as exc:
        raise bad_request(f"request body is not valid msgpack: {exc}", parent) from None
    except RecursionError:
        raise _msgpack_too_deep(parent) from None
    header = _msgpack_map_header(data)
    assert header is not None  # it decoded as a map
    if len(members) < header[0]:
        key = _msgpack_repeated_key(data, *header)
        name = key if parent is None else f"{parent}.{key}"
        raise bad_request(
            f"request body has the key '{name}' more than once: parsers differ on which one counts",
            key if parent is None else parent,
        )
    return members


def _msgpack_too_deep(param: str | None) -> HTTPError:
    return bad_request(
        f"request body rejected: msgpack nests arrays and maps deeper than the limit of {MAX_NESTING} levels",
        param,
    )


def _check_msgpack_value(value: Any, depth: int, path: str, param: str) -> None:
    """``value`` (at ``depth``, the body being 1) is JSON's: a 400 naming ``path`` otherwise.

    A list of strings, integers, booleans and nulls (a prompt's token ids) is
    looked at in one pass over its element types, not element by element.
    """
    kind = type(value)
    if kind is list or kind is dict:
        if depth > MAX_NESTING:
            raise _msgpack_too_deep(param)
        if kind is list:
            if not set(map(type, value)) <= _LEAF_TYPES:
                for i, item in enumerate(value):
                    _check_msgpack_value(item, depth + 1, f"{path}[{i}]", param)
            return
        for key, item in value.items():
            if type(key) is not str:
                raise bad_request(f"'{path}': msgpack map keys must be strings (got {_brief(key)})", param)
            _check_msgpack_value(item, depth + 1, f"{path}.{key}", param)
    elif kind is float:
        if not math.isfinite(value):
            raise bad_request(f"'{path}' is {value}, which JSON cannot carry", param)
    elif kind not in _LEAF_TYPES:
        what = "bin" if kind is bytes else "ext" if kind is msgspec.msgpack.Ext else kind.__name__
        raise bad_request(f"'{path}' is a msgpack {what} value, which JSON cannot carry", param)


def _msgpack_value(data: msgspec.Raw, depth: int, path: str, param: str) -> Any:
    try:
        value = _MSGPACK_ANY.decode(data)
    except RecursionError:
        raise _msgpack_too_deep(param) from None
    except msgspec.DecodeError as exc:  # a value's insides (its strings' UTF-8) are read only here
        raise bad_request(f"request body is not valid msgpack: {exc} (in '{path}')", param) from None
    _check_msgpack_value(value, depth, path, param)
    return value


def msgpack_to_json(raw: bytes) -> bytes:
    """The msgpack body ``raw`` as the JSON bytes of the same object, for :func:`parse_request`;
    a 400 where msgpack says what JSON cannot or fastcore's JSON policy refuses."""
    if not raw:
        raise bad_request("request body is not valid msgpack: it is empty")
    body: dict[str, Any] = {}
    for key, data in _msgpack_map(raw, None).items():
        if key in _CHECKED_OBJECTS and _msgpack_map_header(memoryview(data)) is not None:
            # Two levels of nesting are the body and this object: its values start at depth 3.
            body[key] = {
                name: _msgpack_value(item, 3, f"{key}.{name}", key)
                for name, item in _msgpack_map(memoryview(data), key).items()
            }
        else:
            body[key] = _msgpack_value(data, 2, key, key)
    return msgspec.json.encode(body)


def _int_field(
    body: dict[str, Any], name: str, *, minimum: int | None = None, maximum: int | None = None
) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise bad_request(f"'{name}' must be an integer", name)
    if minimum is not None and value < minimum:
        raise bad_request(f"'{name}' must be >= {minimum}, got {value}", name)
    if maximum is not None and value > maximum:
        raise bad_request(f"'{name}' must be <= {maximum}, got {value}", name)
    return value


def _float_field(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise bad_request(f"'{name}' must be a number", name)
    if not low <= value <= high:
        raise bad_request(f"'{name}' must be between {low} and {high}, got {value}", name)
    return float(value)


def _bool_field(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be a boolean", name)
    return value


def _checked_ids(ids: np.ndarray, name: str, vocab_size: int) -> np.ndarray:
    """int64 ids from a JSON list, range-checked as :func:`_ids_from_list` does, as int32."""
    if ids.size == 0:
        raise bad_request(f"'{name}' must be a non-empty list of token ids", name)
    unsigned = ids.view(np.uint64)  # negatives wrap to huge values: one comparison checks both ends
    if unsigned.max() >= vocab_size:
        i = int(np.argmax(unsigned >= vocab_size))
        raise bad_request(f"'{name}[{i}]' = {int(ids[i])} is outside the vocabulary [0, {vocab_size})", name)
    return ids.astype(np.int32)


def _raw_int_list(value: RawJSON) -> np.ndarray | None:
    """A flat JSON list of integers straight from the body's bytes as int64, or None."""
    if value.data.find(b"[", value.start + 1, value.end) != -1:
        return None  # nested: as_buffer would flatten it
    return _simdjson.int64_list(memoryview(value.data)[value.start : value.end])


def _ids_from_list(value: Any, name: str, vocab_size: int) -> np.ndarray:
    if isinstance(value, RawJSON):
        ids = _raw_int_list(value)
        if ids is not None:
            return _checked_ids(ids, name, vocab_size)
        value = value.value()  # anything else: the general path, with its messages
    if not isinstance(value, list) or not value:
        raise bad_request(f"'{name}' must be a non-empty list of token ids", name)
    for i, t in enumerate(value):
        if not isinstance(t, int) or isinstance(t, bool):
            raise bad_request(f"'{name}[{i}]' must be an integer token id", name)
        if not 0 <= t < vocab_size:
            raise bad_request(f"'{name}[{i}]' = {t} is outside the vocabulary [0, {vocab_size})", name)
    return np.asarray(value, dtype=np.int32)


def _decode_b64(value: Any, max_context: int) -> np.ndarray:
    name = wire.PROMPT_TOKEN_IDS_B64
    if isinstance(value, RawJSON):
        inner = memoryview(value.data)[value.start + 1 : value.end - 1]
        try:
            return fastcore.decode_tokens(inner, max_tokens=max_context)
        except (ValueError, OverflowError):
            # Escapes, non-ASCII or bad data: the string's value decides, and gives the message.
            text = value.value()
            try:
                return fastcore.decode_tokens(text, max_tokens=max_context)
            except (ValueError, OverflowError) as exc:
                message = f"'{name}' is invalid: {exc}"
                offset = getattr(exc, "offset", None)
                if offset is not None and b"\\" not in inner:
                    # Without escapes, the string's byte i is the body's byte start + 1 + i.
                    message += f" (request body byte {value.start + 1 + offset})"
                raise bad_request(message, name) from None
    if not isinstance(value, str):
        raise bad_request(f"'{name}' must be a base64 string", name)
    try:
        return fastcore.decode_tokens(value, max_tokens=max_context)
    except (ValueError, OverflowError) as exc:  # TokenDecodeError is a ValueError; it names the byte offset
        raise bad_request(f"'{name}' is invalid: {exc}", name) from None


def _ids_from_b64(value: Any, vocab_size: int, max_context: int) -> np.ndarray:
    """``prompt_token_ids_b64`` -> int32 array via ``fastcore.decode_tokens``: no Python list.

    ``value``: the string, or the :class:`RawJSON` of it in the body (decoded from
    the body's bytes: no ``str`` either).
    """
    name = wire.PROMPT_TOKEN_IDS_B64
    ids = _decode_b64(value, max_context)
    if ids.size == 0:
        raise bad_request(f"'{name}' holds no token ids", name)
    unsigned = ids.view(np.uint32)  # negatives wrap to huge values: one comparison checks both ends
    if unsigned.max() >= vocab_size:
        i = int(np.argmax(unsigned >= vocab_size))
        raise bad_request(
            f"'{name}' id {int(ids[i])} at index {i} is outside the vocabulary [0, {vocab_size})", name
        )
    return ids


def _parse_disagg(body: dict[str, Any], vocab_size: int) -> DisaggParams | None:
    name = wire.DISAGGREGATED_PARAMS
    raw = body.get(name)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise bad_request(f"'{name}' must be an object", name)
    kind = raw.get(wire.REQUEST_TYPE)
    if kind not in wire.REQUEST_TYPES:
        raise bad_request(
            f"'{name}.request_type' must be '{CONTEXT_ONLY}' or '{GENERATION_ONLY}', got {_brief(kind)}", name
        )
    params = DisaggParams(request_type=kind, disagg_request_id=raw.get(wire.DISAGG_REQUEST_ID), raw=raw)
    want_b64 = raw.get(wire.RETURN_PROMPT_TOKEN_IDS_B64)
    if want_b64 is not None and type(want_b64) is not bool:
        raise bad_request(f"'{name}.return_prompt_token_ids_b64' must be a boolean", name)
    params.return_prompt_token_ids_b64 = want_b64 is True
    if kind == GENERATION_ONLY:
        first = raw.get(wire.FIRST_GEN_TOKENS)
        if not isinstance(first, list) or not first:
            raise bad_request(f"'{name}.first_gen_tokens' must be a non-empty list of token ids", name)
        params.first_gen_tokens = _ids_from_list(first, f"{name}.first_gen_tokens", vocab_size).tolist()
        ctx_id = raw.get(wire.CTX_REQUEST_ID)
        if ctx_id is not None and (not isinstance(ctx_id, int) or isinstance(ctx_id, bool)):
            raise bad_request(f"'{name}.ctx_request_id' must be an integer", name)
        params.ctx_request_id = ctx_id
        endpoint = raw.get(wire.CTX_INFO_ENDPOINT)
        if endpoint is not None and not isinstance(endpoint, str):
            raise bad_request(f"'{name}.ctx_info_endpoint' must be a string", name)
        params.ctx_info_endpoint = endpoint
    return params


def _stop_strings(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad_request("'stop' must be a non-empty string or a list of non-empty strings", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' may hold at most {MAX_STOP_STRINGS} strings", "stop")
    return stop


def _logprobs(body: dict[str, Any], route: Route) -> int | None:
    if route == "chat":
        if not _bool_field(body, "logprobs"):
            if body.get("top_logprobs") is not None:
                raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
            return None
        return _int_field(body, "top_logprobs", minimum=0, maximum=MAX_TOP_LOGPROBS) or 0
    value = body.get("logprobs")
    if value is None:
        return None
    return _int_field(body, "logprobs", minimum=0, maximum=MAX_TOP_LOGPROBS)


def _prompt(
    body: dict[str, Any],
    route: Route,
    tokenizer: Tokenizer,
    disagg: DisaggParams | None,
    max_context: int,
) -> tuple[np.ndarray, bool]:
    vocab = tokenizer.vocab_size
    if body.get(wire.PROMPT_TOKEN_IDS_B64) is not None:
        return _ids_from_b64(body[wire.PROMPT_TOKEN_IDS_B64], vocab, max_context), True
    if route == "chat" and body.get(wire.PROMPT_TOKEN_IDS) is not None:
        return _ids_from_list(body[wire.PROMPT_TOKEN_IDS], wire.PROMPT_TOKEN_IDS, vocab), True
    if route == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, RawJSON):
            ids = _raw_int_list(prompt)
            if ids is not None:
                return _checked_ids(ids, "prompt", vocab), True
            prompt = prompt.value()  # a batch, strings, floats...: the general path below
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, list):
            if prompt and not isinstance(prompt[0], int):
                raise bad_request(
                    "'prompt' must be a string or a list of token ids; batches are not supported", "prompt"
                )
            return _ids_from_list(prompt, "prompt", vocab), True
        if disagg is not None and disagg.request_type == GENERATION_ONLY:
            raise bad_request(
                "a generation_only request must carry the prompt as token ids "
                "('prompt' as a list of ids, or 'prompt_token_ids_b64')",
                "prompt",
            )
        if not isinstance(prompt, str) or not prompt:
            raise bad_request("'prompt' must be a non-empty string or a list of token ids", "prompt")
        return np.asarray(tokenizer.encode(prompt), dtype=np.int32), False
    if disagg is not None and disagg.request_type == GENERATION_ONLY:
        raise bad_request(
            "a generation_only request must carry the prompt as token ids "
            "('prompt_token_ids' or 'prompt_token_ids_b64')",
            wire.PROMPT_TOKEN_IDS,
        )
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_request(f"'messages[{i}]' must be an object", "messages")
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from None
    except RecursionError:  # a template walking deeply nested content
        raise bad_request("'messages' nest too deeply for the chat template", "messages") from None
    return np.asarray(tokenizer.encode(text, add_special_tokens=False), dtype=np.int32), False


# Fields this worker does not implement, with the values that mean "off": anything
# else is refused rather than silently ignored. A value matches by type too (``true``
# is not 1, ``0.0`` is not ``false``).
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "logit_bias": (None, {}),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "tools": (None, []),
    "response_format": (None, {"type": "text"}),
}


def _is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    return any(type(value) is type(off) and value == off for off in neutral)


def _token_limit(body: dict[str, Any], route: Route) -> tuple[str, int | None]:
    """The request's token limit and the field it came from, read as the orchestrator reads it
    (fastcore's read_client_request): chat checks both fields' types and the first set one
    counts (``max_completion_tokens``), completions has ``max_tokens`` only."""
    tokens = _int_field(body, wire.MAX_TOKENS)
    if route == "chat":
        completion = _int_field(body, wire.MAX_COMPLETION_TOKENS)
        if completion is not None:
            tokens = completion
            key = wire.MAX_COMPLETION_TOKENS
        else:
            key = wire.MAX_TOKENS
    else:
        key = wire.MAX_TOKENS
    if tokens is not None and tokens < 1:
        raise bad_request(f"'{key}' must be >= 1, got {tokens}", key)
    return key, tokens


def prompt_ids_members(prompt_ids: np.ndarray, *, b64: bool) -> list[bytes]:
    """A context response's prompt-id members (docs/protocol.md (2)), as pieces of JSON text to append.

    The base64 form goes from the int32 array to base64 bytes
    (``fastcore.encode_tokens``) and into the body as they are: no Python
    ``str``, no pass of ``json.dumps``' escape scan over ~4/3 bytes per id
    (base64 never needs escaping), and no copy until :func:`dump_with_members`
    joins the pieces into the one body allocation. The list form is what a
    worker without the fast path sends.
    """
    if b64:
        return [_B64_MEMBERS_OPEN, fastcore.encode_tokens(prompt_ids), b'"']
    return [_LIST_MEMBER_OPEN, json.dumps(prompt_ids.tolist()).encode()]


_B64_MEMBERS_OPEN = f', "{wire.PROMPT_TOKEN_IDS}": null, "{wire.PROMPT_TOKEN_IDS_B64}": "'.encode()
_LIST_MEMBER_OPEN = f', "{wire.PROMPT_TOKEN_IDS}": '.encode()


def dump_with_members(body: dict[str, Any], members: list[bytes]) -> bytes:
    """``json.dumps(body)`` with ``members`` (JSON text starting with a comma) before its closing brace."""
    data = json.dumps(body).encode()
    return b"".join([memoryview(data)[:-1], *members, b"}"]) if members else data


def parse_request(
    raw: bytes,
    route: Route,
    *,
    tokenizer: Tokenizer,
    model_name: str,
    max_context: int,
    loader: Literal["fast", "json"] = "fast",
    scanner: ModuleType | None = None,
) -> ParsedRequest:
    """The request in ``raw`` (the body as received), or an :class:`HTTPError` (400/404).

    ``loader``: ``"fast"`` (:func:`load_request_body`: the token ids decoded from
    the body's bytes) or ``"json"`` (:func:`load_json_body`, the stdlib reference
    the tests and ``bench.worker`` compare it with); both give the same result.
    ``scanner``: the span scanner twin of the fast loader (default: the active one).
    """
    body = load_request_body(raw, route, scanner=scanner) if loader == "fast" else load_json_body(raw)
    check_no_lone_surrogates(raw, body, lazy=RawJSON)
    # Every field is read strictly, by type (no bool for a number, no 1.0 for an int), and as
    # the orchestrator reads the ones it acts on: a body is never read two ways.
    model = body.get("model")
    if model is None:  # absent or null, as the orchestrator reads it
        model = model_name
    elif type(model) is not str:
        raise bad_request("'model' must be a string", "model")
    if model != model_name:
        raise HTTPError(404, f"model {_brief(model)} does not exist; the model served is {model_name!r} (GET /v1/models lists it)",
                        param="model", code="model_not_found")  # fmt: skip
    for name, neutral in _UNSUPPORTED.items():
        if not _is_neutral(body.get(name), neutral):
            raise bad_request(f"'{name}' is not supported by this worker (got {_brief(body[name])})", name)
    n = body.get("n")
    if n is not None and (type(n) is not int or n != 1):
        raise bad_request(
            f"'n' must be the integer 1 (got {_brief(n)}): this worker returns one choice per request", "n"
        )
    stream = _bool_field(body, "stream")
    stream_options = body.get(wire.STREAM_OPTIONS)
    include_usage = False
    if stream_options is not None:
        if not isinstance(stream_options, dict):
            raise bad_request("'stream_options' must be an object", wire.STREAM_OPTIONS)
        include_usage = _bool_field(stream_options, wire.INCLUDE_USAGE)
    key, max_tokens = _token_limit(body, route)
    disagg = _parse_disagg(body, tokenizer.vocab_size)
    prompt_ids, from_ids = _prompt(body, route, tokenizer, disagg, max_context)
    if prompt_ids.size >= max_context:
        raise bad_request(
            f"the prompt has {prompt_ids.size} tokens; this model's context is {max_context} tokens "
            "(prompt plus at least one generated token)",
            "messages" if route == "chat" and not from_ids else "prompt",
        )
    room = max_context - int(prompt_ids.size)
    if max_tokens is None:
        max_tokens = room
    elif max_tokens > room:
        raise bad_request(
            f"{key} ({max_tokens}) plus the prompt ({prompt_ids.size} tokens) exceeds "
            f"this model's context of {max_context} tokens",
            key,
        )
    stop_token_ids = body.get("stop_token_ids")
    if stop_token_ids is None or stop_token_ids == []:
        stop_token_ids = []
    else:
        stop_token_ids = _ids_from_list(stop_token_ids, "stop_token_ids", tokenizer.vocab_size).tolist()
    top_k = _int_field(body, "top_k", minimum=-1)
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=_float_field(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_float_field(body, "top_p", 1.0, 0.0, 1.0),
        top_k=0 if top_k is None or top_k < 0 else top_k,
        seed=_int_field(body, "seed"),
        stop=_stop_strings(body),
        stop_token_ids=stop_token_ids,
        ignore_eos=_bool_field(body, "ignore_eos"),
        logprobs=_logprobs(body, route),
    )
    if params.top_p == 0.0:
        raise bad_request("'top_p' must be greater than 0", "top_p")
    return ParsedRequest(
        route=route,
        body=body,
        model=model_name,
        stream=stream,
        include_usage=include_usage,
        params=params,
        prompt_ids=prompt_ids,
        prompt_from_ids=from_ids,
        disagg=disagg,
        want_logprobs=params.logprobs is not None,
        cache_salt=_cache_salt(body),
    )


def _cache_salt(body: dict[str, Any]) -> str | None:
    """``cache_salt`` as vLLM and trtllm-serve read it: absent or null is none; anything but a
    string with a non-blank character is a 400 (their wording)."""
    salt = body.get(wire.CACHE_SALT)
    if salt is None:
        return None
    if type(salt) is not str or not salt.strip():
        raise bad_request(
            f"Parameter '{wire.CACHE_SALT}' must be a non-empty string if provided (got {_brief(salt)})",
            wire.CACHE_SALT,
        )
    return salt


# ---------------------------------------------------------------- responses


def new_response_id(route: Route) -> str:
    return ("chatcmpl-" if route == "chat" else "cmpl-") + uuid.uuid4().hex


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {
        wire.PROMPT_TOKENS: prompt_tokens,
        wire.COMPLETION_TOKENS: completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        # OpenAI's field (trtllm-serve's UsageInfo has it too): prompt tokens served from the prefix cache
        wire.PROMPT_TOKENS_DETAILS: {wire.CACHED_TOKENS: cached_tokens},
    }


def request_usage(req: ParsedRequest, completion_tokens: int, engine_req: EngineRequest) -> dict[str, Any]:
    """A request's ``usage``; ``cached_tokens``: the prompt tokens this worker's prefix cache served
    (``engine_req.cached_prefix``).

    A generation leg that imported its context worker's KV reports that worker's count instead,
    from the context leg's usage the orchestrator relays (``disaggregated_params.ctx_usage``), as
    trtllm-serve's generation workers do: the context worker prefilled the client's prompt. One
    that recomputed the prefill (the KV unreachable or not the prompt's) reports its own. A
    ``cached_tokens`` there that is not a non-negative integer is ignored."""
    cached = engine_req.cached_prefix
    if engine_req.kv_imported and req.disagg is not None:
        ctx_usage = req.disagg.raw.get(wire.CTX_USAGE)
        details = ctx_usage.get(wire.PROMPT_TOKENS_DETAILS) if isinstance(ctx_usage, dict) else None
        value = details.get(wire.CACHED_TOKENS) if isinstance(details, dict) else None
        if type(value) is int and value >= 0:
            cached = value
    prompt_tokens = int(req.prompt_ids.size)
    return usage_body(prompt_tokens, completion_tokens, min(cached, prompt_tokens))


def chat_logprobs(logprobs: list[TokenLogprob], tokenizer: Tokenizer) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in logprobs
        ]
    }


def completion_logprobs(
    logprobs: list[TokenLogprob], tokenizer: Tokenizer, text_offset: int = 0
) -> dict[str, Any]:
    tokens, offsets, top = [], [], []
    for lp in logprobs:
        piece = tokenizer.decode([lp.token_id])
        tokens.append(piece)
        offsets.append(text_offset)
        text_offset += len(piece)
        top.append({tokenizer.decode([t]): v for t, v in lp.top})
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": top,
        "text_offset": offsets,
    }


def _logprobs_field(
    route: Route, logprobs: list[TokenLogprob] | None, tokenizer: Tokenizer, text_offset: int = 0
) -> dict[str, Any] | None:
    if logprobs is None:
        return None
    if route == "chat":
        return chat_logprobs(logprobs, tokenizer)
    return completion_logprobs(logprobs, tokenizer, text_offset)


def completion_body(
    *,
    route: Route,
    response_id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None,
    usage: dict[str, Any],
    logprobs: list[TokenLogprob] | None = None,
    tokenizer: Tokenizer | None = None,
) -> dict[str, Any]:
    """A whole (non-streamed) ``chat.completion`` or ``text_completion`` object."""
    lp = _logprobs_field(route, logprobs, tokenizer) if tokenizer is not None else None
    return openai_shapes.answer_object(chat=route == "chat", response_id=response_id, created=created,
                                       model=model, text=text, finish_reason=finish_reason, usage=usage,
                                       logprobs=lp)  # fmt: skip


def stream_chunk(
    *,
    route: Route,
    response_id: str,
    created: int,
    model: str,
    text: str | None = None,
    role: bool = False,
    finish_reason: str | None = None,
    logprobs: list[TokenLogprob] | None = None,
    tokenizer: Tokenizer | None = None,
    text_offset: int = 0,
) -> dict[str, Any]:
    """One SSE chunk (:func:`server.openai_shapes.stream_chunk`) with the engine's logprobs in wire shape."""
    lp = _logprobs_field(route, logprobs, tokenizer, text_offset) if tokenizer is not None else None
    return openai_shapes.stream_chunk(chat=route == "chat", response_id=response_id, created=created,
                                      model=model, text=text, role=role, finish_reason=finish_reason,
                                      logprobs=lp)  # fmt: skip


def usage_chunk(
    *, route: Route, response_id: str, created: int, model: str, usage: dict[str, Any]
) -> dict[str, Any]:
    return openai_shapes.usage_chunk(
        chat=route == "chat", response_id=response_id, created=created, model=model, usage=usage
    )


sse_event = openai_shapes.sse_event
SSE_DONE = openai_shapes.SSE_DONE


class StreamWriterState:
    """Builds the SSE events of one response from engine deltas.

    Shared rules keep a generation worker's stream identical to a single
    worker's: the chat role chunk first, one chunk per delta that carries
    text (or logprobs), a final chunk with the finish reason and an empty
    delta, the usage chunk when asked, then ``[DONE]``.
    """

    def __init__(self, req: ParsedRequest, tokenizer: Tokenizer, response_id: str | None = None) -> None:
        self.req = req
        self.tokenizer = tokenizer
        self.response_id = response_id or new_response_id(req.route)
        self.created = int(time.time())
        self.text_offset = 0

    def _common(self) -> dict[str, Any]:
        return {"route": self.req.route, "response_id": self.response_id, "created": self.created,
                "model": self.req.model}  # fmt: skip

    def start(self) -> bytes:
        if self.req.route == "chat":
            return sse_event(stream_chunk(**self._common(), text="", role=True))
        return b""

    def delta(self, delta: Delta) -> bytes:
        out = b""
        want_lp = self.req.want_logprobs and bool(delta.logprobs)
        if delta.text or want_lp:
            out += sse_event(
                stream_chunk(
                    **self._common(),
                    text=delta.text,
                    logprobs=delta.logprobs if self.req.want_logprobs else None,
                    tokenizer=self.tokenizer,
                    text_offset=self.text_offset,
                )
            )
            self.text_offset += len(delta.text)
        if delta.finish_reason is not None:
            text = None if self.req.route == "chat" else ""
            out += sse_event(stream_chunk(**self._common(), text=text, finish_reason=delta.finish_reason))
        return out

    def end(self, usage: dict[str, Any]) -> bytes:
        out = b""
        if self.req.include_usage:
            out += sse_event(usage_chunk(**self._common(), usage=usage))
        return out + SSE_DONE


__all__ = [
    "CONTEXT_ONLY",
    "GENERATION_ONLY",
    "MAX_NESTING",
    "SSE_DONE",
    "DisaggParams",
    "ParsedRequest",
    "RawJSON",
    "StreamWriterState",
    "completion_body",
    "load_json_body",
    "load_request_body",
    "msgpack_to_json",
    "new_response_id",
    "parse_request",
    "request_usage",
    "sse_event",
    "stream_chunk",
    "usage_body",
    "usage_chunk",
]
