"""``python -m fastcore benchmark``: a short codec benchmark naming the backend.

Like ``python -m pybase64 benchmark``: MB/s of int32 token-id bytes for
encode and decode at 40,000 ids, against the stdlib + numpy path measured in
the same run. The full comparison is ``python -m bench.codec``.
"""

from __future__ import annotations

import argparse
import base64
import sys

import numpy as np

import fastcore
from fastcore._timing import time_call


def benchmark(count: int, min_time: float) -> None:
    ids = np.random.default_rng(0).integers(0, 150_000, count, dtype=np.int32)
    as_list = ids.tolist()
    encoded = base64.b64encode(ids.tobytes())
    if fastcore.encode_tokens(ids) != encoded or fastcore.decode_tokens_list(encoded) != as_list:
        raise SystemExit("fastcore and the stdlib disagree: not benchmarking a wrong answer")
    cases = [
        ("encode from list", lambda: fastcore.encode_tokens(as_list),
         lambda: base64.b64encode(np.asarray(as_list, np.int32).tobytes())),
        ("encode from ndarray", lambda: fastcore.encode_tokens(ids), lambda: base64.b64encode(ids.tobytes())),
        ("decode to ndarray", lambda: fastcore.decode_tokens(encoded),
         lambda: np.frombuffer(base64.b64decode(encoded, validate=True), np.int32)),
        ("decode to list", lambda: fastcore.decode_tokens_list(encoded),
         lambda: np.frombuffer(base64.b64decode(encoded, validate=True), np.int32).tolist()),
    ]  # fmt: skip
    megabytes = count * 4 / 1e6
    print(f"fastcore {fastcore.__version__}, backend: {fastcore.backend}")
    print(f"{count:,} token ids ({megabytes:.2f} MB as int32), MB/s (higher is better):")
    print(f"  {'':22}{'fastcore':>12}{'stdlib+numpy':>14}{'speed-up':>10}")
    for name, ours, stdlib in cases:
        t_ours, t_stdlib = time_call(ours, min_time=min_time), time_call(stdlib, min_time=min_time)
        print(f"  {name:22}{megabytes / t_ours:12,.0f}{megabytes / t_stdlib:14,.0f}{t_stdlib / t_ours:9.1f}x")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastcore", description="fastcore utilities")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("benchmark", help="short token codec benchmark against the stdlib")
    bench.add_argument("--ids", type=int, default=40_000, help="token ids per call")
    bench.add_argument("--min-time", type=float, default=0.1, help="seconds of timing per case")
    args = parser.parse_args(argv)
    benchmark(args.ids, args.min_time)
    return 0


if __name__ == "__main__":
    sys.exit(main())
