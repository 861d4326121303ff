"""Worker answers for the upstream side's fuzz (tests/fuzz_upstream.py): what one worker writes on
one keep-alive connection, one answer per request (Content-Length and chunked bodies, with and
without trailers, SSE streams, 1xx before the answer, 204/304, close-delimited bodies, keep-alive
and ``Connection: close``), sometimes more whole responses behind an answer in the same write,
mutated (byte flips, truncation, duplication, deletion, header injection, huge values and counts,
bad chunk sizes, obs-fold, bare LF, bare CR, NULs), with the read boundaries it arrives in. A case
is made from ``(seed, index)`` alone, so any case of a run can be made again.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field

#: a response head longer than this, or with more header lines, must be refused (any sane bound is
#: far below: nginx's upstream buffer is 4-8 KB, envoy's header limit 60 KB, a client's 16 KB)
BOUND_HEAD_BYTES = 1024 * 1024
BOUND_HEADERS = 1000
#: how the leg is read: a listener that releases at the end (exchange.py's), one that sets a sink at
#: the head (a stream), a whole body (max_body), or no listener (the coroutine path)
MODES = ("callbacks", "stream", "whole", "coroutine")

# -- answers ---------------------------------------------------------------------------------------


@dataclass
class Case:
    """What a worker writes on one connection: ``exchanges[i]`` after the pool's i-th request, read
    in ``reads[i]`` (boundaries); ``eof``: the worker closes after the last."""

    exchanges: list[bytes]
    reads: list[list[int]]
    eof: bool
    mode: str
    tags: list[str] = field(default_factory=list)
    #: the exchange whose first head is over the bounds (it must be refused), and the lines that make it so
    oversized: int | None = None
    marker: bytes = b""

    def pieces(self, i: int) -> list[bytes]:
        data, cuts = self.exchanges[i], self.reads[i]
        bounds = [0, *cuts, len(data)]
        return [data[a:b] for a, b in itertools.pairwise(bounds) if b > a]

    def show(self) -> str:
        lines = [f"mode={self.mode} eof={self.eof} tags={','.join(self.tags)}"]
        for i, data in enumerate(self.exchanges):
            shown = data if len(data) <= 600 else data[:300] + b"...%d bytes..." % len(data) + data[-200:]
            lines.append(f"  exchange {i}: {shown!r}")
            lines.append(f"    read boundaries: {self.reads[i]}")
        return "\n".join(lines)


def _json_body(rng: random.Random) -> bytes:
    ids = [rng.randrange(150_000) for _ in range(rng.choice((0, 1, 5, 40, 400)))]
    return json.dumps({"id": f"cmpl-{rng.randrange(1000)}", "choices": [{"text": "hi"}], "ids": ids}).encode()


def _head(rng: random.Random, status: int, lines: list[bytes], version: bytes = b"1.1") -> bytes:
    reason = rng.choice((b"OK", b"", b"Whatever Reason", b"\xe9t\xe9"))
    if rng.random() < 0.3:
        lines = [*lines, b"Date: Sun, 06 Dec 2026 03:00:00 GMT", b"Server: uvicorn"]
    if rng.random() < 0.2:
        rng.shuffle(lines)
    return b"HTTP/%s %d %s\r\n%s\r\n" % (version, status, reason, b"".join(line + b"\r\n" for line in lines))


def _chunked(rng: random.Random, pieces: list[bytes], trailers: bool) -> bytes:
    out = []
    for piece in pieces:
        ext = rng.choice((b"", b"", b";x=1", b';name="v"'))
        size = b"%x" % len(piece)
        out.append((size.upper() if rng.random() < 0.2 else size) + ext + b"\r\n" + piece + b"\r\n")
    out.append(b"0\r\n")
    if trailers:
        out.append(b"X-Trailer: 1\r\nServer-Timing: total;dur=3\r\n")
    out.append(b"\r\n")
    return b"".join(out)


def answer(rng: random.Random, last: bool) -> tuple[bytes, str]:
    """One worker answer (its final response, maybe after 1xx) and its kind."""
    kind = rng.choice(("length", "length", "chunked", "sse", "error", "nobody", "close", "interim"))
    if kind == "close" and not last:
        kind = "length"
    close = rng.random() < 0.15 and last
    conn = [b"Connection: close"] if close else ([b"Connection: keep-alive"] if rng.random() < 0.2 else [])
    version = b"1.0" if rng.random() < 0.05 else b"1.1"
    prefix = b""
    if kind == "interim":
        prefix = _head(rng, rng.choice((100, 102, 103)), rng.choice(([], [b"Link: </a>; rel=preload"])))
        kind = rng.choice(("length", "chunked"))
    if kind == "length":
        body = _json_body(rng)
        lines = [b"Content-Type: application/json", b"Content-Length: %d" % len(body), *conn]
        return prefix + _head(rng, 200, lines, version) + body, kind
    if kind in ("chunked", "sse"):
        if kind == "sse":
            events = [b"data: %s\n\n" % _json_body(rng) for _ in range(rng.randrange(1, 6))]
            events.append(b"data: [DONE]\n\n")
            pieces = [e for e in events for e in ([e] if rng.random() < 0.7 else [e[:3], e[3:]]) if e]
            ctype = b"text/event-stream; charset=utf-8"
        else:
            body = _json_body(rng)
            cut = sorted(rng.randrange(len(body) + 1) for _ in range(rng.randrange(3)))
            pieces = [body[a:b] for a, b in zip([0, *cut], [*cut, len(body)]) if b > a]
            ctype = b"application/json"
        lines = [b"Content-Type: " + ctype, b"Transfer-Encoding: chunked", *conn]
        return prefix + _head(rng, 200, lines) + _chunked(rng, pieces, rng.random() < 0.3), kind
    if kind == "error":
        status = rng.choice((400, 404, 429, 500, 502, 503))
        body = b'{"error": {"message": "no", "code": %d}}' % status
        lines = [b"Content-Type: application/json", b"Content-Length: %d" % len(body), *conn]
        if status in (429, 503):
            lines.append(b"Retry-After: %d" % rng.randrange(5))
        return _head(rng, status, lines, version) + body, kind
    if kind == "nobody":
        status = rng.choice((204, 304))
        lines = rng.choice(([], [b"Content-Length: 0"], [b"Content-Length: 17"] if status == 304 else []))
        return _head(rng, status, [*lines, *conn]), kind
    body = _json_body(rng)  # close-delimited: no framing header, the worker's close ends it
    return _head(rng, 200, [b"Content-Type: application/json", b"Connection: close"], version) + body, kind


# -- mutations ---------------------------------------------------------------------------------------

INJECTED = (
    b"Content-Length: 3",
    b"Content-Length: 0",
    b"Content-Length: -1",
    b"Content-Length: 99999999999999999999",
    b"Content-Length: 1, 1",
    b"Transfer-Encoding: chunked",
    b"Transfer-Encoding: gzip, chunked",
    b"Transfer-Encoding: identity",
    b"Content-Type: text/event-stream",
    b"Connection: close",
    b"Connection: upgrade",
    b"Upgrade: h2c",
    b"Retry-After: 7",
    b"X: \x00",
    b"Bad Name: v",
    b": empty name",
    b"X-Long: " + b"v" * 20_000,
)
BAD_CHUNK_SIZES = (
    b"ffffffffffffffffff",
    b"-1",
    b"0x5",
    b" 5",
    b"5 ",
    b"g",
    b"",
    b"5;" + b"e" * 5000,
    b"1\r\n\r",
)

MUTATIONS = "flip flip truncate duplicate delete inject huge chunk fold lf cr nul".split()


def _mutate(rng: random.Random, data: bytes, case: Case, i: int, known: bool) -> bytes:
    buf = bytearray(data)
    op = rng.choice(MUTATIONS)
    if op == "huge" and not known:
        op = "flip"
    case.tags.append(op)
    at = rng.randrange(len(buf) + 1)
    heads = [i + 2 for i in range(len(buf)) if buf[i : i + 2] == b"\r\n"]
    if op == "flip" and buf:
        buf[min(at, len(buf) - 1)] = rng.randrange(256)
    elif op == "truncate":
        del buf[at:]
    elif op == "duplicate":
        end = min(len(buf), at + rng.choice((1, 8, 64, len(buf))))
        buf[at:at] = buf[at:end]
    elif op == "delete":
        del buf[at : at + rng.randrange(1, 8)]
    elif op == "inject" and heads:
        line = rng.choice(INJECTED)
        pos = rng.choice(heads[: rng.randrange(1, 6)])
        buf[pos:pos] = line + b"\r\n"
    elif op == "huge" and heads:
        return _huge(rng, bytes(buf), case, i)
    elif op == "chunk":
        sizes = [i for i in heads if i < len(buf) and chr(buf[i]) in "0123456789abcdefABCDEF"]
        if sizes:
            pos = rng.choice(sizes)
            end = buf.find(b"\r\n", pos)
            buf[pos : end if end >= 0 else pos] = rng.choice(BAD_CHUNK_SIZES)
    elif op == "fold" and heads:
        pos = rng.choice(heads[:6]) - 2
        buf[pos:pos] = rng.choice((b"\r\n folded", b"\r\n\tfolded", b"\r\n "))
    elif op == "lf" and heads:
        for pos in sorted(rng.sample(heads, min(len(heads), rng.randrange(1, 4))), reverse=True):
            del buf[pos - 2]
    elif op == "cr" and heads:
        pos = rng.choice(heads)
        buf[pos - 1 : pos] = b""
    elif op == "nul":
        buf[at:at] = b"\x00" * rng.choice((1, 1, 3))
    return bytes(buf)


def _huge(rng: random.Random, data: bytes, case: Case, i: int) -> bytes:
    """A huge value or count of headers in exchange ``i``'s first head (a 1xx's or its answer's)."""
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return data
    style = rng.choice(("content-type", "retry-after", "other", "count"))
    size = rng.choice((20_000, 70_000, 300_000, 1_100_000, 2_500_000))
    if style == "count":
        n = size // 40
        lines = b"".join(b"X-H-%d: %s\r\n" % (i, b"v" * 30) for i in range(n))
        oversized = n > BOUND_HEADERS
    else:
        name = {"content-type": b"Content-Type", "retry-after": b"Retry-After", "other": b"X-Huge"}[style]
        lines = name + b": " + b"t" * size + b"\r\n"
        oversized = size > BOUND_HEAD_BYTES
    case.tags.append(f"huge-{style}-{size}")
    if oversized and case.oversized is None:
        case.oversized, case.marker = i, lines
    return data[: end + 2] + lines + data[end + 2 :]


def endless_head(rng: random.Random) -> bytes:
    """A head that never ends: header lines (or one value) past every bound."""
    one = rng.random() < 0.5
    filler = b"X-Content-Type: " + b"v" * (3 * 1024 * 1024) if one else b"X-H: v\r\n" * 400_000
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: "
        + (b"t" * 600_000 if rng.random() < 0.3 else b"a/b")
        + b"\r\n"
        + filler
    )


def make_case(seed: int, index: int, known: bool = True, trim: Callable[[Case], None] | None = None) -> Case:
    """The case ``index`` of ``seed`` (the same bytes and boundaries wherever it is made). ``known``
    False: no response behind an answer, no head over the bounds (the open findings' shapes, which
    tests/test_fuzz_upstream.py has as their own cases); ``trim`` edits the bytes before the read
    boundaries are drawn."""
    rng = random.Random(f"{seed}:{index}")
    roll = rng.random()
    n = 1 if roll < 0.6 else rng.randrange(2, 4)
    exchanges, kinds = [], []
    for i in range(n):
        data, kind = answer(rng, last=i == n - 1)
        exchanges.append(data)
        kinds.append(kind)
    case = Case(exchanges, [], eof=False, mode=rng.choice(MODES), tags=list(kinds))
    if known and rng.random() < 0.15:  # more whole responses behind an answer, in the same write
        i = rng.randrange(n)
        behind = b"".join(answer(rng, last=True)[0] for _ in range(rng.randrange(1, 3)))
        exchanges[i] += behind
        case.tags.append(f"behind-{i}")
    if known and rng.random() < 0.01:
        exchanges[0] = endless_head(rng)
        case.oversized, case.marker = 0, exchanges[0][-1000:]
        case.tags.append("endless-head")
    for _ in range(rng.choice((0, 0, 1, 1, 2, 3))):
        i = rng.randrange(len(exchanges))
        exchanges[i] = _mutate(rng, exchanges[i], case, i, known)
    if case.oversized is not None:  # still there, and still in the first head (no mutation ended it before)
        at = exchanges[case.oversized].find(case.marker)
        if at < 0 or b"\r\n\r\n" in exchanges[case.oversized][:at]:
            case.oversized = None
    case.eof = "close" in kinds or rng.random() < 0.4
    if trim is not None:
        trim(case)
    for data in exchanges:
        if rng.random() < 0.1 and len(data) < 3000:
            cuts = list(range(1, len(data)))  # byte by byte
        elif len(data) > 100_000:
            cuts = sorted(rng.sample(range(1, len(data)), 40))
        else:
            cuts = sorted({rng.randrange(1, max(2, len(data))) for _ in range(rng.choice((0, 1, 2, 4, 12)))})
        case.reads.append([c for c in cuts if 0 < c < len(data)])
    return case
