# cython: language_level=3, auto_pickle=False
"""The fleet's shared counts in C: the compiled twin of :mod:`.fleet`'s ``PureCore``.

``orchestrator --workers N`` maps one file into every process (:class:`.fleet.Mapping`, made by
the parent before it starts them); this class works on that mapping's 64-bit words with GCC's
atomics (``fastcore/include/fleet_atomics.h``): a slot is one ``fetch_add`` on the process's own
count and a read of the others', a token bucket is one compare-exchange of its theoretical arrival
time (GCRA), a breaker's published end one compare-exchange. No lock spans two words, so a process
killed anywhere leaves none held. The layout and the arithmetic are the pure twin's (the reference,
which takes a ``lockf`` lock instead): :data:`.fleet.LAYOUT` is pinned to the enum below by
tests/test_fleet.py.
"""

from libc.stdint cimport int64_t

from ._fleet cimport fc_cas, fc_exchange, fc_fetch_add, fc_load


cdef enum:
    # .fleet's HEADER_WORDS, W_PROCS, W_BUCKETS, W_BREAKERS, W_GENERATION
    HEADER_WORDS = 8
    W_PROCS = 1
    W_BUCKETS = 2
    W_BREAKERS = 3
    W_GENERATION = 4

#: the enum above, for the test that pins it to .fleet's LAYOUT
LAYOUT = {"HEADER_WORDS": HEADER_WORDS, "W_PROCS": W_PROCS, "W_BUCKETS": W_BUCKETS, "W_BREAKERS": W_BREAKERS,
          "W_GENERATION": W_GENERATION}


cdef class Core:
    """One process's view of the mapping: ``index`` names its slot count."""

    cdef readonly object mapping
    cdef object view
    cdef int64_t *words
    cdef readonly Py_ssize_t index
    cdef readonly Py_ssize_t procs
    cdef Py_ssize_t buckets
    cdef Py_ssize_t breakers

    def __init__(self, mapping, Py_ssize_t index):
        cdef int64_t[::1] view = memoryview(mapping.buffer).cast("B").cast("q")
        self.mapping = mapping
        self.view = view
        self.words = &view[0]
        self.procs = self.words[W_PROCS]
        self.buckets = self.words[W_BUCKETS]
        self.breakers = self.words[W_BREAKERS]
        if not 0 <= index < self.procs:
            raise ValueError(f"process index {index} out of 0..{self.procs - 1}")
        self.index = index

    # -- admission slots ---------------------------------------------------------------------

    cpdef bint acquire(self, int64_t limit):
        """One slot if the fleet holds fewer than ``limit``: this process's count first, then the
        sum read; over the limit it is given back (two processes racing for the last slot may both
        give back: a spurious refusal, never one too many)."""
        cdef int64_t *slots = self.words + HEADER_WORDS
        cdef int64_t total = 0
        cdef Py_ssize_t i
        fc_fetch_add(slots + self.index, 1)
        for i in range(self.procs):
            total += fc_load(slots + i)
        if total <= limit:
            return True
        fc_fetch_add(slots + self.index, -1)
        return False

    cpdef void release(self):
        fc_fetch_add(self.words + HEADER_WORDS + self.index, -1)

    def held(self, Py_ssize_t index):
        return fc_load(self.words + HEADER_WORDS + self._proc(index))

    def total(self):
        cdef int64_t total = 0
        cdef Py_ssize_t i
        for i in range(self.procs):
            total += fc_load(self.words + HEADER_WORDS + i)
        return total

    def clear(self, Py_ssize_t index):
        """A dead process's slots back to the fleet: its count zeroed, the count it held returned."""
        return fc_exchange(self.words + HEADER_WORDS + self._proc(index), 0)

    cdef Py_ssize_t _proc(self, Py_ssize_t index) except -1:
        if not 0 <= index < self.procs:
            raise ValueError(f"process index {index} out of 0..{self.procs - 1}")
        return index

    # -- keyed entries: token buckets (table 0), breakers (table 1) --------------------------

    cdef int64_t *_table(self, int table, Py_ssize_t *size):
        if table == 0:
            size[0] = self.buckets
            return self.words + HEADER_WORDS + self.procs
        size[0] = self.breakers
        return self.words + HEADER_WORDS + self.procs + 2 * self.buckets

    def entry(self, int table, int64_t key):
        """The entry of ``key`` (never 0) in ``table``, claimed if new (open addressing from the
        key's place); -1 when the table is full."""
        cdef Py_ssize_t size, i, slot
        cdef int64_t *base = self._table(table, &size)
        cdef int64_t seen
        if key == 0:
            raise ValueError("key 0 marks a free entry")
        for i in range(size):
            slot = <Py_ssize_t>((<unsigned long long>key + <unsigned long long>i) % <unsigned long long>size)
            seen = 0
            if fc_cas(base + 2 * slot, &seen, key) or seen == key:
                return slot
        return -1

    cdef int64_t *_value(self, int table, Py_ssize_t entry) except NULL:
        cdef Py_ssize_t size
        cdef int64_t *base = self._table(table, &size)
        if not 0 <= entry < size:
            raise ValueError(f"entry {entry} out of 0..{size - 1}")
        return base + 2 * entry + 1

    cpdef int64_t take(self, Py_ssize_t entry, int64_t now, int64_t cost, int64_t burst) except -1:
        """A token bucket as its theoretical arrival time (GCRA, one word): ``cost`` (ns of refill,
        at most ``burst``, the bucket's size in ns) taken if there (0), else the ns until it is."""
        cdef int64_t *tat = self._value(0, entry)
        cdef int64_t seen = fc_load(tat), base
        while True:
            base = seen if seen > now else now
            if base + cost - now > burst:
                return base + cost - burst - now
            if fc_cas(tat, &seen, base + cost):
                return 0

    cpdef void correct(self, Py_ssize_t entry, int64_t now, int64_t more) except *:
        """``more`` ns of refill used beyond what was taken (a refund when negative, up to full)."""
        cdef int64_t *tat = self._value(0, entry)
        cdef int64_t seen = fc_load(tat), target
        while True:
            target = (seen if seen > now else now) + more
            if target < now:
                target = now
            if fc_cas(tat, &seen, target):
                return

    def generation(self):
        """Bumped by each change of a published end: a process with nothing new of its own skips
        its exchange while it reads the same."""
        return fc_load(self.words + W_GENERATION)

    def until(self, Py_ssize_t entry):
        """A breaker's published end (monotonic ns; 0: none)."""
        return fc_load(self._value(1, entry))

    def publish(self, Py_ssize_t entry, int64_t until):
        """A breaker open until ``until``: kept if later than what is published."""
        cdef int64_t *word = self._value(1, entry)
        cdef int64_t seen = fc_load(word)
        while seen < until:
            if fc_cas(word, &seen, until):
                fc_fetch_add(self.words + W_GENERATION, 1)
                return

    def withdraw(self, Py_ssize_t entry, int64_t seen):
        """The published end ``seen`` withdrawn (a probe succeeded); True if it was still the one."""
        if fc_cas(self._value(1, entry), &seen, 0):
            fc_fetch_add(self.words + W_GENERATION, 1)
            return True
        return False
