"""Routing work per request, per router, by prompt length, against round_robin.

    python -m bench.routing                  # 1k and 40k prompt tokens, 4 workers
    python -m bench.routing --sizes 1000,40000,128000
    python -m bench.routing --workers 4,64,1024   # the fleet's size: routing cost should not grow

Each row is what the orchestrator adds per request to route one leg: the routing key (one
non-validating span scan of the raw body and, for kv_cache_aware, ``fastcore.chunk_hashes`` of the
``messages`` bytes), ``Pool.choose`` over 4 healthy workers, and the index update of the chosen
worker. The workload is agentic (bench.workload): 8 conversations whose bodies are routed in turn,
so kv_cache_aware indexes are warm and every request is a hit, as turn N+1 of a conversation is.

With ``--workers``, the pool has that many healthy workers, and for kv_cache_aware every worker's
index is full (``FILL_CHUNKS`` chunks of other prompts each, as in a fleet that has served a while):
a router that scanned each worker's index per request would grow with the fleet; the inverted
index (chunk -> workers) asks only the workers holding the prompt's first chunk.
``Pool.choose``'s own pass over its members (healthy, breaker) still grows with the fleet.

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
from server.orchestrator import routing
from server.orchestrator.pools import Pool
from server.orchestrator.relay_modes import FastRelay
from server.orchestrator.routing import KvCacheAwareRouter, request_key

ROUTERS = tuple(routing.ROUTERS)  # every router built, in the registry's order
CONVERSATIONS = 8
#: chunks of unrelated prompts in each worker's kv_cache_aware index before timing
FILL_CHUNKS = 512


def bodies(n: int) -> list[bytes]:
    """One body per conversation: a shared system prompt, then each conversation's own history."""

    system = agentic_messages(n, seed=0)[0]
    out = []
    for c in range(CONVERSATIONS):
        messages = [system, *agentic_messages(n, seed=c + 1)[1:]]
        body = {
            "model": "tiny",
            "messages": messages,
            "max_tokens": 16,
            "stream": False,
            "conversation_id": f"conv-{c}",
        }
        out.append(json.dumps(body).encode())
    return out


def route_one(pool: Pool, body: bytes) -> object:
    key = request_key(body, True, None) if pool.needs_key else None
    return pool.choose(key=key)


def fill(pool: Pool, rng: random.Random) -> None:
    """Every worker's kv_cache_aware index full of other prompts' chunks (chains of 64)."""
    router = pool.router
    if not isinstance(router, KvCacheAwareRouter):
        return
    for worker in pool.workers:
        for _ in range(FILL_CHUNKS // 64):
            router.routed(worker, [rng.getrandbits(64) for _ in range(64)])


def run(sizes: list[int], fleets: list[int]) -> str:
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
        for fleet in fleets:
            rows.extend(_rows(n, fleet, batch, relay_s, rng))
    headers = [
        "prompt tokens",
        "workers",
        "router",
        "body",
        "routing µs / req",
        "vs round_robin",
        "+ relay µs / req",
        "vs round_robin + relay",
    ]
    return format_table(headers, rows)


def _rows(n: int, fleet: int, batch: list[bytes], relay_s: float, rng: random.Random) -> list[list[str]]:
    rows = []
    base = None
    for kind in ROUTERS:
        pool = Pool("generation", [f"http://w{i}" for i in range(fleet)], kind)
        for w in pool.workers:
            w.healthy = True
        fill(pool, rng)
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
                f"{fleet:,}",
                kind,
                f"{len(batch[0]) / 1e3:,.0f} KB",
                f"{seconds * 1e6:,.2f}",
                f"{seconds / base:,.1f}x",
                f"{total * 1e6:,.1f}",
                f"{total / base_total:,.3f}x",
            ]
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,40000", help="prompt tokens, comma-separated")
    parser.add_argument("--workers", default="4", help="workers per pool, comma-separated (e.g. 4,64,1024)")
    args = parser.parse_args(argv)
    print(f"fastcore backend: {fastcore.backend}")
    print(run([int(s) for s in args.sizes.split(",")], [int(w) for w in args.workers.split(",")]))


if __name__ == "__main__":
    main()
