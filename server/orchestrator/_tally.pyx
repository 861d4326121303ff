# cython: language_level=3, auto_pickle=False
"""The orchestrator's per-request numbers in C: the compiled twins of :mod:`.metrics`' ``TallyOne``,
``TallyHistogram`` and ``NoClock``, of :mod:`.estimates`' ``BytesPerToken`` (compiled from its pure
source, bytes_per_token.py, in Cython's pure-Python mode: the same instructions per ``observe``
as the ``cdef class`` it replaced here; exported from this module) and of :mod:`.pools`'
``CircuitBreaker``.

Each request counts itself, observes three latencies, laps a clock that is not sampled, teaches
two bytes-per-token estimates and passes each leg's worker's breaker three times: in Python that
is some twenty frames and their float objects (about 7% of the orchestrator's instructions per
1 KB request, ``bench.front_instructions``); here each is one C method call on C numbers. The
pure classes are the behavioural reference (the same arithmetic in the same order, on doubles:
the same results to the bit); :mod:`.twins` picks these where they are built, and the tests run
both (tests/test_tally_twins.py).
"""

import time

from libc.stdlib cimport free, malloc

#: estimates' BytesPerToken: written once, in Cython's pure-Python mode (bytes_per_token.py, compiled
#: as server.orchestrator._bytes_per_token), exported here with the other twins twins.py picks
from ._bytes_per_token import BytesPerToken


cdef class TallyOne:
    """metrics.TallyOne: a counter child counted in a C integer, added to the child's value when its
    registry syncs (``flush``)."""

    cdef public object native
    cdef public object _value
    cdef public long long n

    def __init__(self, child):
        self.native = child
        self._value = child._value
        self.n = 0

    def inc(self):
        self.n += 1

    def flush(self):
        cdef long long n = self.n
        if n:
            self.n = 0
            self._value.inc(float(n))


cdef class TallyHistogram:
    """metrics.TallyHistogram: a histogram child observed into a C sum and C bucket counts (the bucket
    found by bisection of the child's upper bounds), added to the child's values at ``flush``."""

    cdef public object native
    cdef public tuple _bounds
    cdef public tuple _buckets
    cdef public object _sum
    cdef public double sum
    cdef public bint pending
    cdef double *bounds
    cdef long long *tallies
    cdef Py_ssize_t size

    def __cinit__(self, child):
        self.bounds = NULL
        self.tallies = NULL

    def __init__(self, child):
        cdef Py_ssize_t i
        self.native = child
        self._bounds = tuple(child._upper_bounds)
        self._buckets = tuple(child._buckets)
        self._sum = child._sum
        self.size = len(self._bounds)
        free(self.bounds)
        free(self.tallies)
        self.bounds = <double *>malloc(max(self.size, 1) * sizeof(double))
        self.tallies = <long long *>malloc(max(self.size, 1) * sizeof(long long))
        if self.bounds == NULL or self.tallies == NULL:
            raise MemoryError()
        for i in range(self.size):
            self.bounds[i] = self._bounds[i]
            self.tallies[i] = 0
        self.sum = 0.0
        self.pending = False

    def __dealloc__(self):
        free(self.bounds)
        free(self.tallies)

    @property
    def counts(self):
        """The bucket counts since the last flush (a new list)."""
        return [self.tallies[i] for i in range(self.size)]

    def observe(self, double amount):
        cdef Py_ssize_t lo = 0, hi = self.size, mid
        self.sum += amount
        self.pending = True
        while lo < hi:  # bisect.bisect_left: the first bound not below amount
            mid = (lo + hi) // 2
            if self.bounds[mid] < amount:
                lo = mid + 1
            else:
                hi = mid
        if lo < self.size and amount <= self.bounds[lo]:
            self.tallies[lo] += 1

    def flush(self):
        cdef Py_ssize_t i
        cdef long long n
        cdef double amount
        if not self.pending:
            return
        self.pending = False
        amount = self.sum
        self.sum = 0.0
        self._sum.inc(amount)
        for i in range(self.size):
            n = self.tallies[i]
            if n:
                self.tallies[i] = 0
                self._buckets[i].inc(n)


cdef class NoClock:
    """metrics.NoClock: the clock of the requests not sampled (a C call per lap, no frame)."""

    def start(self):
        pass

    def lap(self, phase):
        pass

    def finish(self):
        pass


#: pools.py's ``_ROUTABLE_EPOCH`` (a one-item list), bumped by a breaker's change of state as the pure
#: twin bumps it; pools.py hands it over at import (watch_epoch)
cdef list _epoch = [0]


def watch_epoch(list epoch):
    """Bump ``epoch[0]`` on each breaker's change of state (pools.py's cached routable workers)."""
    global _epoch
    _epoch = epoch


cdef enum:
    # pools.CircuitBreaker's states (its CLOSED, HALF_OPEN, OPEN)
    B_CLOSED = 0
    B_HALF_OPEN = 1
    B_OPEN = 2


cdef class CircuitBreaker:
    """pools.CircuitBreaker: one worker's breaker, its state, counts and times in C (three C calls per
    leg: ``chosen``, ``succeeded`` or ``failed``, ``ended``); its defaults pools' BREAKER_FAILURES and
    BREAKER_OPEN_S."""

    CLOSED, HALF_OPEN, OPEN = B_CLOSED, B_HALF_OPEN, B_OPEN
    MAX_OPEN_FACTOR = 8

    cdef public object threshold
    cdef public object open_s
    cdef public int _state
    cdef public object failures
    cdef public object open_for
    cdef public double opened_at
    cdef public bint probing
    cdef public object opened

    def __init__(self, threshold=3, open_s=5.0):
        self.threshold = threshold
        self.open_s = open_s
        self._state = B_CLOSED
        self.failures = 0
        self.open_for = open_s
        self.opened_at = 0.0
        self.probing = False
        self.opened = 0

    @property
    def state(self):
        return self._state

    @state.setter
    def state(self, int state):
        if state != self._state:
            self._state = state
            _epoch[0] += 1  # Pool.choose's cached candidates are stale

    def allows(self, now):
        if self._state == B_OPEN:
            if now - self.opened_at < self.open_for:
                return False
            self.state = B_HALF_OPEN
            self.probing = False
        return not self.probing

    def chosen(self):
        if self._state == B_HALF_OPEN:
            self.probing = True

    def succeeded(self):
        self.failures = 0
        self.probing = False
        if self._state != B_CLOSED:
            self.state = B_CLOSED
            self.open_for = self.open_s

    def failed(self, *, at_once=False):
        self.failures += 1
        probe = self._state == B_HALF_OPEN
        if self._state == B_OPEN or not (at_once or probe or self.failures >= self.threshold):
            return False
        if probe:
            self.open_for = min(self.open_for * 2, self.open_s * self.MAX_OPEN_FACTOR)
        self.state = B_OPEN
        self.opened_at = time.monotonic()
        self.probing = False
        self.opened += 1
        return True

    def ended(self):
        if self._state == B_HALF_OPEN:
            self.probing = False
