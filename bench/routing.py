"""Routing work per request, per router, by prompt length, against round_robin.

    python -m bench.routing                  # 1k and 40k prompt tokens
    python -m bench.routing --sizes 1000,40000,128000

Each row is what the orchestrator adds per request to route one leg: the routing key (one
non-validating span scan of the raw body and, for kv_cache_aware, ``fastcore.chunk_hashes`` of the
``messages`` bytes), ``Pool.choose`` over 4 healthy workers, and the index update of the chosen
worker. The workload is agentic (bench.workload): 8 conversations whose bodies are routed in turn,
so kv_cache_aware indexes are warm and every request is a hit, as turn N+1 of a conversation is.

``+ relay`` is that routing plus the fast relay's own work for the request (gates on: the
``bench.orchestrator_work`` request, validate to client answer), the in-process CPU an orchestrator
spends on it; its ratio to round_robin's is the routing overhead on a request's whole synchronous
work. (The live orchestrator's CPU per request, ``bench.orchestrator``, is larger still: HTTP
framing and socket I/O.)
"""

from __future__ import annotations

import argparse
import functools
import json
import random

import fastcore
from bench._timing import format_table, time_call
from bench.orchestrator_work import context_response, generation_response, one_request
from bench.workload import agentic_messages, chat_body
from server.orchestrator.pools import Pool
from server.orchestrator.relay_modes import FastRelay
from server.orchestrator.routing import request_key

ROUTERS = ("round_robin", "least_loaded", "conversation", "kv_cache_aware")
CONVERSATIONS = 8


def bodies(n: int) -> list[bytes]:
    """One body per conversation: a shared system prompt, then each conversation's own history."""

    system = agentic_messages(n, seed=0)[0]
    out = []
    for c in range(CONVERSATIONS):
        messages = [system, *agentic_messages(n, seed=c + 1)[1:]]
        body = {"model": "tiny", "messages": messages, "max_tokens": 16, "stream": False,
                "conversation_id": f"conv-{c}"}  # fmt: skip
        out.append(json.dumps(body).encode())
    return out


def route_one(pool: Pool, body: bytes) -> object:
    key = request_key(body, True, None) if pool.needs_key else None
    return pool.choose(key=key)


def run(sizes: list[int]) -> str:
    rows = []
    rng = random.Random(0)
    relay = FastRelay(tokids_b64=True, strip_history=True)
    for n in sizes:
        batch = bodies(n)
        ids = [rng.randrange(32000) for _ in range(n)]
        ctx, gen = context_response(ids, b64=True), generation_response(n)
        relay_s = time_call(
            functools.partial(one_request, relay, chat_body(n, stream=False), ctx, gen), min_time=0.3
        )
        base = None
        for kind in ROUTERS:
            pool = Pool("generation", [f"http://w{i}" for i in range(4)], kind)
            for w in pool.workers:
                w.healthy = True
            for body in batch:  # warm: each conversation's first turn has been routed
                route_one(pool, body)
            state = {"i": 0}

            def call(pool: Pool = pool, state: dict[str, int] = state, batch: list[bytes] = batch) -> object:
                state["i"] += 1
                return route_one(pool, batch[state["i"] % CONVERSATIONS])

            seconds = time_call(call, min_time=0.3)
            base = base if base is not None else seconds
            total, base_total = seconds + relay_s, base + relay_s
            rows.append(
                [
                    f"{n:,}",
                    kind,
                    f"{len(batch[0]) / 1e3:,.0f} KB",
                    f"{seconds * 1e6:,.2f}",
                    f"{seconds / base:,.1f}x",
                    f"{total * 1e6:,.1f}",
                    f"{total / base_total:,.3f}x",
                ]
            )
    headers = ["prompt tokens", "router", "body", "routing µs / req", "vs round_robin",
               "+ relay µs / req", "vs round_robin + relay"]  # fmt: skip
    return format_table(headers, rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,40000", help="prompt tokens, comma-separated")
    args = parser.parse_args(argv)
    print(f"fastcore backend: {fastcore.backend}")
    print(run([int(s) for s in args.sizes.split(",")]))


if __name__ == "__main__":
    main()
