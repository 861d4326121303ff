"""Inputs of the router tests (test_routing, test_trtllm_router_args): a pool of healthy workers
with no server behind them, and a conversation's history turn by turn."""

from __future__ import annotations

from typing import Any

from server.orchestrator.pools import Worker


def workers(n: int, in_flight: int = 0) -> list[Worker]:
    out = [Worker(f"http://w{i}") for i in range(n)]
    for w in out:
        w.healthy = True
        w.in_flight = in_flight
    return out


def history(seed: int, turns: int, size: int = 3000) -> list[dict[str, Any]]:
    """A conversation's messages after ``turns`` turns; each turn appends to the last."""
    msgs = [{"role": "system", "content": f"conversation {seed} " + "s" * 200}]
    for t in range(turns):
        msgs.append({"role": "user", "content": f"{seed}-{t} " + "u" * size})
        msgs.append({"role": "assistant", "content": f"{seed}-{t} " + "a" * size})
    return msgs
