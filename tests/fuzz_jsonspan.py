"""Fuzz the JSON span scanner: ``python -m tests.fuzz_jsonspan --seconds N`` (``make fuzz`` runs it under ASan/UBSan).

Hypothesis mutates seed bodies (the JSONTestSuite corpus, relay-shaped
requests and responses) by flipping, inserting, deleting, duplicating and
truncating bytes, draws path sets and edits, and runs both twins on each
input. Any disagreement (spans, or exception type, message and offset), any
exception other than the documented ones, or any sanitizer report is a
failure; hypothesis then shrinks the input and prints it.
"""

from __future__ import annotations

import argparse
import base64
import importlib
import json
import struct
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "data" / "JSONTestSuite"

PY: ModuleType = importlib.import_module("fastcore._scan_py")
C: ModuleType = importlib.import_module("fastcore._scan")
CODEC_PY: ModuleType = importlib.import_module("fastcore._codec_py")
CODEC_C: ModuleType = importlib.import_module("fastcore._codec")


def seeds() -> list[bytes]:
    bodies = [p.read_bytes() for p in sorted(CORPUS.glob("*.json")) if p.stat().st_size <= 2048]
    ids = list(range(0, 300_000, 7919))
    bodies.append(
        json.dumps(
            {
                "model": "m",
                "messages": [
                    {"role": "system", "content": 'be "brief"\n'},
                    {"role": "user", "content": "caf\u00e9 \U0001f600 \\ \u2028"},
                ],
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        ).encode()
    )
    bodies.append(
        json.dumps(
            {
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "length",
                        "disaggregated_params": {
                            "request_type": "context_only",
                            "first_gen_tokens": [1],
                            "x": None,
                        },
                    }
                ],
                "usage": {"prompt_tokens": 5},
                "prompt_token_ids": ids,
                "prompt_token_ids_b64": base64.b64encode(struct.pack(f"<{len(ids)}i", *ids)).decode(),
            },
            indent=1,
        ).encode()
    )
    bodies.append(b'{"a\\u0062": [1, {"\\ud83d\\ude00": "\\"k\\""}], "ab": -0.5e+3}')
    return bodies


SEEDS = seeds()
INTERESTING = [
    b'"',
    b"\\",
    b",",
    b":",
    b"{",
    b"}",
    b"[",
    b"]",
    b"\\u",
    b"\xc3",
    b"\xed\xa0\x80",
    b"\x00",
    b"e",
    b"-",
    b"0",
    b" ",
]
keys = st.sampled_from(
    ["a", "ab", "choices", "messages", "usage", "prompt_token_ids_b64", "", "\U0001f600", "\ud800"]
)
components = st.one_of(keys, st.integers(0, 3))
paths = st.lists(
    st.tuples(st.lists(components, max_size=4), st.booleans()).map(
        lambda p: (*p[0], -1) if p[1] else tuple(p[0])
    ),
    max_size=4,
)


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(0, 4))):
        op = draw(st.integers(0, 5))
        at = draw(st.integers(0, len(data)))
        if op == 0 and data:
            data[min(at, len(data) - 1)] = draw(st.integers(0, 255))
        elif op == 1:
            data[at:at] = draw(st.sampled_from(INTERESTING))
        elif op == 2:
            del data[at : at + draw(st.integers(1, 8))]
        elif op == 3:
            end = min(len(data), at + draw(st.integers(1, 64)))
            data[at:at] = data[at:end]  # duplicate a region: repeated keys, unbalanced brackets
        elif op == 4:
            data = data[:at]
        else:
            other = draw(st.sampled_from(SEEDS))
            data[at:at] = other[: draw(st.integers(0, len(other)))]
    return bytes(data)


def outcome(module: ModuleType, fn: str, *args: Any, **kwargs: Any) -> tuple[str, Any]:
    try:
        return ("ok", getattr(module, fn)(*args, **kwargs))
    except (ValueError, TypeError, BufferError) as exc:
        return (type(exc).__name__, (str(exc), getattr(exc, "offset", None)))


def check(
    body: bytes, path_set: list[tuple[Any, ...]], validate: bool, cut: tuple[int, int], edits_seed: list[int]
) -> None:
    for fn in ("find_spans", "find_member_spans"):
        expected = outcome(PY, fn, body, path_set, validate=validate)
        got = outcome(C, fn, body, path_set, validate=validate)
        assert got == expected, (fn, body, path_set, validate, got, expected)
        if expected[0] == "ok":
            for span in expected[1]:
                assert span is None or 0 <= span[0] <= span[1] <= len(body)
    start, end = sorted(min(x, len(body)) for x in cut)
    assert outcome(CODEC_C, "check_token_b64", body, start, end) == outcome(
        CODEC_PY, "check_token_b64", body, start, end
    )
    points = sorted(min(x, len(body)) for x in edits_seed)
    edits = [
        (points[i], points[i + 1], body[points[i] : points[i] + 3]) for i in range(0, len(points) - 1, 2)
    ]
    assert outcome(C, "splice", body, edits) == outcome(PY, "splice", body, edits)


@given(
    bodies(),
    paths,
    st.booleans(),
    st.tuples(st.integers(0, 4096), st.integers(0, 4096)),
    st.lists(st.integers(0, 4096), max_size=6),
)
@settings(
    database=None,
    deadline=None,
    max_examples=500,
    phases=[Phase.generate, Phase.shrink],
    suppress_health_check=list(HealthCheck),
)
def fuzz_once(
    body: bytes, path_set: list[tuple[Any, ...]], validate: bool, cut: tuple[int, int], edits_seed: list[int]
) -> None:
    global INPUTS
    INPUTS += 1
    check(body, path_set, validate, cut, edits_seed)


INPUTS = 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.fuzz_jsonspan", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to fuzz")
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.seconds
    batches = 0
    while time.monotonic() < deadline:
        fuzz_once()  # raises (after shrinking) on the first failure
        batches += 1
    print(
        f"fuzz_jsonspan: {batches * 500} inputs, no disagreement, no crash ({len(SEEDS)} seeds, {args.seconds:.0f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
