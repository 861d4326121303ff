"""A JSON request body read into Python values, its prompt's token field left as bytes.

:class:`JSONBody` is the worker's loader (``JSON_BODY.load(raw, route)``, on the
active scanner twin; tests choose the other by a subclass). It reads the body
with

1. one validating scan of the raw bytes (``find_spans``): RFC 8259 grammar and
   UTF-8, fastcore's limits (nesting, number length: the policy the
   orchestrator's scanner enforces too, so a body one side passes the other
   never fails on), no repeated token field or ``disaggregated_params``, and the
   spans of the prompt's token fields;
2. one pysimdjson parse of the body with the chosen token field's value cut to
   ``null`` (a copy of the rest of the body: cheaper than letting the parser walk
   40k ids), which gives the other fields' values and, counting members, any
   repeated key at the top level, in ``disaggregated_params`` or in
   ``stream_options`` (json.loads and pysimdjson keep the last copy, the
   orchestrator refuses a repeat of what it reads: neither copy is guessed);

the token field becomes a :class:`RawJSON` of its bytes, decoded later
straight from them (:mod:`server.worker.request`: base64 by the codec on a
memoryview, a list by pysimdjson into an int64 buffer). Valid JSON that
pysimdjson refuses (integers beyond 64 bits, 1e400, lone surrogate escapes)
takes ``json.loads``' values instead.

Every malformed body is a 400 that says where (byte offset), worded by a
validating scan; :func:`load_json_body` (``json.loads`` of the whole body, the
policy checked by the same scan) is the reference the tests hold the loader
to, and the "before" of ``bench.worker``.
"""

from __future__ import annotations

import json
import reprlib
import sys
import threading
from types import ModuleType
from typing import Any, ClassVar, Literal

import numpy as np
import simdjson

import fastcore
from fastcore import JSONSpanError
from fastcore import protocol as wire
from server.errors import HTTPError, check_not_empty
from server.surrogates import check_no_lone_surrogates

Route = Literal["chat", "completions"]

#: Deepest nesting of arrays and objects a body may have (the body itself is level 1):
#: fastcore's policy, below json.loads' recursion limit (~1000) and pysimdjson's (1024).
MAX_NESTING = fastcore.JSON_MAX_DEPTH

#: Top-level keys the scan finds: the prompt's token fields (which one a parser keeps differs
#: between parsers) and the internal parameters.
SINGLE_KEYS = (wire.PROMPT_TOKEN_IDS_B64, wire.PROMPT_TOKEN_IDS, wire.PROMPT, wire.DISAGGREGATED_PARAMS)
_BODY_PATHS = ((), *((key,) for key in SINGLE_KEYS))
#: Objects whose keys are checked for repeats, besides the body's own.
CHECKED_OBJECTS = (wire.DISAGGREGATED_PARAMS, wire.STREAM_OPTIONS)
_OPEN_BRACE, _QUOTE, _OPEN_BRACKET, _N = b'{"[n'


def bad_request(message: str, param: str | None = None) -> HTTPError:
    return HTTPError(400, message, param=param)


_BRIEF = reprlib.Repr()
_BRIEF.maxlevel = 3
_BRIEF.maxstring = 80
_BRIEF.maxother = 80


def brief(value: Any) -> str:
    """``repr(value)`` bounded in length and depth: error messages echo client values."""
    return _BRIEF.repr(value)


class RawJSON:
    """A JSON value left as its bytes in the request body: the prompt's token ids.

    The reader decodes it straight from ``data[start:end]``; :meth:`value` gives
    the Python value ``json.loads`` would (tests, and the rare body the fast
    decoders leave to the general path). The body's scan validated these bytes,
    limits included.
    """

    __slots__ = ("data", "end", "start")

    def __init__(self, data: bytes, start: int, end: int) -> None:
        self.data = data
        self.start = start
        self.end = end

    def value(self) -> Any:
        return json.loads(self.data[self.start : self.end])

    def __repr__(self) -> str:
        return f"RawJSON({self.end - self.start} bytes at {self.start})"


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

    def object_counted(self, data: bytes) -> tuple[dict[str, Any], bool]:
        """The JSON object ``data`` as a dict (the last copy of a repeated key, as json.loads), and
        whether a key repeats at its top level or in one of :data:`CHECKED_OBJECTS`: the document's
        members counted before they become a dict. ValueError or RuntimeError where pysimdjson
        refuses ``data``."""
        doc = self.parse(data, recursive=False)
        try:
            body = doc.as_dict()
            repeated = len(doc) != len(body)
            for parent in CHECKED_OBJECTS:
                inner = body.get(parent)
                if type(inner) is dict and not repeated:
                    repeated = len(doc[parent]) != len(inner)
        finally:
            del doc  # no proxy outlives this call: the parser stays usable
        return body, repeated

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


SIMDJSON = _Simdjson()


class JSONBody:
    """The fast loader over the active scanner twin (``fastcore``'s, chosen once at its import);
    a test chooses the other by a subclass that sets ``scanner``."""

    scanner: ClassVar[ModuleType] = fastcore

    def load(self, raw: bytes, route: Route) -> dict[str, Any]:
        """The body as a JSON object with the prompt's token field left as a :class:`RawJSON`.

        Same dict as :func:`load_json_body` (the token field aside), same 400s, plus:
        ``prompt_token_ids_b64``, ``prompt_token_ids``, ``prompt`` or
        ``disaggregated_params`` twice in the body is a 400 (json.loads keeps the
        last, other parsers the first: the orchestrator and the worker must not read
        different prompts).
        """
        if not isinstance(raw, bytes):
            raw = bytes(raw)
        check_not_empty(raw)
        try:
            spans = self.scanner.find_spans(raw, _BODY_PATHS)
        except JSONSpanError as exc:
            # Where the whole body first goes wrong, UTF-8 first, else what this scan found.
            raise self.malformed(raw) or self.scan_error(raw, exc) from None
        root = spans[0]
        assert root is not None
        if raw[root[0]] != _OPEN_BRACE:
            raise bad_request("request body must be a JSON object")
        field = _token_field(raw, route, spans)
        rest = raw
        if field is not None:
            start, end = spans[field + 1]
            rest = self.scanner.splice(raw, ((start, end, b"null"),))
        try:
            body, repeated = SIMDJSON.object_counted(rest)
            parsed_by_simdjson = True
        except (ValueError, RuntimeError):
            # Valid JSON that pysimdjson refuses: the stdlib's values, as load_json_body gives.
            body = self._loads(rest, raw)
            repeated = parsed_by_simdjson = False
            self.check_members(raw, body)  # not counted: the scan looks
        if repeated:
            self.check_members(raw, body)
        if field is not None:
            body[SINGLE_KEYS[field]] = RawJSON(raw, start, end)
        if not parsed_by_simdjson:
            check_no_lone_surrogates(raw, body, lazy=RawJSON)
        elif field is not None and raw[start] == _QUOTE and raw.find(b"\\", start, end) != -1:
            # pysimdjson refuses a lone surrogate escape: only the token field's bytes may hold one.
            check_no_lone_surrogates(raw, {SINGLE_KEYS[field]: body[SINGLE_KEYS[field]]}, lazy=RawJSON)
        return body

    # -- the 400s, each from a validating scan of the body as sent ----------------------------------

    def scan_error(self, raw: bytes, exc: JSONSpanError) -> HTTPError:
        """The 400 for a scan of ``raw`` that stopped: a limit passed, a repeated key, or malformed JSON."""
        if exc.limit is not None:
            # fastcore's policy (fastcore.limits): the orchestrator words it the same way.
            return bad_request(f"request body rejected: {exc}")
        if exc.key is not None:
            name = param = exc.key
            for parent in CHECKED_OBJECTS:  # the repeat may be inside one of the checked objects
                try:
                    span = self.scanner.find_span(raw, (parent,), validate=False)
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

    def limit_refusal(self, raw: bytes) -> HTTPError | None:
        """The 400 for ``raw`` past fastcore's limits (byte offset), or None: within them, or malformed
        first (the caller's parser words that)."""
        try:
            self.scanner.find_span(raw, ())
        except JSONSpanError as exc:
            if exc.limit is not None:
                return self.scan_error(raw, exc)
        return None

    def limit_error(self, exc: BaseException, raw: bytes) -> HTTPError:
        """The 400 for valid JSON that Python's parser cannot turn into values (nesting, integer
        length): past fastcore's limits, whose scan says where; Python's own limit otherwise."""
        error = self.limit_refusal(raw)
        if error is not None:
            return error
        if isinstance(exc, RecursionError):  # pragma: no cover - the limits are far below Python's
            return bad_request("request body nests arrays and objects too deeply")
        return bad_request(  # pragma: no cover - as above
            f"request body holds an integer too long to convert (more than {sys.get_int_max_str_digits()} digits)"
        )

    def malformed(self, raw: bytes) -> HTTPError | None:
        """The 400 saying where ``raw`` stops being JSON or passes a limit (byte offset), or None when
        it is valid."""
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            return bad_request(f"request body is not valid UTF-8 (byte {exc.start})")
        try:
            self.scanner.find_span(raw, ())
        except JSONSpanError as exc:
            return self.scan_error(raw, exc)
        return None

    def check_members(self, raw: bytes, body: dict[str, Any]) -> None:
        """A validating scan of ``raw`` (what became ``body``) for the keys of ``body`` and of its
        checked objects: it refuses a repeat of any (each distinct key is requested, so each copy
        after the first is one), the grammar and fastcore's limits too."""
        paths: list[tuple[str, ...]] = [(key,) for key in body]
        for parent in CHECKED_OBJECTS:
            inner = body.get(parent)
            if type(inner) is dict:
                paths += [(parent, key) for key in inner]
        try:
            self.scanner.find_spans(raw, paths)
        except JSONSpanError as exc:
            raise self.scan_error(raw, exc) from None

    def _loads(self, data: bytes, raw: bytes) -> Any:
        """``json.loads(data)`` (``raw`` or a splice of it), every failure a 400."""
        try:
            return json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise self.malformed(raw) or bad_request("request body is not valid JSON") from None
        except (RecursionError, ValueError) as exc:
            raise self.limit_error(exc, raw) from None


JSON_BODY = JSONBody()


def _token_field(raw: bytes, route: Route, spans: list[tuple[int, int] | None]) -> int | None:
    """Index in ``SINGLE_KEYS`` of the field the prompt's ids come from (as the reader's prompt
    rule chooses), when its value is a string (base64) or an array; None otherwise."""
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


def load_json_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object via ``json.loads``, or a 400 that says where it is malformed (byte offset).

    The reference the fast loader (:class:`JSONBody`) is held to, and the
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
        raise JSON_BODY.limit_error(exc, raw) from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    try:
        JSON_BODY.check_members(raw, body)
    except HTTPError as exc:
        if "not valid JSON" not in exc.message:  # json.loads decides the grammar here
            raise
    check_no_lone_surrogates(raw, body)
    return body


__all__ = [
    "JSON_BODY",
    "MAX_NESTING",
    "SIMDJSON",
    "JSONBody",
    "RawJSON",
    "load_json_body",
]
