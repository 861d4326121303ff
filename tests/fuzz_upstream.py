"""Fuzz the upstream side: ``python -m tests.fuzz_upstream --seconds N [--seed S]`` (``make fuzz`` runs
it under ASan/UBSan).

Each case (tests/upstream_answers.py: what one worker writes on one keep-alive connection, mutated
and split at random read boundaries) runs through both twins of the connection
(server/http/upstream.py compiled as ``_upstream``: its ``Connection``, its own ``ResponseParser``,
fed bytes objects and, as uvloop does, read into through ``get_buffer``/``buffer_updated``; and
upstream.py's pure ``_Connection`` on _parse_py.py's parser) with no socket: a stand-in transport, a pool on an event loop
that never runs, and a listener that does what server/orchestrator/exchange.py's does (release at
the end, a sink set at the head) or no listener (the coroutine path, released after the reads).

What must hold:

- the twins report the same events: heads (status, Content-Type, Content-Length, Retry-After), the
  body bytes, the end and keep-alive, the error (type and words), and leave the connection the same
  way (pooled, closed, reset);
- where h11 (the reference) frames an answer, a twin that frames it too frames it the same
  (status, the headers it hands on, body bytes), and pools the connection only if h11 would reuse it: bytes past an answer
  with nothing outstanding are a protocol error, the connection closes and that answer stands;
- a response head past ``BOUND_HEAD_BYTES`` or ``BOUND_HEADERS`` is refused (a worker's head is
  bounded like a client's);
- nothing crashes, hangs or grows: each batch of cases runs in a forked child, so a crash or a hang
  is reported with its case (reproducer bytes and read boundaries) and the fuzz goes on; the
  child's RSS is checked after each batch.

Where a twin is stricter than h11 (refuses what h11 frames) or laxer (frames what h11 refuses) is
counted by reason and printed, not failed: llhttp's strictness differs from h11's on purpose. A case
is ``(seed, index)``: ``--seed S --case K`` replays one and prints it.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import importlib
import json
import os
import pickle
import select
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import h11

import fastcore
from server.http import UpstreamPool, client
from server.http import _parse_py as PURE_PARSE

# Run as ``python -m tests.fuzz_upstream`` its sibling is tests.upstream_answers; imported by
# tests/test_fuzz_upstream.py (tests/ on the path, as for the tests' helpers) it is upstream_answers.
if __package__:
    from . import upstream_answers as answers
else:
    import upstream_answers as answers
Case = answers.Case
BOUND_HEAD_BYTES, BOUND_HEADERS, MODES = answers.BOUND_HEAD_BYTES, answers.BOUND_HEADERS, answers.MODES

UPSTREAM: Any = None
if not fastcore.NO_EXTENSIONS:  # FASTCORE_NO_EXTENSIONS=1: the pure twin alone (the summary says so)
    try:
        UPSTREAM = importlib.import_module("server.http._upstream")
    except ImportError:
        if os.environ.get("FASTCORE_REQUIRE_EXTENSIONS") == "1":
            raise

#: max_body of the "whole" mode (a context leg's answer read whole)
WHOLE_LIMIT = 1 << 20
#: a case's budget in the child; one that runs past it is reported as a hang
CASE_TIMEOUT_S = 20.0
#: RSS growth of one child over its cases (after its first batch) reported as memory growing
RSS_GROWTH_LIMIT = 256 * 1024 * 1024
#: under ASan (make fuzz) RSS is not judged: its quarantine keeps freed memory (256 MB by default)
SANITIZED = "libasan" in os.environ.get("LD_PRELOAD", "")
REQUEST_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: w\r\nContent-Length: 0\r\n\r\n"


def make_case(seed: int, index: int, known: bool = True) -> Case:
    """upstream_answers' case ``index`` of ``seed``; ``known`` False: also no byte past an answer
    where h11 frames one (none of the open findings' shapes, which the tests have as their own)."""
    return answers.make_case(seed, index, known, trim=None if known else _cut_behind)


def _cut_behind(case: Case) -> None:
    for i, framing in enumerate(run_h11(case)):
        if framing[0] == "done" and framing[4] < len(case.exchanges[i]):
            case.exchanges[i] = case.exchanges[i][: framing[4]]
            case.tags.append(f"cut-{i}")


# -- the twins, without sockets ---------------------------------------------------------------------


class Transport:
    """Stands where asyncio's transport stands: records how the connection ends."""

    def __init__(self) -> None:
        self.state = "open"

    def write(self, data: Any = None) -> None:
        pass

    writelines = pause_reading = resume_reading = write

    def is_closing(self) -> bool:
        return self.state != "open"

    def close(self) -> None:
        if self.state == "open":
            self.state = "closed"

    def abort(self) -> None:
        self.state = "reset"

    def get_extra_info(self, name: str) -> None:
        return None


class Listener:
    """What exchange.py's listener does with a leg: ``stream`` sets a sink at the head; the end and
    an error release the response (back to the pool, or closed)."""

    def __init__(self, events: list[tuple[Any, ...]], stream: bool) -> None:
        self.events = events
        self.stream = stream
        self.streamed: list[bytes] = []
        self.headed = False

    def _head(self, resp: Any) -> None:
        self.headed = True
        self.events.append(("head", resp.status, resp.content_type, resp.content_length, resp.retry_after))

    def response_head(self, resp: Any) -> None:
        self._head(resp)
        if self.stream:
            resp.sink = self.streamed.append

    def response_done(self, resp: Any) -> None:
        body = b"".join(self.streamed) if self.stream else resp.body()
        self.streamed = []
        if not self.headed:  # a whole-body leg hears the end only
            self._head(resp)
        self.events.append(("done", body, resp.keep_alive))
        resp.release()

    def response_error(self, resp: Any, exc: BaseException) -> None:
        self.events.append(("error", type(exc).__name__, str(exc)))
        resp.release()


def _pool(twin: str, loop: asyncio.AbstractEventLoop) -> tuple[UpstreamPool, Any, Any]:
    pool = UpstreamPool("http://127.0.0.1:9")
    pool.loop = loop
    if twin == "py":
        pool.response_parser = PURE_PARSE.ResponseParser
        return pool, client._Connection, client.UpstreamResponse
    return pool, UPSTREAM.Connection, UPSTREAM.Response


def _feed(conn: Any, piece: bytes, buffered: bool) -> None:
    if not buffered:
        conn.data_received(piece)
        return
    while piece:  # as uvloop: a buffer asked for, read into, reported
        window = memoryview(conn.get_buffer(-1)).cast("B")
        n = min(len(window), len(piece))
        window[:n] = piece[:n]
        window.release()
        conn.buffer_updated(n)
        piece = piece[n:]


_LOOP: list[asyncio.AbstractEventLoop] = []


def run_twin(case: Case, twin: str, buffered: bool = False) -> list[Any]:
    """One twin's record of a case: per exchange, its events and how the connection was left (on an
    event loop that never runs: futures are made on it, nothing is scheduled)."""
    if not _LOOP:
        _LOOP.append(asyncio.new_event_loop())
    return _run(case, twin, buffered, _LOOP[0])


def _run(case: Case, twin: str, buffered: bool, loop: asyncio.AbstractEventLoop) -> list[Any]:
    pool, connection_class, response_class = _pool(twin, loop)
    conn = connection_class(pool)
    transport = Transport()
    conn.connection_made(transport)
    pool.open.add(conn)
    record: list[Any] = []
    for i in range(len(case.exchanges)):
        events: list[tuple[Any, ...]] = []
        listener = None if case.mode == "coroutine" else Listener(events, case.mode == "stream")
        max_body = WHOLE_LIMIT if case.mode == "whole" else 0
        resp = response_class(None if listener else conn, max_body, listener)
        resp.sending = (REQUEST_HEAD, (), 0, None, None, None)
        conn.send(resp)
        pooled_at, at = None, 0
        for piece in case.pieces(i):
            _feed(conn, piece, buffered)
            at += len(piece)
            if pooled_at is None and conn in pool.idle and not conn.closed:
                pooled_at = at  # back in the pool after the read that ended here
        eof = i == len(case.exchanges) - 1 and case.eof
        if listener is None:  # the coroutine path: it wakes, reads what came, then releases
            events.append(_state(resp))
            if eof:
                conn.connection_lost(None)
                events.append(_state(resp))
            resp.release()
            if conn in pool.idle and not conn.closed:
                pooled_at = at
        pooled = conn in pool.idle and not conn.closed
        if listener is not None and (eof or transport.state != "open"):
            conn.connection_lost(None)  # the worker's close, or what the loop calls after ours
        record.append((events, "pooled" if pooled else transport.state, pooled_at))
        if not pooled:
            break
        pool.idle.remove(conn)
    return record


def _state(resp: Any) -> tuple[Any, ...]:
    """A response on the coroutine path, as its awaiting code would find it."""
    error = resp.error
    if resp._headers is not None and resp._headers.done():
        resp._headers.exception()  # (taken, as its awaiting code would: no "never retrieved" noise)
    return (
        "state",
        resp.headers_done,
        resp.status,
        resp.content_type,
        resp.complete,
        resp.keep_alive,
        resp.body(),
        None if error is None else (type(error).__name__, str(error)),
        resp.retry_after,
    )


# -- h11, the reference ------------------------------------------------------------------------------


def run_h11(case: Case) -> list[tuple[Any, ...]]:
    """h11's framing of each exchange's first final response: ("done", status, body, reusable, end,
    exposed), ("error", words) or ("incomplete",); reusable: keep-alive and no byte past the
    response, which ends at byte ``end`` of the exchange; exposed: the headers the twins hand on."""
    conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=1 << 40)
    out: list[tuple[Any, ...]] = []
    for i, data in enumerate(case.exchanges):
        conn.send(h11.Request(method="POST", target="/", headers=[("Host", "w"), ("Content-Length", "0")]))
        conn.send(h11.EndOfMessage())
        conn.receive_data(data)
        if case.eof and i == len(case.exchanges) - 1:
            conn.receive_data(b"")
        status, body, exposed = 0, bytearray(), (b"", None)
        try:
            while True:
                event = conn.next_event()
                if isinstance(event, h11.Response):
                    status = event.status_code
                    exposed = _exposed(event.headers)
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    break
                elif event is h11.NEED_DATA or isinstance(event, h11.ConnectionClosed):
                    out.append(("incomplete",))
                    return out
        except h11.RemoteProtocolError as exc:
            out.append(("error", str(exc)))
            return out
        left = len(conn.trailing_data[0])
        reusable = conn.their_state is h11.DONE and not left
        out.append(("done", status, bytes(body), reusable, len(data) - left, exposed))
        if not reusable:
            return out
        conn.start_next_cycle()
    return out


def _exposed(headers: Any) -> tuple[bytes, bytes | None]:
    """The last Content-Type (b"" if none) and Retry-After (None if none), as the twins read them."""
    found: dict[bytes, bytes] = dict(headers)  # (h11 lowers the names; the last of each stays)
    return found.get(b"content-type", b""), found.get(b"retry-after")


# -- checks ------------------------------------------------------------------------------------------


def framed(events: list[tuple[Any, ...]]) -> tuple[Any, ...]:
    """A twin's first answer of an exchange as h11's are written: done, error or incomplete."""
    for event in events:
        if event[0] == "state":
            if event[4]:
                return ("done", event[2], event[6], (event[3], event[8]))
            if event[7] is not None:
                return ("error", event[7][1])
        if event[0] == "done":
            head = next(e for e in reversed(events[: events.index(event)]) if e[0] == "head")
            return ("done", head[1], event[1], (head[2], head[4]))
        if event[0] == "error":
            return ("error", event[2])
    return ("incomplete",)


@dataclass
class Verdict:
    failures: list[str] = field(default_factory=list)
    stricter: list[str] = field(default_factory=list)
    laxer: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _reason(words: str) -> str:
    """An error's words without the positions and values that make each one unique."""
    words = words.removeprefix("malformed HTTP response: ")
    return "".join(c if not c.isdigit() else "#" for c in words.split(":")[0] if c != "'")[:60]


def check_case(case: Case) -> tuple[Verdict, dict[str, Any]]:
    """Run ``case`` through both twins (the compiled one both ways it reads) and h11, and judge."""
    verdict = Verdict()
    records: dict[str, Any] = {"py": run_twin(case, "py")}
    if UPSTREAM is not None:
        records["c"] = run_twin(case, "c")
        records["c-buffered"] = run_twin(case, "c", buffered=True)
    for name, record in records.items():
        if name == "c" and record != records["py"]:
            verdict.failures.append("twins disagree: c vs py")
        if name == "c-buffered" and _unpooled(record) != _unpooled(records["py"]):
            # (where a read into the body's own buffer ends is the body's end, not the case's boundary)
            verdict.failures.append("twins disagree: c-buffered vs py")
    reference = run_h11(case)
    records["h11"] = reference
    for name, record in records.items():
        if name == "h11":
            continue
        _against_h11(case, name, record, reference, verdict)
    return verdict, records


def _unpooled(record: list[Any]) -> list[Any]:
    return [(events, left) for events, left, _ in record]


def _against_h11(case: Case, name: str, record: list[Any], reference: list[Any], verdict: Verdict) -> None:
    for i, (events, left, pooled_at) in enumerate(record):
        if i >= len(reference):  # h11 closed after the one before (HTTP/1.0 keep-alive: noted)
            return
        mine, theirs = framed(events), reference[i]
        if case.oversized == i and any(e[0] == "head" or (e[0] == "state" and e[1]) for e in events):
            verdict.failures.append(
                f"{name}: a head over {BOUND_HEAD_BYTES} bytes or {BOUND_HEADERS} lines accepted"
            )
            return
        if theirs[0] == "done" and mine[0] == "done":
            if mine[1:] != (*theirs[1:3], theirs[5]):
                what = [
                    f
                    for f, a, b in zip(("status", "body", "headers"), mine[1:], (*theirs[1:3], theirs[5]))
                    if a != b
                ]
                verdict.failures.append(f"{name}: exchange {i}: {' and '.join(what)} not h11's")
                return
            past = case.exchanges[i][theirs[4] : pooled_at or 0]
            if past.strip(b"\r\n"):
                verdict.failures.append(
                    f"{name}: exchange {i}: pooled after a read with bytes past the answer"
                )
                return
            if past:  # (RFC 9112 2.2's robustness: an empty line between messages is skipped)
                verdict.notes.append("empty lines after an answer skipped (llhttp); h11 would not reuse")
            elif left == "pooled" and not theirs[3]:
                verdict.notes.append("keep-alive where h11 closes (HTTP/1.0 with Connection: keep-alive)")
            if left != "pooled" and theirs[3] and not (case.eof and i == len(case.exchanges) - 1):
                verdict.notes.append("not reused where h11 would reuse it")
        elif theirs[0] == "done" and mine[0] == "error":
            verdict.stricter.append(_reason(mine[1]))
            return
        elif theirs[0] == "error" and mine[0] == "done":
            verdict.laxer.append(_reason(theirs[1]))
            return
        elif theirs[0] != mine[0] and "error" not in (theirs[0], mine[0]):
            verdict.failures.append(f"{name}: exchange {i}: {mine[0]}, h11 {theirs[0]}")
            return
        elif mine[0] != "done" or theirs[0] != "done":
            return


# -- the run: batches in forked children -------------------------------------------------------------


def _child(seed: int, start: int, stop: int, known: bool, out: int) -> None:
    """Run cases ``start``..``stop`` here, telling the parent each index before it runs and its
    verdict after (so a crash loses nothing but the case it hit)."""
    rss0 = _rss()
    for index in range(start, stop):
        os.write(out, b"start %d\n" % index)
        case = make_case(seed, index, known)
        verdict, _ = check_case(case)
        line = {
            "index": index,
            "failures": verdict.failures,
            "tags": case.tags,
            "stricter": sorted(set(verdict.stricter)),
            "laxer": sorted(set(verdict.laxer)),
            "notes": sorted(set(verdict.notes)),
            "rss": _rss() - rss0 if index % 100 == 99 else 0,
        }
        os.write(out, b"done " + json.dumps(line).encode() + b"\n")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@dataclass
class Totals:
    cases: int = 0
    failures: list[tuple[int, str, list[str]]] = field(default_factory=list)
    #: (case, exit status or -signal, the twins that crash on it alone)
    crashes: list[tuple[int, int, list[str]]] = field(default_factory=list)
    hangs: list[int] = field(default_factory=list)
    stricter: Counter[str] = field(default_factory=Counter)
    laxer: Counter[str] = field(default_factory=Counter)
    notes: Counter[str] = field(default_factory=Counter)
    rss_growth: int = 0
    #: the first case of each reason counted (to replay it)
    first: dict[str, int] = field(default_factory=dict)

    def add(self, line: dict[str, Any]) -> None:
        self.cases += 1
        for reason in (*line["stricter"], *line["laxer"], *line["notes"]):
            self.first.setdefault(reason, line["index"])
        self.failures += [(line["index"], failure, line["tags"]) for failure in line["failures"]]
        self.stricter.update(line["stricter"])
        self.laxer.update(line["laxer"])
        self.notes.update(line["notes"])
        self.rss_growth = max(self.rss_growth, line["rss"])

    @property
    def bad(self) -> bool:
        grew = self.rss_growth > RSS_GROWTH_LIMIT and not SANITIZED
        return bool(self.failures or self.crashes or self.hangs or grew)


def crashing(case: Case) -> list[str]:
    """Which of the twins (and read paths) crash on ``case``, each run alone in a child."""
    twins = (
        {"py": ("py", False), "c": ("c", False), "c-buffered": ("c", True)}
        if UPSTREAM
        else {"py": ("py", False)}
    )
    return [name for name, args in twins.items() if in_child(run_twin, case, *args) is None]


def run_batch(seed: int, start: int, stop: int, totals: Totals, known: bool = True) -> int:
    """Cases ``start``..``stop`` in a forked child, added to ``totals``; the index to go on from (past
    a case that crashed or hung the child, which ``totals`` records)."""
    read_end, write_end = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        if not totals.crashes:  # the first crash's Python stack on stderr (ASan prints its own)
            faulthandler.enable()
        code = 0
        try:
            _child(seed, start, stop, known, write_end)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 3
        os._exit(code)
    os.close(write_end)
    current, pending, hung = start, b"", False
    with os.fdopen(read_end, "rb", buffering=0) as pipe:
        while True:
            ready, _, _ = select.select([pipe], [], [], CASE_TIMEOUT_S)
            if not ready:
                os.kill(pid, signal.SIGKILL)
                hung = True
                break
            chunk = pipe.read(1 << 20)
            if not chunk:
                break
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                if line.startswith(b"start "):
                    current = int(line[6:])
                else:
                    totals.add(json.loads(line[5:]))
                    current += 1
    _, status = os.waitpid(pid, 0)
    if hung:
        totals.hangs.append(current)
    elif status != 0:
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        totals.crashes.append((current, code, crashing(make_case(seed, current, known))))
    else:
        return stop
    totals.cases += 1
    return current + 1


def in_child(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` in a forked child: its result, or None when the child died (a crash)."""
    read_end, write_end = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        try:
            os.write(write_end, pickle.dumps(fn(*args)))
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        data = pipe.read()
    _, status = os.waitpid(pid, 0)
    return pickle.loads(data) if status == 0 and data else None


def fuzz(
    seed: int, seconds: float, batch: int = 500, known: bool = True, first: int = 0, cases: int = 0
) -> Totals:
    """Cases from ``first`` on, for ``seconds`` (or ``cases`` of them)."""
    totals = Totals()
    index, end = first, time.monotonic() + seconds
    while (index < first + cases) if cases else (time.monotonic() < end):
        stop = min(index + batch, first + cases) if cases else index + batch
        index = run_batch(seed, index, stop, totals, known)
    return totals


def replay(seed: int, index: int, known: bool = True) -> int:
    case = make_case(seed, index, known)
    print(case.show(), flush=True)  # (before a crash)
    verdict, records = check_case(case)
    for name, record in records.items():
        print(f"{name}: {record!r}"[:4000])
    print(f"failures: {verdict.failures}\nstricter: {verdict.stricter}\nlaxer: {verdict.laxer}")
    return 1 if verdict.failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.fuzz_upstream", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to fuzz")
    parser.add_argument(
        "--seed", type=int, default=None, help="the cases' seed (default: from the clock, printed)"
    )
    parser.add_argument(
        "--case", type=int, default=None, help="replay this one case of --seed in-process, verbosely"
    )
    parser.add_argument(
        "--known", choices=("on", "off"), default="on", help="off: leave out the open findings' shapes"
    )
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else int(time.time())
    if args.case is not None:
        return replay(seed, args.case, args.known == "on")
    totals = fuzz(seed, args.seconds, known=args.known == "on")
    print(report(seed, totals, f"{args.seconds:.0f} s"))
    return 1 if totals.bad else 0


def _counted(totals: Totals, counter: Counter[str]) -> str:
    return (
        ", ".join(f"{reason!r} x{n} ({totals.first[reason]})" for reason, n in counter.most_common(8))
        or "none"
    )


def report(seed: int, totals: Totals, spent: str) -> str:
    twins = "both twins" if UPSTREAM is not None else "the pure twin only (server.http._upstream not built)"
    lines = [f"fuzz_upstream: seed {seed}, {totals.cases} cases on {twins}, {spent}"]
    for key in ("stricter", "laxer"):
        counter: Counter[str] = getattr(totals, key)
        lines.append(f"  {key} than h11 (cases by reason, first case): {_counted(totals, counter)}")
    lines.append(f"  notes: {_counted(totals, totals.notes)}")
    judged = " (not judged under ASan)" if SANITIZED else f" (limit {RSS_GROWTH_LIMIT >> 20} MiB)"
    lines.append(f"  RSS growth of a child over its batch: {totals.rss_growth / 2**20:.1f} MiB{judged}")
    failures = Counter(f for _, f, _ in totals.failures)
    for what, n in failures.most_common(12):
        first = next(i for i, f, _ in totals.failures if f == what)
        lines.append(f"  DISAGREEMENT x{n} (first: --seed {seed} --case {first}): {what}")
    if totals.crashes:
        at, code, which = totals.crashes[0]
        lines.append(
            f"  CRASHES: {len(totals.crashes)} (first: --seed {seed} --case {at}, status {code}, in {which}; "
            f"cases {[c[0] for c in totals.crashes[:10]]})"
        )
    if totals.hangs:
        lines.append(f"  HANGS: {len(totals.hangs)} (first: --seed {seed} --case {totals.hangs[0]})")
    lines.append(f"fuzz_upstream: {'FAILED' if totals.bad else 'no disagreement, no crash, no hang'}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
