"""What sharing admission across ``--workers N`` costs a request (server/orchestrator/fleet.py).

    python -m bench.fleet            # ~10 s
    python -m bench.fleet --quick    # ~2 s

In process, best of N: a completion's admission (``async with admission.slot(tenant, body)``: the
priority and prompt read, the rate-limit buckets, a slot taken and given back; no request waits)
with each process's own counts (what ``--workers N`` did before the fleet) and with the fleet's
mapping, its compiled twin (``_fleet.pyx``, GCC atomics) and its pure one (a ``lockf`` lock per
operation); with no rate limit and with both (requests and prompt tokens a minute, set too high to
refuse). Printed: microseconds per request, the fleet's extra cost over the per-process path and
their ratio; then the mapping's operations alone; then one orchestrator of several hosts
(``fleet_cluster``: its share of the limits set by the etcd watch, ``Admission.divide``) beside one
alone: the share is read, never fetched, so the two should cost the same. The target (issue 42): at
most 1 us a request for the compiled path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

from bench._timing import format_table
from bench.loadgen import RESULTS_DIR
from server.metrics import Registry
from server.orchestrator import fleet as fleet_module
from server.orchestrator.admission import Admission
from server.orchestrator.config import AdmissionConfig
from server.orchestrator.fleet import BUCKETS, MINUTE_NS, Fleet, Mapping, PureCore
from server.orchestrator.tenants import Tenant

BODY = b'{"model":"m","messages":[{"role":"user","content":"' + b"hello there " * 40 + b'"}],"max_tokens":8}'
BATCH = 2000
LIMITS = {"*": {"requests_per_minute": 1e12, "prompt_tokens_per_minute": 1e15}}


def best_of(run: Callable[[], float], repeat: int) -> float:
    """The least of ``repeat`` runs' seconds per request (the least noisy figure on a shared machine)."""
    run()  # warm-up
    return min(run() for _ in range(repeat))


def admission_cost(
    config: AdmissionConfig, core: str | None, repeat: int, share: tuple[float, int] | None = None
) -> float:
    """Seconds per admitted request through ``Admission.slot`` (``core``: None, per process; else
    "cython" or "python", the fleet's twin; ``share``: several hosts' part, as the etcd watch sets it)."""
    admission = Admission(config, Registry(), retry_after_s=1)
    if share is not None:
        admission.divide(*share)
    mapping = None
    if core is not None:
        mapping = Mapping.create(2)
        fleet = Fleet(mapping, 0)
        if core == "python":
            fleet.core = PureCore(mapping, 0)
        admission.share(fleet)
    tenant = Tenant("alpha")
    loop = asyncio.new_event_loop()

    async def batch() -> float:
        start = time.perf_counter()
        for _ in range(BATCH):
            async with admission.slot(tenant, BODY):
                pass
        return (time.perf_counter() - start) / BATCH

    try:
        return best_of(lambda: loop.run_until_complete(batch()), repeat)
    finally:
        loop.close()
        if mapping is not None:
            mapping.remove()


def core_costs(core_class: Any, repeat: int) -> dict[str, float]:
    """The mapping's operations alone: a slot taken and given back, a bucket's take."""
    mapping = Mapping.create(2)
    core = core_class(mapping, 0)
    entry = core.entry(BUCKETS, 12345)
    now = time.monotonic_ns()

    def slots() -> float:
        start = time.perf_counter()
        for _ in range(BATCH):
            core.acquire(1 << 40)
            core.release()
        return (time.perf_counter() - start) / BATCH

    def take() -> float:
        start = time.perf_counter()
        for _ in range(BATCH):
            core.take(entry, now, 0, MINUTE_NS)
        return (time.perf_counter() - start) / BATCH

    try:
        return {"slot": best_of(slots, repeat), "bucket": best_of(take, repeat)}
    finally:
        mapping.remove()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats (the smoke test's)")
    parser.add_argument("--json", default=str(RESULTS_DIR / "fleet.json"), help="where the results go")
    args = parser.parse_args()
    repeat = 3 if args.quick else 15
    twins = ["python"] + (["cython"] if fleet_module.compiled is not None else [])
    rows, results = [], {}
    for label, config in (
        ("slots only", AdmissionConfig.model_validate({"max_inflight": 256})),
        (
            "slots + 2 rate limits",
            AdmissionConfig.model_validate({"max_inflight": 256, "rate_limits": LIMITS}),
        ),
    ):
        alone = admission_cost(config, None, repeat)
        results[label] = {"per_process_us": alone * 1e6}
        for twin in twins:
            shared = admission_cost(config, twin, repeat)
            results[label][f"fleet_{twin}_us"] = shared * 1e6
            rows.append(
                [
                    label,
                    f"fleet ({twin})",
                    f"{alone * 1e6:.2f}",
                    f"{shared * 1e6:.2f}",
                    f"{(shared - alone) * 1e6:+.2f}",
                    f"{shared / alone:.2f}x",
                ]
            )
    print(
        f"admission per request, in process, best of {repeat} x {BATCH} (fleet backend: {fleet_module.backend})"
    )
    print(format_table(["config", "path", "per process us", "fleet us", "extra us", "ratio"], rows))
    ops = []
    for twin in twins:
        costs = core_costs(fleet_module.Core if twin == "cython" else PureCore, repeat)
        results[f"ops_{twin}_us"] = {k: v * 1e6 for k, v in costs.items()}
        ops.append([twin, f"{costs['slot'] * 1e6:.3f}", f"{costs['bucket'] * 1e6:.3f}"])
    print()
    print(format_table(["twin", "slot acquire+release us", "bucket take us"], ops))
    limited = AdmissionConfig.model_validate({"max_inflight": 256, "rate_limits": LIMITS})
    alone, divided = admission_cost(limited, None, repeat), admission_cost(limited, None, repeat, (0.5, 128))
    results["several_hosts"] = {"alone_us": alone * 1e6, "divided_us": divided * 1e6}
    print()
    print(
        format_table(
            ["slots + 2 rate limits", "alone us", "one of 2 hosts us", "extra us"],
            [
                [
                    "per process",
                    f"{alone * 1e6:.2f}",
                    f"{divided * 1e6:.2f}",
                    f"{(divided - alone) * 1e6:+.2f}",
                ]
            ],
        )
    )
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    with open(args.json, "w") as out:
        json.dump(results, out, indent=2)


if __name__ == "__main__":
    main()
