"""Each front's user-space instructions per request, under callgrind: the noise-free yardstick.

    python -m bench.front_instructions                      # fastcore:both-gates and rawfloor, 1 KB, unary, c=16
    python -m bench.front_instructions --fronts fastcore:both-gates,rawfloor,sglang-router,vllm-router \\
        --prompt-tokens 250,40000 --stream both            # every point of bench.routers' table
    python -m bench.front_instructions --fastcore-root ../before --fronts fastcore:both-gates,fastcore-before:both-gates

``bench.routers`` times each front by the scheduler's on-CPU time: on a shared machine the same
front reads 200 and 320 us per request back to back, so a change of a few percent cannot be seen
there. Here the front (alone: its mocks and this client run natively) runs under
``valgrind --tool=callgrind``; after a warm-up its counters are zeroed (``callgrind_control -z``),
the measured requests sent, and its counters dumped (``-d``): the instructions it ran for them,
divided by the requests completed. The same binary, inputs and request count give the same figure
within about 1%, whatever else the machine runs. It counts user space only: the kernel's side (the
reads, writes and epoll of the sockets) is not in it. ``strace -c`` shows the same system calls per
request for fastcore and the floor (three reads, three writes), so the CPU gap between them is the
user-space gap this measures. Valgrind runs one thread at a time and has no AVX-512: the fronts run
their AVX2 kernels here.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from bench import routers
from bench._timing import format_table
from bench.loadgen import new_session, one_request, one_unary_request, run_concurrency
from bench.workload import chat_body

#: the front whose figure the others are divided by (issue 25's floor)
FLOOR = routers.RAWFLOOR


@dataclass
class Count:
    front: str
    prompt_tokens: int
    stream: bool
    concurrency: int
    completed: int
    errors: int
    instructions_per_request: float | None


def valgrind_argv(out: Path) -> list[str]:
    """The callgrind command a front's argv runs under (its dumps are ``out``.N)."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise RuntimeError("valgrind is not installed (Debian: apt-get install valgrind)")
    return [valgrind, "--tool=callgrind", f"--callgrind-out-file={out}", "--dump-instr=no"]


def dump_total(path: Path) -> int:
    """The instructions a callgrind dump counted (its ``summary:`` or ``totals:`` line)."""
    with open(path) as f:
        for line in f:
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1])
    raise ValueError(f"{path}: no summary line (not a callgrind dump?)")


def control(pid: int, flag: str) -> None:
    """``callgrind_control`` on the front: ``-z`` zeroes its counters, ``-d`` dumps them."""
    subprocess.run(["callgrind_control", flag, str(pid)], check=True, capture_output=True, timeout=120)


def measure(
    front: str, prompt_tokens: int, stream: bool, c: int, args: argparse.Namespace, workdir: Path
) -> Count:
    """One front at one level, under callgrind from start to stop."""
    out = workdir / f"{front.replace(':', '-')}-{prompt_tokens}-{'stream' if stream else 'unary'}-c{c}.cg"
    prefix = valgrind_argv(out)
    running = routers.start_front(
        front, prompt_tokens, args.routers, workdir, wrap=lambda argv: [*prefix, *argv]
    )
    try:
        body = chat_body(prompt_tokens, model=routers.MODEL, max_tokens=args.max_tokens, stream=stream)
        request = one_request if stream else one_unary_request
        url = running.url + "/v1/chat/completions"

        async def go() -> tuple[int, int]:
            async with new_session() as session:
                await run_concurrency(
                    url,
                    body,
                    c,
                    max_requests=args.warmup,
                    max_seconds=args.max_seconds,
                    timeout=args.timeout,
                    request=request,
                    session=session,
                    label="warm-up",
                )
                control(running.pid, "-z")
                level = await run_concurrency(
                    url,
                    body,
                    c,
                    max_requests=args.requests,
                    max_seconds=args.max_seconds,
                    timeout=args.timeout,
                    request=request,
                    session=session,
                    label="measured",
                )
                control(running.pid, "-d")
                return level.requests - level.errors, level.errors

        completed, errors = asyncio.run(go())
    finally:
        running.stop()
    # -d's dump is OUT.1 (the exit's own is OUT): what ran between the zeroing and it
    dumps = glob.glob(f"{out}.*")
    total = dump_total(Path(dumps[0])) if len(dumps) == 1 else None
    per = round(total / completed, 1) if total is not None and completed else None
    return Count(front, prompt_tokens, stream, c, completed, errors, per)


def table(counts: list[Count]) -> str:
    floors = {
        (x.prompt_tokens, x.stream, x.concurrency): x.instructions_per_request
        for x in counts
        if x.front == FLOOR
    }
    rows = []
    for x in counts:
        floor = floors.get((x.prompt_tokens, x.stream, x.concurrency))
        per = x.instructions_per_request
        rows.append(
            [
                x.front,
                f"{x.prompt_tokens:,}",
                "stream" if x.stream else "unary",
                str(x.concurrency),
                f"{x.completed}",
                str(x.errors),
                "-" if per is None else f"{per / 1000:.1f}k",
                f"{per / floor:.2f}x" if per and floor else "-",
            ]
        )
    head = ["front", "prompt tokens", "mode", "conc", "completed", "errors", "instructions/req", f"/{FLOOR}"]
    return format_table(head, rows)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.front_instructions",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument(
        "--fronts", default=f"fastcore:both-gates,{FLOOR}", help="comma-separated, as bench.routers'"
    )
    p.add_argument("--prompt-tokens", default="250", help="comma-separated (~4 bytes/token)")
    p.add_argument("--stream", choices=["both", "stream", "unary"], default="unary")
    p.add_argument("--concurrency", default="16", help="comma-separated closed-loop levels")
    p.add_argument("--requests", type=int, default=2000, help="measured requests per level")
    p.add_argument("--warmup", type=int, default=300, help="warm-up requests per level (not counted)")
    p.add_argument(
        "--max-seconds", type=float, default=900.0, help="time bound of the warm-up and of the measure"
    )
    p.add_argument(
        "--timeout", type=float, default=120.0, help="per-request timeout, seconds (valgrind is slow)"
    )
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--venvs", type=Path, default=routers.VENVS, help="the Rust routers' venvs")
    p.add_argument("--fastcore-root", type=Path, help="another fastcore checkout, measured as LABEL:MODE")
    p.add_argument("--fastcore-label", default="fastcore-before")
    p.add_argument("--output", type=Path, help="the counts as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.requests < 1 or args.warmup < 0:
        print("--requests must be at least 1 and --warmup at least 0", file=sys.stderr)
        return 2
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("valgrind (with callgrind_control) is not installed: apt-get install valgrind", file=sys.stderr)
        return 2
    forwarded = ["--venvs", str(args.venvs), "--fastcore-label", args.fastcore_label]
    if args.fastcore_root is not None:
        forwarded += ["--fastcore-root", str(args.fastcore_root.resolve())]
    args.routers = routers.build_parser().parse_args(forwarded)
    fronts = args.fronts.split(",")
    for front in fronts:
        reason = routers.check_front(front, args.routers)
        if reason:
            print(f"{front}: {reason}", file=sys.stderr)
            return 2
    streams = {"both": [True, False], "stream": [True], "unary": [False]}[args.stream]
    counts = []
    with tempfile.TemporaryDirectory(prefix="fastcore-instructions-") as tmp:
        for n in (int(x) for x in args.prompt_tokens.split(",")):
            for stream in streams:
                for c in (int(x) for x in args.concurrency.split(",")):
                    for front in fronts:
                        count = measure(front, n, stream, c, args, Path(tmp))
                        per = count.instructions_per_request
                        print(
                            f"  {front} {n} {'stream' if stream else 'unary'} c={c}: {count.completed} ok, "
                            f"{count.errors} errors, {'-' if per is None else f'{per / 1000:.1f}k'} instructions/request",
                            flush=True,
                        )
                        counts.append(count)
    print()
    print(table(counts))
    if args.output is not None:
        args.output.write_text(json.dumps([asdict(x) for x in counts], indent=1) + "\n")
    return 1 if any(x.errors or x.instructions_per_request is None for x in counts) else 0


if __name__ == "__main__":
    sys.exit(main())
