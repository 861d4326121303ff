# cython: language_level=3, auto_pickle=False
"""The orchestrator's per-request numbers in C: the compiled twins of :mod:`.metrics`' ``TallyOne``,
``TallyHistogram`` and ``NoClock``, of :mod:`.estimates`' ``BytesPerToken`` (compiled from its pure
source, bytes_per_token.py, in Cython's pure-Python mode: the same instructions per ``observe``
as the ``cdef class`` it replaced here; exported from this module) and of :mod:`.pools`'
``CircuitBreaker`` (the same: breaker.py compiled, exported here).

Each request counts itself, observes three latencies, laps a clock that is not sampled, teaches
two bytes-per-token estimates and passes each leg's worker's breaker three times: in Python that
is some twenty frames and their float objects (about 7% of the orchestrator's instructions per
1 KB request, ``bench.front_instructions``); here each is one C method call on C numbers. The
pure classes are the behavioural reference (the same arithmetic in the same order, on doubles:
the same results to the bit); :mod:`.twins` picks these where they are built, and the tests run
both (tests/test_tally_twins.py).
"""

from libc.stdlib cimport free, malloc

#: estimates' BytesPerToken: written once, in Cython's pure-Python mode (bytes_per_token.py, compiled
#: as server.orchestrator._bytes_per_token), exported here with the other twins twins.py picks
from ._bytes_per_token import BytesPerToken
#: pools' CircuitBreaker and its epoch hook: the same, breaker.py compiled as server.orchestrator._breaker
from ._breaker import CircuitBreaker, watch_epoch


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
