"""Prometheus metrics of the workers and the orchestrator, through ``prometheus_client``.

A thin layer over prometheus_client that keeps this module's small API
(``Registry.counter/gauge/histogram``, ``.labels()`` children for the hot
path, ``render()`` -> bytes, :data:`CONTENT_TYPE`):

- each :class:`Registry` is its own ``CollectorRegistry`` (several servers in
  one process, as in the tests, never collide; the global ``REGISTRY`` is not
  used);
- ``metric.labels(route="chat")`` returns prometheus_client's own child, bound
  once: its ``inc()`` / ``observe()`` are the whole per-request cost;
- a metric given a ``callback`` is read at scrape time (a total or a level kept
  elsewhere, e.g. the engine's KV tokens in use);
- :meth:`Registry.before_collect` hooks run before each scrape (a gauge set from
  state that is cheaper to read then than to track on every change).

Multiprocess mode (``orchestrator --workers N``): the parent makes a fresh
directory (:class:`SharedMetricsDir`) and exports ``PROMETHEUS_MULTIPROC_DIR``
to the children it spawns, so that prometheus_client, imported fresh in each
child, keeps every value in a per-process mmap file there; a scrape, whichever
process takes it, renders the sum over all of them (``MultiProcessCollector``).
Counters of a process that exited stay counted (totals never go back); gauges
use a ``live*`` mode, and the parent drops a dead child's gauge files.
Callback metrics cannot be read from another process at scrape time, so in this
mode each process writes its callbacks' values into its own file: right before
it renders a scrape (its own part exact) and every :data:`SYNC_INTERVAL_S`
seconds (:meth:`Registry.keep_synced`; the other processes' parts at most that
old), and once more when it stops.

``_created`` samples are disabled (process-wide): the hand-written registry
had none and multiprocess mode has none, so both modes render the same series.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from operator import attrgetter
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client import values as _values
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

LabelValues = tuple[str, ...]

#: Prometheus text format 0.0.4 (what :func:`prometheus_client.generate_latest` writes).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: The environment variable that puts prometheus_client in multiprocess mode (read at its import).
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

#: Whether this process keeps its values in mmap files (prometheus_client chose at import time).
MULTIPROCESS: bool = _values.ValueClass is not _values.MutexValue

#: Multiprocess mode: seconds between two writes of a process's callback metrics into its file.
SYNC_INTERVAL_S = 1.0

prometheus_client.disable_created_metrics()

# Seconds, from 50 µs (the orchestrator's own CPU per request) to 2 minutes.
DEFAULT_BUCKETS = (
    5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0,
)  # fmt: skip

#: Gauges' multiprocess modes: summed over live processes unless said otherwise.
DEFAULT_GAUGE_MODE = "livesum"


class _Metric:
    """One metric family: its prometheus_client object and the children bound so far."""

    kind = ""

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str], native: Any) -> None:
        self.name = name
        self.help = help_text
        self.labelnames = tuple(labelnames)
        self.native = native
        self._children: dict[LabelValues, Any] = {}
        #: its registry's sync (set when registered): values a hot path tallies on its own
        #: (server/orchestrator/metrics.py) reach prometheus_client's at each read
        self.sync: Callable[[], None] | None = None

    def _child(self, labels: dict[str, str]) -> Any:
        if not self.labelnames:
            return self.native
        key = tuple(str(labels.get(n, "")) for n in self.labelnames)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self.native.labels(*key)
        return child

    def labels(self, **labels: str) -> Any:
        """The series of these labels (a missing label is ""), bound for the hot path."""
        return self._child(labels)

    def remove(self, **labels: str) -> None:
        """Drop the series of these labels (a worker that left): no stale value stays on the page.
        In multiprocess mode a value already written to this process's file stays in it."""
        key = tuple(str(labels.get(n, "")) for n in self.labelnames)
        if self._children.pop(key, None) is not None:
            with warnings.catch_warnings():
                # prometheus_client warns that multiprocess mode cannot drop a written value:
                # said once in this docstring rather than on every worker that leaves.
                warnings.simplefilter("ignore", UserWarning)
                self.native.remove(*key)

    def _sample(self, suffix: str, labels: dict[str, str]) -> float:
        """This process's value of one sample (0 when the series does not exist yet)."""
        if self.sync is not None:
            self.sync()
        want = {n: str(labels.get(n, "")) for n in self.labelnames}
        for family in self.native.collect():
            for sample in family.samples:
                if sample.name == family.name + suffix and sample.labels == want:
                    return float(sample.value)
        return 0.0


class _Callback:
    """A collector reading one unlabelled value at scrape time (single-process mode)."""

    def __init__(self, kind: str, name: str, help_text: str, read: Callable[[], float]) -> None:
        self.family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        self.name = name
        self.help = help_text
        self.read = read

    def describe(self) -> Iterable[Metric]:
        return [self.family(self.name, self.help)]

    def collect(self) -> Iterable[Metric]:
        return [self.family(self.name, self.help, value=float(self.read()))]


class _Readable(_Metric):
    """A counter or a gauge: counted by prometheus_client (``native_class``), or read from a
    ``callback`` at scrape time (a total or a level kept elsewhere; unlabelled)."""

    native_class: Any = None
    #: its sample's suffix on the page
    suffix = ""

    def __init__(
        self,
        name: str,
        help_text: str,
        labelnames: Sequence[str],
        registry: CollectorRegistry,
        callback: Callable[[], float] | None = None,
        **native_options: Any,
    ) -> None:
        """``native_options``: the prometheus_client metric's own (a gauge's ``multiprocess_mode``)."""
        self._check_name(name)
        if callback is not None and labelnames:
            raise ValueError(f"{self.kind} {name}: a callback {self.kind} has no labels")
        self.callback = callback
        if callback is not None and not MULTIPROCESS:
            registry.register(_Callback(self.kind, name, help_text, callback))
            native = None
        else:
            native = self.native_class(name, help_text, labelnames, registry=registry, **native_options)
        super().__init__(name, help_text, labelnames, native)

    def _check_name(self, name: str) -> None:
        """Refuse a name that prometheus_client would render as another."""

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        self._child(labels).inc(amount)

    def get(self, **labels: str) -> float:
        if self.callback is not None:
            return float(self.callback())
        return self._sample(self.suffix, labels)


class Counter(_Readable):
    """A counter, incremented directly or read from a callback at scrape time (a total kept elsewhere)."""

    kind = "counter"
    native_class = prometheus_client.Counter
    suffix = "_total"

    def _check_name(self, name: str) -> None:
        if not name.endswith("_total"):
            # prometheus_client renders a counter as <name>_total: any other name would change.
            raise ValueError(f"counter {name}: a counter's name ends in _total")


class Gauge(_Readable):
    """A gauge set directly or read from a callback at scrape time.

    ``multiprocess_mode`` (a keyword): how the processes' values add up in multiprocess mode
    (prometheus_client's modes; ``livesum`` by default, ``livemin`` / ``livemax``
    for a level every process sees on its own).
    """

    kind = "gauge"
    native_class = prometheus_client.Gauge

    def set(self, value: float, **labels: str) -> None:
        self._child(labels).set(value)

    def dec(self, amount: float = 1.0, **labels: str) -> None:
        self._child(labels).dec(amount)


class Histogram(_Metric):
    kind = "histogram"

    def __init__(
        self,
        name: str,
        help_text: str,
        labelnames: Sequence[str],
        registry: CollectorRegistry,
        buckets: Sequence[float] = DEFAULT_BUCKETS,
    ) -> None:
        self.buckets = tuple(sorted(buckets))
        native = prometheus_client.Histogram(
            name, help_text, labelnames, registry=registry, buckets=self.buckets
        )
        super().__init__(name, help_text, labelnames, native)

    def observe(self, value: float, **labels: str) -> None:
        self._child(labels).observe(value)

    def count(self, **labels: str) -> int:
        return int(self._sample("_count", labels))


class Registry:
    """The metrics of one server: its own ``CollectorRegistry``, rendered by :meth:`render`."""

    def __init__(self) -> None:
        self.metrics: list[_Metric] = []
        self.collectors = CollectorRegistry()
        self._hooks: list[Callable[[], None]] = []
        # Multiprocess mode: the callback metrics written into this process's file.
        self._synced: list[tuple[_Metric, Callable[[], float]]] = []
        self._synced_totals: dict[str, float] = {}
        if MULTIPROCESS:
            self._exposed = CollectorRegistry()
            MultiProcessCollector(self._exposed)
        else:
            self._exposed = self.collectors

    def _add(self, metric: _Metric) -> Any:
        self.metrics.append(metric)
        metric.sync = self.sync
        callback = getattr(metric, "callback", None)
        if callback is not None and MULTIPROCESS:
            self._synced.append((metric, callback))
        return metric

    def _check_free(self, name: str) -> None:
        if any(m.name == name for m in self.metrics):
            raise ValueError(f"metric {name} registered twice")

    def counter(
        self,
        name: str,
        help_text: str,
        labelnames: Sequence[str] = (),
        callback: Callable[[], float] | None = None,
    ) -> Counter:
        self._check_free(name)
        return self._add(Counter(name, help_text, labelnames, self.collectors, callback))

    def gauge(
        self,
        name: str,
        help_text: str,
        labelnames: Sequence[str] = (),
        callback: Callable[[], float] | None = None,
        multiprocess_mode: str = DEFAULT_GAUGE_MODE,
    ) -> Gauge:
        self._check_free(name)
        gauge = Gauge(
            name, help_text, labelnames, self.collectors, callback, multiprocess_mode=multiprocess_mode
        )
        return self._add(gauge)

    def histogram(
        self,
        name: str,
        help_text: str,
        labelnames: Sequence[str] = (),
        buckets: Sequence[float] = DEFAULT_BUCKETS,
    ) -> Histogram:
        self._check_free(name)
        return self._add(Histogram(name, help_text, labelnames, self.collectors, buckets))

    def before_collect(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` before each scrape (and, in multiprocess mode, at each :meth:`sync`)."""
        self._hooks.append(hook)

    def sync(self) -> None:
        """Bring the values read at scrape time up to date in this process's own metrics
        (the hooks; in multiprocess mode, the callbacks too, written into its file)."""
        for hook in self._hooks:
            hook()
        for metric, read in self._synced:
            value = float(read())
            if metric.kind == "counter":
                grown = value - self._synced_totals.get(metric.name, 0.0)
                if grown > 0:
                    metric.native.inc(grown)
                    self._synced_totals[metric.name] = value
            else:
                metric.native.set(value)

    async def keep_synced(self, interval: float = SYNC_INTERVAL_S) -> None:
        """Multiprocess mode: :meth:`sync` every ``interval`` seconds, until cancelled
        (returns at once in a single process, where a scrape reads everything itself)."""
        if not MULTIPROCESS:
            return
        while True:
            await asyncio.sleep(interval)
            self.sync()

    def render(self) -> bytes:
        """The Prometheus text page: this process's metrics, or in multiprocess mode all processes'."""
        self.sync()
        return generate_latest(self._exposed)


#: a family read at scrape time from an object (:func:`scraped_families`): its kind (``"counter"`` or
#: ``"gauge"``), name, help and what it reads: a dotted attribute name (:func:`operator.attrgetter`)
#: or a function of the object
Scraped = tuple[str, str, str, str | Callable[[Any], float]]


def scraped_families(registry: Registry, source: Callable[[], Any], families: Iterable[Scraped]) -> None:
    """Register ``families``, each read at each scrape from what ``source()`` returns then (0 while it
    returns None: a server not listening yet)."""
    for kind, name, help_text, what in families:
        callback = partial(_read_from, source, attrgetter(what) if isinstance(what, str) else what)
        if kind == "counter":
            registry.counter(name, help_text, callback=callback)
        elif kind == "gauge":
            registry.gauge(name, help_text, callback=callback)
        else:
            raise ValueError(f"{name}: a family read at scrape time is a counter or a gauge, not {kind!r}")


def _read_from(source: Callable[[], Any], read: Callable[[Any], float]) -> float:
    owner = source()
    return 0 if owner is None else read(owner)


def http_server_families(prefix: str) -> list[Scraped]:
    """The families of a :class:`server.http.HTTPServer`'s connections and refusals, named
    ``prefix_...`` (the orchestrator's client side, a worker's server): for :func:`scraped_families`."""
    return [
        ("gauge", f"{prefix}_client_connections", "Open client connections.", lambda s: len(s.connections)),
        (
            "counter",
            f"{prefix}_connections_refused_total",
            "Client connections refused at the connection cap (503).",
            "refused",
        ),
        (
            "counter",
            f"{prefix}_http_framing_errors_total",
            "Client requests refused before routing: malformed HTTP, limits on headers or body, timeouts.",
            "framing_errors",
        ),
    ]


class SharedMetricsDir:
    """The parent's side of multiprocess mode: a fresh directory for its children's files.

    ``with shared.exported(): proc.start()`` gives the children spawned inside
    it ``PROMETHEUS_MULTIPROC_DIR`` (they must import prometheus_client after:
    a spawned child imports it fresh); the parent's own environment is left as
    it was. :meth:`process_dead` when a child has exited, :meth:`remove` at the end.
    """

    def __init__(self) -> None:
        self.path = tempfile.mkdtemp(prefix="fastcore-metrics-")

    @contextlib.contextmanager
    def exported(self) -> Iterator[str]:
        before = os.environ.get(MULTIPROC_ENV)
        os.environ[MULTIPROC_ENV] = self.path
        try:
            yield self.path
        finally:
            if before is None:
                os.environ.pop(MULTIPROC_ENV, None)
            else:
                os.environ[MULTIPROC_ENV] = before

    def process_dead(self, pid: int | None) -> None:
        """Drop an exited child's live gauges (its counters and histograms stay counted)."""
        if pid is not None:
            mark_process_dead(pid, self.path)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
