# cython: annotation_typing=False, auto_pickle=False
"""The orchestrator's per-request numbers (:class:`TallyOne`, :class:`TallyHistogram`,
:class:`NoClock`, which :mod:`.metrics` binds its hot-path children to), written once: this module is
the pure twin, and Cython compiles the same source, in its pure-Python mode, into
``server.orchestrator._tally`` (setup.py), the compiled twin, typed by ``_tally.pxd`` (``cdef``
classes: the counts C integers, the histogram's sum a C double, its buckets an ``array('q')`` seen
as C integers, ``observe``'s amount and bisection C numbers). Nothing here imports Cython; the
annotations are for mypy alone (``annotation_typing=False``).

Each request counts itself, observes three latencies and laps a clock that is not sampled: in
Python that is a frame and a float object each; compiled, one C method call on C numbers.
:mod:`.twins` picks the compiled module where it is built, :mod:`.metrics` exports its classes under
these names; tests/test_tally_twins.py runs both on the same inputs.

Measured against the hand-written ``_tally.pyx`` it replaced (callgrind, 100,000 rounds of three
``observe``, one ``inc``, one ``lap`` from Python): ~2,640 instructions a round there, ~2,900 here
(``observe`` ~200 against ~110: the pyx bisected a malloc'd C array); with ``bisect.bisect_left``
called instead of the loop written out, ~5,900.
"""

from __future__ import annotations

from array import array
from typing import Any

__all__ = ["NoClock", "TallyHistogram", "TallyOne"]


class TallyOne:
    """A counter child counted in a plain int on the hot path (no lock, no call into prometheus_client)
    and added to the child's value when its registry syncs (each scrape, each read of a value, and
    with --workers N each second: Registry.keep_synced)."""

    __slots__ = ("_value", "n", "native")

    def __init__(self, child: Any) -> None:
        self.native = child
        self._value = child._value
        self.n = 0

    def inc(self) -> None:
        self.n += 1

    def flush(self) -> None:
        n = self.n
        if n:
            self.n = 0
            self._value.inc(float(n))


class TallyHistogram:
    """A histogram child observed into a plain sum and bucket counts (the bucket found by bisection of
    the child's upper bounds, which end at +Inf: NaN, which no bound holds, goes to the sum alone, as
    prometheus_client has it), added to the child's values when its registry syncs (see
    :class:`TallyOne`): the page reads the same series."""

    __slots__ = ("_bounds", "_buckets", "_sum", "counts", "native", "pending", "sum")

    def __init__(self, child: Any) -> None:
        self.native = child
        self._bounds = tuple(child._upper_bounds)
        self._buckets = tuple(child._buckets)
        self._sum = child._sum
        self.counts = array("q", [0] * len(self._bounds))
        self.sum = 0.0
        self.pending = False

    def observe(self, amount: float) -> None:
        self.sum += amount
        self.pending = True
        # bisect.bisect_left(bounds, amount), written out: compiled, this loop runs on C doubles, where
        # a call of bisect_left takes a boxed float and compares objects (3x this method's instructions)
        bounds = self._bounds
        lo, hi = 0, len(bounds)
        while lo < hi:
            mid = (lo + hi) // 2
            bound = bounds[mid]
            if bound < amount:
                lo = mid + 1
            else:
                hi = mid
        if lo < len(bounds):
            bound = bounds[lo]
            if amount <= bound:
                self.counts[lo] += 1

    def flush(self) -> None:
        if not self.pending:
            return
        self.pending = False
        amount = self.sum
        self.sum = 0.0
        self._sum.inc(amount)
        counts = self.counts
        for i, n in enumerate(counts):
            if n:
                counts[i] = 0
                self._buckets[i].inc(n)


class NoClock:
    """The clock of the requests not sampled (metrics.CpuClock's surface, doing nothing)."""

    __slots__ = ()

    def start(self) -> None:
        pass

    def lap(self, phase: str) -> None:
        pass

    def finish(self) -> None:
        pass
