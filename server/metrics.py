"""A small Prometheus text-format registry shared by the workers and the orchestrator.

Single-threaded use from the event loop (or with the GIL as the only lock:
each update is one dict operation), no dependencies, exposition format 0.0.4.

On a hot path, bind the labels once: ``metric.labels(route="chat")`` returns
a child whose ``inc()`` / ``observe()`` touch only its own storage (no label
dict, no key tuple per update).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Sequence

LabelValues = tuple[str, ...]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


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


class _Metric:
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


class CounterChild:
    """A counter's series with its labels bound (:meth:`Counter.labels`)."""

    __slots__ = ("key", "values")

    def __init__(self, values: dict[LabelValues, float], key: LabelValues) -> None:
        self.values = values
        self.key = key
        values.setdefault(key, 0.0)

    def inc(self, amount: float = 1.0) -> None:
        self.values[self.key] += amount


class Counter(_Metric):
    """A counter, incremented directly or read from a callback at scrape time (a total kept elsewhere)."""

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

    def labels(self, **labels: str) -> CounterChild:
        return CounterChild(self.values, self._key(labels))

    def get(self, **labels: str) -> float:
        if self.callback is not None:
            return float(self.callback())
        return self.values.get(self._key(labels), 0.0)

    def samples(self) -> Iterable[str]:
        if self.callback is not None:
            yield f"{self.name} {_num(self.callback())}"
            return
        if not self.values and not self.labelnames:
            yield f"{self.name} 0"
        for key, v in sorted(self.values.items()):
            yield f"{self.name}{_labels(self.labelnames, key)} {_num(v)}"


class Gauge(_Metric):
    """A gauge set directly or read from a callback at scrape time."""

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

    def get(self, **labels: str) -> float:
        if self.callback is not None:
            return float(self.callback())
        return self.values.get(self._key(labels), 0.0)

    def samples(self) -> Iterable[str]:
        if self.callback is not None:
            yield f"{self.name} {_num(self.callback())}"
            return
        if not self.values and not self.labelnames:
            yield f"{self.name} 0"
        for key, v in sorted(self.values.items()):
            yield f"{self.name}{_labels(self.labelnames, key)} {_num(v)}"


# Seconds, from 50 µs (the orchestrator's own CPU per request) to 2 minutes.
DEFAULT_BUCKETS = (
    5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0,
)  # fmt: skip


class HistogramChild:
    """A histogram's series with its labels bound (:meth:`Histogram.labels`)."""

    __slots__ = ("buckets", "counts", "totals")

    def __init__(self, buckets: tuple[float, ...], entry: tuple[list[int], list[float]]) -> None:
        self.buckets = buckets
        self.counts, self.totals = entry

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        totals = self.totals
        totals[0] += value
        totals[1] += 1


class Histogram(_Metric):
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
        # per label set: [counts per bucket (non-cumulative) + overflow, sum, count]
        self.values: dict[LabelValues, tuple[list[int], list[float]]] = {}

    def _entry(self, key: LabelValues) -> tuple[list[int], list[float]]:
        entry = self.values.get(key)
        if entry is None:
            entry = self.values[key] = ([0] * (len(self.buckets) + 1), [0.0, 0.0])
        return entry

    def labels(self, **labels: str) -> HistogramChild:
        return HistogramChild(self.buckets, self._entry(self._key(labels)))

    def observe(self, value: float, **labels: str) -> None:
        entry = self._entry(self._key(labels))
        entry[0][bisect.bisect_left(self.buckets, value)] += 1
        entry[1][0] += value
        entry[1][1] += 1

    def count(self, **labels: str) -> int:
        entry = self.values.get(self._key(labels))
        return int(entry[1][1]) if entry else 0

    def samples(self) -> Iterable[str]:
        for key, (counts, (total, n)) in sorted(self.values.items()):
            cumulative = 0
            for bound, c in zip((*self.buckets, math.inf), counts):
                cumulative += c
                le = 'le="' + _num(bound) + '"'
                yield f"{self.name}_bucket{_labels(self.labelnames, key, le)} {cumulative}"
            yield f"{self.name}_sum{_labels(self.labelnames, key)} {_num(total)}"
            yield f"{self.name}_count{_labels(self.labelnames, key)} {int(n)}"


class Registry:
    def __init__(self) -> None:
        self.metrics: list[_Metric] = []

    def _add(self, metric: _Metric) -> _Metric:
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
    ) -> Counter:
        return self._add(Counter(name, help_text, labelnames, callback))  # type: ignore[return-value]

    def gauge(
        self,
        name: str,
        help_text: str,
        labelnames: Sequence[str] = (),
        callback: Callable[[], float] | None = None,
    ) -> Gauge:
        return self._add(Gauge(name, help_text, labelnames, callback))  # type: ignore[return-value]

    def histogram(
        self,
        name: str,
        help_text: str,
        labelnames: Sequence[str] = (),
        buckets: Sequence[float] = DEFAULT_BUCKETS,
    ) -> Histogram:
        return self._add(Histogram(name, help_text, labelnames, buckets))  # type: ignore[return-value]

    def render(self) -> bytes:
        return "".join(m.render() for m in self.metrics).encode()
