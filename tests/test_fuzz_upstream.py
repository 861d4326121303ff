"""The upstream side's fuzz (tests/fuzz_upstream.py), bounded: a few hundred seeded cases through both
twins with h11 as the reference, and each shape the fuzz found broken (issue 36: a second response
behind the answer crashed the compiled connection or replaced the answer, bytes past an answer
pooled the connection mid-message, response heads were unbounded) as its own case.

Every case runs in a forked child (``fuzz_upstream.in_child``): a twin that crashes fails its test
instead of ending the session. ``make fuzz`` runs the same harness for minutes, under ASan/UBSan.
"""

from __future__ import annotations

from typing import Any

import pytest
from fuzz_upstream import BOUND_HEAD_BYTES, MODES, UPSTREAM, Case, fuzz, in_child, report, run_h11, run_twin
from helpers import REQUIRE_EXTENSIONS

import fastcore

TWINS = ["py", "c"]
SEED = 36


@pytest.fixture(params=TWINS)
def twin(request: pytest.FixtureRequest) -> str:
    """The upstream side's twin: upstream.py's connection on the httptools parser, or upstream.py
    compiled (server.http._upstream)."""
    if request.param == "c" and UPSTREAM is None:
        if REQUIRE_EXTENSIONS and not fastcore.NO_EXTENSIONS:
            pytest.fail("server.http._upstream required but not built")
        pytest.skip("the compiled twin is not built or FASTCORE_NO_EXTENSIONS=1")
    return str(request.param)


def test_seeded_answers_agree_on_both_twins_and_with_h11() -> None:
    """400 cases on both twins and both read paths of the compiled one: the same events, h11's
    framing where both frame, no crash, no hang (responses behind answers and heads past every
    bound among them)."""
    totals = fuzz(SEED, 0, batch=400, cases=400)
    assert totals.cases == 400
    assert not totals.bad, report(SEED, totals, "400 cases")


ANSWER = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 9\r\n\r\n{"a": 1}\n'
#: what a worker may write behind its answer with nothing outstanding: a whole second response, a
#: 1xx, the start of a head
BEHIND = {
    "response": b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 5\r\n\r\nwrong",
    "chunked": b"HTTP/1.1 503 No\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nwrong\r\n0\r\n\r\n",
    "interim": b"HTTP/1.1 100 Continue\r\n\r\n",
    "partial": b"HTTP/1.1 200 OK\r\nContent-Le",
}


def _behind_case(mode: str, behind: str, split: bool) -> Case:
    data = ANSWER + BEHIND[behind]
    return Case([data], [[len(ANSWER) - 3]] if split else [[]], eof=False, mode=mode)


@pytest.mark.parametrize("behind", list(BEHIND))
@pytest.mark.parametrize("mode", MODES)
def test_bytes_behind_the_answer_close_the_connection_and_the_answer_stands(
    twin: str, mode: str, behind: str
) -> None:
    """A worker that writes more than its answer in one write (nothing else was asked on that
    connection): the answer is the client's, the rest a protocol error that closes the connection."""
    for split in (False, True):
        case = _behind_case(mode, behind, split)
        record = in_child(run_twin, case, twin)
        assert record is not None, "the twin crashed (the child died)"
        (events, left, pooled_at), *_ = record
        assert left != "pooled" and pooled_at is None, (split, record)
        if mode == "coroutine":
            assert events[0][2] == 200 and events[0][4] and events[0][6] == b'{"a": 1}\n', (split, events)
        else:
            assert events[:2] == [("head", 200, b"application/json", 9, None), ("done", b'{"a": 1}\n', True)]
            assert all(e[0] != "error" for e in events), events  # (the answer is whole: nothing fails it)
        assert run_h11(case)[0][:3] == ("done", 200, b'{"a": 1}\n')


def _huge_head(style: str) -> bytes:
    size = 2 * BOUND_HEAD_BYTES
    if style == "count":
        lines = b"".join(b"X-H-%d: v\r\n" % i for i in range(size // 16))
    else:
        name = {"content-type": b"Content-Type", "retry-after": b"Retry-After", "other": b"X-Other"}[style]
        lines = name + b": " + b"t" * size + b"\r\n"
    return b"HTTP/1.1 200 OK\r\n" + lines + b"Content-Length: 2\r\n\r\nok"


@pytest.mark.parametrize("ends", [True, False], ids=["ends", "never-ends"])
@pytest.mark.parametrize("style", ["content-type", "retry-after", "other", "count"])
def test_a_response_head_past_the_bound_is_refused(twin: str, style: str, ends: bool) -> None:
    """A head of 2 MiB (one value, or 130k header lines), whole or never ending, in 64 KiB reads: an
    error before its end (a 502 for the client), never a head handed on or held in memory."""
    data = _huge_head(style)
    if not ends:
        data = data[: data.index(b"Content-Length")]
    case = Case([data], [list(range(65536, len(data), 65536))], eof=False, mode="callbacks")
    record: Any = in_child(run_twin, case, twin)
    assert record is not None, "the twin crashed"
    events = record[0][0]
    assert events and events[0][:2] == ("error", "UpstreamError"), events[:1]
    assert record[0][1] in ("closed", "reset")
