"""Token codec benchmark: ``python -m bench.codec [--sizes 4000,40000,128000] [--kernels]``.

For each size and operation it times fastcore beside, in the same run:
(a) the stdlib + numpy path servers use today, (b) pybase64 + numpy, and
(c) a memcpy of the same bytes (the physical floor). It prints µs per call,
MB/s (of int32 id bytes) and ratios, then checks the issue's targets at 40k
ids (ratios only: absolute times depend on the machine). ``--kernels`` adds
one row per SIMD kernel this CPU can run.
"""

from __future__ import annotations

import argparse
import base64
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pybase64

import fastcore
from bench._timing import format_table, time_call

SIZES = (4_000, 40_000, 128_000)
TARGET_SIZE = 40_000


def _cases(ids: np.ndarray) -> dict[str, dict[str, Callable[[], Any]]]:
    """operation -> {contender: zero-argument call}."""
    as_list = ids.tolist()
    b64 = base64.b64encode(ids.tobytes())
    raw = ids.tobytes()
    raw_array = np.frombuffer(raw, np.uint8)

    def memcpy() -> Any:
        return raw_array.copy()

    return {
        "encode from list": {
            "fastcore": lambda: fastcore.encode_tokens(as_list),
            "stdlib": lambda: base64.b64encode(np.asarray(as_list, np.int32).tobytes()),
            "pybase64": lambda: pybase64.b64encode(np.asarray(as_list, np.int32)),  # type: ignore[arg-type]
            "memcpy": memcpy,
        },
        "encode from ndarray": {
            "fastcore": lambda: fastcore.encode_tokens(ids),
            "stdlib": lambda: base64.b64encode(ids.tobytes()),
            "pybase64": lambda: pybase64.b64encode(ids),  # type: ignore[arg-type]
            "memcpy": memcpy,
        },
        "decode to ndarray": {
            "fastcore": lambda: fastcore.decode_tokens(b64),
            "stdlib": lambda: np.frombuffer(base64.b64decode(b64, validate=True), np.int32),
            "pybase64": lambda: np.frombuffer(pybase64.b64decode(b64, validate=True), np.int32),
            "memcpy": memcpy,
        },
        "decode to list": {
            "fastcore": lambda: fastcore.decode_tokens_list(b64),
            "stdlib": lambda: np.frombuffer(base64.b64decode(b64, validate=True), np.int32).tolist(),
            "pybase64": lambda: np.frombuffer(pybase64.b64decode(b64, validate=True), np.int32).tolist(),
            "memcpy": memcpy,
        },
    }


def _check_same_results(ids: np.ndarray) -> None:
    # A fast wrong answer is no answer: every contender must agree first.
    b64 = base64.b64encode(ids.tobytes())
    assert fastcore.encode_tokens(ids) == b64 == fastcore.encode_tokens(ids.tolist())
    assert np.array_equal(fastcore.decode_tokens(b64), ids)
    assert fastcore.decode_tokens_list(b64) == ids.tolist()


def run(sizes: tuple[int, ...], min_time: float) -> dict[tuple[int, str], dict[str, float]]:
    rng = np.random.default_rng(0)
    results: dict[tuple[int, str], dict[str, float]] = {}
    for size in sizes:
        # Realistic ids: a 150k vocabulary, so most are above the small-int cache.
        ids = rng.integers(0, 150_000, size, dtype=np.int32)
        _check_same_results(ids)
        for operation, contenders in _cases(ids).items():
            results[size, operation] = {
                name: time_call(call, min_time=min_time) for name, call in contenders.items()
            }
    return results


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f}"


def _mb_s(size: int, seconds: float) -> str:
    return f"{size * 4 / seconds / 1e6:,.0f}"


def table(results: dict[tuple[int, str], dict[str, float]]) -> str:
    rows = []
    for (size, operation), t in results.items():
        rows.append(
            [
                f"{size:,}",
                operation,
                _us(t["fastcore"]),
                _mb_s(size, t["fastcore"]),
                _us(t["stdlib"]),
                f"{t['stdlib'] / t['fastcore']:.1f}x",
                _us(t["pybase64"]),
                f"{t['fastcore'] / t['pybase64']:.2f}",
                _us(t["memcpy"]),
                f"{t['fastcore'] / t['memcpy']:.1f}",
            ]
        )
    headers = [
        "ids", "operation", "fastcore µs", "MB/s", "(a) stdlib µs", "speed-up vs (a)",
        "(b) pybase64 µs", "time ratio vs (b)", "(c) memcpy µs", "time ratio vs (c)",
    ]  # fmt: skip
    return format_table(headers, rows)


def targets(results: dict[tuple[int, str], dict[str, float]]) -> tuple[str, bool]:
    """The issue's targets at 40k ids, as ratios measured in this run."""
    checks = []
    t = results.get((TARGET_SIZE, "encode from list"))
    if t is None:
        return "(targets are checked at 40,000 ids; not in --sizes)", True
    checks.append(("encode from list >= 6x stdlib", t["stdlib"] / t["fastcore"], ">=", 6.0))
    for operation in ("encode from ndarray", "decode to ndarray", "decode to list"):
        t = results[TARGET_SIZE, operation]
        checks.append((f"{operation}: time / pybase64 <= 1.0", t["fastcore"] / t["pybase64"], "<=", 1.0))
    lines, all_met = [], True
    for label, value, sense, bound in checks:
        met = value >= bound if sense == ">=" else value <= bound
        all_met &= met
        lines.append(f"  {'MET ' if met else 'MISS'}  {label}: {value:.2f}")
    return "\n".join(lines), all_met


# pybase64's private switch (what its own tests and benchmark use): its SIMD flags for our kernel names.
PYBASE64_PATHS = {"scalar": 0, "ssse3": 0x04, "avx2": 0x40, "avx512vbmi": 0x80}


def _pybase64_switch() -> Any:
    """pybase64's C module if it can be forced to one SIMD path, else None."""
    module = getattr(pybase64, "_pybase64", None)
    return module if all(hasattr(module, n) for n in ("_get_simd_path", "_set_simd_path")) else None


def kernel_table(size: int, min_time: float) -> str:
    """Encode/decode ndarray per SIMD kernel (compiled backend only), beside pybase64 on its own best
    path and, where its private switch exists, forced to the same one (like for like)."""
    from fastcore import _codec

    ids = np.random.default_rng(1).integers(0, 150_000, size, dtype=np.int32)
    b64 = base64.b64encode(ids.tobytes())

    def pybase64_times() -> tuple[float, float]:
        encode = time_call(lambda: pybase64.b64encode(ids), min_time=min_time)  # type: ignore[arg-type]
        decode = time_call(
            lambda: np.frombuffer(pybase64.b64decode(b64, validate=True), np.int32), min_time=min_time
        )
        return encode, decode

    best_encode, best_decode = pybase64_times()
    switch = _pybase64_switch()
    pybase64_chosen = switch._get_simd_path() if switch is not None else None
    chosen = _codec._get_simd_path()
    rows = []
    try:
        for path in _codec._available_simd_paths():
            _codec._set_simd_path(path)
            enc = time_call(lambda: _codec.encode_tokens(ids), min_time=min_time)
            dec = time_call(lambda: _codec.decode_tokens(b64), min_time=min_time)
            same = ["-", "-"]
            if switch is not None:
                switch._set_simd_path(PYBASE64_PATHS[path])
                if switch._get_simd_path() == PYBASE64_PATHS[path]:  # 0: its plain C loop
                    same_encode, same_decode = pybase64_times()
                    same = [f"{enc / same_encode:.2f}", f"{dec / same_decode:.2f}"]
            rows.append(
                [
                    path,
                    _us(enc),
                    f"{enc / best_encode:.2f}",
                    same[0],
                    _us(dec),
                    f"{dec / best_decode:.2f}",
                    same[1],
                ]
            )
    finally:
        _codec._set_simd_path(chosen)
        if switch is not None:
            switch._set_simd_path(pybase64_chosen)
    headers = [
        "kernel", "encode µs", "vs pybase64", "vs pybase64 same path",
        "decode µs", "vs pybase64", "vs pybase64 same path",
    ]  # fmt: skip
    return (
        f"{size:,} ids, per kernel; time ratios, < 1.0: fastcore is faster (pybase64: {pybase64.get_version()},"
        " 'same path': forced to that kernel by its private _set_simd_path, '-' where it cannot be):\n"
        + format_table(headers, rows)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.codec", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="comma-separated id counts")
    parser.add_argument("--min-time", type=float, default=0.2, help="seconds of timing per contender")
    parser.add_argument("--kernels", action="store_true", help="also time every SIMD kernel")
    args = parser.parse_args(argv)
    sizes = tuple(int(s) for s in args.sizes.split(","))

    print(f"fastcore backend: {fastcore.backend}; pybase64 {pybase64.get_version()}; numpy {np.__version__}")
    results = run(sizes, args.min_time)
    print(table(results))
    print("time ratio < 1.0: fastcore is faster.  Targets at 40,000 ids:")
    report, _ = targets(results)
    print(report)
    if args.kernels and fastcore.backend.startswith("cython"):
        print()
        print(kernel_table(TARGET_SIZE, args.min_time))
    return 0


if __name__ == "__main__":
    sys.exit(main())
