"""What observing metrics costs per request: ``python -m bench.metrics_cost [--budget-us 400]``.

Times, each in a fresh process, the observations the orchestrator makes per
request (``server/orchestrator/app.py``: the request counter through its bound
child, the context-leg, hand-off and generation-TTFB histograms, and one
request in ``CPU_SAMPLE_EVERY`` six CPU-phase histograms) with:

- ``hand-written``: the registry ``server/metrics.py`` had before it went
  through prometheus_client (kept below, :class:`OldRegistry`, as it was);
- ``prometheus_client``: ``server.metrics`` today, one process;
- ``prometheus_client mmap``: the same in multiprocess mode
  (``PROMETHEUS_MULTIPROC_DIR`` set before the import: every update written
  into the process's mmap file), what ``orchestrator --workers N`` runs.

It prints ns per operation and per request, the ratio to the hand-written
registry, what prometheus_client adds per request in µs and as a share of the
lean-path budget (the orchestrator's whole CPU per request, ~0.4 ms on the fast
path at 1k tokens: ``python -m bench.orchestrator``), and one scrape's render
time. Best of 5 runs each (``bench._timing``); the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from bench._timing import format_table, time_call

MODES = ("hand-written", "prometheus_client", "prometheus_client mmap")
CPU_SAMPLE_EVERY = 32  # server.orchestrator.metrics.CPU_SAMPLE_EVERY
PHASES = ("validate", "build_context", "read_context", "build_generation", "relay", "total")
#: The orchestrator's CPU per request on the fast path at 1k tokens (the lean-path issue's number).
LEAN_PATH_US = 400.0


# -- the hand-written registry, as server/metrics.py had it ------------------------------------

LabelValues = tuple[str, ...]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: Sequence[str], values: LabelValues, extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _num(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if not float(v).is_integer() else str(int(v))


class _OldMetric:
    kind = ""

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> None:
        self.name = name
        self.help = help_text
        self.labelnames = tuple(labelnames)

    def _key(self, labels: dict[str, str] | None) -> LabelValues:
        labels = labels or {}
        return tuple(str(labels.get(n, "")) for n in self.labelnames)

    def samples(self) -> Iterable[str]:
        raise NotImplementedError

    def render(self) -> str:
        head = f"# HELP {self.name} {self.help}\n# TYPE {self.name} {self.kind}\n"
        return head + "".join(line + "\n" for line in self.samples())


class OldCounterChild:
    __slots__ = ("key", "values")

    def __init__(self, values: dict[LabelValues, float], key: LabelValues) -> None:
        self.values = values
        self.key = key
        values.setdefault(key, 0.0)

    def inc(self, amount: float = 1.0) -> None:
        self.values[self.key] += amount


class OldCounter(_OldMetric):
    kind = "counter"

    def __init__(
        self,
        name: str,
        help_text: str,
        labelnames: Sequence[str] = (),
        callback: Callable[[], float] | None = None,
    ) -> None:
        super().__init__(name, help_text, labelnames)
        self.values: dict[LabelValues, float] = {}
        self.callback = callback

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = self._key(labels)
        self.values[key] = self.values.get(key, 0.0) + amount

    def labels(self, **labels: str) -> OldCounterChild:
        return OldCounterChild(self.values, self._key(labels))

    def samples(self) -> Iterable[str]:
        if self.callback is not None:
            yield f"{self.name} {_num(self.callback())}"
            return
        if not self.values and not self.labelnames:
            yield f"{self.name} 0"
        for key, v in sorted(self.values.items()):
            yield f"{self.name}{_labels(self.labelnames, key)} {_num(v)}"


class OldGauge(_OldMetric):
    kind = "gauge"

    def __init__(
        self,
        name: str,
        help_text: str,
        labelnames: Sequence[str] = (),
        callback: Callable[[], float] | None = None,
    ) -> None:
        super().__init__(name, help_text, labelnames)
        self.values: dict[LabelValues, float] = {}
        self.callback = callback

    def set(self, value: float, **labels: str) -> None:
        self.values[self._key(labels)] = float(value)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = self._key(labels)
        self.values[key] = self.values.get(key, 0.0) + amount

    def dec(self, amount: float = 1.0, **labels: str) -> None:
        self.inc(-amount, **labels)

    def samples(self) -> Iterable[str]:
        if self.callback is not None:
            yield f"{self.name} {_num(self.callback())}"
            return
        if not self.values and not self.labelnames:
            yield f"{self.name} 0"
        for key, v in sorted(self.values.items()):
            yield f"{self.name}{_labels(self.labelnames, key)} {_num(v)}"


DEFAULT_BUCKETS = (
    5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0,
)  # fmt: skip


class OldHistogramChild:
    __slots__ = ("buckets", "counts", "totals")

    def __init__(self, buckets: tuple[float, ...], entry: tuple[list[int], list[float]]) -> None:
        self.buckets = buckets
        self.counts, self.totals = entry

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        totals = self.totals
        totals[0] += value
        totals[1] += 1


class OldHistogram(_OldMetric):
    kind = "histogram"

    def __init__(
        self,
        name: str,
        help_text: str,
        labelnames: Sequence[str] = (),
        buckets: Sequence[float] = DEFAULT_BUCKETS,
    ) -> None:
        super().__init__(name, help_text, labelnames)
        self.buckets = tuple(sorted(buckets))
        self.values: dict[LabelValues, tuple[list[int], list[float]]] = {}

    def _entry(self, key: LabelValues) -> tuple[list[int], list[float]]:
        entry = self.values.get(key)
        if entry is None:
            entry = self.values[key] = ([0] * (len(self.buckets) + 1), [0.0, 0.0])
        return entry

    def labels(self, **labels: str) -> OldHistogramChild:
        return OldHistogramChild(self.buckets, self._entry(self._key(labels)))

    def observe(self, value: float, **labels: str) -> None:
        entry = self._entry(self._key(labels))
        entry[0][bisect.bisect_left(self.buckets, value)] += 1
        entry[1][0] += value
        entry[1][1] += 1

    def samples(self) -> Iterable[str]:
        for key, (counts, (total, n)) in sorted(self.values.items()):
            cumulative = 0
            for bound, c in zip((*self.buckets, math.inf), counts):
                cumulative += c
                le = 'le="' + _num(bound) + '"'
                yield f"{self.name}_bucket{_labels(self.labelnames, key, le)} {cumulative}"
            yield f"{self.name}_sum{_labels(self.labelnames, key)} {_num(total)}"
            yield f"{self.name}_count{_labels(self.labelnames, key)} {int(n)}"


class OldRegistry:
    """The hand-written registry (render bytes of Prometheus text 0.0.4, no dependencies).

    One addition, so that the orchestrator's ``_Metrics`` takes it too (tests/test_metrics.py):
    :meth:`before_collect` (the orchestrator set its per-worker gauges before each render itself).
    """

    def __init__(self) -> None:
        self.metrics: list[_OldMetric] = []
        self.hooks: list[Callable[[], None]] = []

    def before_collect(self, hook: Callable[[], None]) -> None:
        self.hooks.append(hook)

    def _add(self, metric: Any) -> Any:
        if any(m.name == metric.name for m in self.metrics):
            raise ValueError(f"metric {metric.name} registered twice")
        self.metrics.append(metric)
        return metric

    def counter(
        self,
        name: str,
        help_text: str,
        labelnames: Sequence[str] = (),
        callback: Callable[[], float] | None = None,
    ) -> OldCounter:
        return self._add(OldCounter(name, help_text, labelnames, callback))

    def gauge(
        self,
        name: str,
        help_text: str,
        labelnames: Sequence[str] = (),
        callback: Callable[[], float] | None = None,
        **_: Any,
    ) -> OldGauge:
        return self._add(OldGauge(name, help_text, labelnames, callback))

    def histogram(
        self,
        name: str,
        help_text: str,
        labelnames: Sequence[str] = (),
        buckets: Sequence[float] = DEFAULT_BUCKETS,
    ) -> OldHistogram:
        return self._add(OldHistogram(name, help_text, labelnames, buckets))

    def render(self) -> bytes:
        for hook in self.hooks:
            hook()
        return "".join(m.render() for m in self.metrics).encode()


# -- the orchestrator's hot path ----------------------------------------------------------------


class OrchestratorMetrics:
    """The orchestrator's metrics (server/orchestrator/app.py's ``_Metrics``, the per-request ones
    and a scrape's worth of the rest), on any registry with the server.metrics API."""

    def __init__(self, registry: Any) -> None:
        self.registry = registry
        self.requests = registry.counter(
            "fastcore_orchestrator_requests_total", "Requests.", ("route", "status")
        )
        self.in_flight = 0
        registry.gauge(
            "fastcore_orchestrator_requests_in_flight", "In flight.", callback=lambda: self.in_flight
        )
        retries = registry.counter("fastcore_orchestrator_retries_total", "Retries.", ("leg",))
        self.retries_leg = {leg: retries.labels(leg=leg) for leg in ("context", "generation")}
        self.worker_in_flight = registry.gauge(
            "fastcore_orchestrator_worker_in_flight", "Per worker.", ("pool", "url")
        )
        cpu = registry.histogram("fastcore_orchestrator_cpu_seconds", "CPU by phase.", ("phase",))
        self.cpu_phase = {phase: cpu.labels(phase=phase) for phase in PHASES}
        self.context_leg = registry.histogram(
            "fastcore_orchestrator_context_leg_seconds", "Context leg."
        ).labels()
        self.handoff = registry.histogram("fastcore_orchestrator_handoff_seconds", "Hand-off.").labels()
        self.generation_ttfb = registry.histogram(
            "fastcore_orchestrator_generation_ttfb_seconds", "TTFB."
        ).labels()
        self._requests: dict[tuple[str, int], Any] = {}
        self.count_request("chat", 200)

    def count_request(self, route: str, status: int) -> None:  # as app.py's
        child = self._requests.get((route, status))
        if child is None:
            child = self._requests[(route, status)] = self.requests.labels(route=route, status=str(status))
        child.inc()

    def requests_batch(self) -> None:
        """CPU_SAMPLE_EVERY requests' observations: each one's three legs and count, one CPU sample."""
        for _ in range(CPU_SAMPLE_EVERY):
            self.in_flight += 1
            self.context_leg.observe(0.0042)  # ~5 ms context leg: bucket 7 of 20
            self.handoff.observe(0.00009)  # ~90 µs: bucket 2
            self.generation_ttfb.observe(0.0031)
            self.in_flight -= 1
            self.count_request("chat", 200)
        phases = self.cpu_phase
        for phase, spent in zip(PHASES, (4e-5, 2e-5, 6e-5, 3e-5, 1.2e-4, 2.7e-4)):
            phases[phase].observe(spent)


def measure(mode: str) -> dict[str, float]:
    """ns per operation in this process (its registry chosen by ``mode``)."""
    if mode == "hand-written":
        registry: Any = OldRegistry()
    else:
        from server.metrics import MULTIPROCESS, Registry

        if MULTIPROCESS != (mode == "prometheus_client mmap"):
            raise RuntimeError(f"{mode}: prometheus_client's multiprocess mode is {MULTIPROCESS}")
        registry = Registry()
    m = OrchestratorMetrics(registry)
    counter = m.retries_leg["context"]
    histogram = m.context_leg
    gauge = m.worker_in_flight
    for pool in ("context", "generation"):
        for port in range(8001, 8009):
            m.worker_in_flight.set(1, pool=pool, url=f"http://127.0.0.1:{port}")
    for _ in range(100):
        m.requests_batch()

    def gauge_inc_dec() -> None:  # the old gauge had no bound children: labels each time
        gauge.inc(pool="generation", url="http://127.0.0.1:8002")
        gauge.dec(pool="generation", url="http://127.0.0.1:8002")

    return {
        "counter inc (bound child)": time_call(counter.inc) * 1e9,
        "histogram observe (bound child)": time_call(lambda: histogram.observe(0.0042)) * 1e9,
        "gauge inc + dec (**labels)": time_call(gauge_inc_dec) * 1e9,
        "counter inc(**labels) (unbound)": time_call(lambda: m.requests.inc(route="chat", status="200"))
        * 1e9,
        "per request (orchestrator)": time_call(m.requests_batch) / CPU_SAMPLE_EVERY * 1e9,
        "render (one scrape)": time_call(registry.render, min_time=0.5) * 1e9,
    }


def run_child(mode: str) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k.upper() != "PROMETHEUS_MULTIPROC_DIR"}
    with tempfile.TemporaryDirectory(prefix="metrics-cost-") as tmp:
        if mode == "prometheus_client mmap":
            env["PROMETHEUS_MULTIPROC_DIR"] = tmp
        out = subprocess.run(
            [sys.executable, "-m", "bench.metrics_cost", "--child", mode],
            env=env,
            check=True,
            capture_output=True,
            text=True,
        )
    return json.loads(out.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--budget-us",
        type=float,
        default=LEAN_PATH_US,
        help="the orchestrator's CPU per request, µs (default 400: fast path, 1k tokens)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the numbers here")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child)))
        return 0
    results = {mode: run_child(mode) for mode in MODES}
    old = results["hand-written"]
    rows = []
    for op in old:
        unit, scale = ("µs", 1e-3) if op.startswith("render") else ("ns", 1.0)
        row: list[Any] = [f"{op} ({unit})"]
        for mode in MODES:
            row.append(f"{results[mode][op] * scale:.1f}")
        row += [f"{results[mode][op] / old[op]:.1f}x" for mode in MODES[1:]]
        rows.append(row)
    print(format_table(["operation", *MODES, *(f"{m} / hand-written" for m in MODES[1:])], rows))
    print()
    per_request = "per request (orchestrator)"
    for mode in MODES[1:]:
        added_us = (results[mode][per_request] - old[per_request]) / 1000
        total_us = results[mode][per_request] / 1000
        print(
            f"{mode}: {total_us:.2f} µs per request in all, +{added_us:.2f} µs over the hand-written "
            f"registry: {100 * added_us / args.budget_us:.2f}% of the {args.budget_us:.0f} µs lean-path "
            f"budget ({100 * total_us / args.budget_us:.2f}% in all)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"budget_us": args.budget_us, "ns": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
