"""The two HTTP parsers (server.http._parse, compiled; server.http._parse_py, its pure twin) agree.

Both frame the same bytes, split into the same reads, into the same events (what the connection
receives: a request's begin, its head, each chunked body piece, its end) and the same refusal,
status and words. The server's own tests (test_http_server, test_http_abuse, test_http_memory)
run every test on each parser through real sockets; here the two are fed the same reads side by
side, which is what pins "identical behaviour" where a socket would not split the bytes the
same way twice: requests valid and mutated, every split, bounds small enough to be hit. Likewise
the response parsers (the upstream side, test_http_client on sockets): the same head (status and
the four headers read), body pieces, end and error for a worker's bytes.
"""

from __future__ import annotations

import gc
import importlib
import itertools
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import pytest
from helpers import REQUIRE_EXTENSIONS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastcore
from server.http import _parse_py
from server.http.limits import MAX_RESPONSE_HEAD_BYTES, MAX_RESPONSE_HEADERS, Limits
from server.http.request import BadResponse, Refused, Request

LIMITS = [
    Limits(),
    Limits(max_header_bytes=120, max_headers=4, max_body_bytes=64),
    Limits(max_header_bytes=300, max_headers=8, max_body_bytes=700),
]


def compiled() -> ModuleType:
    if fastcore.NO_EXTENSIONS:
        pytest.skip("FASTCORE_NO_EXTENSIONS=1")
    try:
        return importlib.import_module("server.http._parse")
    except ImportError as exc:
        if REQUIRE_EXTENSIONS:
            pytest.fail(f"server.http._parse required but not importable: {exc}")
        pytest.skip(f"server.http._parse not built: {exc}")


class Recorder:
    """Stands where the connection stands: records the parser's events, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def on_message_begin(self, req: Request) -> None:
        self.events.append(("begin",))

    def on_head(self, req: Request) -> None:
        head = (req.method, req.url, req.path, req.query, req.version, req.headers, req.content_length)
        self.events.append(("head", *head, req.chunked, req.expect_continue, req.hosts))

    def on_body_piece(self, req: Request, n: int) -> None:
        self.events.append(("piece", n))

    def on_message_complete(self, req: Request) -> None:
        self.events.append(("complete", req.body, req.keep_alive, req.size))


def events(parser_class: Any, reads: Sequence[bytes], limits: Limits) -> list[tuple[Any, ...]]:
    """What the parser hands a connection for ``reads``, ending with its refusal if it refuses."""
    conn = Recorder()
    parser = parser_class(conn, limits)
    for data in reads:
        try:
            parser.feed(data)
        except Refused as exc:
            conn.events.append(("refused", exc.status, exc.message))
            break
    return conn.events


def assert_agree(reads: Sequence[bytes], limits: Limits) -> list[tuple[Any, ...]]:
    pure = events(_parse_py.RequestParser, reads, limits)
    assert events(compiled().RequestParser, reads, limits) == pure, reads
    return pure


HEAD = b"POST /p?q=1 HTTP/1.1\r\nHost: t\r\n"
CASES = {
    "content-length": HEAD + b"Content-Length: 5\r\n\r\nhello",
    "chunked-trailers": HEAD
    + b"Transfer-Encoding: chunked\r\n\r\n3;x=y\r\nabc\r\n2\r\nde\r\n0\r\nT: 1\r\nU: 2\r\n\r\n",
    "pipelined": b"GET / HTTP/1.1\r\nHost: t\r\n\r\n" * 3,
    "http10": b"GET / HTTP/1.0\r\n\r\n",
    "two-hosts": b"GET / HTTP/1.1\r\nHost: a\r\nhOsT: b\r\n\r\n",
    "no-host": b"GET / HTTP/1.1\r\nX: 1\r\n\r\n",
    "http2": b"GET / HTTP/2.0\r\nHost: t\r\n\r\n",
    "upgrade": b"GET / HTTP/1.1\r\nHost: t\r\nConnection: upgrade\r\nUpgrade: h2c\r\n\r\n",
    "connect": b"CONNECT a:443 HTTP/1.1\r\nHost: a\r\n\r\n",
    "absolute-form": b"GET http://a/ HTTP/1.1\r\nHost: a\r\n\r\n",
    "gzip-te": HEAD + b"Transfer-Encoding: gzip\r\n\r\n",
    "two-te": HEAD + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "te-spaces": HEAD + b"transfer-encoding:  Chunked \r\n\r\n0\r\n\r\n",
    "expect": HEAD + b"Expect: 100-Continue\r\nContent-Length: 1\r\n\r\nx",
    "expect-other": HEAD + b"Expect: 200-ok\r\n\r\n",
    "expect-http10": b"POST / HTTP/1.0\r\nExpect: 100-continue\r\nContent-Length: 1\r\n\r\nx",
    "content-encoding": HEAD + b"Content-Encoding: gzip\r\nContent-Length: 1\r\n\r\nx",
    "content-encoding-identity": HEAD + b"Content-Encoding:  IDENTITY\r\nContent-Length: 1\r\n\r\nx",
    "empty-values": b"GET / HTTP/1.1\r\nHost: t\r\nX-E:\r\nContent-Encoding:\r\n\r\n",
    "cl-and-te": HEAD + b"Content-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "obs-fold": b"GET / HTTP/1.1\r\nHost: t\r\nX: a\r\n b\r\n\r\n",
    "bare-lf": b"GET / HTTP/1.1\nHost: t\n\n",
    "chunk-overflow": HEAD + b"Transfer-Encoding: chunked\r\n\r\n1" + b"0" * 20 + b"\r\n",
    # the largest size llhttp takes (2**64 - 1), after a chunk: no wrap-around of the sum
    "chunk-2**64-1": HEAD + b"Transfer-Encoding: chunked\r\n\r\n2\r\nab\r\n" + b"F" * 16 + b"\r\n",
    "http10-chunked": b"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\n0\r\n\r\n",
    "keep-alive-close": b"GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
}


@pytest.mark.parametrize("limits", LIMITS, ids=["default", "tiny", "small"])
@pytest.mark.parametrize("step", [0, 1, 2, 7])
@pytest.mark.parametrize("case", list(CASES))
def test_same_events_and_refusals(case: str, step: int, limits: Limits) -> None:
    data = CASES[case]
    reads = [data] if not step else [data[i : i + step] for i in range(0, len(data), step)]
    assert assert_agree(reads, limits)


def test_a_chunk_that_ends_in_a_read_is_not_read_again_for_its_size() -> None:
    """A chunk whose data ends inside a read, followed there by as many bytes as it had: the pure
    twin once took the data for the size line ("ab" -> 171 bytes) and refused a valid request."""
    reads = [HEAD + b"Transfer-Encoding: chunked\r\n\r\n2\r", b"\nab\r\n0\r", b"\n\r\n"]
    assert assert_agree(reads, Limits(max_body_bytes=64))[-1] == ("complete", b"ab", True, 2)


def test_a_chunk_size_split_over_reads_is_refused_from_its_size() -> None:
    limits = Limits(max_body_bytes=4096)
    reads = [HEAD + b"Transfer-Encoding: chunked\r\n\r\n", *(bytes([b]) for b in b"1000000;e=1\r\n")]
    assert assert_agree(reads, limits)[-1] == (
        "refused",
        413,
        "a chunk of 16777216 bytes takes the request body past the limit of 4096 bytes",
    )


@pytest.mark.parametrize("after", [b"\x00", b"E: 1\r\n\r\n", b"\r\n"])
def test_a_field_is_checked_when_the_next_begins_or_the_section_ends(after: bytes) -> None:
    """httptools hands the pure twin a field when the next one begins (or the headers, or the
    trailer section, end), not at its CRLF: the compiled twin checks it there too, so a read that
    ends between the two refuses the same way (here the fifth of at most four headers: a 431, or a
    400 for a next field that is not one)."""
    limits = Limits(max_headers=4)
    head = b"GET / HTTP/1.1\r\nHost: t\r\nA: 1\r\nB: 1\r\nC: 1\r\nD: 1\r\n"
    status = assert_agree([head, after], limits)[-1][1]
    assert status == (400 if after == b"\x00" else 431)
    trailers = b"T: 1\r\n" * 5
    reads = [HEAD + b"Transfer-Encoding: chunked\r\n\r\n0\r\n" + trailers, after]
    status = assert_agree(reads, limits)[-1][1]
    assert status == (400 if after == b"\x00" else 431)


_TOKEN = st.text(
    alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-", min_size=1, max_size=12
)
_SPECIAL = [
    b"\r\n",
    b"\n",
    b"\r",
    b"\x00",
    b" ",
    b":",
    b"\t",
    b"0",
    b";",
    b"ff",
    b"Host: t\r\n",
    b"Content-Length: 3\r\n",
    b"Transfer-Encoding: chunked\r\n",
    b"Expect: 100-continue\r\n",
    b"Content-Encoding: br\r\n",
    b"HTTP/1.0",
    b"0\r\nT: x\r\n\r\n",
]


@st.composite
def streams(draw: st.DrawFn) -> bytes:
    """Requests, valid or not: a head of drawn fields, a body framed one way or another, then mutated."""
    out = b""
    for _ in range(draw(st.integers(1, 3))):
        head = b"%s /%s HTTP/1.%d\r\n" % (
            draw(st.sampled_from([b"GET", b"POST", b"PUT", b"HEAD"])),
            draw(_TOKEN).encode() * draw(st.sampled_from([1, 1, 20])),
            draw(st.sampled_from([1, 1, 0])),
        )
        fields = draw(
            st.lists(st.tuples(_TOKEN, st.text(alphabet="abc xyz/;=,0123", max_size=30)), max_size=6)
        )
        head += b"Host: t\r\n" * draw(st.sampled_from([1, 1, 1, 1, 0, 2]))
        head += b"".join(b"%s: %s\r\n" % (k.encode(), v.encode()) for k, v in fields)
        body = draw(st.binary(max_size=300))
        if draw(st.booleans()):
            pieces = [body[a:b] for a, b in itertools.pairwise([0, len(body) // 3, len(body)])]
            out += head + b"Transfer-Encoding: chunked\r\n\r\n"
            out += b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces if p) + b"0\r\n"
            out += b"".join(b"T%d: %s\r\n" % (i, b"v" * 20) for i in range(draw(st.integers(0, 6)))) + b"\r\n"
        else:
            out += head + b"Content-Length: %d\r\n\r\n" % len(body) + body
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 2, 3]))):
        at = draw(st.integers(0, len(out)))
        cut = draw(st.integers(0, 4))
        out = out[:at] + draw(st.sampled_from(_SPECIAL)) + out[at + cut :]
    return out


@settings(
    max_examples=300, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)
@given(data=st.data())
def test_property_same_events_and_refusals_for_any_bytes_in_any_reads(data: st.DataObject) -> None:
    stream = data.draw(streams(), label="stream")
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=12), label="cuts"))
    reads = [stream[a:b] for a, b in itertools.pairwise([0, *cuts, len(stream)]) if b > a]
    limits = data.draw(st.sampled_from(LIMITS), label="limits")
    assert_agree(reads, limits)


# -- the response parsers ------------------------------------------------------------------------


class ResponseRecorder:
    """Stands where the upstream connection stands: records the response parser's events."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def on_head(
        self, status: int, content_type: bytes, content_length: int | None, retry_after: bytes | None
    ) -> None:
        self.events.append(("head", status, content_type, content_length, retry_after))

    def on_body(self, body: bytes) -> None:
        self.events.append(("body", body))

    def on_message_complete(self, keep_alive: bool) -> None:
        self.events.append(("complete", keep_alive))


def response_events(parser_class: Any, reads: Sequence[bytes]) -> list[tuple[Any, ...]]:
    conn = ResponseRecorder()
    parser = parser_class(conn)
    for data in reads:
        try:
            parser.feed(data)
        except BadResponse as exc:
            conn.events.append(("bad", str(exc)))
            break
    return conn.events


def assert_responses_agree(reads: Sequence[bytes]) -> list[tuple[Any, ...]]:
    pure = response_events(_parse_py.ResponseParser, reads)
    assert response_events(compiled().ResponseParser, reads) == pure, reads
    return pure


RESPONSES = {
    "content-length": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}",
    "chunked": b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"5\r\ndata:\r\n3\r\n x\n\r\n0\r\n\r\n",
    "close-delimited": b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end",
    "interim": b"HTTP/1.1 100 Continue\r\nX: 1\r\n\r\nHTTP/1.1 200 OK\r\ncontent-type: a/b\r\ncontent-length: 1\r\n\r\nz",
    "retry-after": b"HTTP/1.1 503 Busy\r\nRetry-After: 3\r\nRETRY-AFTER: 4\r\nContent-Length: 0\r\n\r\n",
    "two-content-types": b"HTTP/1.1 200 OK\r\nContent-Type: a\r\nContent-Type: b\r\nContent-Length: 0\r\n\r\n",
    "empty-content-type": b"HTTP/1.1 200 OK\r\nContent-Type:\r\nContent-Length: 0\r\n\r\n",
    "keep-alive-pipelined": b"HTTP/1.1 204 No Content\r\n\r\nHTTP/1.0 200 OK\r\nContent-Length: 1\r\n\r\na",
    "upgrade": b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: h2c\r\n\r\nbytes",
    "cl-and-te": b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "te-gzip": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nrest",
    "bad-status": b"HTTP/1.1 2x0 OK\r\n\r\n",
    "bad-length": b"HTTP/1.1 200 OK\r\nContent-Length: 1x\r\n\r\n",
    "long-name": b"HTTP/1.1 200 OK\r\nX-" + b"n" * 40 + b": v\r\nContent-Length: 0\r\n\r\n",
}


@pytest.mark.parametrize("step", [0, 1, 3])
@pytest.mark.parametrize("case", list(RESPONSES))
def test_responses_same_events_and_errors(case: str, step: int) -> None:
    data = RESPONSES[case]
    reads = [data] if not step else [data[i : i + step] for i in range(0, len(data), step)]
    assert assert_responses_agree(reads)


@settings(
    max_examples=200, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)
@given(data=st.data())
def test_property_responses_same_events_for_any_bytes_in_any_reads(data: st.DataObject) -> None:
    stream = b"".join(
        data.draw(st.lists(st.sampled_from(list(RESPONSES.values())[:7]), min_size=1, max_size=3))
    )
    for _ in range(data.draw(st.sampled_from([0, 0, 1, 2]), label="mutations")):
        at = data.draw(st.integers(0, len(stream)))
        stream = (
            stream[:at] + data.draw(st.sampled_from(_SPECIAL)) + stream[at + data.draw(st.integers(0, 3)) :]
        )
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=10), label="cuts"))
    assert_responses_agree([stream[a:b] for a, b in itertools.pairwise([0, *cuts, len(stream)]) if b > a])


# -- a worker's head, bounded; one response per request ----------------------------------------------

_HEAD = b"HTTP/1.1 200 OK\r\n"
BOUNDED_HEADS = {
    # a value that never ends, and a name that never ends
    "endless-content-type": _HEAD + b"Content-Type: " + b"t" * (MAX_RESPONSE_HEAD_BYTES + 10),
    "endless-retry-after": _HEAD + b"Retry-After: " + b"1" * (MAX_RESPONSE_HEAD_BYTES + 10),
    "endless-other": _HEAD + b"X-Other: " + b"o" * (MAX_RESPONSE_HEAD_BYTES + 10),
    "endless-name": _HEAD + b"X-" + b"n" * (MAX_RESPONSE_HEAD_BYTES + 10),
    # heads that end: at the bound (taken), one byte past it, many fields adding up, too many fields
    # (a head's reads count whole while it is in progress: one whose every byte is under the bound is
    # taken however it is cut; its fields' bytes are counted exactly at its end: X, 14 + 1, the value)
    "under-the-bound": _HEAD
    + b"X: "
    + b"v" * (MAX_RESPONSE_HEAD_BYTES - 100)
    + b"\r\nContent-Length: 0\r\n\r\n",
    "past-the-bound": _HEAD
    + b"X: "
    + b"v" * (MAX_RESPONSE_HEAD_BYTES - 15)
    + b"\r\nContent-Length: 0\r\n\r\n",
    "adding-up": _HEAD + b"".join(b"X-%d: %s\r\n" % (i, b"v" * 999) for i in range(66)) + b"\r\n",
    "as-many-as-allowed": _HEAD + b"".join(b"X-%d: 1\r\n" % i for i in range(MAX_RESPONSE_HEADERS)) + b"\r\n",
    "too-many": _HEAD + b"".join(b"X-%d: 1\r\n" % i for i in range(MAX_RESPONSE_HEADERS + 1)) + b"\r\n",
    "too-many-then-endless": _HEAD
    + b"".join(b"X-%d: 1\r\n" % i for i in range(MAX_RESPONSE_HEADERS + 1))
    + b"Y: "
    + b"y" * (MAX_RESPONSE_HEAD_BYTES + 10),
}
HEAD_WORDS = f"response head exceeds {MAX_RESPONSE_HEAD_BYTES} bytes"
HEADERS_WORDS = f"more than {MAX_RESPONSE_HEADERS} response headers"
BOUNDED_EXPECTED = {
    "under-the-bound": None,
    "as-many-as-allowed": None,
    "too-many": HEADERS_WORDS,
    "too-many-then-endless": HEADERS_WORDS,
}


@pytest.mark.parametrize("step", [0, 1000, 4096, 16384])
@pytest.mark.parametrize("case", list(BOUNDED_HEADS))
def test_a_worker_head_past_its_bounds_is_refused_by_both_twins_alike(case: str, step: int) -> None:
    """A head whose fields' bytes or count pass limits.py's bounds is refused, in the same read and
    words by both twins, whatever the reads; a head at the bounds is taken. A head that never ends is
    refused by the read that takes it past the bound plus one read: what a parser holds of it is
    bounded (the memory of an endless Content-Type, which was not)."""
    data = BOUNDED_HEADS[case]
    reads = [data] if not step else [data[i : i + step] for i in range(0, len(data), step)]
    events = assert_responses_agree(reads)
    words = BOUNDED_EXPECTED.get(case, HEAD_WORDS)
    if words is None:
        assert events[0][0] == "head", events
    else:
        assert events == [("bad", words)], events
    for twin in (_parse_py, compiled()):
        parser = twin.ResponseParser(ResponseRecorder())
        fed = 0
        with pytest.raises(BadResponse) if words else _nothing():
            for data_read in reads:
                parser.feed(data_read)
                fed += len(data_read)
        if words == HEAD_WORDS:
            assert fed <= MAX_RESPONSE_HEAD_BYTES + 2 * max(step, len(_HEAD) + 20), (twin, fed)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@settings(
    max_examples=100, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)
@given(data=st.data())
def test_property_a_worker_head_near_its_bounds_same_refusal_in_any_reads(data: st.DataObject) -> None:
    """Fields of any sizes and count around the bounds, cut at any reads: the twins agree."""
    sizes = data.draw(
        st.lists(st.integers(0, MAX_RESPONSE_HEAD_BYTES // 2), min_size=1, max_size=4), label="sizes"
    )
    count = data.draw(st.integers(0, MAX_RESPONSE_HEADERS + 2), label="short fields")
    ends = data.draw(st.booleans(), label="head ends")
    stream = _HEAD + b"".join(b"X-%d: %s\r\n" % (i, b"v" * n) for i, n in enumerate(sizes))
    stream += b"".join(b"S-%d: 1\r\n" % i for i in range(count))
    stream += b"Content-Length: 0\r\n\r\n" if ends else b"Open: " + b"o" * data.draw(st.integers(0, 70000))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=12), label="cuts"))
    assert_responses_agree([stream[a:b] for a, b in itertools.pairwise([0, *cuts, len(stream)]) if b > a])


@pytest.mark.parametrize("twin_name", ["py", "c"])
def test_a_message_past_a_response_is_refused_until_the_next_request(twin_name: str) -> None:
    """One response per request: a second message behind an answer (in its read or a later one) is
    refused; a 1xx is followed by its answer; ``ended`` set False (the connection sending its next
    request) lets the next answer in."""
    twin = _parse_py if twin_name == "py" else compiled()
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    conn = ResponseRecorder()
    parser = twin.ResponseParser(conn)
    with pytest.raises(BadResponse, match=r"^bytes past the end of the response$"):
        parser.feed(answer + answer)
    assert conn.events == [("head", 200, b"", 2, None), ("body", b"ok"), ("complete", True)]
    conn = ResponseRecorder()
    parser = twin.ResponseParser(conn)
    parser.feed(b"HTTP/1.1 100 Continue\r\n\r\n" + answer)
    with pytest.raises(BadResponse, match="past the end"):
        parser.feed(b"H")
    parser = twin.ResponseParser(conn)
    parser.feed(answer)
    parser.ended = False
    parser.feed(answer)
    assert [e[0] for e in conn.events].count("complete") == 4


def test_a_body_piece_that_is_a_whole_read_is_that_read_not_a_copy() -> None:
    """The compiled twin hands on a read that is all body as the read's own bytes object (the middle
    reads of a large body, of a streamed response); a piece of a read is copied (the pure twin: always)."""
    twin = compiled()
    body = b"b" * 5000
    conn = Recorder()
    parser = twin.RequestParser(conn, Limits())
    parser.feed(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % (2 * len(body)))
    first, second = body, bytes(body)
    parser.feed(first)
    parser.feed(second)
    assert conn.events[-1] == ("complete", body + body, True, 2 * len(body))
    parser.feed(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % len(body))
    parser.feed(second)
    assert conn.events[-1][1] is second  # the whole body, one read: no copy, no join
    response = ResponseRecorder()
    upstream = twin.ResponseParser(response)
    upstream.feed(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\nab" % (len(body) + 2))
    upstream.feed(first)
    assert response.events[1] == ("body", b"ab") and response.events[2][1] is first
    whole = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nab"
    upstream.ended = False  # the next request sent (the connection does this)
    upstream.feed(whole)
    assert response.events[-2][1] == b"ab" and response.events[-2][1] is not whole


@pytest.mark.parametrize(
    ("second", "status"), [(b"zz\r\n", 400), (b"3c\r\n" + b"b" * 60, 413), (b"100\r\n", 413)]
)
def test_a_refused_request_s_body_is_not_kept_by_the_compiled_parser(second: bytes, status: int) -> None:
    """A refusal mid-body (a malformed chunk size, bytes past the limit, a declared size past it): the
    body read so far is the connection's to drop (it drops its request's); the compiled twin, which
    gathers the pieces itself, keeps none of them."""
    parser = compiled().RequestParser(Recorder(), Limits(max_body_bytes=100))
    parser.feed(HEAD + b"Transfer-Encoding: chunked\r\n\r\n32\r\n" + b"a" * 50 + b"\r\n")
    assert any(isinstance(o, list) and o for o in gc.get_referents(parser))  # the first piece, held
    with pytest.raises(Refused) as refused:
        parser.feed(second)
    assert refused.value.status == status
    assert not [o for o in gc.get_referents(parser) if isinstance(o, (list, bytes)) and o]


def read_into(parser: Any, data: bytes) -> tuple[int, int]:
    """One read as uvloop makes it on the compiled parser: into what get_buffer hands (at most its size
    of ``data``), then feed_buffered; (the buffer's size, the bytes read)."""
    window = memoryview(parser.get_buffer(-1)).cast("B")
    n = min(len(window), len(data))
    window[:n] = data[:n]
    parser.feed_buffered(n)
    return len(window), n


def test_a_read_between_messages_takes_a_head_and_a_large_bodys_rest_goes_straight_into_it() -> None:
    """Compiled parser: between messages uvloop gets the read buffer's first HEAD_READ bytes (a head
    and the start of its body), so a large body of a known length is read into its own bytes object
    from there on instead of up to 64 KB of it being copied there out of a whole read buffer; in the
    middle of any other message (a chunked body) a read takes the whole buffer."""
    _parse = compiled()
    conn = Recorder()
    parser = _parse.RequestParser(conn, Limits(max_body_bytes=1 << 20))
    body = bytes(range(256)) * 640  # 160 KB: a 40k-token prompt
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % len(body)
    data = head + body
    size, n = read_into(parser, data)
    assert size == n == _parse.HEAD_READ < _parse.READ_BUFFER
    size, n = read_into(parser, data[n:])
    assert size == n == len(data) - _parse.HEAD_READ  # the rest of the body, into its own bytes
    assert conn.events[-1] == ("complete", body, True, len(body))
    chunked_head = b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab"
    assert read_into(parser, chunked_head) == (_parse.HEAD_READ, len(chunked_head))
    assert read_into(parser, b"cde\r\n0\r\n\r\n") == (_parse.READ_BUFFER, 10)  # mid-message: all of it
    assert conn.events[-1][:2] == ("complete", b"abcde")
    assert len(memoryview(parser.get_buffer(-1))) == _parse.HEAD_READ  # between messages again


def test_a_request_after_a_large_one_is_framed_the_same_however_the_reads_split(
    http_twin: ModuleType,
) -> None:
    """A valid request pipelined after a 17 KB one (its body past the 16 KB header limit): the first
    request's head being in progress when a read began is not counted against the second's head,
    which that read also began; the two requests in one read and split at every boundary (the first
    read ending inside the first head) give the same events, on each twin."""
    body = b"x" * (17 * 1024)
    first = HEAD + b"Content-Length: %d\r\n\r\n" % len(body) + body
    data = first + b"GET /second HTTP/1.1\r\nHost: t\r\n\r\n"
    whole = events(http_twin.RequestParser, [data], Limits())
    assert [e[0] for e in whole] == ["begin", "head", "complete", "begin", "head", "complete"]
    lead = 10  # the first read: inside the first request's head
    for cut in range(lead + 1, len(data)):
        reads = [data[:lead], data[lead:cut], data[cut:]]
        assert events(http_twin.RequestParser, reads, Limits()) == whole, cut
