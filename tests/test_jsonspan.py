"""The JSON span scanner, both twins (``jsonspan`` fixture), against the stdlib and each other; the relay
kernels' twins against each other (``both_relay_twins``)."""

from __future__ import annotations

import base64
import importlib
import json
import struct
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from helpers import REQUIRE_EXTENSIONS, outcome
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastcore import JSONSpanError, TokenDecodeError
from fastcore.limits import JSON_MAX_DEPTH, JSON_MAX_NUMBER_CHARS

# The twin fixtures are modules, not per-test state: sharing them across examples is safe.
STATELESS = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]

# -- helpers ------------------------------------------------------------------------------------------


def side_by_side(name: str) -> tuple[ModuleType, ModuleType]:
    """The pure and compiled twins of ``fastcore.<name>``, for tests that compare them directly."""
    import fastcore

    py = importlib.import_module(f"fastcore.{name}_py")
    if fastcore.NO_EXTENSIONS:
        pytest.skip("FASTCORE_NO_EXTENSIONS=1")
    try:
        c = importlib.import_module(f"fastcore.{name}")
    except ImportError as exc:
        if REQUIRE_EXTENSIONS:
            pytest.fail(f"compiled twin required but not importable: {exc}")
        pytest.skip(f"fastcore.{name} not built: {exc}")
    return py, c


@pytest.fixture(scope="module")
def both_twins() -> tuple[ModuleType, ModuleType]:
    """The scanner twins side by side."""
    return side_by_side("_scan")


@pytest.fixture(scope="module")
def both_relay_twins() -> tuple[ModuleType, ModuleType]:
    """The relay kernels' twins side by side."""
    return side_by_side("_relay")


def value_at(doc: Any, path: tuple[Any, ...]) -> Any:
    for component in path:
        doc = doc[component]
    return doc


def corpus(directory: Path, prefix: str) -> list[Path]:
    files = sorted(directory.glob(f"{prefix}_*.json"))
    assert files, f"no {prefix}_ files in {directory}"
    return files


CONTEXT_RESPONSE = (
    b'{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":" Paris",'
    b'"finish_reason":"length","disaggregated_params":{"request_type":"context_only",'
    b'"first_gen_tokens":[3681],"ctx_request_id":11,"disagg_request_id":7205759403792793601,'
    b'"encoded_opaque_state":null,"ctx_info_endpoint":"127.0.0.1:9000","draft_tokens":null}}],'
    b'"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6},'
    b'"prompt_token_ids":null,"prompt_token_ids_b64":"AQAAAE4jAADFCQAAr3QAAA0AAAA="}'
)


# -- spans ---------------------------------------------------------------------------------------------


def test_spans_of_nested_values(jsonspan: ModuleType) -> None:
    body = CONTEXT_RESPONSE
    paths = [
        ("choices", 0, "disaggregated_params"),
        ("choices", 0, "finish_reason"),
        ("usage",),
        ("prompt_token_ids",),
        ("prompt_token_ids_b64",),
        ("choices", 0, "disaggregated_params", "first_gen_tokens", 0),
        (),
    ]
    doc = json.loads(body)
    spans = jsonspan.find_spans(body, paths)
    for path, span in zip(paths, spans):
        assert span is not None, path
        assert json.loads(body[span[0] : span[1]]) == value_at(doc, path)
    # A string's span includes its quotes; the whole document's span is the whole document.
    assert body[spans[1][0] : spans[1][1]] == b'"length"'
    assert spans[-1] == (0, len(body))
    assert jsonspan.find_span(body, ("usage",)) == spans[2]


def test_absent_paths_and_type_mismatches_are_none(jsonspan: ModuleType) -> None:
    body = b'{"a": {"b": [10, 20]}, "s": "text", "n": 5}'
    assert (
        jsonspan.find_spans(
            body,
            [
                ("missing",),
                ("a", "c"),
                ("a", "b", 2),  # past the end
                ("a", 0),  # an index into an object
                ("a", "b", "0"),  # a key into an array
                ("s", 0),  # into a string
                ("n", "x"),  # into a number
                ("a", "b", 1, "deeper"),
            ],
        )
        == [None] * 8
    )


def test_minus_one_is_the_last_element(jsonspan: ModuleType) -> None:
    body = b'{"messages": [{"role": "user"}, 7, {"role": "assistant", "content": "x"}], "empty": []}'
    span = jsonspan.find_span(body, ("messages", -1))
    assert span is not None
    assert json.loads(body[span[0] : span[1]]) == {"role": "assistant", "content": "x"}
    assert jsonspan.find_span(body, ("empty", -1)) is None
    assert jsonspan.find_span(b"[1]", (-1,)) == (1, 2)
    assert jsonspan.find_span(b'{"m": {"a": 1}}', ("m", -1)) is None  # not an array
    # -1 and a concrete index of the same array in one pass.
    assert jsonspan.find_spans(b"[4, 5, 6]", [(-1,), (0,), (2,)]) == [(7, 8), (1, 2), (7, 8)]


@pytest.mark.parametrize(
    "path",
    [("a", -2), ("a", -1, "b"), (-1, 0)],
)
def test_other_negative_indexes_are_refused(jsonspan: ModuleType, path: tuple[Any, ...]) -> None:
    with pytest.raises(ValueError, match="-1"):
        jsonspan.find_span(b"[]", path)


@pytest.mark.parametrize("path", ["abc", b"abc", ("a", True), ("a", 1.0), ("a", None), 5])
def test_bad_paths_raise_type_error(jsonspan: ModuleType, path: Any) -> None:
    with pytest.raises(TypeError):
        jsonspan.find_span(b'{"a": 1}', path)


def test_body_types(jsonspan: ModuleType) -> None:
    body = b'{"k": [1, 2]}'
    expected = (6, 12)
    assert jsonspan.find_span(bytearray(body), ("k",)) == expected
    assert jsonspan.find_span(memoryview(body), ("k",)) == expected
    assert jsonspan.find_span(memoryview(b"xx" + body)[2:], ("k",)) == expected
    with pytest.raises(TypeError):
        jsonspan.find_span(body.decode(), ("k",))
    with pytest.raises(BufferError):
        jsonspan.find_span(memoryview(b"x" + body)[::2], ("k",))


# -- keys as a parser sees them ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw_key, key",
    [
        (rb"prompt_token_ids\u005fb64", "prompt_token_ids_b64"),
        (rb"\u0070rompt", "prompt"),
        (rb"a\"b", 'a"b'),
        (rb"a\\b", "a\\b"),
        (rb"a\/b", "a/b"),
        (rb"\b\f\n\r\t", "\b\f\n\r\t"),
        (rb"\u00e9t\u00C9", "étÉ"),
        ("été".encode(), "été"),
        (rb"\ud83d\ude00", "\U0001f600"),  # surrogate pair -> one code point
        ("\U0001f600".encode(), "\U0001f600"),
        (rb"\ud800", "\ud800"),  # a lone surrogate matches a lone surrogate
        (rb"\udc00x", "\udc00x"),
        (rb"\ud800\u0041", "\ud800A"),
        (rb"\u0000", "\x00"),
    ],
)
def test_escaped_keys_match_decoded(jsonspan: ModuleType, raw_key: bytes, key: str) -> None:
    body = b'{"other": 0, "' + raw_key + b'": [true]}'
    assert json.loads(body) == {"other": 0, key: [True]}
    span = jsonspan.find_span(body, (key,))
    assert span is not None and body[span[0] : span[1]] == b"[true]"
    assert jsonspan.find_span(body, (key + "x",)) is None


def test_key_text_inside_strings_never_matches(jsonspan: ModuleType) -> None:
    body = (
        b'{"note": "\\"choices\\": [{\\"disaggregated_params\\": 1}]", '
        b'"text": "{\\"usage\\": 5}", "tricky\\\\": "\\\\\\"usage\\\\\\":", '
        b'"list": ["usage", {"usage": "nested"}], "inner": {"usage": 1, "choices": 2}, '
        b'"usage": {"real": true}}'
    )
    assert json.loads(body)["usage"] == {"real": True}
    span = jsonspan.find_span(body, ("usage",))
    assert span is not None and json.loads(body[span[0] : span[1]]) == {"real": True}
    assert jsonspan.find_span(body, ("choices",)) is None
    assert jsonspan.find_span(body, ("inner", "choices")) is not None


def test_whitespace_everywhere(jsonspan: ModuleType) -> None:
    body = b' \t\n\r{ \n"a" \t:\r [ 1 ,\n{ "b"\n:\n"c" } ] , "d":null\n}\r\n '
    spans = jsonspan.find_spans(body, [("a",), ("a", 1, "b"), ("d",), ()])
    assert [body[s:e] for s, e in spans] == [b'[ 1 ,\n{ "b"\n:\n"c" } ]', b'"c"', b"null", body.strip()]


def test_huge_numbers_are_spans_not_values(jsonspan: ModuleType) -> None:
    big = b"-" + b"9" * 200 + b".5e+" + b"9" * 50  # 255 characters: within JSON_MAX_NUMBER_CHARS
    body = b'{"n": ' + big + b', "m": 1e999}'
    assert jsonspan.find_spans(body, [("n",), ("m",)]) == [(6, 6 + len(big)), (len(body) - 6, len(body) - 1)]


# -- duplicate keys ------------------------------------------------------------------------------------


def test_duplicate_target_key_raises_with_its_offset(jsonspan: ModuleType) -> None:
    body = b'{"usage": 1, "x": 2, "usage": 3}'
    with pytest.raises(JSONSpanError, match="duplicate key 'usage'") as info:
        jsonspan.find_span(body, ("usage",))
    assert info.value.offset == body.rindex(b'"usage"')
    # Spelled differently, the same key.
    with pytest.raises(JSONSpanError, match="duplicate key"):
        jsonspan.find_span(b'{"ab": 1, "a\\u0062": 2}', ("ab",))
    # On the path to the target, too.
    with pytest.raises(JSONSpanError, match="duplicate key 'choices'"):
        jsonspan.find_span(b'{"choices": [], "choices": [{"a": 1}]}', ("choices", 0, "a"))


def test_duplicates_off_the_path_are_allowed(jsonspan: ModuleType) -> None:
    body = b'{"x": 1, "x": 2, "a": {"usage": 1}, "b": {"usage": 2}, "usage": [{"k": 1, "k": 2}]}'
    span = jsonspan.find_span(body, ("usage",))
    assert span is not None and body[span[0] : span[1]] == b'[{"k": 1, "k": 2}]'


# -- malformed input -----------------------------------------------------------------------------------

ERRORS = [
    (b"", "unexpected end of data", 0),
    (b"   ", "unexpected end of data", 3),
    (b'{"a": 1', "unexpected end of data", 7),
    (b'{"a": "x', "unexpected end of data", 8),
    (b'["\\', "unexpected end of data", 3),
    (b'["\\u12', "unexpected end of data", 6),
    (b"[1.", "unexpected end of data", 3),
    (b"tru", "unexpected end of data", 3),
    (b"[,1]", "expected a value", 1),
    (b"[1,]", "expected a value", 3),
    (b"\xef\xbb\xbf{}", "expected a value", 0),
    (b"{'a': 1}", "expected '\"' to start an object key", 1),
    (b'{"a": 1,}', "expected '\"' to start an object key", 8),
    (b'{"a" 1}', "expected ':'", 5),
    (b'{"a": 1 "b": 2}', "expected ',' or '}'", 8),
    (b"[1 2]", "expected ',' or ']'", 3),
    (b"[1}", "expected ',' or ']'", 2),
    (b"{} x", "trailing characters", 3),
    (b"01", "trailing characters", 1),
    (b'"a\tb"', "unescaped control character", 2),
    (b'"a\\xb"', "invalid escape", 2),
    (b'"a\\u12G4"', "invalid \\u escape", 2),
    (b'"ok \xc3\xa9 \xff"', "invalid UTF-8", 7),
    (b'"\xed\xa0\x80"', "invalid UTF-8", 1),  # an encoded surrogate
    (b'"\xc0\xaf"', "invalid UTF-8", 1),  # overlong
    (b'"\xf4\x90\x80\x80"', "invalid UTF-8", 1),  # above U+10FFFF
    (b'"\xe2\x82"', "invalid UTF-8", 1),  # truncated
    (b"-x", "expected a digit", 1),
    (b"1.x", "expected a digit", 2),
    (b"1e+x", "expected a digit", 3),
    (b"-", "unexpected end of data", 1),
    (b"nul", "unexpected end of data", 3),
    (b"nulL", "invalid literal", 3),
    (b"[truth]", "invalid literal", 4),
    (b"NaN", "expected a value", 0),
]


@pytest.mark.parametrize("body, message, offset", ERRORS)
def test_malformed_input_names_the_byte(jsonspan: ModuleType, body: bytes, message: str, offset: int) -> None:
    with pytest.raises(JSONSpanError) as info:
        jsonspan.find_span(body, ())
    assert message in str(info.value)
    assert info.value.offset == offset
    assert str(info.value).endswith(f"(byte {offset})")
    assert isinstance(info.value, ValueError)


def test_truncation_at_every_byte_raises(jsonspan: ModuleType) -> None:
    body = CONTEXT_RESPONSE.replace(b'"text":" Paris"', b'"text":" \\"Par\\u00efs\\" \xc3\xa9\\n"')
    assert jsonspan.find_span(body, ("usage",)) is not None
    paths = [("choices", 0, "disaggregated_params"), ("usage",), ("prompt_token_ids_b64",)]
    for cut in range(len(body)):
        for validate in (True, False):
            with pytest.raises(JSONSpanError) as info:
                jsonspan.find_spans(body[:cut], paths, validate=validate)
            assert 0 <= info.value.offset <= cut


def test_deep_nesting_without_recursion(jsonspan: ModuleType) -> None:
    depth = JSON_MAX_DEPTH  # the deepest document the limit allows, walked without recursion
    body = b"[" * depth + b"]" * depth
    for validate in (True, False):
        assert jsonspan.find_span(body, (0, 0), validate=validate) == (2, 2 * depth - 2)
        with pytest.raises(JSONSpanError, match="end of data") as info:
            jsonspan.find_span(body[:-1], (0,), validate=validate)
        assert info.value.offset == 2 * depth - 1 and info.value.limit is None
    objects = b'{"a":' * depth + b"1" + b"}" * depth
    assert jsonspan.find_span(objects, ("a",) * 3) is not None
    with pytest.raises(JSONSpanError, match="expected ',' or '}'"):
        jsonspan.find_span(b'{"a":' * depth + b"1" + b"]" * depth, ("a",))


# -- limits (fastcore.limits) --------------------------------------------------------------------------


def nested(depth: int, layout: str) -> tuple[bytes, int]:
    """A document nesting ``depth`` containers (itself level 1), and the offset of its deepest bracket."""
    inner = depth - 1
    if layout == "arrays":
        return b"[" * depth + b"]" * depth, depth - 1
    if layout == "objects":
        return b'{"a":' * inner + b"{}" + b"}" * inner, 5 * inner
    if layout == "numbers":  # the innermost level is a number list: the scanners' fast path, no frame
        return b'{"x":' + b"[" * (inner - 1) + b"[1,2]" + b"]" * (inner - 1) + b"}", 5 + inner - 1
    if layout == "member":  # deep inside a member off the paths, after one on them
        return b'{"p":[1],"x":' + b"[" * inner + b"]" * inner + b"}", 13 + inner - 1
    raise AssertionError(layout)


LIMIT_PATHS = [[()], [("x",)], [("x", 0, 0)], [("a", "a")], [("p",), ("x",)]]


@pytest.mark.parametrize("layout", ["arrays", "objects", "numbers", "member"])
@pytest.mark.parametrize("validate", [True, False])
def test_depth_limit_is_exact_everywhere(jsonspan: ModuleType, layout: str, validate: bool) -> None:
    """JSON_MAX_DEPTH levels pass and one more fails at its bracket, on the paths or off them, walked
    or skipped (``validate=False`` counts brackets, and the levels open around the skipped value)."""
    for paths in LIMIT_PATHS:
        body, _ = nested(JSON_MAX_DEPTH, layout)
        jsonspan.find_spans(body, paths, validate=validate)
        body, deepest = nested(JSON_MAX_DEPTH + 1, layout)
        with pytest.raises(JSONSpanError, match=f"deeper than the limit of {JSON_MAX_DEPTH} levels") as info:
            jsonspan.find_spans(body, paths, validate=validate)
        assert info.value.offset == deepest and body[deepest] in b"[{", (paths, deepest)
        assert info.value.limit == "JSON_MAX_DEPTH"


def test_depth_limit_stops_before_the_end(jsonspan: ModuleType) -> None:
    """A document of a million open brackets fails at the first one past the limit: no stack of a
    million frames, and the same answer truncated (the limit comes before the end of data)."""
    body = b"[" * 1_000_000
    for validate in (True, False):
        with pytest.raises(JSONSpanError, match="deeper than") as info:
            jsonspan.find_span(body, (), validate=validate)
        assert info.value.offset == JSON_MAX_DEPTH


def number_in(token: bytes, layout: str) -> tuple[bytes, int]:
    """A document holding ``token`` as a number, and the token's offset."""
    prefix = {"scalar": b"", "member": b'{"a":', "list": b'{"b":[1,', "deep": b'{"c":[[{"d":'}[layout]
    suffix = {"scalar": b"", "member": b"}", "list": b",2]}", "deep": b"}]]}"}[layout]
    return prefix + token + suffix, len(prefix)


def number_tokens(length: int) -> list[bytes]:
    return [
        b"1" * length,
        b"-" + b"2" * (length - 1),
        b"3." + b"4" * (length - 2),
        b"-0." + b"5" * (length - 3),
        b"6" * (length - 4) + b"e+78",
        b"9.5" + b"0" * (length - 6) + b"E-1",
    ]


@pytest.mark.parametrize("layout", ["scalar", "member", "list", "deep"])
def test_number_length_limit_is_exact(jsonspan: ModuleType, layout: str) -> None:
    """A number of JSON_MAX_NUMBER_CHARS characters passes, one more fails at its first byte, in every
    form (sign, fraction, exponent) and place (in a number list, the fast path, too)."""
    for token in number_tokens(JSON_MAX_NUMBER_CHARS):
        assert len(token) == JSON_MAX_NUMBER_CHARS
        body, offset = number_in(token, layout)
        assert jsonspan.find_spans(body, [(), ("a",)]) == [(0, len(body)), (5, 5 + len(token)) if layout == "member" else None]
    for token in number_tokens(JSON_MAX_NUMBER_CHARS + 1):
        body, offset = number_in(token, layout)
        for paths in ([()], [("a",)], [("b", 1)], [("c", 0, 0, "d")]):
            with pytest.raises(JSONSpanError, match=f"number longer than the limit of {JSON_MAX_NUMBER_CHARS}") as info:
                jsonspan.find_spans(body, paths)
            assert info.value.offset == offset and info.value.limit == "JSON_MAX_NUMBER_CHARS"


def test_number_length_limit_without_validation(jsonspan: ModuleType) -> None:
    """``validate=False`` checks the numbers it scans (on the paths) and, like everything else in them,
    not those inside skipped containers."""
    token = b"1" * (JSON_MAX_NUMBER_CHARS + 1)
    with pytest.raises(JSONSpanError, match="number longer") as info:
        jsonspan.find_spans(b'{"a":' + token + b"}", [("b",)], validate=False)
    assert info.value.offset == 5
    assert jsonspan.find_spans(b'{"a":[' + token + b"]}", [("b",)], validate=False) == [None]


def test_a_malformed_long_number_is_malformed_and_a_long_string_is_no_number(jsonspan: ModuleType) -> None:
    token = b"1" * (JSON_MAX_NUMBER_CHARS + 10)
    with pytest.raises(JSONSpanError, match="expected a digit") as info:
        jsonspan.find_span(b"[" + token + b".x]", ())
    assert info.value.offset == len(token) + 2 and info.value.limit is None
    digits = b'"' + token * 100 + b'"'
    assert jsonspan.find_span(b'{"s":' + digits + b"}", ("s",)) == (5, 5 + len(digits))


def test_the_limits_are_one_definition() -> None:
    import fastcore
    from fastcore import limits

    assert (fastcore.JSON_MAX_DEPTH, fastcore.JSON_MAX_NUMBER_CHARS) == (limits.JSON_MAX_DEPTH, limits.JSON_MAX_NUMBER_CHARS)
    assert {"JSON_MAX_DEPTH", "JSON_MAX_NUMBER_CHARS"} <= set(fastcore.__all__)


def test_twins_agree_at_the_limits(both_twins: tuple[ModuleType, ModuleType]) -> None:
    py, c = both_twins
    bodies = []
    for depth in (JSON_MAX_DEPTH - 1, JSON_MAX_DEPTH, JSON_MAX_DEPTH + 1):
        bodies += [nested(depth, layout)[0] for layout in ("arrays", "objects", "numbers", "member")]
    for length in (JSON_MAX_NUMBER_CHARS, JSON_MAX_NUMBER_CHARS + 1):
        bodies += [number_in(t, layout)[0] for t in number_tokens(length) for layout in ("scalar", "member", "list", "deep")]
    for body in bodies:
        for cut in (len(body), len(body) - 1, len(body) // 2):
            for paths in LIMIT_PATHS:
                for validate in (True, False):
                    args = (body[:cut], paths)
                    assert outcome(py, "find_spans", *args, validate=validate) == outcome(
                        c, "find_spans", *args, validate=validate
                    ), (body[:40], cut, paths, validate)


# -- the JSONTestSuite corpus --------------------------------------------------------------------------


def test_json_test_suite_accepts_every_y_file(jsonspan: ModuleType, json_test_suite: Path) -> None:
    for path in corpus(json_test_suite, "y"):
        body = path.read_bytes()
        assert jsonspan.find_span(body, ()) is not None, path.name
        assert jsonspan.find_spans(body, [(), (0,), ("no such key",)], validate=False)[0] is not None, (
            path.name
        )


def test_json_test_suite_rejects_every_n_file(jsonspan: ModuleType, json_test_suite: Path) -> None:
    for path in corpus(json_test_suite, "n"):
        with pytest.raises(JSONSpanError):
            jsonspan.find_span(path.read_bytes(), ())
            pytest.fail(f"{path.name} accepted")


def test_json_test_suite_i_files_never_crash(jsonspan: ModuleType, json_test_suite: Path) -> None:
    for path in corpus(json_test_suite, "i"):
        for validate in (True, False):
            try:
                jsonspan.find_spans(path.read_bytes(), [(), (0,), ("a",)], validate=validate)
            except JSONSpanError:
                pass


def test_validate_false_never_crashes_on_the_corpus(jsonspan: ModuleType, json_test_suite: Path) -> None:
    for path in sorted(json_test_suite.glob("*.json")):
        body = path.read_bytes()
        for paths in ([()], [(0,)], [(0, 0), (-1,)], [("a",)], []):
            try:
                jsonspan.find_spans(body, paths, validate=False)
            except JSONSpanError as exc:
                assert 0 <= exc.offset <= len(body)


def test_twins_agree_on_the_corpus(both_twins: tuple[ModuleType, ModuleType], json_test_suite: Path) -> None:
    py, c = both_twins
    for path in sorted(json_test_suite.glob("*.json")):
        body = path.read_bytes()
        for paths in ([()], [(0,), (-1,)], [("a",), (0, 0)], []):
            for validate in (True, False):
                expected = outcome(py, "find_spans", body, paths, validate=validate)
                assert outcome(c, "find_spans", body, paths, validate=validate) == expected, path.name
        # Every truncation of the small files (the big ones are 100k brackets: nothing new).
        for cut in range(len(body)) if len(body) <= 4096 else ():
            assert outcome(c, "find_span", body[:cut], ()) == outcome(py, "find_span", body[:cut], ()), (
                path,
                cut,
            )


# -- validate=False ------------------------------------------------------------------------------------


def test_validate_false_skips_checks_off_the_path(jsonspan: ModuleType) -> None:
    body = b'{"junk": [1,,, tru "\\q" {]], "bad": "\xff\x01", "keep": {"a": [1, 2]}}'
    with pytest.raises(JSONSpanError):
        jsonspan.find_span(body, ("keep", "a"))
    span = jsonspan.find_span(body, ("keep", "a"), validate=False)
    assert span is not None and body[span[0] : span[1]] == b"[1, 2]"
    # The walked containers keep their grammar.
    with pytest.raises(JSONSpanError, match="expected ':'"):
        jsonspan.find_span(b'{"junk" [], "keep": 1}', ("keep",), validate=False)
    with pytest.raises(JSONSpanError, match="end of data"):
        jsonspan.find_span(b'{"junk": [1, 2, "]"}', ("keep",), validate=False)
    # A key on the path must still decode.
    with pytest.raises(JSONSpanError, match="invalid escape"):
        jsonspan.find_span(b'{"k\\q": 1}', ("k",), validate=False)


# -- hypothesis: generated documents against the json module -------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=6), children, max_size=5)
    ),
    max_leaves=25,
)


@st.composite
def documents(draw: st.DrawFn) -> tuple[Any, bytes]:
    value = draw(json_values)
    ensure_ascii = draw(st.booleans())
    indent = draw(st.sampled_from([None, 0, 1, "\t", " \r\n"]))
    separators = draw(st.sampled_from([None, (",", ":"), (" , ", " : ")]))
    text = json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators)
    return value, (" " * draw(st.integers(0, 2)) + text + "\n" * draw(st.integers(0, 2))).encode()


def all_paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    paths = [prefix]
    if isinstance(value, dict):
        for key, child in value.items():
            paths += all_paths(child, (*prefix, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            paths += all_paths(child, (*prefix, index))
        if value:
            paths.append((*prefix, -1))
    return paths


@given(documents())
@settings(max_examples=150, deadline=None, suppress_health_check=STATELESS)
def test_generated_documents_match_json(jsonspan: ModuleType, doc: tuple[Any, bytes]) -> None:
    value, body = doc
    paths = all_paths(value)
    extendable = [p for p in paths if -1 not in p][:5]
    paths += [(*p, "absent") for p in extendable] + [(*p, 99) for p in extendable]
    for validate in (True, False):
        spans = jsonspan.find_spans(body, paths, validate=validate)
        for path, span in zip(paths, spans):
            try:
                expected = value_at(value, path)
            except (KeyError, IndexError, TypeError):
                assert span is None, path
                continue
            assert span is not None, path
            assert json.loads(body[span[0] : span[1]]) == expected, path


def json_accepts(body: bytes) -> bool:
    def refuse(constant: str) -> Any:
        raise ValueError(constant)

    try:
        json.loads(body.decode("utf-8"), parse_constant=refuse)
    except (ValueError, RecursionError):
        return False
    return True


@st.composite
def mutated_documents(draw: st.DrawFn) -> bytes:
    _, body = draw(documents())
    data = bytearray(body)
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.integers(0, 2))
        where = draw(st.integers(0, len(data)))
        if kind == 0 and data:
            del data[min(where, len(data) - 1)]
        elif kind == 1:
            data[where:where] = draw(
                st.sampled_from(
                    [
                        b'"',
                        b"\\",
                        b",",
                        b"}",
                        b"]",
                        b"{",
                        b"[",
                        b":",
                        b"\xc3",
                        b"\x00",
                        b"-",
                        b"e",
                        b"1",
                        b" ",
                    ]
                )
            )
        elif data:
            data[min(where, len(data) - 1)] = draw(st.integers(0, 255))
    return bytes(data)


@given(mutated_documents())
@settings(max_examples=300, deadline=None, suppress_health_check=STATELESS)
def test_mutated_documents_accepted_exactly_when_json_accepts(jsonspan: ModuleType, body: bytes) -> None:
    try:
        jsonspan.find_span(body, ())
        accepted = True
    except JSONSpanError as exc:
        assert 0 <= exc.offset <= len(body)
        accepted = False
    assert accepted == json_accepts(body), body
    try:
        jsonspan.find_spans(body, [(0,), ("a",), (-1,)], validate=False)
    except JSONSpanError as exc:
        assert 0 <= exc.offset <= len(body)


@given(st.one_of(mutated_documents(), st.binary(max_size=64)), st.booleans())
@settings(max_examples=300, deadline=None, suppress_health_check=STATELESS)
def test_twins_agree_on_mutated_documents(
    both_twins: tuple[ModuleType, ModuleType], body: bytes, validate: bool
) -> None:
    py, c = both_twins
    for paths in ([()], [(0,), (-1,), ("a",)], [("", 0, "a"), (1, -1)]):
        assert outcome(c, "find_spans", body, paths, validate=validate) == outcome(
            py, "find_spans", body, paths, validate=validate
        )
        assert outcome(c, "find_member_spans", body, paths, validate=validate) == outcome(
            py, "find_member_spans", body, paths, validate=validate
        )


# -- member spans --------------------------------------------------------------------------------------


def test_member_spans_start_at_the_key(jsonspan: ModuleType) -> None:
    body = b'{"a": 1, "b" :  [2], "c": {"d": 3}}'
    spans = jsonspan.find_member_spans(body, [("b",), ("c", "d"), ("c",), (), ("b", 0), ("b", -1), ("zz",)])
    assert [body[span[0] : span[1]] for span in spans[:-1]] == [
        b'"b" :  [2]',
        b'"d": 3',
        b'"c": {"d": 3}',
        body,
        b"2",
        b"2",
    ]
    assert spans[-1] is None


# -- splice ----------------------------------------------------------------------------------------------


def test_splice(jsonspan: ModuleType) -> None:
    body = b"0123456789"
    assert jsonspan.splice(body, []) == body
    assert jsonspan.splice(
        body, [(0, 0, b"<"), (3, 5, b"-"), (5, 5, bytearray(b"+")), (10, 10, memoryview(b">"))]
    ) == (b"<012-+56789>")
    assert jsonspan.splice(bytearray(body), [(0, 10, b"")]) == b""
    assert jsonspan.splice(memoryview(body)[2:6], [(1, 3, b"x")]) == b"2x5"
    assert jsonspan.splice(body, [(2, 2, b"a"), (2, 2, b"b"), (2, 4, b"c")]) == b"01abc456789"
    wide = memoryview(struct.pack("<2i", 1, 2)).cast("i")
    assert jsonspan.splice(b"[]", [(1, 1, wide)]) == b"[" + struct.pack("<2i", 1, 2) + b"]"
    assert type(jsonspan.splice(bytearray(b"x"), [])) is bytes


@pytest.mark.parametrize(
    "edits, error, message",
    [
        ([(3, 2, b"")], ValueError, "0 <= start <= end"),
        ([(-1, 2, b"")], ValueError, "0 <= start <= end"),
        ([(0, 11, b"")], ValueError, "0 <= start <= end"),
        ([(0, 2**70, b"")], ValueError, "0 <= start <= end"),
        ([(4, 6, b""), (5, 7, b"")], ValueError, "before the previous edit ends"),
        ([(4, 6, b""), (1, 2, b"")], ValueError, "before the previous edit ends"),
        ([(0, 1)], TypeError, "must be a (start, end, replacement) tuple"),
        ([None], TypeError, "must be a (start, end, replacement) tuple"),
        ([(0.0, 1, b"")], TypeError, "start and end must be ints"),
        ([(True, 1, b"")], TypeError, "start and end must be ints"),
        ([(0, 1, "text")], TypeError, "replacement must be bytes-like"),
        ([(0, 1, memoryview(b"abcd")[::2])], BufferError, "contiguous"),
    ],
)
def test_splice_rejects_bad_edits(jsonspan: ModuleType, edits: list[Any], error: type, message: str) -> None:
    with pytest.raises(error) as info:
        jsonspan.splice(b"0123456789", edits)
    assert message in str(info.value)


def test_splice_rejects_bad_bodies(jsonspan: ModuleType) -> None:
    with pytest.raises(TypeError):
        jsonspan.splice("text", [])
    with pytest.raises(BufferError):
        jsonspan.splice(memoryview(b"abcd")[::2], [])


@given(
    st.binary(max_size=40),
    st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40), st.binary(max_size=5)), max_size=6),
)
@settings(suppress_health_check=STATELESS)
def test_splice_matches_slicing(jsonspan: ModuleType, body: bytes, raw: list[tuple[int, int, bytes]]) -> None:
    points = sorted(min(p, len(body)) for edit in raw for p in edit[:2])
    edits = [(points[2 * i], points[2 * i + 1], raw[i][2]) for i in range(len(points) // 2)]
    expected = bytearray()
    previous = 0
    for start, end, replacement in edits:
        expected += body[previous:start] + replacement
        previous = end
    expected += body[previous:]
    assert jsonspan.splice(body, edits) == bytes(expected)


# -- the base64 token check ------------------------------------------------------------------------------


@given(st.lists(st.integers(0, 2**31 - 1), max_size=40))
@settings(suppress_health_check=STATELESS)
def test_token_b64_accepts_encoded_ids(codec: ModuleType, ids: list[int]) -> None:
    data = base64.b64encode(struct.pack(f"<{len(ids)}i", *ids))
    assert codec.check_token_b64(data) == len(ids)
    assert codec.check_token_b64(b'{"x":"' + data + b'"}', 6, 6 + len(data)) == len(ids)


@pytest.mark.parametrize(
    "data, message, offset",
    [
        (b"AQAA AAA", "invalid base64 character ' '", 4),
        (b"AQAAAA-A", "invalid base64 character '-'", 6),
        (b"AQ\\/AAAA", "invalid base64 character '\\\\'", 2),
        (b"AQ=AAAAA", "padding '=' before the end", 2),
        (b"AQAAA===", "padding '=' before the end", 5),
        (b"AQAAAAA", "not a multiple of 4", None),
        (b"AQ==", "not a whole number of int32 ids", None),
        (b"AQAAAAE=", "not a whole number of int32 ids", None),
        (b"AQAAAAB=", "non-canonical", 6),
        (b"AQAAAR==", "non-canonical", 5),
        (b"AQAA====", "padding '=' before the end", 4),
    ],
)
def test_token_b64_errors(codec: ModuleType, data: bytes, message: str, offset: int | None) -> None:
    with pytest.raises(TokenDecodeError) as info:
        codec.check_token_b64(b"xx" + data, 2, 2 + len(data))
    assert message in str(info.value)
    assert info.value.offset == (None if offset is None else offset + 2)


def test_token_b64_range_is_checked(codec: ModuleType) -> None:
    with pytest.raises(ValueError, match="0 <= start <= end"):
        codec.check_token_b64(b"AAAA", 2, 8)
    assert codec.check_token_b64(b"") == 0


# -- the SIMD kernels ------------------------------------------------------------------------------------


def test_kernels_agree_past_the_long_run_switch(both_twins: tuple[ModuleType, ModuleType]) -> None:
    """A string run longer than 4 KiB goes on with the AVX-512 kernel where it runs (include/scan_simd.h
    FC_JS_LONG_RUN): every byte value at the lane edges of its 64-byte steps, per kernel."""
    py, c = both_twins
    kernels = {"avx512": ["avx2", "avx512"], "avx2": ["avx2"]}.get(c.KERNEL, [c.KERNEL])
    try:
        for kernel in kernels:
            if kernel != "scalar":
                c._set_kernel(kernel)
            for position in (4096, 4111, 4112, 4127, 4175, 4176, 4239, 4240, 4300, 4350):
                for value in range(256):
                    data = bytearray(b"QUJD" * 1100)
                    data[position] = value
                    body = b'["' + bytes(data) + b'"]'
                    for validate in (True, False):
                        assert outcome(c, "find_spans", body, [(0,)], validate=validate) == outcome(
                            py, "find_spans", body, [(0,)], validate=validate
                        ), (kernel, position, value, validate)
    finally:
        if c.KERNEL != kernels[-1]:
            c._set_kernel(kernels[-1])


def test_kernels_agree_on_every_byte_in_every_lane(both_twins: tuple[ModuleType, ModuleType]) -> None:
    """Each byte value at lane edges of the 16- and 64-byte steps and in the scalar tail, per kernel:
    the scanner's string kernels and the codec's alphabet check (``check_token_b64``)."""
    py, c = both_twins
    codec_py, codec_c = side_by_side("_codec")
    alphabet = set(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")
    kernels = {"avx512": ["sse2", "avx2", "avx512"], "avx2": ["sse2", "avx2"]}.get(c.KERNEL, [c.KERNEL])
    simd_paths = codec_c._available_simd_paths()
    codec_path = {"sse2": "ssse3", "avx2": "avx2", "avx512": "avx512vbmi"}  # test_codec runs every one
    original = codec_c._get_simd_path()
    try:
        for kernel in kernels:
            simd_path = codec_path.get(kernel, simd_paths[-1])
            if kernel != "scalar":
                c._set_kernel(kernel)
            if simd_path in simd_paths:
                codec_c._set_simd_path(simd_path)
            for position in (0, 15, 16, 31, 32, 63, 64, 79, 100, 140, 143):
                for value in range(256):
                    data = bytearray(b"QUJD" * 36)
                    data[position] = value
                    result = outcome(codec_c, "check_token_b64", bytes(data))
                    assert result == outcome(codec_py, "check_token_b64", bytes(data)), (kernel, position, value)
                    assert (result[0] == "ok") == (value in alphabet), (kernel, position, value)
                    body = b'["' + bytes(data) + b'"]'
                    for validate in (True, False):
                        assert outcome(c, "find_spans", body, [(0,)], validate=validate) == outcome(
                            py, "find_spans", body, [(0,)], validate=validate
                        ), (kernel, position, value, validate)
    finally:
        codec_c._set_simd_path(original)
        if c.KERNEL != kernels[-1]:
            c._set_kernel(kernels[-1])


# -- relay kernels: the twins agree on every relay-shaped body, however broken --------------------------

_B64_IDS = base64.b64encode(struct.pack("<3i", 1, 9038, 70000)).decode()
CLIENT_SEEDS = [
    json.dumps(
        {
            "model": "tiny",
            "messages": [
                {"role": "system", "content": 'Be "terse" \u00e9'},
                {"role": "user", "content": "Hi"},
            ],
            "max_tokens": 8,
            "max_completion_tokens": None,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode(),
    b'{"prompt": [1, 2], "max_tokens": 3, "model": "a\\u00e9", "stream": false, "stream_options": null}',
    b'{"messages": [], "prompt_token_ids": [1]}',
    b'{"messages": [{}], "prompt": "x"}',
    b"{}",
]
CONTEXT_SEEDS = [
    *(
        json.dumps(
            {
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": finish,
                        "disaggregated_params": {"request_type": "context_only", "ctx_usage": None, "x": [1]},
                    },
                    {"index": 1, "disaggregated_params": {}},
                ],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1},
                "prompt_token_ids": [1, 9038, 70000] if ids else None,
                "prompt_token_ids_b64": None if ids else _B64_IDS,
            }
        ).encode()
        for finish, ids in (("length", False), ("not_finished", True), ("stop", False))
    ),
]


@st.composite
def relay_bodies(draw: st.DrawFn, seeds: list[bytes]) -> bytes:
    data = bytearray(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.sampled_from([0, 0, 1, 1, 2, 3]))):
        where = draw(st.integers(0, len(data)))
        kind = draw(st.integers(0, 3))
        if kind == 0 and data:
            del data[min(where, len(data) - 1)]
        elif kind == 1:
            data[where:where] = draw(
                st.sampled_from([b'"', b"\\", b",", b"}", b"]", b"{", b"[", b":", b"1", b"\xc3"])
            )
        elif kind == 2 and data:
            data[min(where, len(data) - 1)] = draw(st.integers(0, 255))
        else:
            end = draw(st.integers(where, min(len(data), where + 30)))
            data[where:where] = data[where:end]  # a repeat: duplicate keys, nested copies
    return bytes(data)


@given(
    relay_bodies(CLIENT_SEEDS),
    relay_bodies(CONTEXT_SEEDS + CLIENT_SEEDS[:1]),
    st.booleans(),
    st.sampled_from([None, 1, 8]),
    st.booleans(),
    st.booleans(),
)
@settings(max_examples=400, deadline=None, suppress_health_check=STATELESS)
def test_twins_agree_on_the_relay_kernels(
    both_relay_twins: tuple[ModuleType, ModuleType],
    client: bytes,
    ctx: bytes,
    chat: bool,
    max_tokens: int | None,
    tokids_b64: bool,
    strip_history: bool,
) -> None:
    py, c = both_relay_twins
    scans = [outcome(twin, "read_client_request", client, chat) for twin in (py, c)]
    assert scans[0] == scans[1]
    contexts = [outcome(twin, "read_context_response", ctx, max_tokens) for twin in (py, c)]
    assert contexts[0] == contexts[1]
    for body in (client, ctx):
        for validate in (True, False):
            assert outcome(py, "strip_internal_fields", body, validate) == outcome(
                c, "strip_internal_fields", body, validate
            )
    if scans[0][0] != "ok":
        return
    for request_id in (0, 2**63 - 1, -(2**70)):
        assert outcome(py, "context_request", scans[0][1], request_id, tokids_b64) == outcome(
            c, "context_request", scans[1][1], request_id, tokids_b64
        )
    if contexts[0][0] == "ok":
        assert outcome(
            py, "generation_request", scans[0][1], contexts[0][1], tokids_b64, strip_history
        ) == outcome(c, "generation_request", scans[1][1], contexts[1][1], tokids_b64, strip_history)


def test_relay_errors_carry_the_field(both_relay_twins: tuple[ModuleType, ModuleType]) -> None:
    for twin in both_relay_twins:
        with pytest.raises(ValueError) as info:
            twin.read_client_request(b'{"stream": 1}', False)
        assert getattr(info.value, "field", None) == "stream"


def test_the_path_cache_keeps_equal_and_rebuilt_tuples_apart(jsonspan: ModuleType) -> None:
    body = b'{"a": 1, "b": [2, 3]}'
    for _ in range(3):  # fresh tuples each time, equal to the cached one or not
        assert jsonspan.find_spans(body, (("a",), ("b", -1))) == [(6, 7), (18, 19)]
        assert jsonspan.find_spans(body, tuple([("b",)])) == [(14, 20)]
    paths = [("a",)]
    assert jsonspan.find_spans(body, paths) == [(6, 7)]
    paths[0] = ("b",)  # a list is never cached by identity
    assert jsonspan.find_spans(body, paths) == [(14, 20)]


@pytest.mark.parametrize(
    "array",
    [
        b"[1,2]",
        b"[ 1 , 2 ]",
        b"[\n-0.5e+3,\t2E-1 ,0]",
        b"[0]",
        b"[]",
        b"[1,]",
        b"[,1]",
        b"[01]",
        b"[1 2]",
        b"[-]",
        b"[1.]",
        b"[1e]",
        b"[1e+]",
        b'[1,"a"]',
        b"[1,[2]]",
        b"[1,{}]",
        b"[1,2",
        b"[1,",
        b"[1",
        b"[-",
        b"[1,2]]",
        b"[1,true]",
    ],
)
def test_number_arrays_on_and_off_the_path(both_twins: tuple[ModuleType, ModuleType], array: bytes) -> None:
    # Id lists are consumed in one go when no path enters them; the result must not show it.
    py, c = both_twins
    body = b'{"ids": ' + array + b', "x": [' + array + b"]}"
    for paths in ([("ids",), ("x",)], [("ids", 0), ("x", 0, -1)], [("ids", -1)]):
        for validate in (True, False):
            got = outcome(c, "find_spans", body, paths, validate=validate)
            assert got == outcome(py, "find_spans", body, paths, validate=validate), (paths, validate)
            if validate:
                assert (got[0] == "ok") == json_accepts(body)
